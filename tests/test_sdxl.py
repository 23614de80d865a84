"""The SDXL family on the tiny random SDXL folder: loading by model_index.json, prompt encoding and the loop vs the
stock StableDiffusionXLPipeline (Euler and DDIM, with and without CFG), the VAE's upcast and latent normalisation, the
validator, and every trainer for two steps, whose LoRAs load in a stock pipeline and whose card names the family."""

from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionXLPipeline
from helpers import (
    DRAFT_CASES,
    assert_lora_changes_stock_images,
    assert_lora_moves_the_scores,
    ddpo_first_update,
    run_script,
    trainer_flags,
    watch_training,
)

from refl_ddpo.core.families import family_class, load_family
from refl_ddpo.core.families.sdxl import StableDiffusionXL
from refl_ddpo.core.sampling import denoise

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32
SEEDS = [3, 7]  # one CPU generator per image, as the inference scripts draw


@pytest.fixture(scope="module")
def tiny_sdxl(tiny_models):
    return tiny_models / "tiny-sdxl"


def _stock(path, **kw) -> StableDiffusionXLPipeline:
    pipe = StableDiffusionXLPipeline.from_pretrained(path, add_watermarker=False, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def stock(tiny_sdxl):
    return _stock(tiny_sdxl)


def _generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def test_load_family_picks_sdxl_from_model_index(tiny_sdxl):
    family = load_family(str(tiny_sdxl))
    assert (
        isinstance(family, StableDiffusionXL)
        and family_class("StableDiffusionXLPipeline") is StableDiffusionXL
    )
    assert family.native_resolution == RES and family.pipe.text_encoder_2 is not None
    assert family.pipe.watermark is None  # the kit decodes itself: no watermark to import
    assert not any(p.requires_grad for p in family.network.parameters())
    half = load_family(str(tiny_sdxl), dtype=torch.float16)  # force_upcast: the VAE decodes in float32
    assert half.network.dtype == torch.float16 and half.vae.dtype == torch.float32


def test_a_guidance_distilled_unet_is_refused_in_one_line(tiny_sdxl):
    from refl_ddpo.core.errors import UserError

    pipe = _stock(tiny_sdxl)
    pipe.unet.register_to_config(time_cond_proj_dim=8)  # as LCM-distilled SDXL UNets have
    with pytest.raises(UserError, match="guidance embedding"):
        StableDiffusionXL(pipe)


def test_encode_prompts_equal_the_stock_encode_prompt(stock):
    family = StableDiffusionXL(stock)
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    embeds, negative, pooled, negative_pooled = stock.encode_prompt(PROMPTS, device="cpu")
    assert cond["prompt_embeds"].shape == (2, 77, 64) and cond["pooled_prompt_embeds"].shape == (2, 32)
    for ours, ref in [
        (cond["prompt_embeds"], embeds),
        (cond["pooled_prompt_embeds"], pooled),
        (uncond["prompt_embeds"], negative),
        (uncond["pooled_prompt_embeds"], negative_pooled),
    ]:
        assert torch.equal(ours, ref)
    # force_zeros_for_empty_prompt (SDXL base's): the negative is zeros, and so is the trainers' empty_cond
    assert not uncond["prompt_embeds"].any() and not uncond["pooled_prompt_embeds"].any()
    empty = family.empty_cond()
    assert empty["prompt_embeds"].shape == (1, 77, 64) and not any(v.any() for v in empty.values())
    stock.register_to_config(force_zeros_for_empty_prompt=False)
    try:
        _, uncond = family.encode_prompts(PROMPTS, with_negative=True)
        _, negative, _, negative_pooled = stock.encode_prompt(PROMPTS, device="cpu")
        encoded = family.encode_prompts([""], with_negative=False)[0]
        assert torch.equal(uncond["prompt_embeds"], negative) and negative.any()
        assert torch.equal(uncond["pooled_prompt_embeds"], negative_pooled)
        assert all(torch.equal(family.empty_cond()[k], encoded[k]) for k in encoded)
    finally:
        stock.register_to_config(force_zeros_for_empty_prompt=True)


def _images(family, scheduler, guidance_scale, steps=6):
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=guidance_scale > 1)
        noise = family.initial_noise(len(PROMPTS), RES, _generators(), cond["prompt_embeds"].dtype)
        out = denoise(family, scheduler, cond, uncond, noise, steps, guidance_scale)
        return family.decode(out.latents)


