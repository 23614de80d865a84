"""The video flags, checked before any model loads and without importing torch, a family or a reward: --num_frames
against the VAE's temporal stride, the video-only flags refused for image models, and --video_reduction (how an image
reward scores a video from its frames; `refl_ddpo.rewards.video.frames_reward` applies it). `first:K` scores the first
K frames only, which the reward-backprop trainers decode alone (`leading_frames`): Wan's VAE is causal in time, its
first 1 + 4 (k - 1) frames come from the first k latent frames alone, so the decode of the rest (its activations,
kept for the backward) is skipped."""

from __future__ import annotations

import json
from pathlib import Path

from refl_ddpo.core.errors import UserError

REDUCTIONS = ("mean", "min", "first")
VIDEO_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")  # model_index.json classes that draw videos


def parse_reduction(spec: str) -> tuple[str, int | None]:
    """'mean' -> ('mean', None); 'min:4' -> ('min', 4); 'first:9' -> ('first', 9): the reduction and how many frames
    (None: all)."""
    how, _, k = spec.partition(":")
    if how not in REDUCTIONS or (k and not (k.isdigit() and int(k) >= 1)) or (how == "first" and not k):
        raise UserError(
            f"--video_reduction {spec}: write mean, min, mean:K / min:K (K >= 1 frames evenly spaced) or first:K "
            "(the mean over the first K frames)."
        )
    return how, int(k) if k else None


def leading_frames(spec: str) -> int | None:
    """K for 'first:K' (the reward reads a video's first K frames, nothing after them); None otherwise."""
    how, k = parse_reduction(spec)
    return k if how == "first" else None


def frame_indices(num_frames: int, k: int | None, how: str = "mean") -> list[int]:
    """The frames scored: all, the first K (`how` "first"), or K evenly spaced from the first to the last (the first
    alone for K = 1)."""
    if k is None or k >= num_frames:
        return list(range(num_frames))
    if how == "first":
        return list(range(k))
    if k == 1:
        return [0]
    return [round(i * (num_frames - 1) / (k - 1)) for i in range(k)]


def vae_config(name: str) -> dict:
    """The VAE config (vae/config.json) of a local folder or hub id, read without loading weights."""
    from refl_ddpo.core.models import looks_local

    if looks_local(name):
        return json.loads((Path(name).expanduser() / "vae" / "config.json").read_text())
    from diffusers import AutoencoderKLWan

    return dict(AutoencoderKLWan.load_config(name, subfolder="vae"))


def check_num_frames(name: str, num_frames: int) -> None:
    """A one-line UserError unless the VAE's temporal stride s takes `num_frames` (num_frames = 1 + s k)."""
    stride = int(vae_config(name).get("scale_factor_temporal") or 4)
    if num_frames < 1 or (num_frames - 1) % stride:
        near = max(1, (num_frames - 1) // stride * stride + 1)
        raise UserError(
            f"--num_frames {num_frames}: this VAE packs {stride} frames into one latent frame after the first, so "
            f"num_frames must be 1 + {stride} k (e.g. {near} or {near + stride})."
        )


def has_two_experts(model: str) -> bool:
    """Whether `model`'s model_index.json names a second expert `transformer_2` (Wan 2.2 A14B)."""
    from refl_ddpo.core.models import model_index

    return bool((model_index(model).get("transformer_2") or [None])[0])


def check_wan_expert(model: str, expert: str | None) -> None:
    """--wan_expert transformer_2 or both needs a Wan 2.2 (A14B) folder, whose model_index.json names a second
    expert `transformer_2`: a one-line UserError otherwise."""
    if expert in ("transformer_2", "both") and not has_two_experts(model):
        raise UserError(
            f"--wan_expert {expert}: {model} has one expert (transformer; Wan 2.2 A14B has a second, transformer_2): "
            "leave --wan_expert at transformer."
        )


def check_video_flags(model: str, num_frames: int | None, **image_flags) -> None:
    """--num_frames fits the model (a frame count its VAE takes), and it and the other video-only flags
    `image_flags` (name -> value, None or the default when unset) are unset for an image model; one-line
    UserErrors, before any model loads."""
    from refl_ddpo.core.models import pipeline_class_name

    if num_frames is None and all(v is None for v in image_flags.values()):
        return  # nothing set: nothing to check (and no config read)
    if pipeline_class_name(model) in VIDEO_PIPELINES:
        if num_frames is not None:
            check_num_frames(model, num_frames)
        check_wan_expert(model, image_flags.get("wan_expert"))
        return
    for flag, value in {"num_frames": num_frames, **image_flags}.items():
        if value is not None:
            raise UserError(f"--{flag} is for video models (Wan); {model} makes images.")
