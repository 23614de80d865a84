"""The policy-gradient family, DDPO and GRPO, as one loop: `train(cfg)` reads top to bottom as ddpo-pytorch's
scripts/train.py does. Each epoch: plan its prompts, sample trajectories with log-probabilities, score them and turn
the rewards into advantages over all processes, report, then PPO over the stored steps; validation and checkpoint-N
when due. The run around it (checks, accelerator, models, resume, the final save) is refl_ddpo.run.session's.

Which of the two it is, is a `Setting` chosen once from the config: DDPO (refl_ddpo.trainers.ddpo) plans each
process' prompts from its own stream and normalises rewards per prompt (or over the batch); GRPO
(refl_ddpo.trainers.grpo) plans the epoch in groups (one stream for all processes, with --same_noise_per_group one
x_T per group, with --sde_window a window of stochastic steps drawn per epoch) and normalises within groups. The maths
is refl_ddpo.algorithms.policy's; the rollouts are rollouts.py's and the PPO pass ppo.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from refl_ddpo.algorithms.policy import PerPromptStatTracker, compute_advantages, zero_std_group_fraction
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import ModelFamily
from refl_ddpo.rewards.pairwise import build_pairwise
from refl_ddpo.run.runs import start_run
from refl_ddpo.run.session import (
    Run,
    add_optimizer,
    begin_run,
    finish_run,
    load_run,
    open_accelerator,
    prepare,
    save_run_checkpoint,
    shared_checks,
    validation,
)
from refl_ddpo.run.training import seeded_generator, stream_seed
from refl_ddpo.trainers.ddpo_config import DDPOConfig, epoch_sizes, num_train_timesteps
from refl_ddpo.trainers.epochs import (
    Advantages,
    EpochCounters,
    EpochPlan,
    ImageSamplesHook,
    build_epoch_reward,
    checkpoint_due,
    phase_bar,
    report_epoch,
    reward_pool,
    score_epoch,
)
from refl_ddpo.trainers.groups import (
    check_group_arithmetic,
    check_pairwise_groups,
    group_sizes,
    grouped_advantages,
    grouped_prompts,
)
from refl_ddpo.trainers.grpo_config import GRPOConfig
from refl_ddpo.trainers.ppo import NonFiniteGradient, PPOSettings, train_on_samples
from refl_ddpo.trainers.rollouts import (
    Policy,
    SampleSettings,
    collect_rewards,
    draw_window_start,
    sample_epoch,
    stack_samples,
)

# the training bar's metrics (train_on_samples' info)
POSTFIX_KEYS = ("loss", "ratio", "approx_kl", "clipfrac", "kl")


@dataclass
class PolicyState:
    """What lives across epochs, kept in checkpoint-N: the counters and DDPO's per-prompt reward buffers."""

    counters: EpochCounters
    stat_tracker: PerPromptStatTracker | None = None

    @classmethod
    def start(cls, cfg: DDPOConfig) -> PolicyState:
        """Nothing done yet; the buffers of --per_prompt_stat_tracking empty."""
        tracker = None
        if cfg.per_prompt_stat_tracking:
            tracker = PerPromptStatTracker(
                cfg.per_prompt_stat_tracking_buffer_size, cfg.per_prompt_stat_tracking_min_count
            )
        return cls(EpochCounters(), tracker)

    def checkpoint(self, done: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """checkpoint-N's (counters, tensors) after `done` epochs."""
        counters = self.counters.state(done)
        counters["stat_tracker"] = self.stat_tracker.state_dict() if self.stat_tracker is not None else None
        return counters, {}

    def restore(self, counters: dict) -> None:
        """From checkpoint-N's counters."""
        self.counters.restore(counters)
        if self.stat_tracker is not None and counters.get("stat_tracker"):
            self.stat_tracker.load_state_dict(counters["stat_tracker"])


# ---- the two settings: which plan, which advantages ----


def ddpo_plan(run: Run, epoch: int) -> EpochPlan:
    """This process' prompts for the epoch, from a stream seeded by (seed, epoch, process): resumable."""
    from refl_ddpo.core.prompts import epoch_prompt_fn

    cfg = run.cfg
    seed = stream_seed(cfg.seed, epoch, run.rank, 0)
    return EpochPlan(epoch_prompt_fn(cfg.prompt_fn, cfg.prompts_file, seed=seed, edit_data=cfg.edit_data))


def grouped_epoch(
    cfg: GRPOConfig, family: ModelFamily, epoch: int, rank: int, num_processes: int, dtype: torch.dtype
) -> EpochPlan:
    """GRPO's epoch plan, the same on every process: this process' prompt_fn (its slice of the groups), the group id
    of each of its samples (N,), their initial noise (one x_T per group with --same_noise_per_group, else None),
    and the SDE window (start, length) or None."""
    prompt_fn, group_ids, noise = grouped_prompts(cfg, family, epoch, rank, num_processes, dtype)
    window = None
    if cfg.sde_window:
        start = cfg.sde_window_start
        if start is None:
            last = cfg.sample_num_steps - cfg.train_skip_last_steps  # the window ends at or before this step
            start = draw_window_start(seeded_generator(cfg.seed, epoch, 5), last, cfg.sde_window)
        window = (start, cfg.sde_window)
    return EpochPlan(prompt_fn, group_ids, noise, window)


def grpo_plan(run: Run, epoch: int) -> EpochPlan:
    return grouped_epoch(run.cfg, run.family, epoch, run.rank, run.accelerator.num_processes, run.dtype)


def ddpo_advantages(cfg: DDPOConfig, state: PolicyState, plan: EpochPlan) -> Advantages:
    """Per-prompt running mean / std (--per_prompt_stat_tracking) or the batch's, clipped to +-train_adv_clip_max."""

    def advantages(rewards: torch.Tensor, prompts: list[str], groups: torch.Tensor | None, parts: dict):
        return compute_advantages(rewards, prompts, state.stat_tracker, cfg.train_adv_clip_max), {}

    return advantages


def grpo_advantages(cfg: GRPOConfig, state: PolicyState, plan: EpochPlan) -> Advantages:
    """(r - the group's mean) / (std + 1e-4), clipped, or GDPO's (--reward_aggregation gdpo); logged: the share of
    groups with one reward value and the SDE window's start."""

    def advantages(rewards: torch.Tensor, prompts: list[str], groups: torch.Tensor | None, parts: dict):
        result = grouped_advantages(cfg, rewards, groups, parts)
        stats = {"grpo/zero_std_groups": zero_std_group_fraction(rewards, groups)}
        if plan.window is not None:
            stats["grpo/sde_window_start"] = plan.window[0]
        return result, stats

    return advantages


@dataclass(frozen=True)
class Setting:
    """What makes the loop DDPO or GRPO: its name (metric prefix, tracker project, run records), the epoch's plan,
    the advantages, the derived sizes printed before training and the check of the process count."""

    name: str
    plan: Callable[[Run, int], EpochPlan]
    advantages: Callable[[DDPOConfig, PolicyState, EpochPlan], Advantages]
    sizes: Callable[[DDPOConfig, int], dict[str, int]]
    check_processes: Callable[[DDPOConfig, int], None]


def check_grpo_processes(cfg: GRPOConfig, num_processes: int) -> None:
    """The config's group checks read WORLD_SIZE; a launcher that does not set it is caught here."""
    check_group_arithmetic(cfg, num_processes)
    if cfg.pairwise_reward:
        check_pairwise_groups(cfg, num_processes)


DDPO = Setting("ddpo", ddpo_plan, ddpo_advantages, epoch_sizes, lambda cfg, num_processes: None)
GRPO = Setting(
    "grpo",
    grpo_plan,
    grpo_advantages,
    lambda cfg, n: {**epoch_sizes(cfg, n), **group_sizes(cfg, n)},
    check_grpo_processes,
)


def setting(cfg: DDPOConfig) -> Setting:
    """GRPO for a GRPOConfig, DDPO otherwise."""
    return GRPO if isinstance(cfg, GRPOConfig) else DDPO


# ---- set-up ----


def policy_scheduler(run: Run):
    """The family's stochastic scheduler (DDIM on SD, flow matching with Flow-GRPO's SDE step), also set on its
    pipeline; --kl_weight is refused where the scheduler clips x0."""
    scheduler = run.family.policy_scheduler()
    run.family.pipe.scheduler = scheduler
    if run.cfg.kl_weight > 0 and scheduler.config.get("clip_sample", False):
        raise UserError(
            f"--kl_weight needs a scheduler with clip_sample=False (Stable Diffusion's); "
            f"{run.cfg.pretrained_model} clips x0: use --kl_weight 0."
        )
    return scheduler


def set_up(cfg: DDPOConfig, algo: Setting) -> tuple[Run, Policy, tuple[dict, dict] | None]:
    """refl_ddpo.run.session's plumbing in its order, with the policy's parts: the checks, the accelerator (one
    optimizer step per train_gradient_accumulation_steps micro-batches x trained timesteps), the family, its
    scheduler, the reward, the optimizer. Returns the run, the policy it samples with, and the resumed checkpoint's
    (counters, tensors) or None."""
    cfg = shared_checks(cfg)
    info = start_run(cfg, algo.name, "num_epochs")
    accelerator = open_accelerator(cfg, cfg.train_gradient_accumulation_steps * num_train_timesteps(cfg))
    algo.check_processes(cfg, accelerator.num_processes)
    run = load_run(cfg, info, accelerator, algo.name, "epoch")
    scheduler = policy_scheduler(run)
    build_epoch_reward(run)
    if isinstance(cfg, GRPOConfig) and cfg.pairwise_reward:
        run.judge = build_pairwise(cfg.pairwise_reward, accelerator.device, run.dtype, cfg.reward_model_dir)
    uncond = run.family.empty_cond()  # batch 1
    add_optimizer(run)
    prepare(run)
    saved = begin_run(run, algo.sizes(run.cfg, accelerator.num_processes))
    return run, Policy(run.family, scheduler, uncond, run.network, accelerator.autocast), saved


def preflight(cfg: DDPOConfig) -> Path | None:
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    return start_run(shared_checks(cfg), setting(cfg).name, "num_epochs").resume


# ---- the loop's small parts ----


def judge_groups(run: Run, plan: EpochPlan, batches: list, epoch: int) -> torch.Tensor | None:
    """--pairwise_reward: this process' samples' win rates (N,) within their groups (each group on this process;
    the opponents drawn from a stream seeded by (seed, epoch, process)), or None without a judge."""
    if run.judge is None:
        return None
    from refl_ddpo.rewards.pairwise import group_win_rates

    cfg = run.cfg
    images = torch.cat([b.images for b in batches])
    prompts = [p for b in batches for p in b.prompts]
    metadata = [m for b in batches for m in b.prompt_metadata]
    generator = seeded_generator(cfg.seed, epoch, run.rank, 6)
    with torch.no_grad():
        wins = group_win_rates(
            run.judge,
            images,
            prompts,
            metadata,
            plan.groups,
            cfg.pairwise_opponents,
            generator,
            cfg.sample_batch_size,
        )
    return wins.float()


@contextmanager
def stop_on_nonfinite_gradient(cfg: DDPOConfig, epoch: int, counters: EpochCounters) -> Iterator[None]:
    """train_on_samples' NonFiniteGradient as the run's one-line error, with the advice that fits (whether an
    earlier epoch or inner epoch, or the run this one resumes, updated the weights)."""
    try:
        yield
    except NonFiniteGradient as e:
        raise e.error(cfg.output_dir, epoch + 1, counters.global_step > 0) from None


def step_ticker(bar) -> Callable[[dict[str, float]], None]:
    """One training bar tick per optimizer step, its metrics beside it."""

    def step_done(info: dict[str, float]) -> None:
        bar.set_postfix({k: f"{info[k]:.3g}" for k in POSTFIX_KEYS if k in info}, refresh=False)
        bar.update(1)

    return step_done


def log_steps(run: Run, counters: EpochCounters, steps: list[dict[str, float]], inner_epoch: int) -> None:
    """An inner epoch's optimizer steps to the trackers (NAME/metric), one tracker step each."""
    for info in steps:
        run.accelerator.log(
            {f"{run.name}/{k}": v for k, v in info.items()} | {f"{run.name}/inner_epoch": inner_epoch},
            step=counters.global_step,
        )
        counters.global_step += 1


# ---- the loop ----


def train(cfg: DDPOConfig | GRPOConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run DDPO, or GRPO for a GRPOConfig; returns the output folder (final LoRA + config.json at its top)."""
    algo = setting(cfg)
    run, sampler, saved = set_up(cfg, algo)
    cfg, accelerator = run.cfg, run.accelerator
    state = PolicyState.start(cfg)
    if saved is not None:
        state.restore(saved[0])
        accelerator.print(f"resumed from {run.info.resume}{state.counters.resumed()}")
    counters, first = state.counters, state.counters.first_epoch
    # training recomputes the log-probs as sampling drew them: with CFG unless --no-train_cfg
    learner = replace(
        sampler, uncond=sampler.uncond if cfg.train_cfg and cfg.sample_guidance_scale > 1.0 else None
    )
    sampling = SampleSettings.from_config(cfg)
    steps_per_epoch = epoch_sizes(cfg, accelerator.num_processes)["optimizer steps per epoch"]
    validate = validation(run, cfg.validation_epochs, cfg.num_epochs, first)
    validate(first, counters.global_step)  # the baseline (LoRA at zero) in a run that starts at epoch 0
    counters.started = time.perf_counter()  # the epoch line's clock
    done = first
    with reward_pool(cfg) as executor:
        for epoch in range(first, cfg.num_epochs):
            # ---- plan: the epoch's prompts (GRPO: this process' slice of the groups, their x_T, the window) ----
            plan = algo.plan(run, epoch)
            # ---- sampling: trajectories with log-probs; rewards scored (in the pool with async rewards) ----
            run.network.eval()
            with phase_bar(run, epoch, "sampling", sampling.num_batches, "batch") as bar:
                generator = seeded_generator(cfg.seed, epoch, run.rank, 1)
                batches = sample_epoch(
                    sampler, sampling, plan, run.reward, generator, executor, lambda _: bar.update(1)
                )
            collect_rewards(batches)
            # ---- rewards (and win rates) and advantages, over all processes; the epoch's line and images ----
            wins = judge_groups(run, plan, batches, epoch)
            scored = score_epoch(run, epoch, batches, algo.advantages(cfg, state, plan), plan.groups, wins)
            report_epoch(run, epoch, counters, scored, image_samples_hook)
            # ---- training: --train_num_inner_epochs passes of PPO over the epoch's samples ----
            samples = stack_samples(scored.batches, scored.advantages)
            scored.batches.clear()
            ppo = PPOSettings.from_config(cfg, plan.window)
            with (
                phase_bar(run, epoch, "training", steps_per_epoch, "step") as bar,
                stop_on_nonfinite_gradient(cfg, epoch, counters),
            ):
                tick = step_ticker(bar)
                for inner_epoch in range(cfg.train_num_inner_epochs):
                    generator = seeded_generator(cfg.seed, epoch, run.rank, 2, inner_epoch)
                    steps = train_on_samples(
                        learner, ppo, samples, accelerator, run.optimizer, run.params, generator, tick
                    )
                    log_steps(run, counters, steps, inner_epoch)
            # ---- validation and checkpoint ----
            done = epoch + 1
            if validate(epoch + 1, counters.global_step):  # --early_stop_patience ran out
                break
            if checkpoint_due(cfg, epoch + 1):
                save_run_checkpoint(run, epoch + 1, *state.checkpoint(epoch + 1))
    return finish_run(run, {"epochs": done, "optimizer steps": counters.global_step})