def _stock_images(stock, scheduler, guidance_scale, steps=6):
    stock.scheduler = scheduler
    kw = {"height": RES, "width": RES, "output_type": "pt"}
    return stock(
        PROMPTS, num_inference_steps=steps, guidance_scale=guidance_scale, generator=_generators(), **kw
    ).images


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
@pytest.mark.parametrize("sampler", ["EulerDiscreteScheduler", "DDIMScheduler"])
def test_loop_reproduces_stock_pipeline(stock, sampler, guidance_scale, record_property):
    family = StableDiffusionXL(stock)
    original = stock.scheduler
    try:
        ref = _stock_images(stock, family.scheduler(sampler), guidance_scale)
    finally:
        stock.scheduler = original
    ours = _images(family, family.scheduler(sampler), guidance_scale)
    assert ours.shape == ref.shape == (2, 3, RES, RES)
    diff = (ours - ref).abs().max().item()
    record_property("max_grey_levels", diff * 255)
    assert diff <= 1 / 255


def test_added_conditions_reach_the_unet(stock):
    """The pooled text, the time ids (the image size) and CFG each change the noise prediction."""
    family = StableDiffusionXL(stock)
    scheduler = family.scheduler("DDIMScheduler")
    scheduler.set_timesteps(4)
    t = scheduler.timesteps[1]
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
        x = family.initial_noise(2, RES, _generators(), torch.float32)
        eps = family.predict(x, t, scheduler, cond, None, 1.0)
        no_pool = {**cond, "pooled_prompt_embeds": torch.zeros_like(cond["pooled_prompt_embeds"])}
        assert (family.predict(x, t, scheduler, no_pool, None, 1.0) - eps).abs().max() > 1e-4
        assert family.add_time_ids(x, x).tolist() == [[RES, RES, 0, 0, RES, RES]] * 2
        assert family.add_time_ids(x, x).data_ptr() == family.add_time_ids(x[:1], x).data_ptr()  # built once
        wide = family.predict(torch.cat([x, x], dim=-1), t, scheduler, cond, None, 1.0)[..., : x.shape[-1]]
        assert (wide - eps).abs().max() > 1e-4  # other time ids (and a wider image)
        assert (family.predict(x, t, scheduler, cond, uncond, 5.0) - eps).abs().max() > 1e-4


def test_decode_denormalises_with_latents_mean_and_std_as_the_pipeline(tiny_sdxl):
    """A VAE config with latents_mean / latents_std (as some SDXL fine-tunes ship) decodes as the pipeline does."""
    pipe = _stock(tiny_sdxl)
    pipe.vae.register_to_config(latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])
    family = StableDiffusionXL(pipe)
    ref = _stock_images(pipe, family.scheduler("DDIMScheduler"), 5.0, steps=3)
    assert (_images(family, family.scheduler("DDIMScheduler"), 5.0, steps=3) - ref).abs().max() <= 1 / 255


def test_inference_defaults_to_ddim_and_draws_the_stock_images(tiny_sdxl, stock, tmp_path):
    from refl_ddpo.apps import inference
    from refl_ddpo.core import generate
    from refl_ddpo.run.flags import parse_config

    flags = ["--pretrained_model", str(tiny_sdxl), "--prompts_file", str(tmp_path / "unused.txt")]
    flags += ["--output_dir", str(tmp_path / "out"), "--device", "cpu"]
    cfg = parse_config(inference.InferenceConfig, flags)
    family, cfg = inference.load_inference_family(cfg)
    assert cfg.scheduler == "ddim" and cfg.resolution == RES and family.name == "sdxl"
    ours = generate.generate_batch(family, PROMPTS, SEEDS, RES, 4, 5.0)
    original = stock.scheduler
    try:
        ref = _stock_images(stock, DDIMScheduler.from_config(original.config), 5.0, steps=4)
    finally:
        stock.scheduler = original
    assert (ours - ref).abs().max().item() <= 1 / 255


def test_reward_gradient_reaches_every_lora_tensor_and_no_base_weight(tiny_sdxl):
    """ReFL's path (no grad to step k, one step with grad, predicted x0, VAE decode) on SDXL's default targets."""
    from refl_ddpo.core.lora import add_lora

    family = load_family(str(tiny_sdxl))
    network = family.network
    params = add_lora(network, 4, 4, family.lora_target_modules, init="random")  # B != 0: A gets gradient too
    base_before = {n: p.detach().clone() for n, p in network.named_parameters() if "lora_" not in n}
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    noise = family.initial_noise(2, RES, _generators(), torch.float32)
    scheduler = family.scheduler("DDIMScheduler")
    out = denoise(family, scheduler, cond, uncond, noise, 4, 5.0, grad_steps={2}, stop_at=2)
    family.decode(out.pred_original_sample).mean().backward()
    for n, p in network.named_parameters():
        if "lora_" in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
    torch.optim.AdamW(params, lr=1e-2).step()
    assert all(torch.equal(base_before[n], p) for n, p in network.named_parameters() if "lora_" not in n)


