"""Policy-gradient maths (DDPO, Black et al. 2023; ddpo-pytorch at commit 1958463): the PPO-clip loss, advantages
from rewards, and the per-prompt reward statistics. Pure functions of tensors."""

from __future__ import annotations

from collections import deque

import torch


def ppo_clip_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss of one step: mean(max(-A * r, -A * clip(r, 1 - c, 1 + c))), r = exp(logp - logp_old).

    All inputs (B,). Returns the loss and detached (approx_kl = 0.5 * mean((logp - logp_old)^2), clipfrac =
    fraction of |r - 1| > c) as in ddpo-pytorch, and ratio = mean(r), the importance ratio (1 on-policy; a mean
    drifting below 1 is what GRPO-Guard reports in Flow-GRPO).
    """
    return clipped_surrogate(log_prob - old_log_prob, advantages, clip_range)


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`ppo_clip_loss` of a log importance ratio (B,) given as such (GRPO-Guard's `ratio_norm`, or logp - logp_old):
    the loss and its detached (approx_kl, clipfrac, ratio and ratio_std: the mean and population std of r)."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    info = {
        "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "clipfrac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
        "ratio": ratio.detach().mean(),
        "ratio_std": ratio.detach().std(unbiased=False),  # its spread over the batch: a drift monitor
    }
    return loss, info


def batch_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + 1e-8) over the batch (population std), as ddpo-pytorch without per-prompt tracking."""
    rewards = rewards.double()
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-8)


class PerPromptStatTracker:
    """Per-prompt reward normalisation over a running buffer (ddpo-pytorch `stat_tracking.py`).

    Each prompt keeps its last `buffer_size` rewards; a prompt with at least `min_count` of them is normalised by
    their mean and (population) std + 1e-6, the others by the mean and std of the whole batch given to `update`.
    The state is plain JSON (floats round-trip exactly), so a resumed run continues bit-exactly.
    """

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.buffers: dict[str, deque[float]] = {}

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """Add the rewards (B,) of `prompts` to the buffers, return advantages (B,) float64."""
        values = rewards.detach().double().cpu()
        if len(prompts) != len(values):
            raise ValueError(f"{len(prompts)} prompts but {len(values)} rewards")
        advantages = torch.empty_like(values)
        batch_mean, batch_std = values.mean(), values.std(unbiased=False) + 1e-6
        for prompt in sorted(set(prompts)):
            idx = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
            buffer = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(values[idx].tolist())
            if len(buffer) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                held = torch.tensor(list(buffer), dtype=torch.float64)
                mean, std = held.mean(), held.std(unbiased=False) + 1e-6
            advantages[idx] = (values[idx] - mean) / std
        return advantages

    def state_dict(self) -> dict:
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "buffers": {p: list(b) for p, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size, self.min_count = int(state["buffer_size"]), int(state["min_count"])
        self.buffers = {p: deque(map(float, b), maxlen=self.buffer_size) for p, b in state["buffers"].items()}


def compute_advantages(
    rewards: torch.Tensor, prompts: list[str], tracker: PerPromptStatTracker | None, adv_clip_max: float
) -> torch.Tensor:
    """Advantages (B,) float32 of gathered rewards: per prompt (tracker) or batch-normalised, then clipped."""
    advantages = tracker.update(prompts, rewards) if tracker is not None else batch_advantages(rewards)
    return advantages.clamp(-adv_clip_max, adv_clip_max).float()


# ---- GRPO (Flow-GRPO, Liu et al. 2025; DanceGRPO, Xue et al. 2025) ----

GROUP_STD_EPS = 1e-4  # Flow-GRPO's: (r - mean) / (std + 1e-4)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    global_std: bool,
    adv_clip_max: float,
    std_floor: float = 0.0,
) -> torch.Tensor:
    """GRPO advantages (N,) float32 of gathered rewards (N,) and their groups (N,) int: (r - mean of r's group) /
    (max(std, std_floor) + 1e-4), the population std of the group or, with `global_std`, of all N rewards; clipped
    to [-adv_clip_max, adv_clip_max]. Groups need not be contiguous nor of equal size. The floor keeps a group whose
    rewards nearly agree (all wrong on the main term, apart only by a small secondary one) from being scaled up to
    +-1; 0 is Flow-GRPO's."""
    if rewards.shape != group_ids.shape:
        raise ValueError(f"{tuple(rewards.shape)} rewards but {tuple(group_ids.shape)} group ids")
    values = rewards.detach().double().cpu()
    _, inverse = torch.unique(group_ids.cpu(), return_inverse=True)  # group index 0..G-1 per sample
    count = torch.bincount(inverse).double()  # (G,)
    mean = torch.bincount(inverse, weights=values) / count  # (G,)
    centred = values - mean[inverse]
    if global_std:
        std = values.std(unbiased=False)
    else:
        std = (torch.bincount(inverse, weights=centred**2) / count).sqrt()[inverse]
    return (centred / (std.clamp_min(std_floor) + GROUP_STD_EPS)).clamp(-adv_clip_max, adv_clip_max).float()


