"""The shared core: gradient on the chosen step only, model loading errors, the tiny-model CLI. The loop vs the stock
pipeline and the LoRA core (gradient, save, stock load, resume) on every family: tests/test_family_conformance.py."""

import os
import subprocess
import sys

import pytest
import torch
from diffusers import StableDiffusionPipeline

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.lora import add_lora
from refl_ddpo.core.models import load_pipeline
from refl_ddpo.core.sampling import denoise

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32


def test_grad_only_on_chosen_step(tiny_sd):
    family = load_family(str(tiny_sd))
    params = add_lora(family.network, 4, 4, ["to_q", "to_k", "to_v", "to_out.0"], init="random")
    scheduler = family.scheduler("DDPMScheduler")
    cond, _ = family.encode_prompts(PROMPTS, with_negative=False)
    noise = family.initial_noise(2, RES, torch.Generator().manual_seed(0), torch.float32)
    out = denoise(
        family,
        scheduler,
        cond,
        None,
        noise,
        10,
        1.0,
        grad_steps={7},
        stop_at=7,
        keep_trajectory=True,
        generator=torch.Generator().manual_seed(1),
    )
    assert len(out.timesteps) == 8 and len(out.all_latents) == 9
    assert not any(x.requires_grad for x in out.all_latents[:-1])  # steps 0..6 ran without autograd
    assert out.pred_original_sample.requires_grad
    out.pred_original_sample.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_missing_model_is_one_line_error(tmp_path):
    with pytest.raises(UserError, match="checkpoint/README.md"):
        load_pipeline(str(tmp_path / "nope"))


def test_tiny_cli_builds_a_loadable_pipeline(tmp_path, monkeypatch):
    """`python -m refl_ddpo.tiny OUT`, run as that command in this process (the models are tiny; a new process would
    spend its time on the imports)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["refl_ddpo.tiny", str(tmp_path)])
    runpy.run_module("refl_ddpo.tiny", run_name="__main__", alter_sys=True)
    for name in [
        "stable-diffusion/model_index.json",
        "tiny-sd3/model_index.json",
        "tiny-sdxl/model_index.json",
        "tiny-flux/model_index.json",
        "tiny-flux-schnell/model_index.json",
        "ImageReward.pt",
        "med_config.json",
        "bert-base-uncased/vocab.txt",
    ]:
        assert (tmp_path / name).is_file(), name
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "stable-diffusion")
    pipe.set_progress_bar_config(disable=True)
    img = pipe("a dog", num_inference_steps=2, height=RES, width=RES, output_type="pt").images
    assert img.shape == (1, 3, RES, RES) and torch.isfinite(img).all()


def test_unreachable_hub_id_is_one_line_error_exit_2(tmp_path):
    """No network here: a hub id ends in one `error:` line and exit code 2, not a traceback."""
    code = (
        "from refl_ddpo.core.errors import cli_main; from refl_ddpo.core.models import load_pipeline; "
        "cli_main(load_pipeline)('CompVis/stable-diffusion-v1-4')"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "checkpoint/README.md" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