def test_ddpo_first_update_is_on_policy_through_the_sample_buffers(tiny_sdxl):
    """DDPO's sample buffers carry SDXL's conditioning (prompt_embeds (N, 77, 64), pooled (N, 32)) through stacking,
    shuffling and slicing; the first PPO step recomputes the sampler's log-probs (CFG against empty_cond's zeros):
    approx KL 0, nothing clipped."""
    from refl_ddpo.core.lora import add_lora

    torch.manual_seed(0)
    family = load_family(str(tiny_sdxl))
    scheduler = family.policy_scheduler()
    assert type(scheduler).__name__ == "DDIMScheduler"
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    kw = {"num_steps": 3, "guidance_scale": 5.0, "eta": 1.0}
    samples, first = ddpo_first_update(family, scheduler, params, family.empty_cond(), PROMPTS * 4, RES, **kw)
    assert samples["pooled_prompt_embeds"].shape == (4, 32) and samples["prompt_embeds"].shape == (4, 77, 64)
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


# ---- the trainers, two steps each (in this process; GRPO through its shell script) ----


def _policy_flags(tiny_models, out: Path, *extra: str, **flags) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model="tiny-sdxl",
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_num_steps=3,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=2,
        device="cpu",
        report_to="none",
        **flags,
    )


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "validation.txt"
    path.write_text("a photo of a cat\n")
    return path


def test_refl_trains_a_lora_that_loads_in_the_stock_pipeline_and_the_card_names_sdxl(
    tiny_models, tiny_sdxl, tmp_path, prompts_file, capsys
):
    """ReFL (ImageReward, the KL term on) for 2 steps with validation: the LoRA changes the stock pipeline's images;
    the run, the validation files and the model card name the family."""
    from refl_ddpo.run.model_card import CARD_NAME
    from refl_ddpo.run.validation import validation_files
    from refl_ddpo.trainers import refl

    out = tmp_path / "refl"
    argv = trainer_flags(
        tiny_models,
        out,
        model="tiny-sdxl",
        num_inference_steps=6,
        k_lo=3,
        k_hi=5,
        train_batch_size=2,
        learning_rate="3e-2",
        max_train_steps=2,
        kl_weight=1,
        lora_init="random",
        validation_prompts_file=prompts_file,
        num_validation_images=1,
        validation_num_steps=3,
        device="cpu",
        report_to="none",
    )
    refl.main(argv)
    assert "model family: sdxl" in capsys.readouterr().out
    assert_lora_changes_stock_images(_stock(tiny_sdxl), out, RES, part="unet")
    records = validation_files(out)
    assert [r["count"] for r in records] == [0, 2] and {r["family"] for r in records} == {"sdxl"}
    card = (out / CARD_NAME).read_text()
    assert "| model family | Stable Diffusion XL" in card and "stable-diffusion-xl" in card

    # before / after inference with its scores, and the scored comparison, on this LoRA
    assert_lora_moves_the_scores(tiny_models, tiny_sdxl, out, prompts_file, tmp_path)


@pytest.mark.parametrize("flags, described", DRAFT_CASES)
def test_draft_k_alignprop_and_draft_lv_run_two_steps(
    flags, described, tiny_models, tmp_path, capsys, monkeypatch
):
    from refl_ddpo.trainers import refl

    watch = watch_training(monkeypatch)
    out = tmp_path / "draft"
    argv = trainer_flags(
        tiny_models,
        out,
        *flags,
        model="tiny-sdxl",
        num_inference_steps=4,
        scheduler="ddim",
        train_batch_size=1,
        learning_rate="3e-2",
        max_train_steps=2,
        lora_init="random",
        device="cpu",
        report_to="none",
    )
    refl.main(argv)
    assert described in capsys.readouterr().out
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    watch.assert_lora_moved_and_base_not(out)


def test_grpo_script_trains_a_lora_that_loads_in_the_stock_pipeline(tiny_models, tiny_sdxl, tmp_path):

    out = tmp_path / "grpo"
    flags = _policy_flags(tiny_models, out, group_size=2, beta="0.04")
    r = run_script("train_grpo.sh", flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_lora_changes_stock_images(_stock(tiny_sdxl), out, RES, part="unet")


@pytest.mark.parametrize("trainer", ["ddpo", "nft", "awm"])
def test_trainer_runs_two_epochs(trainer, tiny_models, tiny_sdxl, tmp_path, capsys, monkeypatch):
    import importlib

    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    extra = {} if trainer == "ddpo" else {"group_size": 2}
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(_policy_flags(tiny_models, out, **extra))
    assert "epoch 2/2" in capsys.readouterr().out
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    watch.assert_lora_moved_and_base_not(out)
    if trainer == "ddpo":
        assert_lora_changes_stock_images(_stock(tiny_sdxl), out, RES, part="unet")
