"""GRPO (the policy-gradient loop with a GRPOConfig): group advantages and zero-std groups vs closed forms, the epoch's groups
over processes, the SDE window (its steps are the only stochastic and the only trained ones), the KL to the base model
in the loss, config checks and presets, the shell script end to end. CPU, tiny models."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import cpu_accelerator, resume_two, run_script, script_env, trainer_flags
from safetensors.torch import load_file

from refl_ddpo.algorithms.policy import GROUP_STD_EPS, group_advantages, zero_std_group_fraction
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.lora import LORA_WEIGHTS_NAME, add_lora
from refl_ddpo.core.sampling import denoise
from refl_ddpo.rewards import build_reward
from refl_ddpo.run.flags import parse_config
from refl_ddpo.trainers.ddpo_config import num_train_timesteps
from refl_ddpo.trainers.epochs import EpochPlan
from refl_ddpo.trainers.grpo_config import GRPOConfig
from refl_ddpo.trainers.policy_gradient import grouped_epoch
from refl_ddpo.trainers.ppo import PPOSettings, train_on_samples
from refl_ddpo.trainers.rollouts import (
    Policy,
    SampleSettings,
    draw_window_start,
    epoch_groups,
    sample_epoch,
    stack_samples,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "train_scripts" / "train_grpo.sh"
RES = 32


def _parse(argv: list[str]) -> GRPOConfig:
    return parse_config(GRPOConfig, argv)


# ---- pure maths ----


def test_group_advantages_closed_form():
    # two groups, interleaved and of different sizes: a = [1, 3, 5] (mean 3), b = [2, 6] (mean 4)
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0])
    g = torch.tensor([7, 9, 7, 9, 7])
    std_a, std_b = (8 / 3) ** 0.5, 2.0  # population stds
    expected = torch.tensor(
        [-2 / (std_a + 1e-4), -2 / (std_b + 1e-4), 0.0, 2 / (std_b + 1e-4), 2 / (std_a + 1e-4)]
    )
    adv = group_advantages(r, g, global_std=False, adv_clip_max=5.0)
    assert adv.dtype == torch.float32 and GROUP_STD_EPS == 1e-4
    torch.testing.assert_close(adv, expected)
    # global std: the same centring, divided by the std of all five rewards
    std_all = r.double().std(unbiased=False).item()
    centred = torch.tensor([-2.0, -2.0, 0.0, 2.0, 2.0])
    torch.testing.assert_close(group_advantages(r, g, True, 5.0), centred / (std_all + 1e-4))
    # clipping
    assert group_advantages(r, g, False, 1.0).abs().max().item() == 1.0
    # a std floor of 1.9 lifts group b's std (2.0) not, group a's (1.63) to 1.9; 0 is bit-equal to no floor
    floored = group_advantages(r, g, False, 5.0, std_floor=1.9)
    torch.testing.assert_close(floored, torch.tensor([-2 / 1.9001, -2 / 2.0001, 0.0, 2 / 2.0001, 2 / 1.9001]))
    assert torch.equal(group_advantages(r, g, False, 5.0, std_floor=0.0), adv)
    # a near-flat group (rewards 0.01 apart) stays small under a floor, where its own std makes it +-1
    near = torch.tensor([0.0, 0.01])
    assert group_advantages(near, torch.zeros(2), False, 5.0).abs().min() > 0.9
    torch.testing.assert_close(
        group_advantages(near, torch.zeros(2), False, 5.0, std_floor=0.1).abs().max(),
        torch.tensor(0.005 / 0.1001),
    )


def test_equal_rewards_in_a_group_give_zero_advantages_and_count_as_zero_std():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    adv = group_advantages(r, g, global_std=False, adv_clip_max=5.0)
    assert torch.equal(adv[[0, 1, 4, 5, 6, 7]], torch.zeros(6))
    assert adv[2] < 0 < adv[3]
    assert zero_std_group_fraction(r, g) == 3 / 4
    assert zero_std_group_fraction(torch.arange(4.0), torch.tensor([0, 0, 1, 1])) == 0.0


def test_epoch_groups_are_repeated_prompts_sliced_over_processes():
    prompts = iter(["a", "b", "c"])
    samples, groups = epoch_groups(lambda: (next(prompts), {"k": 1}), num_groups=3, group_size=4)
    assert [p for p, _ in samples] == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    assert groups.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    samples[0][1]["k"] = 2  # every sample's metadata is its own
    assert samples[1][1] == {"k": 1}


def test_grouped_epoch_is_the_same_plan_on_every_process(tiny_sd):
    """Two processes x 6 samples, groups of 4: group 1 spans both; its x_T is the same on both (shared noise), the
    prompts and the window start agree, and the processes' slices tile the epoch."""
    family = load_family(str(tiny_sd))
    cfg = GRPOConfig(
        pretrained_model=str(tiny_sd),
        resolution=RES,
        sample_num_steps=6,
        sample_batch_size=3,
        sample_num_batches_per_epoch=2,
        train_batch_size=3,
        group_size=4,
        same_noise_per_group=True,
        sde_window=2,
        prompt_fn="simple_animals",
    )
    plans = [grouped_epoch(cfg, family, 5, rank, 2, torch.float32) for rank in (0, 1)]
    ids = torch.cat([p.groups for p in plans])
    assert ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    prompts = [p.prompt_fn() for p in plans for _ in range(6)]
    assert all(prompts[i] == prompts[j] for i in range(12) for j in range(12) if ids[i] == ids[j])
    noise = torch.cat([p.initial_noise for p in plans])  # (12, C, h, w)
    for i in range(12):
        for j in range(12):
            assert torch.equal(noise[i], noise[j]) == bool(ids[i] == ids[j]), (i, j)
    window = plans[0].window
    assert window == plans[1].window and 0 <= window[0] <= 4 and window[1] == 2


