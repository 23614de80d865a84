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
GRPO (refl_ddpo.trainers.grpo) is the same loop with its own epoch plan (the prompts in groups, one shared x_T per
group with --same_noise_per_group, with --sde_window stochastic steps only in a window drawn per epoch, all that
step 4 trains on) and group advantages in step 3: both are refl_ddpo.trainers.policy_gradient's `train`, and the run
around the epochs (set-up, resume, validation, checkpoints, the final weights) is refl_ddpo.run.session's.
All randomness of an epoch (prompts, noise, shuffles) comes from generators seeded by (seed, epoch, process), so a
run resumed from `checkpoint-N` repeats epochs N+1... exactly as the uninterrupted run would.
"""

from __future__ import annotations

from pathlib import Path

from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.session import main_for
from refl_ddpo.trainers import policy_gradient
from refl_ddpo.trainers.ddpo_config import DDPOConfig
from refl_ddpo.trainers.epochs import ImageSamplesHook


def train(cfg: DDPOConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run DDPO as configured; returns the output folder (final LoRA + config.json at its top)."""
    return policy_gradient.train(cfg, image_samples_hook)


def preflight(cfg: DDPOConfig) -> Path | None:
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    return policy_gradient.preflight(cfg)


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(train, preflight, DDPOConfig, argv, __doc__)


if __name__ == "__main__":
    main()
