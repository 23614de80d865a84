"""The SD3 family on the tiny random SD3 folder: the loop vs the stock StableDiffusion3Pipeline, the SDE step in the
loop, the LoRA core (gradient, save, load in a stock pipeline, resume), loading by model_index.json, T5 dropped or
absent, and a ReFL smoke run."""

from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from helpers import assert_lora_changes_stock_images, ddpo_first_update

from refl_ddpo.core.families import family_class, load_family
from refl_ddpo.core.families.sd3 import StableDiffusion3
from refl_ddpo.core.lora import add_lora, load_lora_into_unet, save_lora
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


def test_load_family_picks_sd3_from_model_index(tiny_sd3):
    family = load_family(str(tiny_sd3))
    assert (
        isinstance(family, StableDiffusion3) and family_class("StableDiffusion3Pipeline") is StableDiffusion3
    )
    assert family.pipe.text_encoder_3 is not None
    assert family.native_resolution == RES and family.network.config.in_channels == 16
    assert not any(p.requires_grad for p in family.network.parameters())


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


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0])
def test_loop_reproduces_stock_pipeline(tiny_sd3, stock, guidance_scale):
    ref = stock(
        PROMPTS,
        num_inference_steps=6,
        guidance_scale=guidance_scale,
        height=RES,
        width=RES,
        generator=_generators(),
        output_type="pt",
    ).images
    ours = _images(StableDiffusion3(stock), guidance_scale, steps=6)
    assert ours.shape == ref.shape == (2, 3, RES, RES)
    assert (ours - ref).abs().max().item() <= 1 / 255


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


def test_lora_gets_reward_gradient_saves_and_loads_in_stock_pipeline(tiny_sd3, stock, tmp_path):
    family = load_family(str(tiny_sd3))
    network = family.network
    params = add_lora(network, 4, 8, family.lora_target_modules, init="random")  # B != 0: A gets gradient too
    names = {n for n, _ in network.named_parameters() if "lora_A" in n}
    assert any("add_q_proj" in n for n in names) and any("to_add_out" in n for n in names)
    base_before = {n: p.detach().clone() for n, p in network.named_parameters() if "lora_" not in n}
    # ReFL's path: denoise without grad, one step with grad, predicted x0, decode through the 16-channel VAE
    cond, _ = family.encode_prompts(PROMPTS, with_negative=False)
    noise = family.initial_noise(2, RES, _generators(), torch.float32)
    scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    out = denoise(family, scheduler, cond, None, noise, 4, 1.0, grad_steps={2}, stop_at=2)
    family.decode(out.pred_original_sample).mean().backward()
    # every LoRA tensor gets gradient, except the last block's text-query one: that block drops its text stream
    # (context_pre_only), so its text queries reach nothing
    last = f"transformer_blocks.{len(network.transformer_blocks) - 1}.attn.add_q_proj."
    for n, p in network.named_parameters():
        if "lora_" in n:
            assert (p.grad is not None and p.grad.abs().sum() > 0) != n.startswith(last), n
    torch.optim.AdamW(params, lr=1e-2).step()
    for n, p in network.named_parameters():
        if "lora_" not in n:
            assert torch.equal(base_before[n], p), n

    save_lora(network, tmp_path / "lora", config={"lora_rank": 4})
    pipe = assert_lora_changes_stock_images(_stock(tiny_sd3), tmp_path / "lora", RES, steps=4)
    adapter = pipe.transformer.active_adapters()[0]
    loaded = {
        n.replace(f".{adapter}.", ".default."): p
        for n, p in pipe.transformer.named_parameters()
        if "lora_" in n
    }
    ours = {n: p for n, p in network.named_parameters() if "lora_" in n}
    assert loaded.keys() == ours.keys()  # every matrix found its layer (none dropped by the loader)
    for n, p in ours.items():
        torch.testing.assert_close(loaded[n], p)
    assert pipe.transformer.peft_config[adapter].lora_alpha == 8

    # resume: a fresh adapter restored from the file equals ours
    fresh = load_family(str(tiny_sd3))
    add_lora(fresh.network, 4, 8, family.lora_target_modules)
    load_lora_into_unet(fresh.network, tmp_path / "lora")
    restored = dict(fresh.network.named_parameters())
    assert all(torch.equal(restored[n], p) for n, p in ours.items())


def test_refl_trains_a_lora_on_sd3_that_loads_in_stock_pipeline(tiny_models, tiny_sd3, stock, tmp_path):
    """ReFL smoke run on the tiny SD3 folder (x0 = x_t - sigma v through the 16-channel VAE, ImageReward, the KL term
    on): the LoRA it saves loads in a stock StableDiffusion3Pipeline and changes its images."""
    import os
    import subprocess
    import sys

    out = tmp_path / "refl"
    flags = [
        "--pretrained_model",
        str(tiny_sd3),
        "--reward_model_dir",
        str(tiny_models),
        "--output_dir",
        str(out),
    ]
    flags += [
        "--resolution",
        str(RES),
        "--num_inference_steps",
        "6",
        "--k_lo",
        "3",
        "--k_hi",
        "5",
        "--device",
        "cpu",
    ]
    flags += [
        "--train_batch_size",
        "2",
        "--learning_rate",
        "3e-2",
        "--max_train_steps",
        "2",
        "--kl_weight",
        "1",
    ]
    flags += ["--lora_init", "random", "--lora_target_modules", *StableDiffusion3.lora_target_modules]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "refl_ddpo.trainers.refl", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,  # the repo root: `-m` imports this checkout's package
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sampler: FlowMatchEulerDiscreteScheduler" in r.stdout
    assert_lora_changes_stock_images(_stock(tiny_sd3), out, RES, steps=4)


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


def test_ddpo_first_update_on_sd3_is_on_policy(stock):
    """DDPO on SD3 samples with Flow-GRPO's SDE step (the family's policy sampler) and its first PPO step is on the
    sampling policy: approx KL 0 and no clipping, with CFG in the training forward as in sampling."""
    torch.manual_seed(0)
    family = StableDiffusion3(stock)
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    assert type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    uncond, _ = family.encode_prompts([""], with_negative=False)
    kw = {"num_steps": 3, "guidance_scale": 4.5, "eta": 0.7}
    _, first = ddpo_first_update(family, scheduler, params, uncond, PROMPTS * 4, RES, **kw)
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


def test_ddpo_script_trains_sd3_without_t5_and_saves_a_lora_that_loads(tiny_models, tiny_sd3, tmp_path):
    """train_ddpo.sh on the tiny SD3 folder with --drop_t5: runs end to end; the LoRA loads in a stock pipeline."""
    import os
    import subprocess
    import sys

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
    flags += ["--lora_target_modules", *StableDiffusion3.lora_target_modules]
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable}
    r = subprocess.run(
        ["bash", str(repo / "train_scripts" / "train_ddpo.sh"), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
        cwd=repo,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert_lora_changes_stock_images(
        _stock(tiny_sd3, text_encoder_3=None, tokenizer_3=None), out, RES, steps=4
    )
