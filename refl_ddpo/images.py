"""Small helpers on images and files shared by training, inference and comparison: captioned grids, uint8
conversion, atomic JSON writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def caption_grid(
    images: torch.Tensor | list[torch.Tensor], captions: list[str], cell: int = 256, cols: int = 4
) -> torch.Tensor:
    """(3, H, W) uint8 grid: each image (3, h, w) in [0, 1] resized to `cell` px with its caption drawn under it."""
    from PIL import Image, ImageDraw
    from torchvision.transforms.functional import pil_to_tensor, to_pil_image

    n = len(images)
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    text_h = 28
    canvas = Image.new("RGB", (cols * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (img, cap) in enumerate(zip(images, captions)):
        x, y = (i % cols) * cell, (i // cols) * (cell + text_h)
        canvas.paste(to_pil_image(img.detach().float().clamp(0, 1).cpu()).resize((cell, cell)), (x, y))
        draw.text((x + 4, y + cell + 2), cap[:48], fill="black")
        if len(cap) > 48:
            draw.text((x + 4, y + cell + 14), cap[48:96], fill="black")
    return pil_to_tensor(canvas)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) uint8 on the CPU, rounded as diffusers' numpy_to_pil."""
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file beside `path` and rename it over `path` (no half-written JSON)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")  # NaN is not JSON: never write it
    os.replace(tmp, path)
