"""What only the FLUX.1 family has, on the tiny random FLUX folders (dev-like with the guidance embedding, schnell-like
without): prompt encoding vs the stock FluxPipeline's, packing and position ids at the network call, the embedded
guidance, true CFG and the resolution-dependent shift, the loop in bfloat16, the unset guidance flags resolved to the
pipeline's 3.5, resumed ReFL and GRPO runs equal to the uninterrupted ones, schnell and the Flow-GRPO-Fast preset
trained. The checks every family passes (the loop vs the stock pipeline, the reward gradient, the LoRA in the stock
pipeline, DDPO on policy, ReFL's card, every trainer for two steps) are in tests/test_family_conformance.py and
test_family_trainers.py."""

import re
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from helpers import (
    GUIDANCE_FIELDS,
    assert_lora_changes_stock_images,
    config_classes,
    one_image_inference,
    trainer_flags,
    watch_training,
)

from refl_ddpo.core.families import cond_expand, load_family
from refl_ddpo.core.families.flux import Flux
from refl_ddpo.core.sampling import denoise

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32
SEEDS = [3, 7]  # one CPU generator per image, as the inference scripts draw
DEV, SCHNELL = "tiny-flux", "tiny-flux-schnell"


def _stock(path) -> FluxPipeline:
    pipe = FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def stock(tiny_models):
    return {name: _stock(tiny_models / name) for name in (DEV, SCHNELL)}


def _generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def test_flux_loads_dev_with_the_guidance_embedding_and_schnell_without(tiny_models):
    """Beside what every family is checked for on loading (tests/test_family_conformance.py)."""
    family = load_family(str(tiny_models / DEV))
    assert family.network.config.guidance_embeds and family.vae.config.latent_channels == 16
    assert family.native_resolution == 128 * family.vae_scale_factor  # the pipeline's default height
    assert not load_family(str(tiny_models / SCHNELL)).network.config.guidance_embeds


def test_drop_t5_is_refused_in_one_line(tiny_models):
    from refl_ddpo.core.errors import UserError

    with pytest.raises(UserError, match="cannot run without it"):
        load_family(str(tiny_models / DEV), drop_t5=True)


def test_encode_prompts_equal_the_stock_encode_prompt(stock):
    family = Flux(stock[DEV])
    assert (
        family.encode_prompts(PROMPTS, with_negative=True)[1] is None
    )  # true CFG off: no negative to encode
    family.true_cfg_scale = 4.0
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    with torch.no_grad():  # as the pipeline's __call__
        embeds, pooled, text_ids = stock[DEV].encode_prompt(PROMPTS, prompt_2=None, device="cpu")
        empty, empty_pooled, _ = stock[DEV].encode_prompt([""] * 2, device="cpu")
    assert cond["prompt_embeds"].shape == (2, 512, 64) and cond["pooled_prompt_embeds"].shape == (2, 32)
    assert torch.equal(cond["prompt_embeds"], embeds) and torch.equal(cond["pooled_prompt_embeds"], pooled)
    assert torch.equal(family.text_ids(embeds), text_ids)
    assert torch.equal(uncond["prompt_embeds"], empty) and torch.equal(
        uncond["pooled_prompt_embeds"], empty_pooled
    )


def test_a_prompt_is_said_truncated_only_past_t5s_512_tokens(stock, capsys):
    family = Flux(stock[DEV])
    family.encode_prompts(["a cat " * 30], with_negative=False)  # past CLIP's 77 tokens, within T5's 512
    assert "truncated" not in capsys.readouterr().err
    family.encode_prompts(["a cat " * 200], with_negative=False)  # 800 tokens of the tiny T5
    assert "the text encoder reads 512" in capsys.readouterr().err


