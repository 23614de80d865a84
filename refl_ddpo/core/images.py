"""Small helpers on images and files shared by training, inference and comparison: captioned grids, uint8
conversion, atomic JSON writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def font(size: int = 10):
    """PIL's bundled font at `size` px (scalable where Pillow has FreeType, else its fixed bitmap font)."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ValueError, OSError):  # Pillow without FreeType: the one bitmap size
        return ImageFont.load_default()


def wrap_words(text: str, width: float, measure, max_lines: int | None = None) -> list[str]:
    """`text` in lines at most `width` wide (by `measure(str) -> float`, e.g. a font's getlength), broken at spaces;
    a single word wider than a line is broken inside. With `max_lines`, the last kept line ends in "..." when text
    was left out."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if measure(candidate) <= width:
            line = candidate
            continue
        if line:
            lines.append(line)
        while measure(word) > width and len(word) > 1:  # only a word longer than a whole line is cut
            cut = max((k for k in range(1, len(word)) if measure(word[:k]) <= width), default=1)
            lines.append(word[:cut])
            word = word[cut:]
        line = word
    if line:
        lines.append(line)
    if max_lines is not None and len(lines) > max_lines:
        last = lines[max_lines - 1]
        while last and measure(last + "...") > width:
            last = last[:-1].rstrip()
        lines = [*lines[: max_lines - 1], last + "..."]
    return lines


MAX_GRID_COLUMNS = 8  # a grid wider than this wraps into rows


def grid_columns(cols: int, max_cols: int = MAX_GRID_COLUMNS) -> int:
    """`cols` wrapped to at most `max_cols` columns: the largest divisor of `cols` from `max_cols` down to half of
    it (16 images of a prompt -> two rows of 8: a prompt's images stay on whole rows), else `max_cols`."""
    if cols <= max_cols:
        return max(1, cols)
    return next((d for d in range(max_cols, max_cols // 2 - 1, -1) if cols % d == 0), max_cols)


def caption_grid(
    images: torch.Tensor | list[torch.Tensor],
    captions: list[str],
    cell: int = 256,
    cols: int = 4,
    caption_lines: int = 2,
) -> torch.Tensor:
    """(3, H, W) uint8 grid: each image (3, h, w) in [0, 1] resized to `cell` px with its caption under it, wrapped
    at words on up to `caption_lines` lines; `cols` per row, wrapped by `grid_columns` (at most 8)."""
    from PIL import Image, ImageDraw
    from torchvision.transforms.functional import pil_to_tensor, to_pil_image

    n = len(images)
    cols, rows, text_h = _grid_layout(n, cols, caption_lines)
    face = font(10)
    canvas = Image.new("RGB", (cols * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (img, cap) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % cols) * cell, (i // cols) * (cell + text_h)
        canvas.paste(to_pil_image(img.detach().float().clamp(0, 1).cpu()).resize((cell, cell)), (x, y))
        for j, line in enumerate(wrap_words(cap, cell - 8, face.getlength, caption_lines)):
            draw.text((x + 4, y + cell + 2 + j * _LINE_HEIGHT), line, fill="black", font=face)
    return pil_to_tensor(canvas)


def caption_video_grid(
    videos: torch.Tensor, captions: list[str], cell: int = 256, cols: int = 4
) -> torch.Tensor:
    """caption_grid of each frame of `videos` (N, T, 3, H, W) uint8: (T, 3, H', W') uint8. Each frame's N images
    are resized to `cell` px at once first (antialiased), about 3 times faster on a long video."""
    import torch.nn.functional as F

    grids = []
    for t in range(videos.shape[1]):
        frame = F.interpolate(videos[:, t].float() / 255, size=(cell, cell), mode="bilinear", antialias=True)
        grids.append(caption_grid(frame.clamp(0, 1), captions, cell, cols))
    return torch.stack(grids)


_LINE_HEIGHT = 12  # a caption line of caption_grid, in pixels


def _grid_layout(n: int, cols: int, caption_lines: int) -> tuple[int, int, int]:
    """caption_grid's (columns, rows, caption height in px) for `n` images asked in `cols` columns."""
    cols = min(grid_columns(cols), n)
    return cols, (n + cols - 1) // cols, caption_lines * _LINE_HEIGHT + 4


def grid_cells(
    grid: torch.Tensor, n: int, cols: int = 4, cell: int = 256, caption_lines: int = 2
) -> torch.Tensor:
    """The `n` images of a caption_grid (3, H, W) uint8 made with the same `cols`, `cell` and `caption_lines`, as
    it shows them (resized to `cell` px): (n, 3, cell, cell) uint8, captions left out."""
    cols, rows, text_h = _grid_layout(n, cols, caption_lines)
    if tuple(grid.shape) != (3, rows * (cell + text_h), cols * cell):
        raise ValueError(
            f"a grid of {tuple(grid.shape)} is not one of {n} images in {cols} columns of {cell} px"
        )
    return torch.stack(
        [
            grid[:, (i // cols) * (cell + text_h) :][:, :cell, (i % cols) * cell : (i % cols + 1) * cell]
            for i in range(n)
        ]
    )


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) uint8 on the CPU, rounded as diffusers' numpy_to_pil."""
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu()


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file beside `path` and rename it over `path` (no half-written JSON)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")  # NaN is not JSON: never write it
    os.replace(tmp, path)


def fmt_score(x: float | None, sign: bool = False) -> str:
    """A score as printed and captioned: three decimals, n/a for None."""
    return "n/a" if x is None else (f"{x:+.3f}" if sign else f"{x:.3f}")