def test_window_start_is_uniform_over_the_windows_that_fit():
    g = torch.Generator().manual_seed(0)
    starts = {draw_window_start(g, trainable_steps=6, window=2) for _ in range(200)}
    assert starts == {0, 1, 2, 3, 4}


# ---- the SDE window on the tiny model ----


FAMILIES = [
    "stable-diffusion",
    "tiny-sd3",
]  # SD 1.x (DDIM, eta 1) and SD3 (Flow-GRPO's SDE step, noise level 0.7)
ETA = {"stable-diffusion": 1.0, "tiny-sd3": 0.7}


def _family(tiny_models, model: str = "stable-diffusion"):
    torch.manual_seed(0)
    family = load_family(str(tiny_models / model))
    family.pipe.scheduler = family.policy_scheduler()  # DDIM on SD 1.x, flow matching on SD3
    uncond, _ = family.encode_prompts([""], with_negative=False)
    return family, uncond


@pytest.mark.parametrize("model", FAMILIES)
@torch.no_grad()
def test_only_the_window_steps_are_stochastic(tiny_models, model):
    """Same x_T, two step-noise generators: the latents agree up to the window and differ from its first step on;
    log-probs are 0 exactly outside the window; with an empty window the loop is the deterministic sampler (DDIM eta
    0 / the flow ODE)."""
    family, uncond = _family(tiny_models, model)
    scheduler = family.pipe.scheduler
    cond, _ = family.encode_prompts(["a cat", "a dog"], with_negative=False)
    noise = family.initial_noise(2, RES, torch.Generator().manual_seed(1), torch.float32)
    runs = [
        denoise(
            family,
            scheduler,
            cond,
            {k: v.expand(2, *v.shape[1:]) for k, v in uncond.items()},
            noise,
            6,
            5.0,
            eta=ETA[model],
            generator=torch.Generator().manual_seed(seed),
            with_logprob=True,
            keep_trajectory=True,
            sde_steps=range(2, 4),
        )
        for seed in (2, 3)
    ]
    a, b = (r.all_latents for r in runs)
    assert all(torch.equal(a[i], b[i]) for i in range(3)), "deterministic before the window"
    assert all(not torch.allclose(a[i], b[i]) for i in range(3, 7)), "stochastic from the window on"
    lp = torch.stack(runs[0].log_probs, 1)  # (2, 6)
    assert torch.equal(lp[:, [0, 1, 4, 5]], torch.zeros(2, 4)) and (lp[:, 2:4] != 0).all()
    ode = denoise(family, scheduler, cond, None, noise, 6, 1.0, with_logprob=True, sde_steps=())
    ddim = denoise(family, scheduler, cond, None, noise, 6, 1.0, eta=0.0)
    assert torch.equal(ode.latents, ddim.latents)


