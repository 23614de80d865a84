"""DDPO trainer: on-policy log-probs, PPO loss / advantages / stat tracker vs closed forms, the update's direction,
config checks, the shell script end to end, learning (held-out JPEG compressibility rises), resume after a kill,
two processes. CPU, tiny models."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline
from helpers import cpu_accelerator, run_in_process, script_env, trainer_flags
from safetensors.torch import load_file

from refl_ddpo.algorithms.policy import (
    PerPromptStatTracker,
    batch_advantages,
    compute_advantages,
    ppo_clip_loss,
)
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family, resolve_guidance
from refl_ddpo.core.families.base import cond_expand
from refl_ddpo.core.families.sd import StableDiffusion
from refl_ddpo.core.lora import CONFIG_NAME, LORA_WEIGHTS_NAME, add_lora
from refl_ddpo.core.steps.ddim import ddim_step_kl
from refl_ddpo.rewards import build_reward
from refl_ddpo.trainers.ddpo_config import DDPOConfig, epoch_sizes, parse_ddpo_config
from refl_ddpo.trainers.epochs import EpochPlan
from refl_ddpo.trainers.ppo import PPOSettings, train_on_samples
from refl_ddpo.trainers.rollouts import Policy, SampleSettings, sample_epoch, shuffle_samples, stack_samples

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "train_scripts" / "train_ddpo.sh"
RES = 32


pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


# ---- pure maths ----


def test_ppo_clip_loss_matches_closed_form():
    logp_old = torch.zeros(4, dtype=torch.float64)
    ratio = torch.tensor([1.5, 0.5, 1.05, 0.98], dtype=torch.float64)
    adv = torch.tensor([2.0, 2.0, -1.0, -3.0], dtype=torch.float64)
    logp = ratio.log().requires_grad_(True)
    loss, info = ppo_clip_loss(logp, logp_old, adv, clip_range=0.1)
    # per sample max(-A r, -A clip(r, 0.9, 1.1)): [-2*1.1, -2*0.5, 1*1.05, 3*0.98]
    expected = torch.tensor([-2.2, -1.0, 1.05, 2.94], dtype=torch.float64).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(info["approx_kl"], 0.5 * (ratio.log() ** 2).mean())
    assert info["clipfrac"].item() == 0.5  # |r - 1| > 0.1 for 1.5 and 0.5
    torch.testing.assert_close(
        info["ratio"], torch.tensor((1.5 + 0.5 + 1.05 + 0.98) / 4, dtype=torch.float64)
    )
    torch.testing.assert_close(info["ratio_std"], ratio.std(unbiased=False))  # the spread, a drift monitor
    loss.backward()
    # the clipped sample 0 has no gradient; the others d/dlogp (-A r / B)
    torch.testing.assert_close(
        logp.grad, torch.tensor([0.0, -2 * 0.5 / 4, 1.05 / 4, 3 * 0.98 / 4], dtype=torch.float64)
    )


def test_ppo_without_clipping_is_the_score_function_gradient():
    """DDPO-SF: clip_range inf; on-policy (ratio 1) the gradient is -A * grad logp / B."""
    logp = torch.tensor([-1.0, -2.0, 0.5], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, info = ppo_clip_loss(logp, logp.detach(), adv, clip_range=float("inf"))
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 3)
    assert info["approx_kl"].item() == 0 and info["clipfrac"].item() == 0


def test_batch_advantages_closed_form():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])
    mean, std = 3.0, (((r - 3.0) ** 2).mean()) ** 0.5  # population std, as numpy's default
    torch.testing.assert_close(batch_advantages(r), ((r - mean) / (std + 1e-8)).double())


def test_per_prompt_stat_tracker_buffers_min_count_and_fallback():
    tracker = PerPromptStatTracker(buffer_size=3, min_count=2)
    # 'a' has 2 rewards (>= min_count): its own stats; 'b' has 1: the batch's stats
    adv = tracker.update(["a", "b", "a"], torch.tensor([1.0, 10.0, 3.0]))
    batch = torch.tensor([1.0, 10.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(adv[[0, 2]], torch.tensor([-1.0, 1.0], dtype=torch.float64) / (1 + 1e-6))
    torch.testing.assert_close(adv[1], (10 - batch.mean()) / (batch.std(unbiased=False) + 1e-6))
    # the buffer keeps the last 3 rewards of 'a': [3, 5, 7] -> mean 5, std sqrt(8/3)
    adv = tracker.update(["a", "a"], torch.tensor([5.0, 7.0]))
    std = (8 / 3) ** 0.5 + 1e-6
    torch.testing.assert_close(adv, torch.tensor([0.0, 2 / std], dtype=torch.float64))
    assert list(tracker.buffers["a"]) == [3.0, 5.0, 7.0] and list(tracker.buffers["b"]) == [10.0]


def test_stat_tracker_state_round_trips_exactly_through_json():
    tracker = PerPromptStatTracker(16, 2)
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(0))
    prompts = [f"p{i % 3}" for i in range(12)]
    tracker.update(prompts, rewards)
    restored = PerPromptStatTracker(1, 1)
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    nxt = torch.rand(12, generator=torch.Generator().manual_seed(1))
    assert torch.equal(tracker.update(prompts, nxt), restored.update(prompts, nxt))


def test_compute_advantages_clips():
    adv = compute_advantages(torch.tensor([0.0] * 30 + [1.0]), ["x"] * 31, None, adv_clip_max=2.0)
    assert adv.dtype == torch.float32 and adv.max().item() == 2.0 and adv.min().item() > -2.0


def test_step_kl_is_the_gaussian_kl_of_the_two_ddim_means(tiny_sd):
    """KL(N(mu, s^2) || N(mu_ref, s^2)) per dim, with the means from diffusers' own DDIMScheduler.step."""
    scheduler = DDIMScheduler.from_config(DDIMScheduler.load_config(tiny_sd, subfolder="scheduler"))
    scheduler.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x, eps, eps_ref = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    for t in scheduler.timesteps[[0, 4, 9]]:
        zero = torch.zeros_like(x)
        mu = scheduler.step(eps, t, x, eta=0.7, variance_noise=zero).prev_sample
        mu_ref = scheduler.step(eps_ref, t, x, eta=0.7, variance_noise=zero).prev_sample
        var = 0.7**2 * scheduler._get_variance(t, t - 100)
        expected = ((mu - mu_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * var)
        torch.testing.assert_close(
            ddim_step_kl(scheduler, eps, eps_ref, t.repeat(2), 0.7), expected, rtol=1e-4, atol=1e-7
        )


def test_shuffle_keeps_each_samples_steps_together():
    n, s = 5, 6
    t = torch.arange(s).repeat(n, 1) * 10 + torch.arange(n)[:, None] * 1000  # (N, S): sample*1000 + step*10
    samples = {
        "timesteps": t,
        "latents": t[..., None, None, None].float(),
        "next_latents": t[..., None].float() + 1,
        "log_probs": t.float() + 2,
        "prompt_embeds": torch.arange(n)[:, None].float(),
        "advantages": torch.arange(n).float(),
    }
    out = shuffle_samples(samples, torch.Generator().manual_seed(0))
    sample_of = out["timesteps"] // 1000  # (N, S)
    assert (sample_of == out["advantages"][:, None].long()).all()
    assert (sample_of == out["prompt_embeds"].long()).all()
    assert torch.equal(out["latents"][..., 0, 0, 0], out["timesteps"].float())
    assert torch.equal(out["next_latents"][..., 0], out["timesteps"].float() + 1)
    assert torch.equal(out["log_probs"], out["timesteps"].float() + 2)
    assert sorted(out["advantages"].tolist()) == list(range(n))
    assert not torch.equal(out["timesteps"] % 1000, samples["timesteps"] % 1000), "steps shuffled per sample"


def test_skipped_last_steps_are_never_trained():
    """--train_skip_last_steps k: only the first S - k steps are shuffled and put first; the last k stay behind."""
    n, s, k = 6, 5, 2
    t = torch.arange(s).repeat(n, 1)  # (N, S): step index
    samples = {
        "timesteps": t,
        "latents": t[..., None].float(),
        "next_latents": t[..., None].float(),
        "log_probs": t.float(),
        "prompt_embeds": torch.zeros(n, 1),
        "advantages": torch.zeros(n),
    }
    out = shuffle_samples(samples, torch.Generator().manual_seed(0), trainable_steps=s - k)
    assert (out["timesteps"][:, : s - k].sort(dim=1).values == torch.arange(s - k)).all()
    assert (out["timesteps"][:, s - k :] == torch.arange(s - k, s)).all()
    assert torch.equal(out["latents"][..., 0], out["timesteps"].float())
    # the default draws exactly what it drew before the option existed (resumed runs stay bit-exact)
    a = shuffle_samples(samples, torch.Generator().manual_seed(3))
    b = shuffle_samples(samples, torch.Generator().manual_seed(3), trainable_steps=s)
    assert torch.equal(a["timesteps"], b["timesteps"])


# ---- components on the tiny model ----


def _policy(tiny_sd):
    """Tiny pipeline, DDIM, LoRA with random A and B (so the adapter changes the output from step 0)."""
    torch.manual_seed(0)
    family = load_family(str(tiny_sd))
    family.pipe.scheduler = DDIMScheduler.from_config(family.pipe.scheduler.config)
    params = add_lora(family.network, 4, 4, ["to_q", "to_k", "to_v", "to_out.0"], init="random")
    negative, _ = family.encode_prompts([""], with_negative=False)
    return family, params, negative


def _cfg(**kw) -> DDPOConfig:
    base = {
        "resolution": RES,
        "sample_num_steps": 6,
        "sample_batch_size": 4,
        "sample_num_batches_per_epoch": 1,
        "train_batch_size": 2,
        "device": "cpu",
        "report_to": "none",
    }
    return resolve_guidance(DDPOConfig(**{**base, **kw}), StableDiffusion)  # the trainer's resolution on SD


def _sample(family, negative, cfg, seed=0):
    prompts = iter(["a cat", "a dog", "a red bird", "a fish"] * 4)
    reward = build_reward("jpeg_compressibility", "cpu")
    return sample_epoch(
        Policy(family, family.pipe.scheduler, negative),
        SampleSettings.from_config(cfg),
        EpochPlan(lambda: (next(prompts), {})),
        reward,
        torch.Generator().manual_seed(seed),
    )


def _log_probs(family, negative, samples, cfg) -> torch.Tensor:
    """(N, S) log-probs of the stored steps under the current UNet, with CFG (negative None: without)."""
    negative = None if negative is None else cond_expand(negative, len(samples["latents"]))
    scheduler, cond = family.pipe.scheduler, {"prompt_embeds": samples["prompt_embeds"]}
    out = []
    with torch.no_grad():
        for j in range(cfg.sample_num_steps):
            x_t, t = samples["latents"][:, j], samples["timesteps"][:, j]
            eps = family.predict(x_t, t, scheduler, cond, negative, cfg.sample_guidance_scale)
            _, log_prob, _ = family.step_with_logprob(
                scheduler, eps, t, x_t, cfg.sample_eta, prev_sample=samples["next_latents"][:, j]
            )
            out.append(log_prob)
    return torch.stack(out, dim=1)


def _train(family, samples, negative, cfg, accelerator, optimizer, params, generator):
    return train_on_samples(
        Policy(family, family.pipe.scheduler, negative, family.network),
        PPOSettings.from_config(cfg),
        samples,
        accelerator,
        optimizer,
        params,
        generator,
    )


@torch.no_grad()
def test_recomputed_log_prob_of_stored_trajectory_gives_ratio_one(tiny_sd):
    """The first PPO step is on-policy: with unchanged weights, the training forward (per-sample timesteps after
    the shuffle, other micro-batches, CFG) gives back the sampler's log-probs: |ratio - 1| <= 1e-5."""
    pipe, _, negative = _policy(tiny_sd)
    cfg = _cfg()
    batches = _sample(pipe, negative, cfg)
    samples = shuffle_samples(stack_samples(batches, torch.zeros(4)), torch.Generator().manual_seed(1))
    assert len(set(samples["timesteps"][:, 0].tolist())) > 1, "micro-batches mix timesteps"
    worst = 0.0
    for start in (0, 2):
        mb = {k: v[start : start + 2] for k, v in samples.items()}
        worst = max(
            worst, (torch.exp(_log_probs(pipe, negative, mb, cfg) - mb["log_probs"]) - 1).abs().max().item()
        )
    assert worst <= 1e-5, worst
    # and the check can fail: without CFG in the training forward it is another policy
    off = (torch.exp(_log_probs(pipe, None, mb, cfg) - mb["log_probs"]) - 1).abs().max().item()
    assert off > 1e-2, off


def test_update_moves_probability_towards_positive_advantages(tiny_sd):
    """One inner epoch raises sum_i A_i * (logp_new - logp_old) over the trajectory; negated advantages lower it.
    Only the LoRA params change. (The sign, the sample/advantage alignment and the gradient path in one check.)"""
    pipe, params, negative = _policy(tiny_sd)
    cfg = _cfg(learning_rate=3e-3, train_clip_range=float("inf"), max_grad_norm=0.0)
    batches = _sample(pipe, negative, cfg)
    rewards = torch.cat([b.rewards[0] for b in batches])
    advantages = batch_advantages(rewards).float()
    initial = [p.detach().clone() for p in params]
    base = {n: p.detach().clone() for n, p in pipe.network.named_parameters() if "lora_" not in n}
    accelerator = cpu_accelerator(gradient_accumulation_steps=cfg.sample_num_steps)
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for p, p0 in zip(params, initial, strict=True):
                p.copy_(p0)
        samples = stack_samples(batches, sign * advantages)
        old = _log_probs(pipe, negative, samples, cfg)
        # prepared: it steps only when the accumulated micro-steps sync (every trained timestep of a micro-batch)
        optimizer = accelerator.prepare_optimizer(
            torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
        )
        steps = _train(
            pipe, samples, negative, cfg, accelerator, optimizer, params, torch.Generator().manual_seed(0)
        )
        assert len(steps) == 2 and steps[0]["approx_kl"] < 1e-10, (
            steps
        )  # 4 samples / micro-batch 2; on-policy
        gain = (
            (samples["advantages"][:, None] * (_log_probs(pipe, negative, samples, cfg) - old)).sum().item()
        )
        assert gain > 0, (sign, gain)
    assert all(torch.equal(p, base[n]) for n, p in pipe.network.named_parameters() if "lora_" not in n)


def test_kl_weight_adds_the_step_kl_to_the_base_model(tiny_sd):
    pipe, params, negative = _policy(tiny_sd)
    cfg = _cfg(
        kl_weight=1.0, sample_num_steps=3, train_timestep_fraction=0.5
    )  # int(3 * 0.5) = 1 step trained
    samples = stack_samples(_sample(pipe, negative, cfg), torch.zeros(4))
    accelerator = cpu_accelerator(gradient_accumulation_steps=1)
    steps = _train(
        pipe,
        samples,
        negative,
        cfg,
        accelerator,
        accelerator.prepare_optimizer(torch.optim.SGD(params, lr=0.0)),
        params,
        torch.Generator().manual_seed(0),
    )
    # zero advantages: the loss is the KL alone, > 0 as the random LoRA moved the policy off the base model
    assert len(steps) == 2 and all(s["kl"] > 0 and abs(s["loss"] - s["kl"]) < 1e-6 for s in steps), steps
    # the adapters are on again after the reference forward: the UNet's output is not the base model's
    x, t, emb = samples["latents"][:2, 0], samples["timesteps"][:2, 0], samples["prompt_embeds"][:2]
    with torch.no_grad():
        eps = pipe.network(x, t, encoder_hidden_states=emb).sample
        pipe.network.disable_adapters()
        eps_base = pipe.network(x, t, encoder_hidden_states=emb).sample
        pipe.network.enable_adapters()
    assert (eps - eps_base).abs().max().item() > 1e-4


# ---- config ----


@pytest.mark.parametrize(
    "argv, names",
    [
        (
            ["--sample_batch_size", "2", "--train_batch_size", "4"],
            ["--sample_batch_size", "--train_batch_size"],
        ),
        (
            ["--sample_batch_size", "6", "--train_batch_size", "4"],
            ["--sample_batch_size", "--train_batch_size"],
        ),
        (
            [
                "--sample_batch_size",
                "4",
                "--sample_num_batches_per_epoch",
                "1",
                "--train_batch_size",
                "2",
                "--train_gradient_accumulation_steps",
                "3",
            ],
            [
                "--sample_batch_size",
                "--sample_num_batches_per_epoch",
                "--train_batch_size",
                "--train_gradient_accumulation_steps",
            ],
        ),
        (["--train_timestep_fraction", "0"], ["--train_timestep_fraction"]),
        (["--train_timestep_fraction", "1.5"], ["--train_timestep_fraction"]),
        (
            ["--train_timestep_fraction", "0.1", "--sample_num_steps", "5"],
            ["--train_timestep_fraction", "--sample_num_steps"],
        ),
        (["--sample_eta", "0"], ["--sample_eta"]),
        (
            ["--per_prompt_stat_tracking_min_count", "20"],
            ["--per_prompt_stat_tracking_min_count", "--per_prompt_stat_tracking_buffer_size"],
        ),
        (
            ["--num_inference_steps", "10", "--sample_num_steps", "20"],
            ["--num_inference_steps", "--sample_num_steps"],
        ),
        (
            ["--guidance_scale", "3", "--sample_guidance_scale", "7"],
            ["--guidance_scale", "--sample_guidance_scale"],
        ),
        (
            ["--gradient_accumulation_steps", "2", "--train_gradient_accumulation_steps", "4"],
            ["--gradient_accumulation_steps", "--train_gradient_accumulation_steps"],
        ),
        (["--checkpointing_steps", "10"], ["--checkpointing_steps", "--save_freq"]),
        (["--kl_weight", "0.1", "--no-use_lora"], ["--kl_weight", "--use_lora"]),
        (["--reward", "jpeg_smallness"], ["--reward"]),
        (["--prompt_fn", "from_file"], ["--prompt_fn", "--prompts_file"]),
        (["--prompt_fn", "simple_animals", "--prompts_file", __file__], ["--prompt_fn", "--prompts_file"]),
        (["--preset", "prompt_image_alignment"], ["--preset", "--reward"]),
        (["--train_clip_range", "-1"], ["--train_clip_range"]),
    ],
)
def test_config_check_names_the_fields(argv, names):
    with pytest.raises(UserError) as e:
        parse_ddpo_config(argv)
    msg = str(e.value)
    assert "\n" not in msg
    for name in names:
        assert name in msg, (name, msg)


def test_defaults_are_ddpo_pytorch_base():
    cfg = parse_ddpo_config([])
    assert cfg.sample_guidance_scale is None  # unset until the model's family is known
    cfg = resolve_guidance(cfg, StableDiffusion)  # as the trainer resolves it for an SD model
    assert (cfg.reward, cfg.prompt_fn, cfg.sample_num_steps, cfg.sample_eta, cfg.sample_guidance_scale) == (
        "jpeg_compressibility",
        "imagenet_animals",
        50,
        1.0,
        5.0,
    )
    assert (cfg.learning_rate, cfg.train_clip_range, cfg.train_adv_clip_max, cfg.train_timestep_fraction) == (
        3e-4,
        1e-4,
        5.0,
        1.0,
    )
    assert cfg.per_prompt_stat_tracking and (
        cfg.per_prompt_stat_tracking_buffer_size,
        cfg.per_prompt_stat_tracking_min_count,
    ) == (16, 16)
    # the common aliases hold the DDPO values, so the saved config reads the same either way
    assert (cfg.num_inference_steps, cfg.guidance_scale, cfg.gradient_accumulation_steps) == (50, 5.0, 1)


def test_presets_set_defaults_that_flags_and_config_files_override(tmp_path):
    cfg = parse_ddpo_config(["--preset", "aesthetic"])
    assert (
        cfg.reward,
        cfg.prompt_fn,
        cfg.num_epochs,
        cfg.train_gradient_accumulation_steps,
        cfg.per_prompt_stat_tracking_buffer_size,
        cfg.sample_batch_size,
    ) == ("aesthetic", "simple_animals", 200, 4, 32, 8)
    sizes = epoch_sizes(cfg, num_processes=8)  # dgx.py: 8 GPUs x 8 x 4 = 256, (8 x 4) / (4 x 4) = 2 steps
    assert sizes["images per epoch (all processes)"] == 256 and sizes["optimizer steps per epoch"] == 2
    cfg = parse_ddpo_config(
        ["--preset", "incompressibility", "--num_epochs", "3", "--gradient_accumulation_steps", "4"]
    )
    assert (cfg.reward, cfg.num_epochs, cfg.train_gradient_accumulation_steps) == (
        "jpeg_incompressibility",
        3,
        4,
    )
    assert epoch_sizes(cfg, 8)["optimizer steps per epoch"] == 2
    config = tmp_path / "c.yaml"
    config.write_text("preset: compressibility\nsave_freq: 7\n")
    cfg = parse_ddpo_config(["--config", str(config), "--num_epochs", "5"])
    assert (cfg.preset, cfg.sample_batch_size, cfg.save_freq, cfg.num_epochs) == ("compressibility", 8, 7, 5)
    toy3 = parse_ddpo_config(["--preset", "toy_world_sd3"])
    assert toy3.pretrained_model.endswith("toy-sd3") and toy3.prompt_fn == "toy_world_cyan"
    assert (toy3.sample_eta, toy3.num_epochs) == (0.7, 16)
    assert toy3.lora_target_modules == ["add_k_proj", "add_v_proj"]


def test_alias_sets_the_ddpo_field():
    cfg = parse_ddpo_config(["--num_inference_steps", "8", "--guidance_scale", "3"])
    assert (cfg.sample_num_steps, cfg.num_inference_steps, cfg.sample_guidance_scale) == (8, 8, 3.0)
    assert parse_ddpo_config(["--num_inference_steps", "8", "--sample_num_steps", "8"]).sample_num_steps == 8


def test_alias_and_field_both_given_must_agree_even_at_the_default():
    with pytest.raises(UserError, match="--num_inference_steps 8 and --sample_num_steps 50 disagree"):
        parse_ddpo_config(["--sample_num_steps", "50", "--num_inference_steps", "8"])


# ---- the shell script end to end ----


def _flags(tiny_models, out: Path, epochs: int, *extra: str) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        resolution=RES,
        sample_num_steps=4,
        sample_batch_size=4,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        learning_rate="3e-2",
        num_epochs=epochs,
        save_freq=1,
        device="cpu",
    )


