"""DDPO: Denoising Diffusion Policy Optimization (Black et al. 2023) with LoRA, on the shared core.

    bash train_scripts/train_ddpo.sh [--preset NAME] [--flag ...]
    (presets: compressibility, incompressibility, aesthetic, prompt_image_alignment, toy_world, toy_world_sd3)

One epoch (the algorithm of ddpo-pytorch `scripts/train.py`, commit 1958463, written against today's libraries):

1. sampling: `sample_batch_size x sample_num_batches_per_epoch` images per process with the family's stochastic
   sampler (DDIM with eta > 0 on SD), CFG batched; keep every step's latents, next latents, log-probabilities and
   timesteps, and the prompt conditioning;
2. rewards: any reward of the registry (need not be differentiable), optionally in a thread pool while sampling
   goes on; gathered over all processes;
3. advantages: per-prompt running mean / std over a buffer (`PerPromptStatTracker`), or the batch mean / std;
   clipped to [-train_adv_clip_max, train_adv_clip_max] (refl_ddpo.algorithms.policy);
4. training, `train_num_inner_epochs` times: shuffle the samples and, independently per sample, the timesteps; for
   the first `train_timestep_fraction` of them recompute the log-probability of the stored next latent under the
   current weights (CFG as in sampling when `train_cfg`), ratio = exp(logp - logp_old), PPO-clip loss; gradients
   accumulate over the trained timesteps and `train_gradient_accumulation_steps` micro-batches per optimizer step.

DDPO-SF (the plain score-function estimator) is the configuration `--train_clip_range inf --train_num_inner_epochs 1`.
GRPO (refl_ddpo.trainers.grpo) is this loop with its own epoch plan (the prompts in groups, one shared x_T per
group with --same_noise_per_group, with --sde_window stochastic steps only in a window drawn per epoch, all that
step 4 trains on) and group advantages in step 3. The run around the epochs (set-up, resume, validation,
checkpoints, the final weights) is refl_ddpo.trainers.skeleton's.
All randomness of an epoch (prompts, noise, shuffles) comes from generators seeded by (seed, epoch, process), so a
run resumed from `checkpoint-N` repeats epochs N+1... exactly as the uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refl_ddpo.algorithms.policy import PerPromptStatTracker, compute_advantages
from refl_ddpo.errors import UserError, cli_main
from refl_ddpo.ppo import train_on_samples
from refl_ddpo.rollouts import collect_rewards, sample_epoch, stack_samples
from refl_ddpo.trainers.ddpo_config import DDPOConfig, epoch_sizes, num_train_timesteps
from refl_ddpo.trainers.skeleton import Algorithm, Run, main_for, run_training
from refl_ddpo.training import seeded_generator, stream_seed

# A TRL-compatible image hook: (prompt_image_data, global_step, tracker) where prompt_image_data is a list of
# [images (B, 3, H, W) in [0, 1], prompts, prompt_metadata, rewards (B,), reward_metadata] batches, newest last.
ImageSamplesHook = Callable[[list[list[Any]], int, Any], None]


# --------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------


# the training bar's metrics (train_on_samples' info)
POSTFIX_KEYS = ("loss", "ratio", "approx_kl", "clipfrac", "kl")


def default_image_hook(accelerator, tag: str = "ddpo/samples") -> ImageSamplesHook:
    """Log the newest batch as a captioned grid ('prompt | reward') to the trackers each epoch."""
    from refl_ddpo.training import log_image_grid

    def hook(prompt_image_data: list[list[Any]], global_step: int, tracker: Any) -> None:
        images, prompts, _, rewards, _ = prompt_image_data[-1]
        captions = [f"{p} | {r:.3g}" for p, r in zip(prompts, rewards.tolist(), strict=True)]
        log_image_grid(accelerator, tag, images[:16], captions[:16], global_step)

    return hook


def check_rewards(cfg: DDPOConfig, rewards: torch.Tensor, epoch: int) -> torch.Tensor:
    """Which of an epoch's gathered rewards (N,) are finite. A NaN or inf reward stops the run (the same on every
    process: the rewards are gathered), unless --nonfinite_rewards drop, which keeps the others; all dropped stops."""
    from refl_ddpo.training import nonfinite_step_error

    finite = torch.isfinite(rewards)
    bad = len(rewards) - int(finite.sum())
    if bad and (cfg.nonfinite_rewards == "error" or bad == len(rewards)):
        fix = (
            "check the reward, or pass --nonfinite_rewards drop to train on the other samples"
            if bad < len(rewards)
            else "check the reward (or the model: do its images hold NaN?)"
        )
        raise nonfinite_step_error(
            cfg,
            f"--reward {cfg.reward} gave {bad} non-finite reward(s) (NaN or inf) of {len(rewards)} samples in "
            f"epoch {epoch + 1}",
            fix,
        )
    return finite


@dataclass
class EpochPlan:
    """What an epoch samples: this process' prompt source, and for GRPO its samples' group ids (N,), their initial
    noise (N, C, h, w) and the SDE window (start, length)."""

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


class DDPO(Algorithm):
    """DDPO's parts for the run skeleton (refl_ddpo.trainers.skeleton); GRPO (refl_ddpo.trainers.grpo) overrides
    the epoch plan and the advantages."""

    name = "ddpo"
    unit = "epoch"
    iterations_field = "num_epochs"

    def __init__(self, cfg: DDPOConfig, image_samples_hook: ImageSamplesHook | None = None):
        super().__init__(cfg)
        self.image_samples_hook = image_samples_hook
        self.global_step = 0  # optimizer steps so far

    # ---- set-up ----

    def accumulation_steps(self) -> int:
        return self.cfg.train_gradient_accumulation_steps * num_train_timesteps(self.cfg)

    def setup(self, run: Run) -> None:
        from refl_ddpo.rewards import build_reward

        cfg = self.cfg
        self.scheduler = (
            run.family.policy_scheduler()
        )  # DDIM (SD 1.x) or flow matching with Flow-GRPO's SDE step
        run.family.pipe.scheduler = self.scheduler
        if cfg.kl_weight > 0 and self.scheduler.config.get("clip_sample", False):
            raise UserError(
                f"--kl_weight needs a scheduler with clip_sample=False (Stable Diffusion's); "
                f"{cfg.pretrained_model} clips x0: use --kl_weight 0."
            )
        vlm = {k: v for k, v in (("model", cfg.vlm_model), ("question", cfg.vlm_question)) if v is not None}
        options = {"vlm_judge": vlm, "vlm_bertscore": vlm}
        run.reward = build_reward(
            cfg.reward, run.accelerator.device, run.dtype, cfg.reward_model_dir, options=options
        )
        self.uncond, _ = run.family.encode_prompts([""], with_negative=False)  # batch 1
        self.stat_tracker = (
            PerPromptStatTracker(
                cfg.per_prompt_stat_tracking_buffer_size, cfg.per_prompt_stat_tracking_min_count
            )
            if cfg.per_prompt_stat_tracking
            else None
        )

    def describe(self, run: Run) -> dict:
        return epoch_sizes(self.cfg, run.accelerator.num_processes)

    # ---- state ----

    @property
    def validation_every(self) -> int:
        return self.cfg.validation_epochs

    def log_step(self, done: int) -> int:
        return self.global_step

    def checkpoint_due(self, done: int) -> bool:
        return done % self.cfg.save_freq == 0 or done == self.cfg.num_epochs

    def state(self, run: Run, done: int) -> tuple[dict, dict]:
        tracker = self.stat_tracker
        counters = {
            "epoch": done,
            "global_step": self.global_step,
            "stat_tracker": tracker.state_dict() if tracker is not None else None,
        }
        return counters, {}

    def load_state(self, run: Run, counters: dict, tensors: dict) -> int:
        self.global_step = int(counters["global_step"])
        if self.stat_tracker is not None and counters.get("stat_tracker"):
            self.stat_tracker.load_state_dict(counters["stat_tracker"])
        return int(counters["epoch"])

    def resumed(self, start: int) -> str:
        return f": {start} epoch(s) done, {self.global_step} optimizer step(s)"

    # ---- the loop ----

    def begin(self, run: Run, start: int) -> None:
        import time

        cfg = self.cfg
        self.hook = self.image_samples_hook or default_image_hook(run.accelerator, f"{self.name}/samples")
        self.executor = ThreadPoolExecutor(cfg.max_workers) if cfg.async_reward_computation else None
        self.train_uncond = self.uncond if cfg.train_cfg and cfg.sample_guidance_scale > 1.0 else None
        self.first_epoch, self.started = start, time.perf_counter()

    def end(self, run: Run) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def finish(self, run: Run) -> dict[str, int]:
        return {"epochs": self.cfg.num_epochs, "optimizer steps": self.global_step}

    def iteration(self, run: Run, epoch: int) -> None:
        """One epoch: sample with the current weights, score, advantages over all processes, PPO on the samples."""
        plan = self.plan_epoch(run, epoch)
        batches = self.sample(run, epoch, plan)
        scored = self.score(run, epoch, plan, batches)
        self.report(run, epoch, scored)
        self.train(run, epoch, plan, scored)

    # ---- the parts of one epoch ----

    def plan_epoch(self, run: Run, epoch: int) -> EpochPlan:
        """This process' prompts for the epoch, from a stream seeded by (seed, epoch, process): resumable."""
        from refl_ddpo.prompts import get_prompt_fn

        cfg = self.cfg
        source = cfg.prompts_file if cfg.prompt_fn == "from_file" else cfg.prompt_fn
        return EpochPlan(get_prompt_fn(source, seed=stream_seed(cfg.seed, epoch, run.rank, 0)))

    def advantages(
        self, run: Run, plan: EpochPlan, rewards: torch.Tensor, prompts: list[str], finite: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The finite gathered rewards' advantages (per-prompt stats, or the batch's), and stats to log."""
        kept = [p for p, ok in zip(prompts, finite.tolist(), strict=True) if ok]
        return compute_advantages(rewards[finite], kept, self.stat_tracker, self.cfg.train_adv_clip_max), {}

    def sample(self, run: Run, epoch: int, plan: EpochPlan) -> list:
        """The epoch's trajectories with log-probabilities, rewards scored (in a thread pool with async rewards)."""
        cfg = self.cfg
        run.network.eval()
        with self.phase_bar(run, epoch, "sampling", cfg.sample_num_batches_per_epoch, "batch") as bar:
            batches = sample_epoch(
                run.family,
                self.scheduler,
                plan.prompt_fn,
                run.reward,
                self.uncond,
                batch_size=cfg.sample_batch_size,
                num_batches=cfg.sample_num_batches_per_epoch,
                num_steps=cfg.sample_num_steps,
                guidance_scale=cfg.sample_guidance_scale,
                eta=cfg.sample_eta,
                resolution=cfg.resolution,
                generator=seeded_generator(cfg.seed, epoch, run.rank, 1),
                network=run.network,
                autocast=run.accelerator.autocast,
                executor=self.executor,
                initial_noise=plan.initial_noise,
                sde_window=plan.window,
                on_batch=lambda _, tick=bar.update: tick(1),
            )
        collect_rewards(batches)
        return batches

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

        from refl_ddpo.progress import run_clock

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

    def train(self, run: Run, epoch: int, plan: EpochPlan, scored: ScoredEpoch) -> None:
        """`train_num_inner_epochs` passes of PPO over the epoch's samples, one bar tick per optimizer step."""
        from refl_ddpo.training import nonfinite_step_error

        cfg = self.cfg
        samples = stack_samples(scored.batches, scored.advantages)
        scored.batches.clear()
        steps_per_epoch = epoch_sizes(cfg, run.accelerator.num_processes)["optimizer steps per epoch"]
        with self.phase_bar(run, epoch, "training", steps_per_epoch, "step") as bar:

            def step_done(info: dict[str, float]) -> None:
                bar.set_postfix({k: f"{info[k]:.3g}" for k in POSTFIX_KEYS if k in info}, refresh=False)
                bar.update(1)

            for inner_epoch in range(cfg.train_num_inner_epochs):
                try:
                    steps = train_on_samples(
                        run.family,
                        run.network,
                        self.scheduler,
                        samples,
                        self.train_uncond,
                        run.accelerator,
                        run.optimizer,
                        run.params,
                        seeded_generator(cfg.seed, epoch, run.rank, 2, inner_epoch),
                        num_steps=cfg.sample_num_steps,
                        batch_size=cfg.train_batch_size,
                        num_train_steps=num_train_timesteps(cfg),
                        guidance_scale=cfg.sample_guidance_scale,
                        eta=cfg.sample_eta,
                        clip_range=cfg.train_clip_range,
                        kl_weight=cfg.kl_weight,
                        max_grad_norm=cfg.max_grad_norm,
                        # a window's trajectory holds its steps only, all trainable
                        skip_last_steps=0 if plan.window is not None else cfg.train_skip_last_steps,
                        on_step=step_done,
                    )
                except FloatingPointError as e:
                    bar.close()
                    raise nonfinite_step_error(
                        cfg, f"{e} in epoch {epoch + 1}", "lower --learning_rate, or check the reward"
                    ) from None
                for info in steps:
                    run.accelerator.log(
                        {f"{self.name}/{k}": v for k, v in info.items()}
                        | {f"{self.name}/inner_epoch": inner_epoch},
                        step=self.global_step,
                    )
                    self.global_step += 1

    def phase_bar(self, run: Run, epoch: int, phase: str, total: int, unit: str):
        """One bar per phase of an epoch (sampling, training), gone when it ends: the epoch's line stays."""
        from refl_ddpo.progress import progress_bar

        return progress_bar(
            total,
            f"epoch {epoch + 1}/{self.cfg.num_epochs} {phase}",
            unit=unit,
            leave=False,
            enabled=run.accelerator.is_local_main_process,
        )


def train(cfg: DDPOConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run DDPO as configured; returns the output folder (final LoRA + config.json at its top)."""
    return run_training(DDPO(cfg, image_samples_hook))


def preflight(cfg: DDPOConfig) -> Path | None:
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    return DDPO(cfg).preflight().resume


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(DDPO, DDPOConfig, argv, __doc__)


if __name__ == "__main__":
    main()
