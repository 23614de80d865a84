"""What the sample-then-train loops share (policy gradient: DDPO, GRPO; forward process: DiffusionNFT, AWM), as
plain functions: the reward and its thread pool, scoring an epoch's samples (rewards gathered over all processes, the
non-finite guard, the advantages), the epoch's report, its progress bars, its counters in checkpoint-N.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from refl_ddpo.run.session import Run
from refl_ddpo.trainers.ddpo_config import EpochConfig

# A TRL-compatible image hook: (prompt_image_data, global_step, tracker) where prompt_image_data is a list of
# [images (B, 3, H, W) in [0, 1], prompts, prompt_metadata, rewards (B,), reward_metadata] batches, newest last.
ImageSamplesHook = Callable[[list[list[Any]], int, Any], None]


def default_image_hook(accelerator, tag: str = "ddpo/samples") -> ImageSamplesHook:
    """Log the newest batch as a captioned grid ('prompt | reward') to the trackers each epoch."""
    from refl_ddpo.run.training import log_image_grid

    def hook(prompt_image_data: list[list[Any]], global_step: int, tracker: Any) -> None:
        images, prompts, _, rewards, _ = prompt_image_data[-1]
        captions = [f"{p} | {r:.3g}" for p, r in zip(prompts, rewards.tolist(), strict=True)]
        log_image_grid(accelerator, tag, images[:16], captions[:16], global_step)

    return hook


def check_rewards(cfg: EpochConfig, rewards: torch.Tensor, epoch: int) -> torch.Tensor:
    """Which of an epoch's gathered rewards (N,) are finite. A NaN or inf reward stops the run (the same on every
    process: the rewards are gathered), unless --nonfinite_rewards drop, which keeps the others; all dropped stops."""
    from refl_ddpo.run.training import nonfinite_step_error

    finite = torch.isfinite(rewards)
    bad = len(rewards) - int(finite.sum())
    if bad and (cfg.nonfinite_rewards == "error" or bad == len(rewards)):
        fix = (
            "check the reward, or pass --nonfinite_rewards drop to train on the other samples"
            if bad < len(rewards)
            else "check the reward (or the model: do its images hold NaN?)"
        )
        raise nonfinite_step_error(
            cfg.output_dir,
            f"--reward {cfg.reward} gave {bad} non-finite reward(s) (NaN or inf) of {len(rewards)} samples in "
            f"epoch {epoch + 1}",
            fix,
        )
    return finite


@dataclass
class EpochPlan:
    """What an epoch samples: this process' prompt source, and with groups (GRPO, NFT, AWM) its samples' group ids
    (N,) and their initial noise (N, C, h, w); GRPO's SDE window (start, length)."""

    prompt_fn: Callable[[], tuple[str, dict]]
    groups: torch.Tensor | None = None
    initial_noise: torch.Tensor | None = None
    window: tuple[int, int] | None = None


@dataclass
class ScoredEpoch:
    """An epoch's samples after scoring: this process' advantages (N,) and the gathered, finite rewards' stats."""

    batches: list
    advantages: torch.Tensor
    stats: dict[str, float]
    num_rewards: int
    dropped: int


# (finite gathered rewards (M,), their prompts, the group ids or None, each part of a weighted --reward by name (M,))
# -> (advantages (M,), stats to log)
Advantages = Callable[
    [torch.Tensor, list[str], torch.Tensor | None, dict[str, torch.Tensor]],
    tuple[torch.Tensor, dict[str, float]],
]


@dataclass
class EpochCounters:
    """Where a sample-then-train run stands: optimizer steps so far, the epoch this start began at and when (the
    clock of the epoch line)."""

    global_step: int = 0
    first_epoch: int = 0
    started: float = field(default_factory=time.perf_counter)

    def state(self, done: int) -> dict:
        """checkpoint-N's counters after `done` epochs."""
        return {"epoch": done, "global_step": self.global_step}

    def restore(self, counters: dict) -> int:
        """From checkpoint-N's counters; returns the epochs done."""
        self.first_epoch, self.global_step = int(counters["epoch"]), int(counters["global_step"])
        return self.first_epoch

    def resumed(self) -> str:
        return f": {self.first_epoch} epoch(s) done, {self.global_step} optimizer step(s)"


def build_epoch_reward(run: Run) -> None:
    """run.reward from --reward (the VLM rewards' model and question passed on; geneval2's and ocr's questions are
    their own)."""
    from refl_ddpo.rewards import build_reward

    cfg = run.cfg
    vlm = {k: v for k, v in (("model", cfg.vlm_model), ("question", cfg.vlm_question)) if v is not None}
    model = {"model": cfg.vlm_model} if cfg.vlm_model is not None else {}
    asks = ("vlm_judge", "vlm_bertscore", "unifiedreward", "vlm_yesno")
    options = {name: vlm for name in asks} | {"geneval2": model, "ocr": model}
    run.reward = build_reward(
        cfg.reward,
        run.accelerator.device,
        run.dtype,
        cfg.reward_model_dir,
        options=options,
        video_reduction=cfg.video_reduction,
    )