@pytest.mark.parametrize("model", FAMILIES)
def test_first_update_is_on_policy_and_trains_the_window_steps_only(tiny_models, model):
    """sample_epoch keeps the window's steps only, so training (every kept step, shuffled) touches no other step. The
    first PPO step is on-policy there on both families, with the KL to the base model on (a random LoRA, so the KL
    is > 0): importance ratio 1 to 1e-5, overall and at each sampler step (logged as ratio_by_step/NN, NN = the
    window's steps 3 and 4 only), nothing clipped."""
    family, uncond = _family(tiny_models, model)
    scheduler = family.pipe.scheduler
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    prompts = iter(["a cat", "a dog"] * 4)
    batches = sample_epoch(
        Policy(family, scheduler, uncond),
        SampleSettings(
            batch_size=2, num_batches=2, num_steps=6, guidance_scale=5.0, eta=ETA[model], resolution=RES
        ),
        EpochPlan(lambda: (next(prompts), {}), window=(3, 2)),
        build_reward("jpeg_compressibility", "cpu"),
        torch.Generator().manual_seed(0),
    )
    family.set_timesteps(scheduler, 6, batches[0].latents)
    window = scheduler.timesteps[3:5]
    samples = stack_samples(batches, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert samples["timesteps"].shape == (4, 2) and (samples["timesteps"] == window).all()
    accelerator = cpu_accelerator(gradient_accumulation_steps=2)
    optimizer = accelerator.prepare_optimizer(torch.optim.SGD(params, lr=0.0))
    steps = train_on_samples(
        Policy(family, scheduler, uncond, family.network),
        PPOSettings(
            num_steps=6,
            guidance_scale=5.0,
            eta=ETA[model],
            batch_size=2,
            num_train_steps=2,
            clip_range=1e-4,
            kl_weight=0.04,
        ),
        samples,
        accelerator,
        optimizer,
        params,
        torch.Generator().manual_seed(1),
    )
    assert len(steps) == 2, steps
    for s in steps:
        assert s["approx_kl"] < 1e-10 and s["clipfrac"] == 0 and s["kl"] > 0, s
        assert abs(s["ratio"] - 1) <= 1e-5, s
        by_step = {k: v for k, v in s.items() if k.startswith("ratio_by_step/")}
        assert sorted(by_step) == ["ratio_by_step/03", "ratio_by_step/04"], s
        assert all(abs(v - 1) <= 1e-5 for v in by_step.values()), s
    cfg = _parse(["--sample_num_steps", "10", "--sde_window", "4", "--timestep_fraction", "0.5"])
    assert num_train_timesteps(cfg) == 2  # the fraction is of the window's steps


def test_ratio_by_step_averages_the_ratios_of_each_sampler_step(tiny_sd):
    """Off-policy on purpose (the stored log-probs shifted by a known amount per sample and step): ratio_by_step/NN
    is the mean of exp(logp - logp_old) over the samples trained at sampler step NN, ratio the mean over all."""
    family = load_family(str(tiny_sd))
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, ["to_q", "to_v"])
    uncond, _ = family.encode_prompts([""], with_negative=False)
    prompts = iter(["a cat", "a dog"] * 2)
    batches = sample_epoch(
        Policy(family, scheduler, uncond),
        SampleSettings(batch_size=4, num_batches=1, num_steps=3, guidance_scale=1.0, eta=1.0, resolution=RES),
        EpochPlan(lambda: (next(prompts), {})),
        build_reward("jpeg_compressibility", "cpu"),
        torch.Generator().manual_seed(0),
    )
    samples = stack_samples(batches, torch.zeros(4))
    shift = torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.1, -0.1], [0.2, 0.2, 0.0], [-0.3, 0.0, 0.1]])  # (N, S)
    samples["log_probs"] = samples["log_probs"] - shift  # ratio = exp(shift) to ~1e-6 (on-policy otherwise)
    accelerator = cpu_accelerator(gradient_accumulation_steps=3)
    (step,) = train_on_samples(
        Policy(family, scheduler, None, family.network),
        PPOSettings(
            num_steps=3, guidance_scale=1.0, eta=1.0, batch_size=4, num_train_steps=3, clip_range=0.05
        ),
        samples,
        accelerator,
        accelerator.prepare_optimizer(torch.optim.SGD(params, lr=0.0)),
        params,
        torch.Generator().manual_seed(1),
    )
    ratios = shift.double().exp()
    for i in range(3):
        assert step[f"ratio_by_step/{i:02d}"] == pytest.approx(ratios[:, i].mean().item(), rel=1e-5)
    assert step["ratio"] == pytest.approx(ratios.mean().item(), rel=1e-5)
    assert step["clipfrac"] == pytest.approx((shift.abs() > 0.05).float().mean().item())


