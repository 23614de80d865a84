"""What only the Wan family has, on the tiny random Wan 2.1 and Wan 2.2 (two experts) folders: the kit's videos vs
the stock WanPipeline's at the same seeds (CFG, and Wan 2.2's second guidance scale), which expert each step uses,
per-sample timesteps that straddle the boundary, a bad --num_frames refused in one line, the UniPC config's
flow_shift taken as the Euler sampler's shift."""

import pytest
import torch
from diffusers import WanPipeline

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.families.wan import Wan
from refl_ddpo.core.generate import generate_batch
from refl_ddpo.core.video import check_num_frames

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a red cat", "a dog  &amp; the sun"]  # the second needs the pipeline's prompt_clean
SEEDS = [0, 1]
RES, FRAMES, STEPS = 16, 5, 4


def _stock(path) -> WanPipeline:
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _family(path) -> Wan:
    family = load_family(str(path))
    family.num_frames = FRAMES
    return family


@pytest.mark.parametrize(
    ("model", "guidance", "guidance_2"),
    [
        ("tiny-wan21", 4.0, None),
        ("tiny-wan22", 4.0, None),
        ("tiny-wan22", 3.0, 1.5),
        ("tiny-wan22", 1.0, None),
    ],
)
def test_videos_match_the_stock_pipeline(tiny_models, model, guidance, guidance_2):
    """generate_batch's frames (B, T, 3, H, W) equal WanPipeline's at the same seeds, to 1 grey level (float32)."""
    family = _family(tiny_models / model)
    family.guidance_scale_2 = guidance_2
    videos = generate_batch(family, PROMPTS, SEEDS, RES, STEPS, guidance)
    generators = [torch.Generator().manual_seed(s) for s in SEEDS]
    kwargs = {"guidance_scale_2": guidance_2} if guidance_2 is not None else {}
    stock = _stock(tiny_models / model)
    ref = stock(
        PROMPTS,
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        generator=generators,
        output_type="pt",
        **kwargs,
    ).frames
    assert videos.shape == ref.shape == (2, FRAMES, 3, RES, RES)
    assert (videos - ref).abs().max().item() * 255 <= 1.0


