"""What only the SD3 family has, on the tiny random SD3 folder: T5 dropped or absent, the SDE step's log-probs in
the loop, the x0 KL weight, inference's flow-matching default, DDPO without T5. The checks every family passes (the
loop vs the stock pipeline, the reward gradient, the LoRA in the stock pipeline and resumed, DDPO on policy, ReFL's
card, every trainer for two steps) are in tests/test_family_conformance.py and test_family_trainers.py."""

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from helpers import assert_lora_changes_stock_images, watch_training

from refl_ddpo.core.families import load_family
from refl_ddpo.core.families.sd3 import StableDiffusion3
from refl_ddpo.core.sampling import denoise

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32
SEEDS = [3, 7]  # one CPU generator per image, as the inference scripts draw


@pytest.fixture(scope="module")
def tiny_sd3(tiny_models):
    return tiny_models / "tiny-sd3"


def _stock(path, **kw) -> StableDiffusion3Pipeline:
    pipe = StableDiffusion3Pipeline.from_pretrained(path, **kw)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def stock(tiny_sd3):
    return _stock(tiny_sd3)  # with its T5


def _generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def test_sd3_loads_with_its_t5_and_a_16_channel_transformer(tiny_sd3):
    """Beside what every family is checked for on loading (tests/test_family_conformance.py)."""
    family = load_family(str(tiny_sd3))
    assert family.pipe.text_encoder_3 is not None and family.network.config.in_channels == 16


def _images(family, guidance_scale=5.0, steps=4):
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=guidance_scale > 1)
        noise = family.initial_noise(len(PROMPTS), RES, _generators(), cond["prompt_embeds"].dtype)
        scheduler = family.scheduler(family.schedulers["euler"])
        out = denoise(family, scheduler, cond, uncond, noise, steps, guidance_scale)
        return family.decode(out.latents)


def test_t5_dropped_or_absent(tiny_sd3, tmp_path):
    """drop_t5 loads a full folder without T5 (as the stock pipeline with text_encoder_3=None: zero T5 tokens), and a
    folder saved without T5 loads so by itself."""
    kw = {"num_inference_steps": 4, "guidance_scale": 5.0, "height": RES, "width": RES, "output_type": "pt"}
    no_t5 = _stock(tiny_sd3, text_encoder_3=None, tokenizer_3=None)
    ref = no_t5(PROMPTS, generator=_generators(), **kw).images
    dropped = load_family(str(tiny_sd3), drop_t5=True)
    assert dropped.pipe.text_encoder_3 is None and dropped.pipe.tokenizer_3 is None
    assert (_images(dropped) - ref).abs().max().item() <= 1 / 255
    no_t5.save_pretrained(tmp_path / "no-t5")
    absent = load_family(str(tmp_path / "no-t5"))
    assert absent.pipe.text_encoder_3 is None
    assert (_images(absent) - ref).abs().max().item() <= 1 / 255
    with_t5 = _stock(tiny_sd3)(PROMPTS, generator=_generators(), **kw).images
    assert (with_t5 - ref).abs().max().item() > 1e-3  # T5 really takes part when loaded


def test_sde_loop_log_probs_are_on_policy(stock):
    """The stochastic loop's log-probs equal those recomputed from the stored trajectory (per-sample timesteps, as
    the policy-gradient trainers score them), and a different noise level gives different ones."""
    family = StableDiffusion3(stock)
    scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
        noise = family.initial_noise(2, RES, _generators(), torch.float32)
        out = denoise(
            family,
            scheduler,
            cond,
            uncond,
            noise,
            4,
            4.5,
            eta=0.7,
            generator=_generators(),
            with_logprob=True,
            keep_trajectory=True,
        )
        assert len(out.log_probs) == 4 and len(out.all_latents) == 5
        for i, t in enumerate(out.timesteps):
            ts = t.expand(2)
            v = family.predict(out.all_latents[i], ts, scheduler, cond, uncond, 4.5)
            _, lp, x0 = family.step_with_logprob(
                scheduler, v, ts, out.all_latents[i], 0.7, None, out.all_latents[i + 1]
            )
            torch.testing.assert_close(lp, out.log_probs[i], rtol=1e-6, atol=1e-6)
            sigma = scheduler.sigmas[i]
            torch.testing.assert_close(x0, out.all_latents[i] - sigma * v)
            _, lp_other, _ = family.step_with_logprob(
                scheduler, v, ts, out.all_latents[i], 1.0, None, out.all_latents[i + 1]
            )
            assert not torch.allclose(lp_other, lp)


