"""DDPO and GRPO on the tiny SDXL as diffusers' own SDXL pipeline tests build it (issue #72): 2 layers per block,
sample_size 32, a VAE of sample_size 128 and scaling factor 0.18215, and an Euler scheduler config without
set_alpha_to_one, so that the policy sampler (DDIM from that config) takes DDIM's default and its last step goes to
a_prev = 1: deterministic, with log-prob 0. Both train two epochs with finite gradients, on policy at their first
update, and their LoRAs load in the stock pipeline and change its images."""

import importlib
import math

import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from helpers import assert_lora_changes_stock_images, ddpo_first_update, trainer_flags, watch_training

from refl_ddpo.core.families import load_family
from refl_ddpo.core.lora import add_lora
from refl_ddpo.core.steps.ddim import step_alphas
from refl_ddpo.testing.tiny import write_tiny_sdxl_diffusers_config

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

RES = 32
STEPS = 4  # leading spacing, steps_offset 1: timesteps 751, 501, 251, 1; the last goes to a_prev = 1


@pytest.fixture(scope="module")
def diffusers_sdxl(tmp_path_factory):
    return write_tiny_sdxl_diffusers_config(tmp_path_factory.mktemp("models"))


def test_first_update_is_finite_and_on_policy_with_a_deterministic_last_step(diffusers_sdxl):
    torch.manual_seed(0)
    family = load_family(str(diffusers_sdxl))
    scheduler = family.policy_scheduler()
    schedule = family.set_timesteps(scheduler, STEPS, None)
    assert schedule.tolist() == [751, 501, 251, 1] and float(scheduler.final_alpha_cumprod) == 1.0
    assert step_alphas(scheduler, schedule)[2].tolist()[-1] == 0.0  # the last step's variance
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    kw = {"num_steps": STEPS, "guidance_scale": 5.0, "eta": 1.0}
    samples, first = ddpo_first_update(
        family, scheduler, params, family.empty_cond(), ["a cat"] * 4, RES, **kw
    )
    assert torch.isfinite(samples["log_probs"]).all() and not samples["log_probs"][:, -1].any()
    assert math.isfinite(first["grad_norm"]) and first["grad_norm"] > 0, first
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first
    assert first["ratio_by_step/03"] == 1.0 and all(
        abs(first[f"ratio_by_step/0{i}"] - 1) <= 1e-5 for i in range(3)
    )


@pytest.mark.parametrize("trainer, extra", [("ddpo", {}), ("grpo", {"group_size": 2})])
def test_trains_two_epochs_on_policy_with_finite_gradients_and_the_lora_loads_in_the_stock_pipeline(
    trainer, extra, diffusers_sdxl, tmp_path, monkeypatch
):
    """The trainer (in this process) on that model, every sampler step trained: each epoch's single optimizer step
    has a finite gradient norm and is on policy (its samples were drawn with the weights it starts from)."""
    from refl_ddpo.trainers import policy_gradient

    steps = []

    def recorded(*args, **kwargs):
        steps.extend(train_on_samples(*args, **kwargs))
        return steps[-1:]

    train_on_samples = policy_gradient.train_on_samples
    monkeypatch.setattr(policy_gradient, "train_on_samples", recorded)  # DDPO's and GRPO's one loop
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    flags = trainer_flags(
        diffusers_sdxl.parent,
        out,
        model=diffusers_sdxl.name,
        resolution=RES,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_num_steps=STEPS,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=2,
        device="cpu",
        report_to="none",
        **extra,
    )
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(flags)
    assert len(steps) == 2, steps
    for step in steps:
        assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0, step
        assert step["approx_kl"] < 1e-10 and abs(step["ratio"] - 1) <= 1e-5, step
        assert step["ratio_by_step/03"] == 1.0, step  # the deterministic last step: log-prob 0 both times
    watch.assert_lora_moved_and_base_not(out)
    pipe = StableDiffusionXLPipeline.from_pretrained(diffusers_sdxl, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    assert_lora_changes_stock_images(pipe, out, RES, part="unet")
