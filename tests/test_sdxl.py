"""What only the SDXL family has, on the tiny random SDXL folder: both text encoders, prompt encoding vs the stock
StableDiffusionXLPipeline's, the added conditions (pooled text, time ids), the VAE's upcast and latent normalisation,
a guidance-distilled UNet refused, inference's DDIM default. The checks every family passes (the loop vs the stock
pipeline, the reward gradient, the LoRA in the stock pipeline, DDPO on policy, every trainer for two steps) are in
tests/test_family_conformance.py and test_family_trainers.py."""

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionXLPipeline

from refl_ddpo.core.families import load_family
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


def test_sdxl_loads_both_text_encoders_no_watermark_and_a_float32_vae(tiny_sdxl):
    """Beside what every family is checked for on loading (tests/test_family_conformance.py)."""
    family = load_family(str(tiny_sdxl))
    assert family.pipe.text_encoder_2 is not None
    assert family.pipe.watermark is None  # the kit decodes itself: no watermark to import
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