def test_pack_unpack_and_noise_are_the_pipelines(stock):
    family = Flux(stock[DEV])
    noise = family.initial_noise(2, RES, _generators(), torch.float32)
    assert noise.shape == (2, 16, 16, 16)
    packed, _ = stock[DEV].prepare_latents(2, 16, RES, RES, torch.float32, "cpu", _generators())
    assert torch.equal(family.pack(noise), packed) and packed.shape == (2, 64, 64)
    assert torch.equal(family.unpack(packed, 16, 16), noise)
    with pytest.raises(ValueError, match="multiple of 4"):
        family.initial_noise(1, 30, None, torch.float32)


def test_position_ids_are_built_once_per_shape_and_serve_a_step_with_gradient(stock, monkeypatch):
    """The image position ids are the pipeline's, built on the host once per latent shape (not at every network call:
    on a GPU each copy from the host waits for the stream), and ids first built while sampling (inference mode) serve
    a later step with gradient."""
    family = Flux(stock[DEV])
    built = []
    make = family.pipe._prepare_latent_image_ids
    monkeypatch.setattr(family.pipe, "_prepare_latent_image_ids", lambda *a: built.append(a[1:3]) or make(*a))
    scheduler, t = family.scheduler("FlowMatchEulerDiscreteScheduler"), torch.tensor(500.0)
    cond, _ = family.encode_prompts(PROMPTS, with_negative=False)
    x = family.initial_noise(2, RES, _generators(), torch.float32)
    with torch.inference_mode():
        v = family.predict(x, t, scheduler, cond, None, 3.5)
        assert torch.equal(family.predict(x, t, scheduler, cond, None, 3.5), v)
        family.predict(torch.cat([x, x], dim=-1), t, scheduler, cond, None, 3.5)
    assert built == [(8, 8), (8, 16)]
    ids = family.constant(("img_ids", 16, 16, x.device, torch.float32), None)
    assert torch.equal(ids, make(2, 8, 8, "cpu", torch.float32)) and not ids.is_inference()
    x = x.clone().requires_grad_(True)
    family.predict(x, t, scheduler, cond, None, 3.5).square().mean().backward()
    assert x.grad.abs().sum() > 0 and built == [(8, 8), (8, 16)]


def _images(family, guidance_scale, steps=4, uncond=False, resolution=RES):
    with torch.no_grad():
        cond, negative = family.encode_prompts(PROMPTS, with_negative=uncond)
        noise = family.initial_noise(len(PROMPTS), resolution, _generators(), cond["prompt_embeds"].dtype)
        scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
        out = denoise(family, scheduler, cond, negative, noise, steps, guidance_scale)
        return family.decode(out.latents), out.timesteps


def _stock_images(pipe, guidance_scale, steps=4, resolution=RES, **kw):
    return pipe(
        PROMPTS,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        generator=_generators(),
        height=resolution,
        width=resolution,
        output_type="pt",
        **kw,
    ).images


@pytest.mark.parametrize("name", [DEV, SCHNELL])
def test_the_schedule_is_shifted_on_dev_and_plain_on_schnell(stock, name):
    """The loop's timesteps (its images equal the stock pipeline's: tests/test_family_conformance.py)."""
    _, timesteps = _images(Flux(stock[name]), 3.5 if name == DEV else 0.0)
    if name == SCHNELL:  # no dynamic shifting, shift 1: the plain linspace(1, 1/T, T) x 1000
        assert timesteps.tolist() == [1000.0, 750.0, 500.0, 250.0]
    else:  # shifted by mu(64 image tokens) = 0.5 - (1.15 - 0.5) / (4096 - 256) * 192
        assert timesteps[1].item() == pytest.approx(827.2286, abs=1e-3)


