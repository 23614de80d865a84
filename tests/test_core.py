"""The shared core: the denoising loop vs the stock pipeline, the LoRA core, model loading errors."""

import os
import subprocess
import sys

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, StableDiffusionPipeline

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.families.sd import StableDiffusion
from refl_ddpo.core.lora import add_lora, save_lora
from refl_ddpo.core.models import load_pipeline
from refl_ddpo.core.sampling import denoise

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32


def _ours(pipe, scheduler_cls, seed, guidance_scale, steps=6, eta=0.0):
    family = StableDiffusion(pipe)
    scheduler = scheduler_cls.from_config(pipe.scheduler.config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=guidance_scale > 1)
        noise = family.initial_noise(len(PROMPTS), RES, g, cond["prompt_embeds"].dtype)
        out = denoise(family, scheduler, cond, uncond, noise, steps, guidance_scale, eta=eta, generator=g)
        return family.decode(out.latents)


@pytest.mark.parametrize("scheduler_cls", [DDIMScheduler, DDPMScheduler])
@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_loop_reproduces_stock_pipeline(tiny_sd, scheduler_cls, guidance_scale):
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = scheduler_cls.from_config(pipe.scheduler.config)
    ref = pipe(
        PROMPTS,
        num_inference_steps=6,
        guidance_scale=guidance_scale,
        height=RES,
        width=RES,
        generator=torch.Generator().manual_seed(3),
        output_type="pt",
    ).images
    ours = _ours(pipe, scheduler_cls, 3, guidance_scale)
    assert ours.shape == ref.shape == (2, 3, RES, RES)
    assert (ours - ref).abs().max().item() <= 1e-5


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


def test_lora_step_moves_only_lora_and_loads_in_stock_pipeline(tiny_sd, tmp_path):
    family = load_family(str(tiny_sd))
    pipe = family.pipe
    params = add_lora(pipe.unet, 4, 8, ["to_q", "to_k", "to_v", "to_out.0"], init="gaussian")
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    base_before = {n: p.detach().clone() for n, p in pipe.unet.named_parameters() if "lora_" not in n}
    lora_before = [p.detach().clone() for p in params]
    # one step on a toy differentiable loss through the whole chain
    cond, _ = family.encode_prompts(PROMPTS, with_negative=False)
    noise = family.initial_noise(2, RES, torch.Generator().manual_seed(0), torch.float32)
    opt = torch.optim.AdamW(params, lr=1e-2)
    out = denoise(
        family,
        DDIMScheduler.from_config(pipe.scheduler.config),
        cond,
        None,
        noise,
        4,
        1.0,
        grad_steps={3},
        stop_at=3,
    )
    family.decode(out.pred_original_sample).mean().backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(lora_before, params, strict=True)), (
        "every LoRA tensor moves"
    )
    for n, p in pipe.unet.named_parameters():
        if "lora_" not in n:
            assert torch.equal(base_before[n], p), n
    assert all(not p.requires_grad for p in pipe.vae.parameters())

    save_lora(pipe.unet, tmp_path / "lora", config={"lora_rank": 4})
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    stock = StableDiffusionPipeline.from_pretrained(tiny_sd)
    stock.set_progress_bar_config(disable=True)
    kw = {"num_inference_steps": 4, "height": RES, "width": RES, "output_type": "pt"}
    before = stock("a cat", generator=torch.Generator().manual_seed(0), **kw).images
    stock.load_lora_weights(str(tmp_path / "lora"))
    after = stock("a cat", generator=torch.Generator().manual_seed(0), **kw).images
    assert (before - after).abs().max() > 1e-4
    # the adapter's alpha travelled with the file: loaded weights equal ours (scale alpha/r = 2)
    adapter = stock.unet.active_adapters()[0]
    loaded = {
        n.replace(f".{adapter}.", ".default."): p for n, p in stock.unet.named_parameters() if "lora_" in n
    }
    ours = {n: p for n, p in pipe.unet.named_parameters() if "lora_" in n}
    assert loaded.keys() == ours.keys()
    for n, p in ours.items():
        torch.testing.assert_close(loaded[n], p)
    assert stock.unet.peft_config[adapter].lora_alpha == 8


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
