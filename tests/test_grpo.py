"""GRPO (DDPO's trainer with a GRPOConfig): group advantages and zero-std groups vs closed forms, the epoch's groups
over processes, the SDE window (its steps are the only stochastic and the only trained ones), the KL to the base model
in the loss, config checks and presets, the shell script end to end. CPU, tiny models."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from refl_ddpo.algorithms.policy import GROUP_STD_EPS, group_advantages, zero_std_group_fraction
from refl_ddpo.config import parse_config
from refl_ddpo.errors import UserError
from refl_ddpo.families import load_family
from refl_ddpo.lora import LORA_WEIGHTS_NAME, add_lora
from refl_ddpo.rewards import build_reward
from refl_ddpo.rollouts import draw_window_start, epoch_groups, sample_epoch, stack_samples
from refl_ddpo.sampling import denoise
from refl_ddpo.trainers.ddpo import grouped_epoch, train_on_samples
from refl_ddpo.trainers.ddpo_config import num_train_timesteps
from refl_ddpo.trainers.grpo_config import GRPOConfig

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
    ids = torch.cat([p[1] for p in plans])
    assert ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    prompts = [p[0]() for p in plans for _ in range(6)]
    assert all(prompts[i] == prompts[j] for i in range(12) for j in range(12) if ids[i] == ids[j])
    noise = torch.cat([p[2] for p in plans])  # (12, C, h, w)
    for i in range(12):
        for j in range(12):
            assert torch.equal(noise[i], noise[j]) == bool(ids[i] == ids[j]), (i, j)
    assert plans[0][3] == plans[1][3] and 0 <= plans[0][3][0] <= 4 and plans[0][3][1] == 2


def test_window_start_is_uniform_over_the_windows_that_fit():
    g = torch.Generator().manual_seed(0)
    starts = {draw_window_start(g, trainable_steps=6, window=2) for _ in range(200)}
    assert starts == {0, 1, 2, 3, 4}


# ---- the SDE window on the tiny model ----


def _family(tiny_sd):
    from diffusers import DDIMScheduler

    torch.manual_seed(0)
    family = load_family(str(tiny_sd))
    family.pipe.scheduler = DDIMScheduler.from_config(family.pipe.scheduler.config)
    uncond, _ = family.encode_prompts([""], with_negative=False)
    return family, uncond


@torch.no_grad()
def test_only_the_window_steps_are_stochastic(tiny_sd):
    """Same x_T, two step-noise generators: the latents agree up to the window and differ from its first step on;
    log-probs are 0 exactly outside the window; with an empty window the loop is the deterministic DDIM (eta 0)."""
    family, uncond = _family(tiny_sd)
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
            eta=1.0,
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


def test_window_steps_are_the_only_trained_ones_and_on_policy(tiny_sd):
    """sample_epoch keeps the window's steps only, so training (every kept step, shuffled) touches no other step; the
    first PPO step is on-policy there."""
    family, uncond = _family(tiny_sd)
    scheduler = family.pipe.scheduler
    params = add_lora(family.network, 4, 4, ["to_q", "to_k", "to_v", "to_out.0"], init="random")
    prompts = iter(["a cat", "a dog"] * 4)
    batches = sample_epoch(
        family,
        scheduler,
        lambda: (next(prompts), {}),
        build_reward("jpeg_compressibility", "cpu"),
        uncond,
        batch_size=2,
        num_batches=2,
        num_steps=6,
        guidance_scale=5.0,
        eta=1.0,
        resolution=RES,
        generator=torch.Generator().manual_seed(0),
        sde_window=(3, 2),
    )
    family.set_timesteps(scheduler, 6, batches[0].latents)
    window = scheduler.timesteps[3:5]
    samples = stack_samples(batches, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert samples["timesteps"].shape == (4, 2) and (samples["timesteps"] == window).all()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    optimizer = accelerator.prepare_optimizer(torch.optim.SGD(params, lr=0.0))
    steps = train_on_samples(
        family,
        family.network,
        scheduler,
        samples,
        uncond,
        accelerator,
        optimizer,
        params,
        torch.Generator().manual_seed(1),
        num_steps=6,
        batch_size=2,
        num_train_steps=2,
        guidance_scale=5.0,
        eta=1.0,
        clip_range=1e-4,
    )
    assert len(steps) == 2 and all(s["approx_kl"] < 1e-10 and s["clipfrac"] == 0 for s in steps), steps
    cfg = _parse(["--sample_num_steps", "10", "--sde_window", "4", "--timestep_fraction", "0.5"])
    assert num_train_timesteps(cfg) == 2  # the fraction is of the window's steps


def test_beta_adds_the_mean_space_kl_to_the_base_model_on_sd3(tiny_models):
    """On SD3 (Flow-GRPO's SDE step) with zero advantages the loss is beta * ||mean - mean_base||^2 / (2 std_t^2),
    the step means computed by flow_sde_step_with_logprob with the LoRA on and off (averaged per dimension)."""
    from refl_ddpo.families.sd3 import StableDiffusion3
    from refl_ddpo.lora import adapters_off
    from refl_ddpo.steps.flow_sde import flow_sde_step_with_logprob

    torch.manual_seed(0)
    family = load_family(str(tiny_models / "tiny-sd3"))
    assert isinstance(family, StableDiffusion3)
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    uncond, _ = family.encode_prompts([""], with_negative=False)
    prompts = iter(["a cat", "a dog"])
    batches = sample_epoch(
        family,
        scheduler,
        lambda: (next(prompts), {}),
        build_reward("jpeg_compressibility", "cpu"),
        uncond,
        batch_size=2,
        num_batches=1,
        num_steps=4,
        guidance_scale=1.0,
        eta=0.7,
        resolution=RES,
        generator=torch.Generator().manual_seed(0),
        sde_window=(1, 1),
    )
    samples = stack_samples(batches, torch.zeros(2))
    beta = 0.04
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=1)
    steps = train_on_samples(
        family,
        family.network,
        scheduler,
        samples,
        None,
        accelerator,
        accelerator.prepare_optimizer(torch.optim.SGD(params, lr=0.0)),
        params,
        torch.Generator().manual_seed(1),
        num_steps=4,
        batch_size=2,
        num_train_steps=1,
        guidance_scale=1.0,
        eta=0.7,
        clip_range=1e-4,
        kl_weight=beta,
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
        toy.same_noise_per_group and toy.reward == "toy_color_match" and toy.output_dir.endswith("grpo_lora")
    )


# ---- the shell script end to end ----


def test_script_trains_groups_spread_over_two_processes_and_saves_a_lora(tiny_models, tmp_path):
    """Two CPU processes x 6 samples in groups of 4: group 1 spans both (rewards and group ids are gathered before
    the advantages), with a shared x_T, an SDE window and beta; the processes end with identical weights."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "NUM_PROCESSES")}
    env.update(PYTHON=sys.executable, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", NUM_PROCESSES="2")
    flags = [
        "--pretrained_model",
        str(tiny_models / "stable-diffusion"),
        "--reward_model_dir",
        str(tiny_models),
        "--output_dir",
        str(out),
        "--resolution",
        str(RES),
        "--sample_num_steps",
        "4",
        "--sample_batch_size",
        "3",
        "--sample_num_batches_per_epoch",
        "2",
        "--train_batch_size",
        "3",
        "--group_size",
        "4",
        "--same_noise_per_group",
        "--sde_window",
        "2",
        "--beta",
        "0.04",
        "--learning_rate",
        "3e-2",
        "--num_epochs",
        "2",
        "--save_freq",
        "2",
        "--device",
        "cpu",
        "--report_to",
        "none",
        # validated on the main process alone, the other one waits at the next collective
        "--validation_prompts_file",
        "toy_world_heldout",
        "--validation_epochs",
        "1",
        "--num_validation_images",
        "1",
        "--validation_num_steps",
        "2",
    ]
    r = subprocess.run(
        ["bash", str(SCRIPT), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "groups (prompts) per epoch: 3" in r.stdout and "samples per group: 4" in r.stdout
    assert r.stdout.count("12 rewards from 2 process(es)") == 2 and "grpo/zero_std_groups" in r.stdout
    assert (out / LORA_WEIGHTS_NAME).is_file() and (out / "checkpoint-2").is_dir()
    assert "weights identical on all 2 process(es)" in r.stdout
    assert r.stdout.count("validation after epoch") == 3, "once per validation: by the main process"
    assert sorted(p.name for p in (out / "validation").glob("*.json")) == [
        f"epoch-{n}.json" for n in range(3)
    ]
    assert (out / "README.md").is_file()
