"""Advantage Weighted Matching (AWM, Xue et al. 2025) with LoRA, as X-GenGroup/Flow-Factory's trainers/awm.py
implements it, on DiffusionNFT's forward-process epoch (refl_ddpo.trainers.nft; both run by
refl_ddpo.trainers.forward_process).

    bash train_scripts/train_awm.sh [--preset toy_world|toy_world_sd3|awm_sd35m] [--flag ...]

What differs from DiffusionNFT, per epoch:

1. sampling with the current weights (on-policy), the same deterministic sampler, groups and advantages (clipped to
   +-1 by default);
2. the loss of a trained timestep: the matching loss m = mean((v - v*)^2) against the family's pretraining target
   v* (flow: noise - x0; SD 1.x: the noise, or v), weighted by the noise level t (--awm_weighting; Flow-Factory's
   default `ghuber`), stands in for the log-likelihood ll = -w(m, t); the PPO-clip objective on the ratio
   exp(ll - ll_old), ll_old computed with the weights as the micro-batch starts (refl_ddpo.algorithms.policy
   .ppo_clip_loss, --train_clip_range); plus --kl_weight mean((v - v_base)^2) to the base model (LoRA off) and
   --old_kl_weight mean((v - v_old)^2) to the old policy, an EMA of the weights updated after each epoch as
   DiffusionNFT's (--old_decay_*). On the first update of a micro-batch the ratio is 1 and the gradient is the
   advantage-weighted matching loss's: A grad w(m, t).

The trained timesteps are one stratified set per micro-batch, never the first (pure-noise) step, as Flow-Factory's
AWM example draws them (--train_timesteps stratified, --train_timestep_range); the old policy's decay counts epochs
as its EMA does (--old_decay_clock). The old policy is Flow-Factory's EMA of the weights, which it evaluates and saves:
validation, the final LoRA and the model card hold it (--release_weights raw: the trained weights).
"""

from __future__ import annotations

from pathlib import Path

from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.session import main_for
from refl_ddpo.trainers import forward_process
from refl_ddpo.trainers.epochs import ImageSamplesHook
from refl_ddpo.trainers.forward_config import AWMConfig


def train(cfg: AWMConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run AWM as configured; returns the output folder (final LoRA + config.json at its top)."""
    return forward_process.train(cfg, image_samples_hook)


def preflight(cfg: AWMConfig) -> None:
    """The checks that need no model (launch.sh runs them once before it starts the processes)."""
    forward_process.preflight(cfg)


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(train, preflight, AWMConfig, argv, __doc__)


if __name__ == "__main__":
    main()
