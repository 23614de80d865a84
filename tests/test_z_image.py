"""What only the Z-Image family has, on the tiny random Z-Image and Z-Image-Turbo folders: prompt encoding (the chat
template, one sequence per prompt) vs the stock ZImagePipeline's, float32 noise, the Turbo told apart by its
scheduler and its guidance flags resolved to no CFG, the pipeline's CFG convention (its g is the kit's s - 1),
conditionings of unequal text lengths side by side, the loop in bfloat16, inference.py against the stock pipeline,
the presets. The checks every family passes (the loop vs the stock pipeline, the reward gradient, the LoRA in the
stock pipeline, DDPO on policy, ReFL's card, every trainer for two steps) are in tests/test_family_conformance.py and
test_family_trainers.py."""

from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline
from helpers import (
    GUIDANCE_FIELDS,
    assert_lora_changes_stock_images,
    config_classes,
    one_image_inference,
    train_preset_small,
)

from refl_ddpo.core.families import cond_cat, load_family
from refl_ddpo.core.families.z_image import ZImage, ZImageTurbo, unpadded
from refl_ddpo.core.sampling import denoise

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32
SEEDS = [3, 7]  # one CPU generator per image, as the inference scripts draw
MODEL = "tiny-z-image"
TURBO = "tiny-z-image-turbo"


