"""Advantages from several rewards and from pairwise comparisons, pure functions of tensors.

GDPO (as Flow-Factory defines it, X-GenGroup/Flow-Factory `advantage/advantage_processor.py`, `compute_gdpo`): each
reward is normalised within its group apart, weighted, summed, and the sum normalised over the whole epoch, so that a
reward of large spread does not drown the others as it does in the weighted sum.

Win rates (Pref-GRPO, Wang et al. 2025, arXiv 2508.20751): a sample's reward is the share of the comparisons with the
other members of its group that it wins, by a pairwise judge's verdict (0 / 1) or probability.
"""

from __future__ import annotations

import torch

GDPO_STD_MIN = 1e-6  # Flow-Factory's: (r - mean) / max(std, 1e-6), per group and over the epoch


def gdpo_advantages(
    rewards: torch.Tensor, weights: torch.Tensor, group_ids: torch.Tensor, adv_clip_max: float
) -> torch.Tensor:
    """GDPO advantages (N,) float32 of K rewards (K, N) with weights (K,) and the samples' groups (N,) int:

        n_k,i = (r_k,i - mean_{j in g(i)} r_k,j) / max(std_{j in g(i)} r_k,j, 1e-6)     (population std)
        c_i   = sum_k w_k n_k,i,        A_i = clip((c_i - mean_j c_j) / max(std_j c_j, 1e-6), +-adv_clip_max)

    Groups need not be contiguous nor of equal size."""
    if rewards.ndim != 2 or rewards.shape[1] != group_ids.shape[0] or weights.shape != rewards.shape[:1]:
        raise ValueError(
            f"{tuple(rewards.shape)} rewards, {tuple(weights.shape)} weights and {tuple(group_ids.shape)} group ids"
        )
    values = rewards.detach().double().cpu()  # (K, N)
    _, inverse = torch.unique(group_ids.cpu(), return_inverse=True)  # group index 0..G-1 per sample
    count = torch.bincount(inverse).double()  # (G,)
    combined = torch.zeros(values.shape[1], dtype=torch.float64)
    for r, w in zip(values, weights.double().cpu().tolist(), strict=True):
        mean = torch.bincount(inverse, weights=r) / count  # (G,)
        centred = r - mean[inverse]
        std = (torch.bincount(inverse, weights=centred**2) / count).sqrt()[inverse]
        combined += w * centred / std.clamp_min(GDPO_STD_MIN)
    std_all = combined.std(unbiased=False).clamp_min(GDPO_STD_MIN)
    return ((combined - combined.mean()) / std_all).clamp(-adv_clip_max, adv_clip_max).float()


def opponents(
    group_ids: torch.Tensor, max_opponents: int = 0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Which pairs are compared: (N, N) bool, [i, j] True where j is one of i's opponents. Every other member of i's
    group (`max_opponents` 0 or at least the group's size - 1), else `max_opponents` of them drawn uniformly without
    replacement for each i from `generator` (CPU), in the order of the samples."""
    ids = group_ids.cpu()
    same = (ids[:, None] == ids[None, :]) & ~torch.eye(len(ids), dtype=torch.bool)
    if max_opponents <= 0:
        return same
    chosen = torch.zeros_like(same)
    for i in range(len(ids)):
        mates = same[i].nonzero()[:, 0]
        if len(mates) > max_opponents:
            mates = mates[torch.randperm(len(mates), generator=generator)[:max_opponents]]
        chosen[i, mates] = True
    return chosen


def judged_pairs(chosen: torch.Tensor) -> torch.Tensor:
    """The unordered pairs to judge (P, 2), i < j, each once, of an opponents matrix (N, N): (i, j) where i chose j
    or j chose i."""
    return torch.triu(chosen | chosen.T, diagonal=1).nonzero()


def win_rates(chosen: torch.Tensor, pairs: torch.Tensor, p_first_wins: torch.Tensor) -> torch.Tensor:
    """Each sample's win rate (N,) float64: the mean over its opponents j (`chosen` (N, N)) of P(i beats j), from the
    verdicts `p_first_wins` (P,) in [0, 1] on `pairs` (P, 2) (P(a beats b) for (a, b); b's is 1 minus it). A sample
    with no opponent gets 0.5."""
    n = chosen.shape[0]
    beats = torch.zeros(n, n, dtype=torch.float64)
    p = p_first_wins.detach().double().cpu()
    beats[pairs[:, 0], pairs[:, 1]] = p
    beats[pairs[:, 1], pairs[:, 0]] = 1 - p
    counts = chosen.sum(1).double()
    wins = (beats * chosen).sum(1)
    return torch.where(counts > 0, wins / counts.clamp_min(1), 0.5)
