"""JPEG (in)compressibility rewards of DDPO (Black et al. 2023; ddpo-pytorch `rewards.py`): the size of the image
saved as JPEG at quality 95, in kilobytes; compressibility is its negative. Not differentiable."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """(B,) JPEG sizes in kB of images (B, 3, H, W) in [0, 1]."""
    arr = (
        (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    )
    sizes = []
    for img in arr:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(img)).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def jpeg_compressibility(device: torch.device, dtype: torch.dtype, model_dir: str):
    def reward_fn(images, prompts, metadata):
        return -jpeg_size_kb(images).to(device), {}

    return reward_fn


def jpeg_incompressibility(device: torch.device, dtype: torch.dtype, model_dir: str):
    def reward_fn(images, prompts, metadata):
        return jpeg_size_kb(images).to(device), {}

    return reward_fn