def test_loop_reproduces_stock_pipeline_in_bfloat16(tiny_models, record_property):
    path = tiny_models / DEV
    family = load_family(str(path), dtype=torch.bfloat16)
    pipe = FluxPipeline.from_pretrained(path, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    diff = (_images(family, 3.5)[0].float() - _stock_images(pipe, 3.5).float()).abs().max().item()
    record_property("max_grey_levels", diff * 255)
    assert diff <= 1 / 255  # the stock postprocess rounds in bfloat16, ours decodes to float32


def test_guidance_embedding_and_resolution_shift_follow_the_pipeline(stock):
    """Dev's embedded guidance changes the image (schnell's none); at 64 px (256 image tokens) mu is base_shift."""
    dev, schnell = Flux(stock[DEV]), Flux(stock[SCHNELL])
    assert (_images(dev, 3.5, steps=2)[0] - _images(dev, 7.0, steps=2)[0]).abs().max() > 1e-3
    assert torch.equal(_images(schnell, 3.5, steps=2)[0], _images(schnell, 7.0, steps=2)[0])
    ours, timesteps = _images(dev, 3.5, steps=2, resolution=64)
    ref = _stock_images(stock[DEV], 3.5, steps=2, resolution=64)
    assert (ours - ref).abs().max().item() <= 1 / 255
    sigma = 0.5  # the second sigma of linspace(1, 1/2, 2), shifted with exp(mu = 0.5)
    shifted = torch.exp(torch.tensor(0.5)) / (torch.exp(torch.tensor(0.5)) + (1 / sigma - 1))
    assert timesteps[1].item() == pytest.approx(1000 * shifted.item(), abs=1e-3)


def test_true_cfg_is_off_by_default_and_equals_the_pipelines_when_on(stock):
    family = Flux(stock[DEV])
    assert family.true_cfg_scale == 1.0
    plain = _images(family, 3.5)[0]
    with torch.no_grad():  # an uncond alone (the trainers' empty_cond) turns nothing on
        cond = family.encode_prompts(PROMPTS, with_negative=False)[0]
        scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
        noise = family.initial_noise(2, RES, _generators(), torch.float32)
        empty = cond_expand(family.empty_cond(), 2)
        out = denoise(family, scheduler, cond, empty, noise, 4, 3.5)
        assert torch.equal(family.decode(out.latents), plain)
    family.true_cfg_scale = 4.0
    ours = _images(family, 3.5, uncond=True)[0]
    ref = _stock_images(stock[DEV], 3.5, negative_prompt="", true_cfg_scale=4.0)
    assert (ours - ref).abs().max().item() <= 1 / 255 and (ours - plain).abs().max() > 1e-3


# ---- the trainers (every trainer for two steps: tests/test_family_trainers.py) ----


def _policy_flags(tiny_models, out: Path, *extra: str, num_epochs: int = 2, **flags) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=DEV,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_num_steps=3,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        sample_guidance_scale=3.5,
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=num_epochs,
        device="cpu",
        report_to="none",
        **flags,
    )


def _refl_flags(tiny_models, out: Path, *extra: str, **flags) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=DEV,
        num_inference_steps=4,
        k_lo=2,
        k_hi=3,
        guidance_scale=3.5,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        device="cpu",
        report_to="none",
        **flags,
    )


def test_resumed_refl_run_equals_the_uninterrupted_one(tiny_models, tmp_path, capsys):
    """4 ReFL steps with a checkpoint at 2; a run that stopped after checkpoint-2 (its folder holds only that) and
    resumes from it ends with the bit-identical LoRA."""
    from safetensors.torch import load_file

    from refl_ddpo.core.lora import LORA_WEIGHTS_NAME
    from refl_ddpo.trainers import refl

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    refl.main(_refl_flags(tiny_models, whole, max_train_steps=4, checkpointing_steps=2))
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    refl.main(
        _refl_flags(
            tiny_models,
            resumed,
            "--resume_from_checkpoint",
            "latest",
            max_train_steps=4,
            checkpointing_steps=2,
        )
    )
    assert f"resumed from {resumed / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    a, b = load_file(whole / LORA_WEIGHTS_NAME), load_file(resumed / LORA_WEIGHTS_NAME)
    midway = load_file(whole / "checkpoint-2" / LORA_WEIGHTS_NAME)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(midway[k], a[k]) for k in a), "the resumed half did train"


