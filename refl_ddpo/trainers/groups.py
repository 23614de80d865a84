"""Prompts sampled in groups, for every trainer whose advantage is a reward against its group's (GRPO, DiffusionNFT,
AWM): the group fields of the config, the check that an epoch is a whole number of groups, and the epoch's plan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import ModelFamily
from refl_ddpo.run.parts import field_
from refl_ddpo.run.training import seeded_generator, stream_seed
from refl_ddpo.trainers.rollouts import epoch_groups


@dataclass(frozen=True)
class GroupConfig:
    """Prompts sampled in groups (GRPO, DiffusionNFT, AWM), a part of their configs (before `EpochConfig`, whose
    checks its own follow): each prompt of an epoch is sampled --group_size times and a sample's advantage is its
    reward against its group's."""

    group_size: int = field_(
        8,
        "Samples per prompt in an epoch (one group); a group may be spread over processes. Images per epoch "
        "(--sample_batch_size x --sample_num_batches_per_epoch x processes) must be a multiple of it.",
        group="groups",
    )
    global_std: bool = field_(
        False,
        "Divide by the std of all the epoch's rewards (gathered over processes; Flow-GRPO's default) instead "
        "of the group's.",
    )
    std_floor: float = field_(
        0.0,
        "Divide by max(std, this): a group whose rewards nearly agree (all wrong on the main reward, apart only "
        "by a small secondary one) is not scaled up to +-1. 0 is Flow-GRPO's; same units as the reward.",
    )
    reward_aggregation: Literal["sum", "gdpo"] = field_(
        "sum",
        "How the rewards of a weighted --reward 'a:w,b:v' make the advantages: sum (the weighted sum, normalised "
        "within its group) or gdpo (each reward normalised within its group apart, weighted, summed, the sum "
        "normalised over the epoch: Flow-Factory's GDPO, so that a reward of large spread does not drown the "
        "others). Each reward's curve is logged as reward/<name>/... either way.",
    )
    same_noise_per_group: bool = field_(
        False,
        "One shared initial noise x_T per group (DanceGRPO): the group's rewards then differ only by the "
        "sampler's step noise, so the advantages measure what the policy's steps did.",
    )

    def check(self) -> None:
        super().check()
        if self.group_size < 2:
            raise UserError(
                f"--group_size must be >= 2 (got {self.group_size}): a group of one has advantage 0 and "
                "gives no gradient; Flow-GRPO uses 24 on 8 GPUs, 8 is a start on one."
            )
        if not self.std_floor >= 0:
            raise UserError(f"--std_floor must be >= 0 (got {self.std_floor}); 0 divides by the std alone.")
        if self.reward_aggregation == "gdpo" and (self.global_std or self.std_floor):
            flag = "--global_std" if self.global_std else f"--std_floor {self.std_floor}"
            raise UserError(
                f"--reward_aggregation gdpo divides each reward by its group's std and the sum by the epoch's: "
                f"{flag} has no place there; drop it or use --reward_aggregation sum."
            )
        # WORLD_SIZE: set by launch.sh's check and by accelerate in every process (train() checks again)
        check_group_arithmetic(self, int(os.environ.get("WORLD_SIZE", "1")))


def check_group_arithmetic(cfg: GroupConfig, num_processes: int) -> None:
    """Refuse an epoch that is not a whole number of groups, in one line that names the fields and two fixes: the
    nearest --group_size that fits, and the least --sample_num_batches_per_epoch above the current one that fits
    (keeping the epoch a whole number of optimizer steps)."""
    per_process = cfg.sample_batch_size * cfg.sample_num_batches_per_epoch
    images = per_process * num_processes
    if images % cfg.group_size == 0:
        return
    divisors = [d for d in range(2, images + 1) if images % d == 0]
    group = max((d for d in divisors if d <= cfg.group_size), default=min(divisors, default=0))
    per_step = cfg.train_batch_size * cfg.train_gradient_accumulation_steps
    batches = next(
        n
        for n in range(
            cfg.sample_num_batches_per_epoch, cfg.sample_num_batches_per_epoch * cfg.group_size + 1
        )
        if (cfg.sample_batch_size * n * num_processes) % cfg.group_size == 0
        and (cfg.sample_batch_size * n) % per_step == 0
    )
    hint = f" x {num_processes} processes" if num_processes > 1 else ""
    fixes = f"--group_size {group} or " if group else ""
    raise UserError(
        f"images per epoch (--sample_batch_size {cfg.sample_batch_size} x --sample_num_batches_per_epoch "
        f"{cfg.sample_num_batches_per_epoch}{hint} = {images}) must be a multiple of --group_size {cfg.group_size}: "
        f"use {fixes}--sample_num_batches_per_epoch {batches}."
    )


