"""GRPO (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470; DanceGRPO, Xue et al. 2025) with LoRA: DDPO's epoch
(refl_ddpo.trainers.ddpo) with GRPO's own epoch plan and advantages: refl_ddpo.trainers.policy_gradient's loop.

    bash train_scripts/train_grpo.sh [--preset toy_world|toy_world_sd3|flow_grpo_sd35m] [--flag ...]

What differs from DDPO, per epoch:

1. sampling: num_groups = images per epoch / --group_size prompts are drawn from one stream shared by all processes,
   each repeated --group_size times; process p samples the p-th slice (a group may span processes). With
   --same_noise_per_group every sample of a group starts from the group's x_T (DanceGRPO). With --sde_window W only
   W consecutive steps (starting at --sde_window_start, or drawn per epoch) are stochastic; the others are
   deterministic (DDIM eta 0 / the flow ODE step) and never trained on (Flow-GRPO-Fast, MixGRPO);
2. advantages: rewards and group ids are gathered over processes; A = (r - mean of the group) / (std + 1e-4), the
   group's std or with --global_std the whole epoch's, clipped to +-train_adv_clip_max (refl_ddpo.algorithms.policy
   .group_advantages); the fraction of groups whose rewards are all equal is logged as grpo/zero_std_groups;
3. training: DDPO's PPO-clip on per-step ratios, plus --beta (= --kl_weight) times the KL of each trained step to the
   base model (LoRA switched off), in mean space: ||mean - mean_ref||^2 / (2 std_t^2) (family.step_kl). Logged per
   optimizer step: grpo/ratio (mean importance ratio, 1 at the first update), grpo/ratio_by_step/NN (per sampler
   step), grpo/clipfrac, grpo/approx_kl, grpo/kl, grpo/loss.

Before training: the derived sizes (images and groups per epoch, optimizer steps); an epoch that is not a whole number
of groups is refused in one line with fixes that fit. Resume (--resume_from_checkpoint) is bit-exact: the epoch's
prompts, group noise and window start come from generators seeded by (seed, epoch).
"""

from __future__ import annotations

from pathlib import Path

from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.session import main_for
from refl_ddpo.trainers import policy_gradient
from refl_ddpo.trainers.epochs import ImageSamplesHook
from refl_ddpo.trainers.grpo_config import GRPOConfig

__all__ = ["GRPOConfig", "main", "preflight", "train"]


def train(cfg: GRPOConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run GRPO as configured; returns the output folder (final LoRA + config.json at its top)."""
    return policy_gradient.train(cfg, image_samples_hook)


def preflight(cfg: GRPOConfig) -> Path | None:
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    return policy_gradient.preflight(cfg)


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(train, preflight, GRPOConfig, argv, __doc__)


if __name__ == "__main__":
    main()