def _script(args: list[str], cwd: Path = REPO, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", os.path.relpath(SCRIPT, cwd), *args],
        check=False,
        cwd=cwd,
        env=script_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )


EPOCHS = 3
# the toy world's 6 held-out prompts, one image each, 3 deterministic steps: before epoch 1, after epochs 2 and 3
VALIDATION = (
    "--validation_prompts_file",
    "toy_world_heldout",
    "--validation_steps",
    "2",
    "--num_validation_images",
    "1",
    "--validation_num_steps",
    "3",
)


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("ddpo") / "run"
    # validation on here and off in the resumed run below: the LoRAs must still be bit-identical
    r = _script(_flags(tiny_models, out, EPOCHS, *VALIDATION), cwd=REPO / "train_scripts")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@torch.no_grad()
def _held_out(pipe, steps: int = 4, per_prompt: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-seed images of held-out prompts with the training sampler (DDIM, eta 1, CFG 5) and their JPEG kB."""
    from refl_ddpo.rewards.jpeg import jpeg_size_kb

    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    prompts = ["a lighthouse at dusk", "a bowl of soup", "a red car", "a mountain lake"]
    images = pipe(
        prompts,
        num_inference_steps=steps,
        num_images_per_prompt=per_prompt,
        guidance_scale=5.0,
        eta=1.0,
        height=RES,
        width=RES,
        generator=torch.Generator().manual_seed(7),
        output_type="pt",
    ).images
    return images, jpeg_size_kb(images)


def test_script_trains_logs_and_saves_a_lora_that_loads_in_a_stock_pipeline(trained, tiny_models):
    out, r = trained
    assert "images per epoch (all processes): 4" in r.stdout and "optimizer steps per epoch: 2" in r.stdout
    assert "\r" not in r.stdout + r.stderr, "no library's loading bar redraws into a log"
    assert (out / LORA_WEIGHTS_NAME).is_file()
    saved = json.loads((out / CONFIG_NAME).read_text())
    assert (
        saved["reward"] == "jpeg_compressibility"
        and saved["sample_num_steps"] == 4
        and saved["num_epochs"] == 3
    )
    assert {p.name for p in out.glob("checkpoint-*")} == {f"checkpoint-{n}" for n in range(1, EPOCHS + 1)}
    state = json.loads((out / f"checkpoint-{EPOCHS}" / "train_state.json").read_text())
    assert state["epoch"] == EPOCHS and state["global_step"] == 2 * EPOCHS
    assert sum(len(b) for b in state["stat_tracker"]["buffers"].values()) == 4 * EPOCHS

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars, images = {}, set()
    for f in (out / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        scalars.update({t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]})
        images |= set(acc.Tags()["images"])
    for key in (
        "reward/jpeg_compressibility/mean",
        "reward/jpeg_compressibility/std",
        "ddpo/approx_kl",
        "ddpo/clipfrac",
        "ddpo/loss",
    ):
        assert key in scalars, (key, sorted(scalars))
    assert (
        len(scalars["ddpo/loss"]) == 2 * EPOCHS and len(scalars["reward/jpeg_compressibility/mean"]) == EPOCHS
    )
    assert scalars["ddpo/approx_kl"][0] < 1e-10, "the first optimizer step is on-policy"
    assert "ddpo/samples" in images

    pipe = StableDiffusionPipeline.from_pretrained(tiny_models / "stable-diffusion")
    pipe.set_progress_bar_config(disable=True)
    before, _ = _held_out(pipe)
    pipe.load_lora_weights(str(out))  # a stock pipeline, stock loader
    after, _ = _held_out(pipe)
    assert (after - before).abs().max().item() > 1e-3, "the trained LoRA changes the samples"


def test_script_trains_on_the_users_own_reward_and_prompt_fn(tiny_models, tmp_path):
    """--reward and --prompt_fn by dotted path (tests/user_functions.py, found in the folder the script is started
    from): the run trains on them and logs the user's reward under its name."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    user = ("--reward", "user_functions:redness", "--prompt_fn", "user_functions:colour_prompt")
    r = _script(_flags(tiny_models, out, 1, *user), cwd=REPO / "tests")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / LORA_WEIGHTS_NAME).is_file()
    saved = json.loads((out / CONFIG_NAME).read_text())
    assert (saved["reward"], saved["prompt_fn"]) == (user[1], user[3])
    tags = set()
    for f in (out / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "reward/user_functions:redness/mean" in tags, sorted(tags)


def test_script_validates_by_epoch_and_writes_the_model_card(trained):
    from huggingface_hub import ModelCard

    from refl_ddpo.run.validation import validation_files

    out, r = trained
    records = validation_files(out)
    assert [x["count"] for x in records] == [0, 2, EPOCHS] and all(x["unit"] == "epoch" for x in records)
    assert len(records[0]["records"]) == 6 and records[0]["sampler"]["num_inference_steps"] == 3
    assert r.stdout.count("validation after epoch") == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for f in (out / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        if "validation/jpeg_compressibility/mean" in acc.Tags()["scalars"]:
            steps += [e.step for e in acc.Scalars("validation/jpeg_compressibility/mean")]
    assert steps == [0, 4, 6], "logged at the optimizer step count: 2 per epoch"
    card = ModelCard.load(out / "README.md")
    assert {"refl_ddpo", "ddpo", "lora"} <= set(card.data.tags)
    for line in ("| epochs | 3 |", "| optimizer steps | 6 |", "| sample_num_steps | `4` |", "| 3 | "):
        assert line in card.text, line


LEARN_EPOCHS = 12


def test_resume_after_a_killed_run_gives_the_bit_identical_lora(
    trained, tiny_models, tmp_path, capsys, monkeypatch
):
    """The script killed with -9 in epoch 2, then resumed (in this process) from its checkpoint: the uninterrupted
    script's LoRA and train state."""
    uninterrupted, _ = trained
    out = tmp_path / "killed"
    cmd = ["bash", str(SCRIPT), *_flags(tiny_models, out, EPOCHS, "--report_to", "none")]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=script_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 180
    while not (out / "checkpoint-1").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # in the middle of epoch 2
    proc.wait()
    assert (out / "checkpoint-1").is_dir() and not (out / LORA_WEIGHTS_NAME).exists(), "killed before the end"
    resume = _flags(tiny_models, out, EPOCHS, "--report_to", "none", "--resume_from_checkpoint", "latest")
    run_in_process(monkeypatch, SCRIPT.name, resume)
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "epoch(s) done" in printed
    resumed, reference = load_file(out / LORA_WEIGHTS_NAME), load_file(uninterrupted / LORA_WEIGHTS_NAME)
    first = load_file(uninterrupted / "checkpoint-1" / LORA_WEIGHTS_NAME)
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in resumed)
    assert any(not torch.equal(first[k], reference[k]) for k in first), "the resumed epochs did train"
    assert json.loads((out / f"checkpoint-{EPOCHS}" / "train_state.json").read_text()) == json.loads(
        (uninterrupted / f"checkpoint-{EPOCHS}" / "train_state.json").read_text()
    )


def test_two_processes_stay_identical_and_gather_rewards(tiny_models, tmp_path):
    prompts = tmp_path / "one_prompt.txt"
    prompts.write_text("a photo of a cat\n")
    out = tmp_path / "ddp"
    r = _script(
        _flags(
            tiny_models,
            out,
            2,
            "--prompts_file",
            str(prompts),
            "--report_to",
            "none",
            "--async_reward_computation",
            "--lora_init",
            "random",
        ),
        NUM_PROCESSES="2",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "images per epoch (all processes): 8" in r.stdout
    assert r.stdout.count("8 rewards from 2 process(es)") == 2
    # every process sampled 4 images of the one prompt per epoch; its buffer holds both processes' rewards
    state = json.loads((out / "checkpoint-2" / "train_state.json").read_text())
    assert len(state["stat_tracker"]["buffers"]["a photo of a cat"]) == 16
    # the trainer compares sha256 digests of every process' weights at the end (it fails the run otherwise)
    assert "weights identical on all 2 process(es)" in r.stdout


def test_script_refuses_bad_batch_settings_in_one_line_before_loading(tmp_path):
    out = tmp_path / "never"
    r = _script(
        [
            "--output_dir",
            str(out),
            "--sample_batch_size",
            "3",
            "--train_batch_size",
            "2",
            "--pretrained_model",
            str(tmp_path / "missing"),
        ]
    )
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "--sample_batch_size 3" in err[0] and "--train_batch_size 2" in err[0]
    assert "Traceback" not in r.stderr and not out.exists()