def check_pairwise_groups(cfg: GroupConfig, num_processes: int) -> None:
    """--pairwise_reward compares the images of a group where they were drawn: each group on one process, i.e. the
    images per process a multiple of --group_size (one line otherwise)."""
    per_process = cfg.sample_batch_size * cfg.sample_num_batches_per_epoch
    if num_processes > 1 and per_process % cfg.group_size:
        raise UserError(
            f"--pairwise_reward judges each group's images on the process that drew them, but with "
            f"{num_processes} processes a group of --group_size {cfg.group_size} spans two of them (--sample_batch_size "
            f"{cfg.sample_batch_size} x --sample_num_batches_per_epoch {cfg.sample_num_batches_per_epoch} = "
            f"{per_process} images per process): make that a multiple of --group_size."
        )


def group_sizes(cfg: GroupConfig, num_processes: int) -> dict[str, int]:
    """GRPO's derived sizes, printed before training beside DDPO's."""
    images = cfg.sample_batch_size * cfg.sample_num_batches_per_epoch * num_processes
    return {"groups (prompts) per epoch": images // cfg.group_size, "samples per group": cfg.group_size}


def grouped_prompts(
    cfg: GroupConfig, family: ModelFamily, epoch: int, rank: int, num_processes: int, dtype: torch.dtype
):
    """The groups of an epoch, the same plan on every process: this process' prompt_fn (its slice of the groups),
    the group id of each of its samples (N,), and their initial noise (one x_T per group with
    --same_noise_per_group, else None)."""
    from refl_ddpo.core.prompts import epoch_prompt_fn

    per_process = cfg.sample_batch_size * cfg.sample_num_batches_per_epoch
    num_groups = per_process * num_processes // cfg.group_size
    prompt_fn = epoch_prompt_fn(  # one stream for all processes: every one of them draws the same groups
        cfg.prompt_fn, cfg.prompts_file, seed=stream_seed(cfg.seed, epoch, 0, 3), edit_data=cfg.edit_data
    )
    samples, group_ids = epoch_groups(prompt_fn, num_groups, cfg.group_size)
    mine = slice(rank * per_process, (rank + 1) * per_process)
    local = iter(samples[mine])
    noise = None
    if cfg.same_noise_per_group:
        group_noise = [
            family.initial_noise(1, cfg.resolution, seeded_generator(cfg.seed, epoch, 4, g), dtype)
            for g in range(num_groups)
        ]
        noise = torch.cat([group_noise[g] for g in group_ids[mine].tolist()])
    return (lambda: next(local)), group_ids[mine], noise


def grouped_advantages(
    cfg: GroupConfig, rewards: torch.Tensor, groups: torch.Tensor, parts: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The advantages (M,) of the finite gathered rewards (M,) and their groups: --reward_aggregation sum normalises
    the weighted sum within its group (refl_ddpo.algorithms.policy.group_advantages); gdpo each part of --reward
    (`parts`, by name; the total for a reward of one part) apart (refl_ddpo.algorithms.multi_reward)."""
    from refl_ddpo.algorithms.multi_reward import gdpo_advantages
    from refl_ddpo.algorithms.policy import group_advantages
    from refl_ddpo.rewards import parse_reward_spec

    if cfg.reward_aggregation == "sum":
        return group_advantages(rewards, groups, cfg.global_std, cfg.train_adv_clip_max, cfg.std_floor)
    named = parse_reward_spec(cfg.reward)
    matrix = torch.stack([parts.get(name, rewards) for name, _ in named])  # (K, M)
    weights = torch.tensor([w for _, w in named], dtype=torch.float64)
    return gdpo_advantages(matrix, weights, groups, cfg.train_adv_clip_max)
