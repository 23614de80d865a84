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
    fraction of |r - 1| > c) as in ddpo-pytorch.
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    info = {
        "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "clipfrac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
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
