"""Rewards of videos (B, T, 3, H, W) in [0, 1]: an image reward applied per frame and reduced over the frames
(`frames_reward`, the reduction of --video_reduction: mean, min, or either over K frames evenly spaced, to bound the
cost; first:K, the mean over the first K frames, which the reward-backprop trainers decode alone), and a temporal-consistency term (`temporal_consistency`: minus the mean squared distance between
consecutive frames, differentiable).

A reward function that takes whole videos itself says so with `reward_fn.video = True`; every other one is an image
reward and `build_reward` wraps it in `frames_reward`, which passes images (B, 3, H, W) through unchanged.
"""

from __future__ import annotations

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.video import frame_indices, parse_reduction


def frames_reward(fn, reduction: str = "mean"):
    """The image reward `fn` as a reward of videos: each chosen frame scored with its video's prompt and metadata,
    the scores (B, K) reduced to (B,); tensors of `info` with one value per frame are reduced the same way. Images
    (4-D) go to `fn` unchanged."""
    how, k = parse_reduction(reduction)

    def reward_fn(images, prompts, metadata):
        if images.ndim != 5:
            return fn(images, prompts, metadata)
        b, t = images.shape[:2]
        idx = frame_indices(t, k, how)
        n = len(idx)
        frames = images[:, idx].flatten(0, 1)
        rewards, info = fn(frames, [p for p in prompts for _ in idx], [m for m in metadata for _ in idx])
        reduced = {
            key: _reduce(v.reshape(b, n), how) if torch.is_tensor(v) and v.shape[:1] == (b * n,) else v
            for key, v in info.items()
        }
        return _reduce(rewards.reshape(b, n), how), reduced

    return reward_fn


def _reduce(values: torch.Tensor, how: str) -> torch.Tensor:
    return values.min(1).values if how == "min" else values.mean(1)


def temporal_consistency(device: torch.device, dtype: torch.dtype, model_dir: str):
    """-(1 / (T - 1)) sum_t mean((f_{t+1} - f_t)^2) per video: 0 for a still video, lower the more consecutive
    frames differ (a flicker penalty to weigh against a per-frame reward). Differentiable; videos only."""

    def reward_fn(videos, prompts, metadata):
        if videos.ndim != 5:
            raise UserError(
                "--reward temporal_consistency scores videos (a video model, e.g. Wan), not images."
            )
        if videos.shape[1] < 2:
            return videos.new_zeros(videos.shape[0], dtype=torch.float32), {}
        diff = (videos[:, 1:].float() - videos[:, :-1].float()) ** 2
        return -diff.mean(dim=(2, 3, 4)).mean(1), {}

    reward_fn.video = True
    return reward_fn