def zero_std_group_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of the groups whose rewards are all equal: with the group's mean subtracted they give no gradient."""
    groups = torch.unique(group_ids)
    flat = sum(bool((rewards[group_ids == g] == rewards[group_ids == g][0]).all()) for g in groups.tolist())
    return flat / len(groups)


# ---- GRPO-Guard (Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
# Regulated Clipping", arXiv 2510.22319; reference code: flow_grpo's scripts/train_sd3_GRPO_Guard.py) ----


def ratio_norm(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    prev_sample_mean: torch.Tensor,
    old_prev_sample_mean: torch.Tensor,
    step_std: torch.Tensor | float,
) -> torch.Tensor:
    """GRPO-Guard's RatioNorm: the normalised log importance ratio (B,) of one stochastic denoising step, to be
    exponentiated and clipped by PPO in place of log_prob - old_log_prob.

    The step is Gaussian, x_next ~ N(mean, s^2 I) with s = `step_std` (B,) or a scalar (the SDE step's
    std_dev_t * sqrt(-dt) on flow models, DDIM's std_dev_t); `log_prob` (B,) is the log-density of the stored
    x_next = old_mean + s * eps under the current weights and `old_log_prob` (B,) under the sampling ones, both
    averaged over the latent's D dimensions (as `flow_sde_step_with_logprob` and `ddim_step_with_logprob` give
    them); `prev_sample_mean` and `old_prev_sample_mean` (B, ...) are the two means. With delta = mean - old_mean,

        log_prob - old_log_prob = mean(eps * delta) / s - mean(delta^2) / (2 s^2),

    whose second term shifts the log-ratio left (its mean is below 0, so the ratio's mean falls below 1 and PPO's
    upper clip rarely binds) and whose spread grows as 1 / s, unequal across steps. RatioNorm adds the bias back and
    multiplies by s:

        s * (log_prob - old_log_prob + mean(delta^2) / (2 s^2)) = mean(eps * delta),

    centred on 0 whatever the step, with a spread that depends on the change of the mean alone. The paper pairs it
    with a per-step gradient weight (the reference divides the step's PPO loss by -dt), which is not part of this
    function; its reference code takes s as the batch's mean, this function per sample (the same when a batch's
    samples are at one step). A step of std 0 (deterministic, no density) gives 0."""
    s = torch.as_tensor(step_std, dtype=torch.float32, device=log_prob.device)
    s = s.reshape(-1) if s.ndim else s  # (B,) or a scalar
    delta = prev_sample_mean.float() - old_prev_sample_mean.float()
    bias = delta.square().mean(dim=tuple(range(1, delta.ndim)))  # (B,): mean(delta^2) over the D dimensions
    # a deterministic step (s = 0: DDIM's step to a_prev = 1) has no density: 0, with a finite (zero) gradient
    deterministic = s == 0
    s_safe = torch.where(deterministic, 1.0, s)
    normed = s_safe * (log_prob.float() - old_log_prob.float()) + bias / (2 * s_safe)
    return torch.where(deterministic, 0.0, normed)