def test_resumed_grpo_run_equals_the_uninterrupted_one(tiny_models, tmp_path, capsys):
    """3 GRPO epochs (KL to the base on) with a checkpoint after each; a run that stopped after checkpoint-1 and
    resumes from it ends with the bit-identical LoRA and train state."""
    import json

    from safetensors.torch import load_file

    from refl_ddpo.core.lora import LORA_WEIGHTS_NAME
    from refl_ddpo.trainers import grpo

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    flags = {"group_size": 2, "beta": "0.04", "num_epochs": 3, "save_freq": 1}
    grpo.main(_policy_flags(tiny_models, whole, **flags))
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-1", resumed / "checkpoint-1")
    grpo.main(_policy_flags(tiny_models, resumed, "--resume_from_checkpoint", "latest", **flags))
    assert "resumed from" in capsys.readouterr().out
    a, b = load_file(whole / LORA_WEIGHTS_NAME), load_file(resumed / LORA_WEIGHTS_NAME)
    first = load_file(whole / "checkpoint-1" / LORA_WEIGHTS_NAME)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(first[k], a[k]) for k in a), "the resumed epochs did train"
    state = "checkpoint-3/train_state.json"
    assert json.loads((whole / state).read_text()) == json.loads((resumed / state).read_text())


@pytest.mark.parametrize("trainer", ["refl", "grpo"])
def test_schnell_trains_a_lora_that_loads_in_its_stock_pipeline(trainer, tiny_models, tmp_path, monkeypatch):
    """The schnell-like folder (no guidance embedding, no dynamic shifting) through reward backprop and GRPO."""
    import importlib

    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    if trainer == "refl":
        flags = _refl_flags(tiny_models, out, max_train_steps=2)
    else:
        flags = _policy_flags(tiny_models, out, group_size=2)
    flags[flags.index("--pretrained_model") + 1] = str(tiny_models / SCHNELL)
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(flags)
    watch.assert_lora_moved_and_base_not(out)
    assert_lora_changes_stock_images(_stock(tiny_models / SCHNELL), out, RES, part="transformer")


# ---- guidance defaults: an unset guidance flag takes FLUX.1-dev's embedded 3.5, not an SD trainer's CFG default ----


def _guidance_flags(cls, model: Path, *flags: str):
    from refl_ddpo.run.flags import parse_config

    return parse_config(cls, ["--pretrained_model", str(model), *flags])


def test_unset_guidance_flags_resolve_per_family_and_a_set_one_wins(tiny_models):
    """Every trainer's guidance flags: unset, FLUX.1-dev (and schnell, which ignores it) gets the pipeline's 3.5
    and SD 1.x its CFG default as before; a value the user gives is kept on both; the DDPO-style alias reads the
    resolved value."""
    from refl_ddpo.core.families import resolve_guidance

    for cls in config_classes():
        defaults = GUIDANCE_FIELDS[cls.__name__]
        for model, expected in [
            (tiny_models / DEV, dict.fromkeys(defaults, 3.5)),
            (tiny_models / SCHNELL, dict.fromkeys(defaults, 3.5)),
            (tiny_models / "stable-diffusion", defaults),
        ]:
            cfg = _guidance_flags(cls, model)
            assert all(getattr(cfg, name) is None for name in defaults), cls.__name__  # unset until resolved
            resolved = resolve_guidance(cfg)
            assert {n: getattr(resolved, n) for n in defaults} == expected, (cls.__name__, model.name)
            sampler = next(iter(defaults))
            given = resolve_guidance(_guidance_flags(cls, model, f"--{sampler}", "2.0"))
            assert (
                getattr(given, sampler) == 2.0
                and given.validation_guidance_scale == expected["validation_guidance_scale"]
            )
            if sampler == "sample_guidance_scale":  # the common flag is an alias of it
                assert resolved.guidance_scale == resolved.sample_guidance_scale
                alias = resolve_guidance(_guidance_flags(cls, model, "--guidance_scale", "2.5"))
                assert alias.sample_guidance_scale == alias.guidance_scale == 2.5