def _stock(path, **kw) -> ZImagePipeline:
    pipe = ZImagePipeline.from_pretrained(path, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def stock(tiny_models):
    return _stock(tiny_models / MODEL)


def _generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def test_the_turbo_is_told_apart_by_its_scheduler_and_drop_t5_is_refused(tiny_models):
    """Both folders are ZImagePipeline's; the base's scheduler shift (6.0) makes a `ZImage`, the Turbo's (3.0) a
    `ZImageTurbo`; both load at the pipeline's default size."""
    from refl_ddpo.core.errors import UserError

    base, turbo = load_family(str(tiny_models / MODEL)), load_family(str(tiny_models / TURBO))
    assert type(base) is ZImage and type(turbo) is ZImageTurbo and base.name == turbo.name == "z_image"
    assert base.native_resolution == turbo.native_resolution == 1024
    with pytest.raises(UserError, match="has no T5"):
        load_family(str(tiny_models / MODEL), drop_t5=True)


def test_encode_prompts_equal_the_stock_encode_prompt(stock):
    """The kit's padded conditioning holds the pipeline's list of per-prompt sequences, each under its mask; the
    negative is the empty prompt's, and none is encoded without CFG. The prompts given are left as they were (the
    pipeline writes its template into its list)."""
    family = ZImage(stock)
    prompts = list(PROMPTS)
    cond, uncond = family.encode_prompts(prompts, with_negative=True)
    assert prompts == PROMPTS
    with torch.no_grad():
        embeds, negative = stock.encode_prompt(list(PROMPTS), device="cpu")
    mask = cond["prompt_embeds_mask"]
    assert mask.shape == cond["prompt_embeds"].shape[:2] and mask[1].sum() < mask[0].sum() == mask.shape[1]
    assert all(torch.equal(a, b) for a, b in zip(unpadded(cond), embeds, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(unpadded(uncond), negative, strict=True))
    assert (cond["prompt_embeds"][1, mask[1].sum() :] == 0).all()  # padding: zeros
    assert family.encode_prompts(PROMPTS, with_negative=False)[1] is None


def test_a_prompt_is_said_truncated_past_the_512_tokens_the_template_leaves(stock, capsys):
    family = ZImage(stock)
    tokenizer, limit = family.prompt_reader()
    template = len(tokenizer(family._templated("")).input_ids)
    assert limit == 512 - template
    family.encode_prompts(["a" * limit], with_negative=False)  # one token per byte: exactly fits
    assert "truncated" not in capsys.readouterr().err
    family.encode_prompts(["a" * (limit + 1)], with_negative=False)
    assert f"the text encoder reads {limit}" in capsys.readouterr().err


def test_noise_is_the_pipelines_in_float32(stock):
    family = ZImage(stock)
    noise = family.initial_noise(2, RES, _generators(), torch.bfloat16)
    ref = stock.prepare_latents(2, 16, RES, RES, torch.float32, "cpu", _generators())
    assert noise.dtype == torch.float32 and noise.shape == (2, 16, 16, 16) and torch.equal(noise, ref)
    with pytest.raises(ValueError, match="multiple of 4"):
        family.initial_noise(1, 30, None, torch.float32)


def test_cfg_is_the_pipelines_with_its_scale_plus_one(stock):
    """The kit's s runs the pipeline's text + (s - 1) (text - uncond); s = 1 (or no uncond) is the text alone;
    the prediction is the negated network output."""
    family = ZImage(stock)
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    x = family.initial_noise(2, RES, _generators(), torch.float32)
    scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    t = family.set_timesteps(scheduler, 4, x)[1]
    with torch.no_grad():
        text = family.predict(x, t, scheduler, cond, None, 1.0)
        negative = family.predict(x, t, scheduler, uncond, None, 1.0)
        guided = family.predict(x, t, scheduler, cond, uncond, 5.0)
        frames = list(x.unsqueeze(2).unbind(0))  # (16, 1, h, w) each
        raw = stock.transformer(frames, (1000 - t.expand(2)) / 1000, unpadded(cond))[0]
        assert torch.equal(family.predict(x, t, scheduler, cond, uncond, 1.0), text)
    torch.testing.assert_close(text, -torch.stack(raw).squeeze(2))
    torch.testing.assert_close(guided, text + 4.0 * (text - negative), atol=1e-5, rtol=1e-5)
    assert (guided - text).abs().max() > 1e-3


def test_conditionings_of_unequal_lengths_concatenate_padded_and_predict_the_same(stock):
    """cond_cat (DDPO / NFT sample buffers) right-pads a batch's shorter text with masked zeros: the prediction
    of each image is unchanged."""
    family = ZImage(stock)
    short = family.encode_prompts(["a cat"], with_negative=False)[0]
    long = family.encode_prompts(["a red bird on a branch"], with_negative=False)[0]
    both = cond_cat([short, long])
    assert both["prompt_embeds"].shape[1] == long["prompt_embeds"].shape[1] > short["prompt_embeds"].shape[1]
    x = family.initial_noise(2, RES, _generators(), torch.float32)
    scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    t = family.set_timesteps(scheduler, 4, x)[0]
    with torch.no_grad():
        together = family.predict(x, t, scheduler, both, None, 1.0)
        alone = family.predict(x[:1], t, scheduler, short, None, 1.0)
    torch.testing.assert_close(together[:1], alone, atol=1e-5, rtol=1e-5)


def test_loop_reproduces_stock_pipeline_in_bfloat16(tiny_models, record_property):
    """CFG 5 (the pipeline's 4) in bfloat16: within 1 grey level (the stock postprocess rounds in bfloat16, ours
    decodes to float32)."""
    path = tiny_models / MODEL
    family = load_family(str(path), dtype=torch.bfloat16)
    pipe = _stock(path, dtype=torch.bfloat16)
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
        noise = family.initial_noise(2, RES, _generators(), cond["prompt_embeds"].dtype)
        scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
        ours = family.decode(denoise(family, scheduler, cond, uncond, noise, 4, 5.0).latents).float()
    kw = {"height": RES, "width": RES, "output_type": "pt", "guidance_scale": 4.0}
    ref = pipe(list(PROMPTS), num_inference_steps=4, generator=_generators(), **kw).images.float()
    diff = (ours - ref).abs().max().item()
    record_property("max_grey_levels", diff * 255)
    assert diff <= 1 / 255


# ---- guidance defaults: the Turbo's unset guidance flags are 1 (no CFG), the base's keep their CFG defaults ----


def test_unset_guidance_flags_are_no_cfg_on_the_turbo_and_a_set_one_wins(tiny_models):
    from refl_ddpo.core.families import resolve_guidance
    from refl_ddpo.run.flags import parse_config

    for cls in config_classes():
        defaults = GUIDANCE_FIELDS[cls.__name__]
        for model, expected in [(TURBO, dict.fromkeys(defaults, 1.0)), (MODEL, defaults)]:
            argv = ["--pretrained_model", str(tiny_models / model)]
            resolved = resolve_guidance(parse_config(cls, argv))
            assert {n: getattr(resolved, n) for n in defaults} == expected, (cls.__name__, model)
            sampler = next(iter(defaults))
            given = resolve_guidance(parse_config(cls, [*argv, f"--{sampler}", "3.0"]))
            assert getattr(given, sampler) == 3.0
            assert given.validation_guidance_scale == expected["validation_guidance_scale"]


@pytest.mark.parametrize(
    "model, flags, stock_guidance",
    [(TURBO, (), 0.0), (MODEL, ("--guidance_scale", "5.0"), 4.0), (MODEL, ("--guidance_scale", "1.0"), 0.0)],
)
def test_inference_draws_the_stock_pipelines_images(
    model, flags, stock_guidance, tiny_models, tmp_path, monkeypatch, record_property
):
    """inference.py on the Turbo without a guidance flag runs no CFG (the pipeline's guidance_scale=0.0, the
    Turbo's), on the base its --guidance_scale s is the pipeline's s - 1: the PNG written equals the stock
    pipeline's image at the same seed within 1 grey level (its rounding to 8 bits aside)."""
    import numpy as np
    from PIL import Image

    seen = []
    predict = ZImage.predict

    def recording(self, *args, **kwargs):
        seen.append((args[4] is not None, args[5]))  # (an uncond given, guidance_scale)
        return predict(self, *args, **kwargs)

    monkeypatch.setattr(ZImage, "predict", recording)
    result = one_image_inference(tmp_path, tiny_models / model, PROMPTS[0], 3, RES, SEEDS[0], *flags)
    assert {s for _, s in seen} == {stock_guidance + 1.0} and {u for u, _ in seen} == {stock_guidance > 0}
    image = Image.open(tmp_path / "out" / result["records"][0]["file"])
    ref = _stock(tiny_models / model)(
        PROMPTS[0],
        height=RES,
        width=RES,
        num_inference_steps=3,
        guidance_scale=stock_guidance,
        generator=torch.Generator().manual_seed(SEEDS[0]),
        output_type="np",
    ).images[0]
    diff = np.abs(np.asarray(image).astype(np.float32) / 255 - ref).max()
    record_property("max_grey_levels", float(diff * 255))
    assert diff <= 1 / 255


# ---- the presets ----


def test_flow_grpo_z_image_presets_keep_their_sources_numbers():
    """Flow-Factory's GRPO (Z-Image and Z-Image-Turbo) and NFT (Z-Image) LoRA examples as data: their numbers, the
    pipeline's CFG 4 as the kit's 5 and the Turbo's 0 as 1, LoRA on the family's default targets."""
    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers.forward_config import NFTConfig
    from refl_ddpo.trainers.grpo_config import GRPOConfig

    base = parse_config(GRPOConfig, ["--preset", "flow_grpo_z_image"])
    turbo = parse_config(GRPOConfig, ["--preset", "flow_grpo_z_image_turbo"])
    nft = parse_config(NFTConfig, ["--preset", "nft_z_image"])
    assert base.pretrained_model == "Tongyi-MAI/Z-Image"
    assert turbo.pretrained_model == "Tongyi-MAI/Z-Image-Turbo"
    for cfg, steps, guidance in [(base, 10, 5.0), (turbo, 6, 1.0)]:
        assert (cfg.reward, cfg.resolution, cfg.sample_num_steps) == ("pickscore", 512, steps)
        assert cfg.sample_eta == 0.7
        assert cfg.sample_guidance_scale == guidance and cfg.sde_window == 1
        assert cfg.sample_num_steps - cfg.train_skip_last_steps - cfg.sde_window == 3  # start in steps 0-3
        assert (cfg.group_size, cfg.sample_batch_size * cfg.sample_num_batches_per_epoch) == (16, 16)
        assert (cfg.learning_rate, cfg.train_clip_range, cfg.kl_weight) == (3e-4, 1e-4, 0.0)
        assert not cfg.global_std
    assert (base.validation_num_steps, turbo.validation_num_steps) == (40, 10)
    assert (nft.sample_num_steps, nft.sample_guidance_scale) == (10, 5.0)
    assert (nft.nft_beta, nft.kl_weight) == (0.1, 0.0)
    assert (nft.train_timesteps, nft.train_timestep_range) == ("stratified", 0.5)
    assert round(nft.train_timestep_fraction * nft.sample_num_steps) == 2
    assert (nft.old_decay_flat, nft.old_decay_rate, nft.old_decay_max) == (0, 0.001, 0.5)
    for cfg in (base, turbo, nft):
        assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (64, 128, None)
        assert cfg.mixed_precision == "bf16"


def test_flow_grpo_z_image_turbo_preset_trains_on_the_tiny_turbo(tiny_models, tmp_path, capsys, monkeypatch):
    """The Turbo preset scaled down to the tiny Turbo (one group of 2, JPEG size as reward, one epoch, CPU
    precision): no CFG, a 1-step SDE window, a LoRA the stock pipeline loads."""
    from refl_ddpo.trainers import grpo

    out = tmp_path / "preset"
    train_preset_small(
        monkeypatch,
        capsys,
        grpo.main,
        tiny_models,
        out,
        "flow_grpo_z_image_turbo",
        model=TURBO,
        resolution=RES,
    )
    assert_lora_changes_stock_images(_stock(Path(tiny_models / TURBO)), out, RES, part="transformer")


def test_memory_benchmark_configs_are_z_images_published_sizes():
    """benchmarks/configs/z_image_*.json (and FLUX.1's VAE, Z-Image's) build the published parameter counts (on
    meta): the 6.15B single-stream DiT, Qwen3-4B without its LM head and the 84M VAE."""
    from benchmarks.z_image_memory import parameter_counts

    assert parameter_counts() == {
        "transformer": 6_154_908_736,
        "vae": 83_819_683,
        "text_encoder": 4_022_468_096,
    }