def test_beta_adds_the_mean_space_kl_to_the_base_model_on_sd3(tiny_models):
    """On SD3 (Flow-GRPO's SDE step) with zero advantages the loss is beta * ||mean - mean_base||^2 / (2 std_t^2),
    the step means computed by flow_sde_step_with_logprob with the LoRA on and off (averaged per dimension)."""
    from refl_ddpo.core.families.sd3 import StableDiffusion3
    from refl_ddpo.core.lora import adapters_off
    from refl_ddpo.core.steps.flow_sde import flow_sde_step_with_logprob

    torch.manual_seed(0)
    family = load_family(str(tiny_models / "tiny-sd3"))
    assert isinstance(family, StableDiffusion3)
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    uncond, _ = family.encode_prompts([""], with_negative=False)
    prompts = iter(["a cat", "a dog"])
    batches = sample_epoch(
        Policy(family, scheduler, uncond),
        SampleSettings(batch_size=2, num_batches=1, num_steps=4, guidance_scale=1.0, eta=0.7, resolution=RES),
        EpochPlan(lambda: (next(prompts), {}), window=(1, 1)),
        build_reward("jpeg_compressibility", "cpu"),
        torch.Generator().manual_seed(0),
    )
    samples = stack_samples(batches, torch.zeros(2))
    beta = 0.04
    accelerator = cpu_accelerator(gradient_accumulation_steps=1)
    steps = train_on_samples(
        Policy(family, scheduler, None, family.network),
        PPOSettings(
            num_steps=4,
            guidance_scale=1.0,
            eta=0.7,
            batch_size=2,
            num_train_steps=1,
            clip_range=1e-4,
            kl_weight=beta,
        ),
        samples,
        accelerator,
        accelerator.prepare_optimizer(torch.optim.SGD(params, lr=0.0)),
        params,
        torch.Generator().manual_seed(1),
    )
    x, t = samples["latents"][:, 0], samples["timesteps"][:, 0]
    cond = {k: samples[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    with torch.no_grad():
        v = family.predict(x, t, scheduler, cond, None, 1.0)
        with adapters_off(family.network):
            v_ref = family.predict(x, t, scheduler, cond, None, 1.0)
        _, _, mean, std = flow_sde_step_with_logprob(scheduler, v, t, x, 0.7, prev_sample=x)
        _, _, mean_ref, _ = flow_sde_step_with_logprob(scheduler, v_ref, t, x, 0.7, prev_sample=x)
    kl = (((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std**2)).mean()
    assert kl > 0
    (step,) = steps
    torch.testing.assert_close(torch.tensor(step["kl"]), kl, rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(step["loss"]), beta * kl, rtol=1e-4, atol=1e-9)


# ---- config ----


@pytest.mark.parametrize(
    "argv, env, names",
    [
        (["--group_size", "1"], {}, ["--group_size"]),
        (
            ["--sample_batch_size", "4", "--sample_num_batches_per_epoch", "1", "--group_size", "3"],
            {},
            ["--sample_batch_size", "--sample_num_batches_per_epoch", "--group_size"],
        ),
        (
            ["--sample_batch_size", "2", "--sample_num_batches_per_epoch", "1", "--group_size", "8"],
            {"WORLD_SIZE": "3"},
            ["--sample_batch_size", "--sample_num_batches_per_epoch", "3 processes", "--group_size"],
        ),
        (["--per_prompt_stat_tracking"], {}, ["--per_prompt_stat_tracking", "--group_size"]),
        (["--sde_window", "-1"], {}, ["--sde_window"]),
        (["--sample_num_steps", "6", "--sde_window", "7"], {}, ["--sde_window", "--sample_num_steps"]),
        (
            [
                "--sample_num_steps",
                "6",
                "--train_skip_last_steps",
                "2",
                "--sde_window",
                "2",
                "--sde_window_start",
                "3",
            ],
            {},
            ["--sde_window_start", "--sde_window", "--train_skip_last_steps"],
        ),
        (["--sde_window_start", "0"], {}, ["--sde_window_start", "--sde_window"]),
        (["--beta", "-1"], {}, ["--beta"]),
        (
            ["--sde_window", "3", "--timestep_fraction", "0.2"],
            {},
            ["--train_timestep_fraction", "--sde_window"],
        ),
    ],
)
def test_config_check_names_the_fields(argv, env, names, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError) as e:
        _parse(argv)
    msg = str(e.value)
    assert "\n" not in msg
    for name in names:
        assert name in msg, (name, msg)


@pytest.mark.parametrize(
    "batch, batches, processes, group, train_batch",
    [
        (3, 1, 2, 4, 3),
        (3, 2, 1, 4, 1),
        (4, 1, 1, 3, 2),
        (2, 1, 3, 8, 1),
        (1, 1, 1, 3, 1),
        (6, 1, 1, 4, 3),
        (4, 1, 1, 3, 4),
    ],
)
def test_group_arithmetic_error_offers_fixes_that_work(batch, batches, processes, group, train_batch):
    """The one-line error's two fixes (a --group_size, a --sample_num_batches_per_epoch) each make the epoch a whole
    number of groups and of optimizer steps."""
    import dataclasses
    import re

    from refl_ddpo.trainers.grpo_config import check_group_arithmetic

    cfg = GRPOConfig(
        sample_batch_size=batch,
        sample_num_batches_per_epoch=batches,
        group_size=group,
        train_batch_size=train_batch,
    )
    with pytest.raises(UserError) as e:
        check_group_arithmetic(cfg, processes)
    msg = str(e.value)
    fixes = dict(re.findall(r"--(group_size|sample_num_batches_per_epoch) (\d+)", msg.split("use ")[1]))
    assert "sample_num_batches_per_epoch" in fixes, msg
    for name, value in fixes.items():
        fixed = dataclasses.replace(cfg, **{name: int(value)})
        check_group_arithmetic(fixed, processes)
        assert fixed.group_size >= 2 and (batch * fixed.sample_num_batches_per_epoch) % train_batch == 0, msg


def test_groups_may_span_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = _parse(["--sample_batch_size", "2", "--sample_num_batches_per_epoch", "1", "--group_size", "4"])
    assert cfg.group_size == 4  # 2 processes x 2 samples = one group of 4


def test_flow_grpo_preset_and_flags():
    cfg = _parse(["--preset", "flow_grpo_sd35m"])
    assert (cfg.sample_num_steps, cfg.sample_eta, cfg.sample_guidance_scale) == (10, 0.7, 4.5)
    assert (cfg.learning_rate, cfg.train_clip_range, cfg.kl_weight, cfg.global_std) == (
        3e-4,
        1e-4,
        0.04,
        True,
    )
    cfg = _parse(["--beta", "0.01", "--timestep_fraction", "0.5", "--group_size", "4"])
    assert (cfg.kl_weight, cfg.train_timestep_fraction, cfg.per_prompt_stat_tracking) == (0.01, 0.5, False)
    toy = _parse(["--preset", "toy_world"])
    assert (
        toy.same_noise_per_group
        and toy.reward == "toy_color_match:1,toy_clean:1"
        and toy.output_dir.endswith("grpo_lora")
    )
    assert toy.prompt_fn == "toy_world_green" and toy.pretrained_model.endswith("toy-sd")
    toy3 = _parse(["--preset", "toy_world_sd3"])
    assert toy3.pretrained_model.endswith("toy-sd3") and toy3.prompt_fn == "toy_world_cyan"
    assert toy3.reward == "toy_color_match"
    assert (toy3.sample_eta, toy3.lora_target_modules) == (0.7, ["add_k_proj", "add_v_proj"])


# The FLUX.1-dev presets, from their sources: (name, steps, noise level, trained steps per sample, optimizer steps per
# epoch on one GPU, window, reward, LoRA).
FLUX_PRESETS = [
    ("flow_grpo_flux", 6, 0.9, 5, 2, 0, "pickscore", True),
    ("flow_grpo_fast_flux", 6, 0.8, 3, 2, 3, "pickscore", True),
    ("dance_grpo_flux", 16, 0.3, 9, 3, 0, "hpsv2", False),
]


@pytest.mark.parametrize("name, steps, eta, trained, opt_steps, window, reward, lora", FLUX_PRESETS)
def test_flux_presets_parse_and_resolve_on_a_flux_model(
    name, steps, eta, trained, opt_steps, window, reward, lora, tiny_models, tmp_path
):
    """Each FLUX.1-dev preset parses (its checks pass), its numbers are its source's, and it resolves on a FLUX.1
    folder as the trainer resolves it before loading (the model, the reward's files, the LoRA targets, the guidance:
    3.5 embedded, sampled and validated alike); its groups fit one GPU."""
    from refl_ddpo.core.families.flux import Flux
    from refl_ddpo.run.session import shared_checks
    from refl_ddpo.trainers.ddpo_config import epoch_sizes
    from refl_ddpo.trainers.grpo_config import FLOW_GRPO_FLUX_LORA, check_group_arithmetic

    cfg = _parse(["--preset", name])
    assert cfg.pretrained_model == "black-forest-labs/FLUX.1-dev" and cfg.mixed_precision == "bf16"
    assert (cfg.sample_num_steps, cfg.sample_eta, cfg.sample_guidance_scale) == (steps, eta, 3.5)
    assert (num_train_timesteps(cfg), cfg.sde_window, cfg.reward, cfg.use_lora) == (
        trained,
        window,
        reward,
        lora,
    )
    assert epoch_sizes(cfg, 1)["optimizer steps per epoch"] == opt_steps
    check_group_arithmetic(cfg, 1)
    if lora:
        assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (64, 128, FLOW_GRPO_FLUX_LORA)
    local = ["--pretrained_model", str(tiny_models / "tiny-flux"), "--reward_model_dir", str(tiny_models)]
    resolved = shared_checks(_parse(["--preset", name, *local, "--output_dir", str(tmp_path / "out")]))
    assert resolved.sample_guidance_scale == resolved.validation_guidance_scale == 3.5
    assert resolved.lora_target_modules == (FLOW_GRPO_FLUX_LORA if lora else Flux.lora_target_modules)


# ---- the shell script end to end ----


def _span_flags(tiny_models, model: str, out: Path, *extra: str) -> list[str]:
    """Two CPU processes x 6 samples in groups of 4 (group 1 spans both), one x_T per group, an SDE window of 2 whose
    start is drawn per epoch, beta; 2 epochs, a checkpoint after each. SD3 adds --global_std."""
    sd3 = ["--global_std"] if model == "tiny-sd3" else []
    return trainer_flags(
        tiny_models,
        out,
        *sd3,
        *extra,
        model=model,
        resolution=RES,
        sample_num_steps=4,
        sample_batch_size=3,
        sample_num_batches_per_epoch=2,
        train_batch_size=3,
        group_size=4,
        same_noise_per_group=True,
        sde_window=2,
        beta="0.04",
        learning_rate="3e-2",
        num_epochs=2,
        save_freq=1,
        device="cpu",
    )


def _script(args: list[str], **env) -> subprocess.CompletedProcess:
    return run_script("train_grpo.sh", args, script_env(NUM_PROCESSES="2", **env), timeout=240)


# validated on the main process alone, the other one waits at the next collective; the resumed run below has no
# validation nor trackers, and its LoRA must still be bit-identical
VALIDATION = (
    "--validation_prompts_file",
    "toy_world_heldout",
    "--validation_epochs",
    "1",
    "--num_validation_images",
    "1",
    "--validation_num_steps",
    "2",
)
_runs: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}


@pytest.fixture(scope="module")
def spanning_run(tiny_models, tmp_path_factory):
    """The two-process run of a family (`_span_flags`), run once per module and family."""

    def run(model: str) -> tuple[Path, subprocess.CompletedProcess]:
        if model not in _runs:
            out = tmp_path_factory.mktemp(f"grpo-{model}") / "run"
            r = _script(_span_flags(tiny_models, model, out, "--report_to", "tensorboard", *VALIDATION))
            assert r.returncode == 0, r.stderr[-3000:]
            _runs[model] = out, r
        return _runs[model]

    yield run
    _runs.clear()


def _scalars(out: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for f in (out / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        scalars.update({t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]})
    return scalars


# SD3 only: on SD 1.x the same loop runs on two processes in tests/test_ddpo.py (the suite's time is the limit)
@pytest.mark.parametrize("model", ["tiny-sd3"])
def test_script_trains_groups_spread_over_two_processes_and_saves_a_lora(spanning_run, model):
    """Rewards and group ids are gathered before the advantages; the processes end with identical weights; the
    derived sizes are printed; the trackers get the mean importance ratio (1 at the first, on-policy, update; and
    per sampler step), the clip fraction, the KL and the zero-std fraction."""
    out, r = spanning_run(model)
    assert "groups (prompts) per epoch: 3" in r.stdout and "samples per group: 4" in r.stdout
    assert r.stdout.count("12 rewards from 2 process(es)") == 2 and "grpo/zero_std_groups" in r.stdout
    assert (out / LORA_WEIGHTS_NAME).is_file() and (out / "checkpoint-2").is_dir()
    assert "weights identical on all 2 process(es)" in r.stdout
    assert r.stdout.count("validation after epoch") == 3, "once per validation: by the main process"
    assert sorted(p.name for p in (out / "validation").glob("*.json")) == [
        f"epoch-{n}.json" for n in range(3)
    ]
    assert (out / "README.md").is_file()
    scalars = _scalars(out)
    for key in (
        "grpo/ratio",
        "grpo/approx_kl",
        "grpo/clipfrac",
        "grpo/kl",
        "grpo/loss",
        "grpo/zero_std_groups",
    ):
        assert key in scalars, (key, sorted(scalars))
    assert len(scalars["grpo/ratio"]) == 4 and len(scalars["grpo/zero_std_groups"]) == 2  # 2 steps per epoch
    assert abs(scalars["grpo/ratio"][0] - 1) <= 1e-5, scalars["grpo/ratio"]
    assert scalars["grpo/kl"][0] == 0 < scalars["grpo/kl"][-1], (
        "the LoRA starts at the base model, then moves"
    )
    by_step = [k for k in scalars if k.startswith("grpo/ratio_by_step/")]
    assert by_step and set(by_step) <= {f"grpo/ratio_by_step/{i:02d}" for i in range(4)}, by_step
    assert "validation/jpeg_compressibility/mean" in scalars


def test_resume_from_the_first_checkpoint_gives_the_bit_identical_lora(spanning_run, tiny_models, tmp_path):
    """SD3, two processes, groups across them, one x_T per group, a drawn window, beta, global std: the run's
    checkpoint-1 in a fresh folder (what a run killed right after writing it leaves), resumed with
    --resume_from_checkpoint latest and without validation or trackers: the LoRA and the counters equal the
    uninterrupted run's bit for bit. (GRPO killed with -9 on two processes and resumed: tests/test_fsdp_grpo.py; DDPO
    and DiffusionNFT under DDP: tests/test_ddpo.py, test_nft.py.)"""
    reference, _ = spanning_run("tiny-sd3")
    out = tmp_path / "resumed"
    flags = _span_flags(tiny_models, "tiny-sd3", out, "--report_to", "none")
    r = resume_two(reference / "checkpoint-1", SCRIPT.name, flags)
    assert "resumed from" in r.stdout and "1 epoch(s) done" in r.stdout
    assert "weights identical on all 2 process(es)" in r.stdout
    resumed, uninterrupted = load_file(out / LORA_WEIGHTS_NAME), load_file(reference / LORA_WEIGHTS_NAME)
    first = load_file(reference / "checkpoint-1" / LORA_WEIGHTS_NAME)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert any(not torch.equal(first[k], uninterrupted[k]) for k in first), "the resumed epoch did train"
    assert json.loads((out / "checkpoint-2" / "train_state.json").read_text()) == json.loads(
        (reference / "checkpoint-2" / "train_state.json").read_text()
    )


def test_script_refuses_groups_that_do_not_tile_the_processes_in_one_line_before_loading(tmp_path):
    """2 processes x 3 x 1 images = 6, groups of 4: one line (not one per process) naming the fields, the process
    count and fixes that work, before any model is looked at (the model path does not exist)."""
    out = tmp_path / "never"
    r = _script(
        [
            "--output_dir",
            str(out),
            "--pretrained_model",
            str(tmp_path / "missing"),
            "--sample_batch_size",
            "3",
            "--sample_num_batches_per_epoch",
            "1",
            "--train_batch_size",
            "3",
            "--group_size",
            "4",
        ]
    )
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1, r.stderr
    for part in (
        "--sample_batch_size 3",
        "--sample_num_batches_per_epoch 1",
        "2 processes = 6",
        "--group_size 4",
        "use --group_size 3 or --sample_num_batches_per_epoch 2",
    ):
        assert part in err[0], (part, err[0])
    assert "Traceback" not in r.stderr and not out.exists()
