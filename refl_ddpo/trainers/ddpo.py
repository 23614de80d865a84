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

from pathlib import Path

import torch

from refl_ddpo.algorithms.policy import PerPromptStatTracker, compute_advantages
from refl_ddpo.core.errors import UserError, cli_main
from refl_ddpo.run.training import seeded_generator, stream_seed
from refl_ddpo.trainers.ddpo_config import DDPOConfig, epoch_sizes, num_train_timesteps
from refl_ddpo.trainers.epochs import EpochAlgorithm, EpochPlan, ImageSamplesHook, ScoredEpoch
from refl_ddpo.trainers.ppo import NonFiniteGradient, train_on_samples
from refl_ddpo.trainers.rollouts import collect_rewards, sample_epoch, stack_samples
from refl_ddpo.trainers.skeleton import Run, main_for, run_training

# the training bar's metrics (train_on_samples' info)
POSTFIX_KEYS = ("loss", "ratio", "approx_kl", "clipfrac", "kl")


class DDPO(EpochAlgorithm):
    """DDPO's parts of the shared epoch (refl_ddpo.trainers.epochs); GRPO (refl_ddpo.trainers.grpo) overrides the
    epoch plan and the advantages."""

    name = "ddpo"

    # ---- set-up ----

    def accumulation_steps(self) -> int:
        return self.cfg.train_gradient_accumulation_steps * num_train_timesteps(self.cfg)

    def setup(self, run: Run) -> None:
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
        self.build_reward(run)
        self.uncond = run.family.empty_cond()  # batch 1
        self.stat_tracker = (
            PerPromptStatTracker(
                cfg.per_prompt_stat_tracking_buffer_size, cfg.per_prompt_stat_tracking_min_count
            )
            if cfg.per_prompt_stat_tracking
            else None
        )

    def describe(self, run: Run) -> dict:
        return epoch_sizes(self.cfg, run.accelerator.num_processes)

    # ---- state: the per-prompt buffer beside the counters ----

    def state(self, run: Run, done: int) -> tuple[dict, dict]:
        counters, tensors = super().state(run, done)
        counters["stat_tracker"] = self.stat_tracker.state_dict() if self.stat_tracker is not None else None
        return counters, tensors

    def load_state(self, run: Run, counters: dict, tensors: dict) -> int:
        done = super().load_state(run, counters, tensors)
        if self.stat_tracker is not None and counters.get("stat_tracker"):
            self.stat_tracker.load_state_dict(counters["stat_tracker"])
        return done

    # ---- the loop ----

    def begin(self, run: Run, start: int) -> None:
        super().begin(run, start)
        cfg = self.cfg
        self.train_uncond = self.uncond if cfg.train_cfg and cfg.sample_guidance_scale > 1.0 else None

    # ---- the parts of one epoch ----

    def plan_epoch(self, run: Run, epoch: int) -> EpochPlan:
        """This process' prompts for the epoch, from a stream seeded by (seed, epoch, process): resumable."""
        from refl_ddpo.core.prompts import get_prompt_fn

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

    def train(self, run: Run, epoch: int, plan: EpochPlan, scored: ScoredEpoch) -> None:
        """`train_num_inner_epochs` passes of PPO over the epoch's samples, one bar tick per optimizer step."""

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
                except NonFiniteGradient as e:
                    bar.close()
                    # self.global_step > 0: an earlier epoch or inner epoch, or the resumed run, updated the weights
                    raise e.error(cfg.output_dir, epoch + 1, self.global_step > 0) from None
                for info in steps:
                    run.accelerator.log(
                        {f"{self.name}/{k}": v for k, v in info.items()}
                        | {f"{self.name}/inner_epoch": inner_epoch},
                        step=self.global_step,
                    )
                    self.global_step += 1


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
