"""The epoch every sample-then-train trainer shares (DDPO, GRPO, DiffusionNFT, AWM), as parts for the run skeleton:
plan the epoch's prompts, sample, score (rewards gathered over all processes, the non-finite guard, advantages),
report, train. A trainer supplies `plan_epoch`, `sample`, `advantages` and `train`; the counters, the checkpoint
schedule, the reward pool and the logging are here.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from refl_ddpo.trainers.ddpo_config import EpochConfig
from refl_ddpo.trainers.skeleton import Algorithm, Run

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


class EpochAlgorithm(Algorithm):
    """An algorithm whose iteration is an epoch: sample with the current (or the old) weights, score, train."""

    unit = "epoch"
    iterations_field = "num_epochs"

    def __init__(self, cfg: EpochConfig, image_samples_hook: ImageSamplesHook | None = None):
        super().__init__(cfg)
        self.image_samples_hook = image_samples_hook
        self.global_step = 0  # optimizer steps so far

    def build_reward(self, run: Run) -> None:
        """run.reward from --reward (the VLM judges' model and question passed on)."""
        from refl_ddpo.rewards import build_reward

        cfg = self.cfg
        vlm = {k: v for k, v in (("model", cfg.vlm_model), ("question", cfg.vlm_question)) if v is not None}
        options = {"vlm_judge": vlm, "vlm_bertscore": vlm}
        run.reward = build_reward(
            cfg.reward, run.accelerator.device, run.dtype, cfg.reward_model_dir, options=options
        )

    # ---- state ----

    @property
    def validation_every(self) -> int:
        return self.cfg.validation_epochs

    def log_step(self, done: int) -> int:
        return self.global_step

    def checkpoint_due(self, done: int) -> bool:
        return done % self.cfg.save_freq == 0 or done == self.cfg.num_epochs

    def state(self, run: Run, done: int) -> tuple[dict, dict]:
        return {"epoch": done, "global_step": self.global_step}, {}

    def load_state(self, run: Run, counters: dict, tensors: dict) -> int:
        self.global_step = int(counters["global_step"])
        return int(counters["epoch"])

    def resumed(self, start: int) -> str:
        return f": {start} epoch(s) done, {self.global_step} optimizer step(s)"

    # ---- the loop ----

    def begin(self, run: Run, start: int) -> None:
        import time

        cfg = self.cfg
        self.hook = self.image_samples_hook or default_image_hook(run.accelerator, f"{self.name}/samples")
        self.executor = ThreadPoolExecutor(cfg.max_workers) if cfg.async_reward_computation else None
        self.first_epoch, self.started = start, time.perf_counter()

    def end(self, run: Run) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def finish(self, run: Run) -> dict[str, int]:
        return {"epochs": self.cfg.num_epochs, "optimizer steps": self.global_step}

    def iteration(self, run: Run, epoch: int) -> None:
        """One epoch: plan, sample, score (advantages over all processes), report, train."""
        plan = self.plan_epoch(run, epoch)
        batches = self.sample(run, epoch, plan)
        scored = self.score(run, epoch, plan, batches)
        self.report(run, epoch, scored)
        self.train(run, epoch, plan, scored)

    # ---- the parts of one epoch ----

    @abstractmethod
    def plan_epoch(self, run: Run, epoch: int) -> EpochPlan:
        """This process' prompts (and groups, noise) for the epoch, from streams seeded by (seed, epoch): resumable."""

    @abstractmethod
    def sample(self, run: Run, epoch: int, plan: EpochPlan) -> list:
        """The epoch's samples as batches with `prompts`, `prompt_metadata`, `images` and `rewards` (scored, or a
        future of the reward pool)."""

    @abstractmethod
    def advantages(
        self, run: Run, plan: EpochPlan, rewards: torch.Tensor, prompts: list[str], finite: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The finite gathered rewards' advantages, and stats to log."""

    @abstractmethod
    def train(self, run: Run, epoch: int, plan: EpochPlan, scored: ScoredEpoch) -> None:
        """Update the weights on the scored samples; count `self.global_step`."""

    def score(self, run: Run, epoch: int, plan: EpochPlan, batches: list) -> ScoredEpoch:
        """Rewards gathered over all processes, the non-finite guard, advantages; this process' share of them."""
        from accelerate.utils import gather_object

        from refl_ddpo.rewards import parse_reward_spec, reward_stats

        cfg, accelerator, name = self.cfg, run.accelerator, self.name
        local_rewards = torch.cat([b.rewards[0] for b in batches]).to(accelerator.device)  # (N,)
        all_rewards = accelerator.gather(local_rewards).cpu()  # (P * N,), process-major
        all_prompts = gather_object([p for b in batches for p in b.prompts])
        finite = check_rewards(cfg, all_rewards, epoch)  # (P * N,) bool: False = dropped
        advantages = torch.zeros(len(all_rewards))  # a dropped sample: advantage 0, no gradient
        advantages[finite], extra = self.advantages(run, plan, all_rewards, all_prompts, finite)
        parts = {
            part: accelerator.gather(
                torch.cat([b.rewards[1][part].float() for b in batches]).to(accelerator.device)
            ).cpu()[finite]
            for part, _ in parse_reward_spec(cfg.reward)
            if part in batches[0].rewards[1]
        }
        stats = {**reward_stats(cfg.reward, all_rewards[finite], parts), **extra}
        dropped = len(all_rewards) - int(finite.sum())
        if cfg.nonfinite_rewards == "drop":
            stats[f"{name}/nonfinite_rewards_dropped"] = dropped
        mine = advantages.reshape(accelerator.num_processes, -1)[run.rank]  # this process' samples
        return ScoredEpoch(batches, mine, stats, len(all_rewards), dropped)

    def report(self, run: Run, epoch: int, scored: ScoredEpoch) -> None:
        """The epoch's reward stats to the trackers and the log line; its images to the hook (main process)."""
        import time

        from refl_ddpo.core.progress import run_clock

        cfg, accelerator = self.cfg, run.accelerator
        accelerator.log({**scored.stats, f"{self.name}/epoch": epoch}, step=self.global_step)
        if not run.main:
            return
        clock = run_clock(
            time.perf_counter() - self.started, epoch + 1 - self.first_epoch, cfg.num_epochs - epoch - 1
        )
        print(
            f"epoch {epoch + 1}/{cfg.num_epochs} ({clock}): {scored.num_rewards} rewards from "
            f"{accelerator.num_processes} process(es)"
            + (f" ({scored.dropped} non-finite, dropped), " if scored.dropped else ", ")
            + ", ".join(f"{k} {v:.4g}" for k, v in scored.stats.items()),
            flush=True,
        )
        self.hook(
            [[b.images, b.prompts, b.prompt_metadata, b.rewards[0], b.rewards[1]] for b in scored.batches],
            self.global_step,
            accelerator.trackers[0] if accelerator.trackers else None,
        )

    def phase_bar(self, run: Run, epoch: int, phase: str, total: int, unit: str):
        """One bar per phase of an epoch (sampling, training), gone when it ends: the epoch's line stays."""
        from refl_ddpo.core.progress import progress_bar

        return progress_bar(
            total,
            f"epoch {epoch + 1}/{self.cfg.num_epochs} {phase}",
            unit=unit,
            leave=False,
            enabled=run.accelerator.is_local_main_process,
        )
