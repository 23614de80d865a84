"""Advantage Weighted Matching (AWM, Xue et al. 2025) with LoRA, as X-GenGroup/Flow-Factory's trainers/awm.py
implements it, on DiffusionNFT's forward-process epoch (refl_ddpo.trainers.nft).

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

from typing import Any

import torch

from refl_ddpo.algorithms.forward import matching_log_likelihood, output_mse
from refl_ddpo.algorithms.policy import ppo_clip_loss
from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.zero import unwrap
from refl_ddpo.trainers.forward_config import AWMConfig
from refl_ddpo.trainers.nft import Draw, ForwardProcess
from refl_ddpo.trainers.skeleton import Run, main_for, run_training


class AWM(ForwardProcess):
    """AWM's loss of one trained timestep (module doc, step 2)."""

    name = "awm"
    sample_with_old = False

    def released(self) -> list[torch.Tensor] | None:
        return self.old if self.cfg.release_weights == "ema" else None

    def log_likelihood(self, run: Run, v: torch.Tensor, draw: Draw) -> torch.Tensor:
        family, cfg = run.family, self.cfg
        target = family.training_target(self.scheduler, draw.x0, draw.noise, draw.timesteps)
        t = family.noise_level(self.scheduler, draw.timesteps)
        return matching_log_likelihood(v, target, t, cfg.awm_weighting, cfg.ghuber_power)

    def batch_start(self, run: Run, batch: dict, cond, draws: list[Draw]) -> Any:
        """ll_old of every draw, with the weights as the micro-batch starts (no grad)."""
        network = unwrap(run.accelerator, run.network)
        with torch.no_grad(), run.accelerator.autocast():
            return [self.log_likelihood(run, self.predict(run, d, cond, network), d) for d in draws]

    def draw_loss(self, run: Run, batch: dict, cond, draw: Draw, prepared: Any) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        v = self.predict(run, draw, cond, run.network)
        ll = self.log_likelihood(run, v, draw)
        loss, info = ppo_clip_loss(ll, prepared[draw.index], batch["advantages"], cfg.train_clip_range)
        info["policy_loss"] = loss.detach()
        v_base = self.base_output(run, draw, cond)
        if v_base is not None:
            kl = output_mse(v, v_base).mean()
            loss = loss + cfg.kl_weight * kl
            info["kl"] = kl.detach()
        if cfg.old_kl_weight > 0:
            old_kl = output_mse(v, self.old_output(run, draw, cond)).mean()
            loss = loss + cfg.old_kl_weight * old_kl
            info["old_kl"] = old_kl.detach()
        return loss, info


def train(cfg: AWMConfig, image_samples_hook=None):
    """Run AWM as configured; returns the output folder (final LoRA + config.json at its top)."""
    return run_training(AWM(cfg, image_samples_hook))


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(AWM, AWMConfig, argv, __doc__)


if __name__ == "__main__":
    main()