def test_wan22_switches_experts_at_the_boundary(tiny_models):
    """Steps with t >= 875 run `transformer`, the others `transformer_2`; a batch whose samples straddle the boundary
    gives each sample its own expert's output."""
    family = _family(tiny_models / "tiny-wan22")
    scheduler = family.pipe.scheduler
    family.set_timesteps(scheduler, STEPS, None)
    assert family.boundary(scheduler) == 875.0
    calls = []
    hooks = [
        getattr(family.pipe, e).register_forward_hook(
            lambda m, a, k, o, e=e: calls.append(e), with_kwargs=True
        )
        for e in ("transformer", "transformer_2")
    ]
    x = torch.randn(2, 16, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    cond = {"prompt_embeds": torch.randn(2, 512, 32)}
    t = scheduler.timesteps
    with torch.no_grad():
        family.predict(x, t[0], scheduler, cond, None, 1.0)
        family.predict(x, t[-1], scheduler, cond, None, 1.0)
        mixed = family.predict(x, torch.stack([t[0], t[-1]]), scheduler, cond, None, 1.0)
        high = family.predict(x[:1], t[0], scheduler, {"prompt_embeds": cond["prompt_embeds"][:1]}, None, 1.0)
        low = family.predict(x[1:], t[-1], scheduler, {"prompt_embeds": cond["prompt_embeds"][1:]}, None, 1.0)
    for h in hooks:
        h.remove()
    assert t[0] >= 875 > t[-1]
    assert calls[:2] == ["transformer", "transformer_2"]
    torch.testing.assert_close(mixed, torch.cat([high, low]), rtol=1e-5, atol=1e-6)


def test_a_bad_num_frames_is_refused_in_one_line(tiny_models):
    check_num_frames(str(tiny_models / "tiny-wan21"), 9)
    with pytest.raises(UserError, match=r"--num_frames 8: .* 1 \+ 4 k") as e:
        check_num_frames(str(tiny_models / "tiny-wan21"), 8)
    assert "\n" not in str(e.value)


def test_train_expert_and_unipc_flow_shift(tiny_models):
    """--wan_expert picks the trained expert (`transformer_2` only where the folder has one): the network is the
    pair with the LoRA's part that expert, at the top of a LoRA folder (unpaired: the expert itself); a UniPC
    scheduler's flow_shift becomes the Euler sampler's shift."""
    from diffusers import UniPCMultistepScheduler

    from refl_ddpo.core.lora import lora_parts

    family = _family(tiny_models / "tiny-wan22")
    family.train_expert("transformer_2")
    assert lora_parts(family.network) == [("transformer_2", family.pipe.transformer_2, "")]
    family.train_expert("transformer_2", pair=False)
    assert family.network is family.pipe.transformer_2
    with pytest.raises(UserError, match="has transformer$|has transformer\\."):
        _family(tiny_models / "tiny-wan21").train_expert("transformer_2")
    pipe = family.pipe
    pipe.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    euler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    assert type(euler).__name__ == "FlowMatchEulerDiscreteScheduler" and euler.config.shift == 5.0


def test_fsdp_keeps_the_trained_expert_on_the_host(tiny_models, monkeypatch):
    """--fsdp (`network_on_host`): the expert --wan_expert trains stays on the host for `prepare` to shard, the
    frozen one goes to the device with the other parts; an image model keeps its own network there."""
    from refl_ddpo.core import models

    seen = []
    real = models.load_pipeline
    monkeypatch.setattr(
        models, "load_pipeline", lambda *a, on_host=(), **kw: seen.append(on_host) or real(*a, **kw)
    )
    load_family(
        str(tiny_models / "tiny-wan22"), network_on_host=True, expert="transformer_2", pair_experts=False
    )
    load_family(str(tiny_models / "stable-diffusion"), network_on_host=True, expert="transformer")
    assert seen == [("transformer_2",), ("unet",)]


def _inference(tmp_path, model, *flags, lora_dir=None):
    from refl_ddpo.apps import inference
    from refl_ddpo.run.flags import parse_config

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n")
    argv = ["--pretrained_model", str(model), "--prompts_file", str(prompts), "--device", "cpu"]
    argv += ["--output_dir", str(tmp_path / "out"), "--num_images_per_prompt", "1", "--seed", "3"]
    argv += [
        "--num_inference_steps",
        str(STEPS),
        "--resolution",
        str(RES),
        "--rewards",
        "jpeg_compressibility",
    ]
    argv += ["--num_frames", str(FRAMES), "--guidance_scale", "4", *flags]
    if lora_dir is None:
        return inference.run_inference(parse_config(inference.InferenceConfig, argv))
    argv += ["--lora_dir", str(lora_dir)]
    return inference.run_inference(parse_config(inference.LoraInferenceConfig, argv))


def _frames(out, record) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    return torch.stack(
        [torch.from_numpy(np.array(Image.open(out / f).convert("RGB"))) for f in record["frames"]]
    )


def test_inference_writes_videos_that_match_the_stock_pipeline(tiny_models, tmp_path):
    """inference.py on tiny Wan 2.2: the video, its frames as PNGs (within 1 grey level of WanPipeline's at the same
    seed) and its strip, listed in scores.json; the jpeg reward scores the frames (mean of the per-frame scores)."""
    import json

    from refl_ddpo.rewards.jpeg import jpeg_size_kb

    model = tiny_models / "tiny-wan22"
    result = _inference(tmp_path, model, "--guidance_scale_2", "2")
    out = tmp_path / "out"
    record = result["records"][0]
    assert record["file"].endswith((".mp4", ".webp", ".gif")) and (out / record["file"]).is_file()
    assert len(record["frames"]) == FRAMES and (out / record["strip"]).is_file()
    assert json.loads((out / "scores.json").read_text())["config"]["num_frames"] == FRAMES
    frames = _frames(out, record)  # (T, H, W, 3) uint8
    stock = _stock(model)
    ref = stock(
        PROMPTS[0],
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        guidance_scale_2=2.0,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).frames[0]
    assert (frames.float() - torch.from_numpy(ref * 255).round()).abs().max() <= 1
    per_frame = -jpeg_size_kb(frames.permute(0, 3, 1, 2).float() / 255)
    assert record["jpeg_compressibility"] == pytest.approx(per_frame.mean().item(), rel=1e-6)


def test_num_frames_is_refused_before_loading(tiny_models, tmp_path):
    with pytest.raises(UserError, match="--num_frames 6"):
        _inference(tmp_path, tiny_models / "tiny-wan21", "--num_frames", "6")
    with pytest.raises(UserError, match="--num_frames is for video models"):
        _inference(tmp_path, tiny_models / "tiny-sd3")


def test_memory_benchmark_configs_are_wans_published_sizes():
    """benchmarks/configs/wan2*.json (diffusers' conversion script's Wan-T2V-1.3B, -14B and Wan2.2-TI2V-5B, and the
    VAEs it builds) and umt5_xxl_text_encoder.json (Wan's own umt5_xxl) build the published sizes on meta: 1.4 B,
    14.3 B and 5.0 B transformers (Wan 2.2's README: "a 5B dense model"), UMT5-XXL's 5.7 B encoder, the 127 M Wan 2.1
    VAE and the Wan 2.2 VAE (48 latent channels, 16x in space); the text width is the transformers' text_dim."""
    from benchmarks.family_memory import load_config
    from benchmarks.wan_memory import TEXT_ENCODER_CONFIG, VAE_CONFIGS, WAN_MODELS, parameter_counts

    assert parameter_counts() == {
        "wan21_1_3b": 1_418_996_800,
        "wan21_14b": 14_288_491_584,
        "wan22_ti2v_5b": 4_999_787_712,
        "text_encoder": 5_680_910_336,
        "vae": 126_892_531,
        "wan22_vae": 704_688_668,
    }
    width = load_config(TEXT_ENCODER_CONFIG)["d_model"]
    assert all(load_config(f)["text_dim"] == width for f in WAN_MODELS.values())
    ti2v, vae = load_config(WAN_MODELS["wan22_ti2v_5b"]), load_config(VAE_CONFIGS["wan22_vae"])
    assert ti2v["in_channels"] == ti2v["out_channels"] == vae["z_dim"] == len(vae["latents_std"]) == 48
    assert (vae["scale_factor_spatial"], vae["scale_factor_temporal"]) == (16, 4)


def test_expand_timesteps_as_ti2v_5b(tiny_models):
    """A folder whose pipeline says `expand_timesteps` (Wan2.2-TI2V-5B's per-token timesteps) draws the stock
    pipeline's video: the kit hands the transformer one timestep per video token, as the pipeline builds them."""
    family = _family(tiny_models / "tiny-wan21")
    family.pipe.register_to_config(expand_timesteps=True)
    videos = generate_batch(family, PROMPTS[:1], SEEDS[:1], RES, STEPS, 4.0)
    stock = WanPipeline.from_pretrained(tiny_models / "tiny-wan21", expand_timesteps=True)
    stock.set_progress_bar_config(disable=True)
    ref = stock(
        PROMPTS[:1],
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=4.0,
        generator=[torch.Generator().manual_seed(SEEDS[0])],
        output_type="pt",
    ).frames
    assert stock.config.expand_timesteps and (videos - ref).abs().max().item() * 255 <= 1.0


def test_decoding_the_first_frames_alone_equals_the_whole_decodes_first_frames(tiny_models):
    """Wan's VAE is causal in time: `decode(latents, frames=K)` (the latent frames the first K need, alone) equals the
    first K frames of the whole decode, to float32 rounding."""
    family = _family(tiny_models / "tiny-wan21")
    latents = torch.randn(1, 16, 4, 2, 2, generator=torch.Generator().manual_seed(0))  # 13 frames
    with torch.no_grad():
        whole = family.decode(latents)
        for k in (1, 2, 5, 6, 13):
            part = family.decode(latents, frames=k)
            assert part.shape == whole[:, :k].shape and (part - whole[:, :k]).abs().max() <= 1e-6


def test_a_ti2v_5b_like_model_matches_the_stock_pipeline(tiny_models, tmp_path):
    """Wan2.2-TI2V-5B's shape on tiny parts: 48 latent channels, the Wan 2.2 VAE (residual, patch 2, 16x in space) and
    `expand_timesteps`: the kit's noise, per-token timesteps and decode give the stock pipeline's video."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    base = WanPipeline.from_pretrained(tiny_models / "tiny-wan21")
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        latents_mean=[0.1] * 48,
        latents_std=[0.5] * 48,
    )
    config = {**base.transformer.config, "in_channels": 48, "out_channels": 48}
    transformer = WanTransformer3DModel.from_config(config)
    parts = {"tokenizer": base.tokenizer, "text_encoder": base.text_encoder, "scheduler": base.scheduler}
    WanPipeline(transformer=transformer, vae=vae, expand_timesteps=True, **parts).save_pretrained(tmp_path)
    family = _family(tmp_path)
    assert family.initial_noise(1, 32, None, torch.float32).shape == (1, 48, 2, 2, 2)
    videos = generate_batch(family, PROMPTS[:1], SEEDS[:1], 32, 2, 4.0)
    ref = _stock(tmp_path)(
        PROMPTS[:1],
        height=32,
        width=32,
        num_frames=FRAMES,
        num_inference_steps=2,
        guidance_scale=4.0,
        generator=[torch.Generator().manual_seed(SEEDS[0])],
        output_type="pt",
    ).frames
    assert (
        videos.shape == ref.shape == (1, FRAMES, 3, 32, 32) and (videos - ref).abs().max().item() * 255 <= 1.0
    )