def test_trainer_records_the_guidance_it_resolved(tiny_models, tmp_path):
    """The trainers' shared checks resolve the unset guidance from model_index.json before any weights load: the
    config they print and save beside the LoRA says 3.5 on FLUX.1-dev."""
    from refl_ddpo.run.session import shared_checks
    from refl_ddpo.trainers.refl_config import ReFLConfig

    cfg = _guidance_flags(ReFLConfig, tiny_models / DEV, "--reward_model_dir", str(tiny_models))
    resolved = shared_checks(cfg)
    assert (resolved.guidance_scale, resolved.validation_guidance_scale) == (3.5, 3.5)
    assert resolved.to_dict()["guidance_scale"] == 3.5
    assert re.search(r"^  guidance_scale +=  ?3\.5$", resolved.pretty(), re.MULTILINE)


@pytest.mark.parametrize("flags, expected", [((), 3.5), (("--guidance_scale", "2.0"), 2.0)])
def test_inference_embeds_the_pipelines_default_guidance_unless_one_is_given(
    flags, expected, tiny_models, stock, tmp_path, monkeypatch, capsys
):
    """inference.py on FLUX.1-dev: without --guidance_scale the transformer gets the stock pipeline's 3.5 as its
    embedded guidance (the image equals FluxPipeline's default call), with it the value given; scores.json and the
    PNG's settings record the value used, and so do the printed lines."""
    import json

    import numpy as np
    from PIL import Image

    seen = []
    predict = Flux.predict

    def recording(self, *args, **kwargs):
        seen.append(args[5])  # guidance_scale
        return predict(self, *args, **kwargs)

    monkeypatch.setattr(Flux, "predict", recording)
    result = one_image_inference(tmp_path, tiny_models / DEV, PROMPTS[0], 2, RES, SEEDS[0], *flags)
    assert set(seen) == {expected} and result["config"]["guidance_scale"] == expected
    assert f"guidance_scale {expected}" in capsys.readouterr().out
    image = Image.open(tmp_path / "out" / result["records"][0]["file"])
    assert json.loads(image.text["parameters"])["guidance_scale"] == expected
    kw = {} if not flags else {"guidance_scale": expected}  # the pipeline's own default when none is given
    ref = stock[DEV](
        PROMPTS[0],
        height=RES,
        width=RES,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(SEEDS[0]),
        output_type="np",
        **kw,
    ).images[0]
    ours = np.asarray(image).astype(np.float32) / 255
    assert np.abs(ours - ref).max() <= 1.5 / 255


def test_flow_grpo_fast_preset_trains_its_lora_targets_in_a_window(
    tiny_models, tmp_path, capsys, monkeypatch
):
    """Flow-GRPO-Fast's FLUX.1-dev preset, scaled down to the tiny FLUX.1-dev (one group of 2, JPEG size as
    reward): its window of 3 steps trains, and the LoRA on its targets (the feed-forward layers too) loads in the
    stock pipeline."""
    from refl_ddpo.trainers import grpo

    out = tmp_path / "fast"
    flags = trainer_flags(
        tiny_models,
        out,
        "--preset",
        "flow_grpo_fast_flux",
        model=DEV,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        group_size=2,
        train_batch_size=2,
        train_gradient_accumulation_steps=1,
        num_epochs=1,
        lora_rank=4,
        lora_alpha=4,
        lora_init="random",
        learning_rate="3e-2",
        mixed_precision="no",
        device="cpu",
        report_to="none",
    )
    watch = watch_training(monkeypatch)
    grpo.main(flags)
    assert "trained timesteps per sample: 3" in capsys.readouterr().out
    watch.assert_lora_moved_and_base_not(out)
    assert_lora_changes_stock_images(_stock(tiny_models / DEV), out, RES, part="transformer")