@contextmanager
def reward_pool(cfg: EpochConfig) -> Iterator[ThreadPoolExecutor | None]:
    """The thread pool that scores while sampling goes on (--async_reward_computation), or None."""
    executor = ThreadPoolExecutor(cfg.max_workers) if cfg.async_reward_computation else None
    try:
        yield executor
    finally:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def score_epoch(
    run: Run,
    epoch: int,
    batches: list,
    advantages: Advantages,
    groups: torch.Tensor | None = None,
    win_rates: torch.Tensor | None = None,
) -> ScoredEpoch:
    """Rewards (and `groups`, this process' group ids) gathered over all processes, the non-finite guard, the
    advantages; this process' share of them. With `win_rates` (N,) (--pairwise_reward) the advantages are of the
    win rates, logged as reward/pairwise/..., and the --reward's rewards are logged beside them."""
    from accelerate.utils import gather_object

    from refl_ddpo.rewards import reward_stats

    cfg, accelerator = run.cfg, run.accelerator
    all_rewards = gather_rewards(accelerator, [b.rewards[0] for b in batches])  # (P * N,), process-major
    all_prompts = gather_object([p for b in batches for p in b.prompts])
    finite = check_rewards(cfg, all_rewards, epoch)  # (P * N,) bool: False = dropped
    kept = [p for p, ok in zip(all_prompts, finite.tolist(), strict=True) if ok]
    all_groups = None if groups is None else accelerator.gather(groups.to(accelerator.device)).cpu()[finite]
    parts = reward_parts(cfg.reward, accelerator, batches, finite)
    stats = reward_stats(cfg.reward, all_rewards[finite], parts)
    stats |= info_stats(cfg.reward, run, batches, finite)
    trained = all_rewards
    if win_rates is not None:
        trained = gather_rewards(accelerator, [win_rates])
        wins = trained[finite].double()
        stats |= {
            "reward/pairwise/mean": float(wins.mean()),
            "reward/pairwise/std": float(wins.std(unbiased=False)),
        }
    result = torch.zeros(len(all_rewards))  # a dropped sample: advantage 0, no gradient
    result[finite], extra = advantages(trained[finite], kept, all_groups, parts)
    stats |= extra
    dropped = len(all_rewards) - int(finite.sum())
    if cfg.nonfinite_rewards == "drop":
        stats[f"{run.name}/nonfinite_rewards_dropped"] = dropped
    mine = result.reshape(accelerator.num_processes, -1)[run.rank]  # this process' samples
    return ScoredEpoch(batches, mine, stats, len(all_rewards), dropped)


def gather_rewards(accelerator, rewards: list[torch.Tensor]) -> torch.Tensor:
    """This process' rewards (a list of (B,)) concatenated and gathered over all processes, on the CPU."""
    return accelerator.gather(torch.cat(rewards).float().to(accelerator.device)).cpu()


def info_stats(spec: str, run: Run, batches: list, finite: torch.Tensor) -> dict[str, float]:
    """`refl_ddpo.rewards.info_means` of the rewards' per-sample info, gathered over all processes, the `finite`
    ones."""
    from refl_ddpo.rewards import info_means, per_sample_info

    keys = per_sample_info(batches[0].rewards[1], len(batches[0].rewards[0]))
    info = {
        k: gather_rewards(run.accelerator, [b.rewards[1][k].detach() for b in batches])[finite] for k in keys
    }
    return info_means(spec, info)


def reward_parts(spec: str, accelerator, batches: list, finite: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each part of a weighted --reward by name: its rewards gathered over all processes (M,), the `finite` ones."""
    from refl_ddpo.rewards import parse_reward_spec

    return {
        part: gather_rewards(accelerator, [b.rewards[1][part] for b in batches])[finite]
        for part, _ in parse_reward_spec(spec)
        if part in batches[0].rewards[1]
    }


def report_epoch(
    run: Run, epoch: int, counters: EpochCounters, scored: ScoredEpoch, hook: ImageSamplesHook | None = None
) -> None:
    """The epoch's reward stats to the trackers and the log line; its images to the hook (main process; default:
    a captioned grid to the trackers)."""
    from refl_ddpo.core.progress import run_clock

    cfg, accelerator = run.cfg, run.accelerator
    accelerator.log({**scored.stats, f"{run.name}/epoch": epoch}, step=counters.global_step)
    if not run.main:
        return
    clock = run_clock(
        time.perf_counter() - counters.started, epoch + 1 - counters.first_epoch, cfg.num_epochs - epoch - 1
    )
    print(
        f"epoch {epoch + 1}/{cfg.num_epochs} ({clock}): {scored.num_rewards} rewards from "
        f"{accelerator.num_processes} process(es)"
        + (f" ({scored.dropped} non-finite, dropped), " if scored.dropped else ", ")
        + ", ".join(f"{k} {v:.4g}" for k, v in scored.stats.items()),
        flush=True,
    )
    hook = hook or default_image_hook(accelerator, f"{run.name}/samples")
    hook(
        [[b.images, b.prompts, b.prompt_metadata, b.rewards[0], b.rewards[1]] for b in scored.batches],
        counters.global_step,
        accelerator.trackers[0] if accelerator.trackers else None,
    )


def phase_bar(run: Run, epoch: int, phase: str, total: int, unit: str):
    """One bar per phase of an epoch (sampling, training), gone when it ends: the epoch's line stays."""
    from refl_ddpo.core.progress import progress_bar

    return progress_bar(
        total,
        f"epoch {epoch + 1}/{run.cfg.num_epochs} {phase}",
        unit=unit,
        leave=False,
        enabled=run.accelerator.is_local_main_process,
    )


def checkpoint_due(cfg: EpochConfig, done: int) -> bool:
    """checkpoint-N every --save_freq epochs and after the last."""
    return done % cfg.save_freq == 0 or done == cfg.num_epochs
