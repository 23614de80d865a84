"""GRPO (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470; DanceGRPO, Xue et al. 2025) with LoRA: DDPO's epoch
(refl_ddpo.trainers.ddpo) with GRPO's own epoch plan and advantages, on the shared run skeleton.

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

import torch

from refl_ddpo.algorithms.policy import group_advantages, zero_std_group_fraction
from refl_ddpo.core.errors import cli_main
from refl_ddpo.core.families import ModelFamily
from refl_ddpo.run.training import seeded_generator
from refl_ddpo.trainers.ddpo import DDPO
from refl_ddpo.trainers.epochs import EpochPlan
from refl_ddpo.trainers.groups import check_group_arithmetic, group_sizes, grouped_prompts
from refl_ddpo.trainers.grpo_config import GRPOConfig
from refl_ddpo.trainers.rollouts import draw_window_start
from refl_ddpo.trainers.skeleton import Run, main_for, run_training

__all__ = ["GRPO", "GRPOConfig", "grouped_epoch", "main", "preflight", "train"]


def grouped_epoch(
    cfg: GRPOConfig, family: ModelFamily, epoch: int, rank: int, num_processes: int, dtype: torch.dtype
):
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
    return prompt_fn, group_ids, noise, window


class GRPO(DDPO):
    """DDPO's epoch with GRPO's plan (groups, shared noise, the SDE window) and group advantages."""

    name = "grpo"

    def check_processes(self, num_processes: int) -> None:
        # the config's check read WORLD_SIZE; a launcher that does not set it is caught here
        check_group_arithmetic(self.cfg, num_processes)

    def describe(self, run: Run) -> dict:
        return {**super().describe(run), **group_sizes(self.cfg, run.accelerator.num_processes)}

    def plan_epoch(self, run: Run, epoch: int) -> EpochPlan:
        prompt_fn, groups, noise, window = grouped_epoch(
            self.cfg, run.family, epoch, run.rank, run.accelerator.num_processes, run.dtype
        )
        return EpochPlan(prompt_fn, groups, noise, window)

    def advantages(
        self, run: Run, plan: EpochPlan, rewards: torch.Tensor, prompts: list[str], finite: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(r - the group's mean) / (std + 1e-4) over the gathered finite rewards; the share of groups with one
        reward value and the SDE window's start, to log."""
        accelerator, cfg = run.accelerator, self.cfg
        groups = accelerator.gather(plan.groups.to(accelerator.device)).cpu()  # (P * N,)
        advantages = group_advantages(
            rewards[finite], groups[finite], cfg.global_std, cfg.train_adv_clip_max, cfg.std_floor
        )
        stats = {f"{self.name}/zero_std_groups": zero_std_group_fraction(rewards[finite], groups[finite])}
        if plan.window is not None:
            stats[f"{self.name}/sde_window_start"] = plan.window[0]
        return advantages, stats


def train(cfg: GRPOConfig, image_samples_hook=None):
    """Run GRPO as configured; returns the output folder (final LoRA + config.json at its top)."""
    return run_training(GRPO(cfg, image_samples_hook))


def preflight(cfg: GRPOConfig):
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    return GRPO(cfg).preflight().resume


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(GRPO, GRPOConfig, argv, __doc__)


if __name__ == "__main__":
    main()