def test_x0_kl_weight_turns_x0_mse_into_velocity_mse(stock):
    family = StableDiffusion3(stock)
    scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    scheduler.set_timesteps(8)
    g = torch.Generator().manual_seed(0)
    x, v, v_ref = (torch.randn(2, 16, 4, 4, generator=g) for _ in range(3))
    t = scheduler.timesteps[5]
    _, x0 = family.step(scheduler, v, t, x, 0.0, None)
    _, x0_ref = family.step(scheduler, v_ref, t, x, 0.0, None)
    w = family.x0_kl_weight(scheduler, t)
    torch.testing.assert_close(
        w * (x0 - x0_ref).square().mean(), (v - v_ref).square().mean(), rtol=1e-5, atol=0
    )


def test_inference_uses_the_flow_matching_scheduler_by_default(tiny_sd3, stock, tmp_path):
    from refl_ddpo.apps import inference
    from refl_ddpo.core import generate
    from refl_ddpo.core.errors import UserError
    from refl_ddpo.run.flags import parse_config

    flags = ["--pretrained_model", str(tiny_sd3), "--prompts_file", str(tmp_path / "unused.txt")]
    flags += ["--output_dir", str(tmp_path / "out"), "--device", "cpu"]
    cfg = parse_config(inference.InferenceConfig, flags)
    family, cfg = inference.load_inference_family(cfg)
    assert cfg.scheduler == "euler" and cfg.resolution == RES
    assert type(family.pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    ours = generate.generate_batch(family, PROMPTS, SEEDS, RES, 4, 5.0)
    ref = stock(PROMPTS, num_inference_steps=4, guidance_scale=5.0, generator=_generators(), output_type="pt")
    assert (ours - ref.images).abs().max().item() <= 1 / 255
    with pytest.raises(UserError, match="does not fit a sd3 model"):
        inference.load_inference_family(
            parse_config(inference.InferenceConfig, [*flags, "--scheduler", "ddim"])
        )


def test_ddpo_trains_sd3_without_t5_and_saves_a_lora_that_loads(tiny_models, tiny_sd3, tmp_path, monkeypatch):
    """DDPO (in this process; train_ddpo.sh itself: tests/test_ddpo.py) on the tiny SD3 folder with --drop_t5: runs
    end to end, moves its LoRA and no base weight; the LoRA loads in a stock pipeline without T5."""
    from refl_ddpo.trainers import ddpo

    watch = watch_training(monkeypatch)
    out = tmp_path / "ddpo"
    flags = ["--pretrained_model", str(tiny_sd3), "--drop_t5", "--reward", "jpeg_compressibility"]
    flags += ["--output_dir", str(out), "--resolution", str(RES), "--device", "cpu"]
    flags += ["--sample_num_steps", "3", "--sample_batch_size", "2", "--sample_num_batches_per_epoch", "1"]
    flags += [
        "--train_batch_size",
        "2",
        "--num_epochs",
        "1",
        "--learning_rate",
        "3e-2",
        "--sample_eta",
        "0.7",
    ]
    flags += ["--report_to", "none", "--lora_target_modules", *StableDiffusion3.lora_target_modules]
    ddpo.main(flags)
    assert watch.runs[-1]["family"].pipe.text_encoder_3 is None
    watch.assert_lora_moved_and_base_not(out)
    assert_lora_changes_stock_images(
        _stock(tiny_sd3, text_encoder_3=None, tokenizer_3=None), out, RES, steps=4
    )
