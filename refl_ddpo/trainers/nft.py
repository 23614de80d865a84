"""DiffusionNFT: Online Diffusion Reinforcement with Forward Process (Zheng et al. 2025, arXiv 2509.16117) with
LoRA, on the shared core; the forward-process epoch that AWM (refl_ddpo.trainers.awm) shares, run by
refl_ddpo.trainers.forward_process.

    bash train_scripts/train_nft.sh [--preset toy_world|toy_world_sd3|nft_sd35m] [--flag ...]

One epoch (the algorithm of NVlabs/DiffusionNFT scripts/train_nft_sd3.py, written against our core):

1. sampling: prompts in groups (--group_size, as GRPO), each sample drawn by the family's deterministic sampler (DDIM
   eta 0 on SD 1.x, the flow Euler step on SD3), CFG-free by default, with the old policy's weights; only the clean
   latents x0 and the prompt conditioning are kept;
2. rewards: any reward of the registry (no gradient needed); A = (r - the group's mean) / (std + 1e-4), the std of
   the group or with --global_std of the epoch (the reference's), clipped to +-c = --train_adv_clip_max; the
   optimality probability r = 0.5 + 0.5 A / c (refl_ddpo.algorithms.forward.optimality_probability);
3. training, --train_num_inner_epochs times: shuffle the samples; each sample is trained at a random
   --train_timestep_fraction of the sampler's timesteps t (less the last --train_skip_last_steps; or as AWM's,
   --train_timesteps), with fresh noise: x_t = the family's forward process of x0 at t; the network's output v, the old policy's v_old (no grad) and, with --kl_weight, the base model's (LoRA
   off); loss = nft_loss (the implicit positive and negative policies, beta = --nft_beta, the adaptive x0-space
   weighting) + kl_weight mean((v - v_base)^2); gradients accumulate over the trained timesteps and
   --train_gradient_accumulation_steps micro-batches per optimizer step; after each, the EMA of the trained
   weights moves toward them with decay min((1 + s) / (10 + s), --ema_decay_max) (the reference's, step s);
4. after the epoch the old policy moves toward the trained weights: old <- d old + (1 - d) theta, d from the
   optimizer step count (--old_decay_flat, --old_decay_rate, --old_decay_max, --old_decay_clock).

Validation, the final LoRA and the card hold the EMA, as the reference's (--release_weights raw: the trained ones).
No log-probabilities, no SDE, no CFG in training: the loss is the family's own denoising loss (in x0 space) on the
forward process, so any sampler may draw the samples. On SD 1.x the same objective holds in epsilon (or v)
parameterisation: x0 is affine in the network's output at fixed x_t, so the implicit policies' x0-predictions are
the same mixtures of the two networks' x0-predictions (refl_ddpo.algorithms.forward's module doc).
The old policy's weights and the EMA (copies of the trainable tensors) are saved in checkpoint-N's train_state
beside the trained weights: resume is bit-exact on CPU.
"""

from __future__ import annotations

from pathlib import Path

from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.session import main_for
from refl_ddpo.trainers import forward_process
from refl_ddpo.trainers.epochs import ImageSamplesHook
from refl_ddpo.trainers.forward_config import NFTConfig


def train(cfg: NFTConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run DiffusionNFT as configured; returns the output folder (final LoRA + config.json at its top)."""
    return forward_process.train(cfg, image_samples_hook)


def preflight(cfg: NFTConfig) -> None:
    """The checks that need no model (launch.sh runs them once before it starts the processes)."""
    forward_process.preflight(cfg)


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(train, preflight, NFTConfig, argv, __doc__)


if __name__ == "__main__":
    main()
