"""Edit data: (instruction, source image(s), metadata) for the image-editing families (FLUX.1 Kontext,
Qwen-Image-Edit-Plus, FLUX.2's reference images).

`--edit_data FILE` is a JSONL file, one edit per line:

    {"image": "cat.png", "instruction": "make the cat blue", ...}
    {"image": ["a.png", "b.png"], "instruction": "...", ...}      several references (multi-reference models)

or a folder holding such a file as `metadata.jsonl`. Image paths are relative to the file. Every image is opened when
the flag is checked, before any model loads: a missing file, an unreadable image or a wrong size is one line naming
the file's line. All source images share one size (a batch stacks them) whose sides are multiples of 16 (the VAE's 8
times the 2x2 packing); a family uses them at that size, as a stock pipeline called with that size does.

The conditioning seam. A prompt source yields (instruction, metadata); for an edit, `metadata["source_paths"]` lists
the image files (plain strings: the metadata stays JSON for scores.json and the reward server), and
`with_source_images` adds `metadata["source_images"]` (SOURCE_IMAGES): a list of float32 tensors (3, H, W) in [0, 1]
on the CPU, one per reference, in the order of the line. That key is what an edit family conditions on and what a
reward that sees the source reads; a user's prompt_fn may put it there itself (tensors, or PIL images, which
`source_tensors` converts). The other fields of a line travel as metadata (e.g. a source caption for
`edit_clip_direction`).
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

from refl_ddpo.core.errors import UserError, read_utf8

SOURCE_IMAGES = (
    "source_images"  # metadata key: list of (3, H, W) float32 tensors in [0, 1], one per reference
)
SOURCE_PATHS = (
    "source_paths"  # metadata key: list of the source images' files (str), as --edit_data names them
)
SIZE_MULTIPLE = 16  # the VAE's 8 x the 2x2 packing of the FLUX / Qwen-Image latents


def edit_file(path: str | Path) -> Path:
    """The JSONL file of `--edit_data path` (a folder: its metadata.jsonl)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metadata.jsonl"
    if not path.is_file():
        raise UserError(
            f"--edit_data {path}: no such file (a JSONL of {{'image': path, 'instruction': ...}} lines, or a "
            "folder holding one as metadata.jsonl)."
        )
    return path


def _image_size(path: Path, where: str) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise UserError(f"{where}: the image {path} does not exist (paths are relative to the edit file).")
    try:
        with Image.open(path) as im:
            im.load()
            return im.size
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{where}: the image {path} could not be read ({type(e).__name__}).") from None


def _edit_line(line: str, root: Path, where: str) -> tuple[str, dict]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where}: not JSON ({e}); write one {{'image', 'instruction'}} object per line."
        ) from None
    if (
        not isinstance(item, dict)
        or not isinstance(item.get("instruction"), str)
        or not item["instruction"].strip()
    ):
        raise UserError(f"{where}: not a JSON object with an 'instruction' string.")
    images = item.get("image")
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not images or not all(isinstance(p, str) and p for p in images):
        raise UserError(f"{where}: 'image' must be a path or a non-empty list of paths.")
    metadata = {k: v for k, v in item.items() if k not in ("image", "instruction")}
    metadata[SOURCE_PATHS] = [str(root / p) for p in images]
    return item["instruction"], metadata


def _check_sizes(edits: list[tuple[str, dict]], where: str) -> tuple[int, int]:
    first = None
    for i, (_, metadata) in enumerate(edits, 1):
        for p in metadata[SOURCE_PATHS]:
            size = _image_size(Path(p), f"{where} line {i}")
            first = first or size
            if size[0] % SIZE_MULTIPLE or size[1] % SIZE_MULTIPLE:
                raise UserError(
                    f"{where} line {i}: the image {p} is {size[0]}x{size[1]}; its sides must be multiples of "
                    f"{SIZE_MULTIPLE} (the VAE's 8 x the 2x2 packing): crop or resize it."
                )
            if size != first:
                raise UserError(
                    f"{where} line {i}: the image {p} is {size[0]}x{size[1]} and the first is {first[0]}x"
                    f"{first[1]}; every source image must have one size (a batch stacks them)."
                )
    return first


def load_edit_data(path: str | Path) -> list[tuple[str, dict]]:
    """--edit_data -> [(instruction, metadata with SOURCE_PATHS)], every image opened and its size checked; one-line
    errors naming the line."""
    file = edit_file(
        path
    ).absolute()  # the sources' paths are absolute: scores.json and compare find them anywhere
    where = f"--edit_data {file}"
    lines = read_utf8(file, where).splitlines()
    edits = [
        _edit_line(line, file.parent, f"{where} line {i}") for i, line in enumerate(lines, 1) if line.strip()
    ]
    if not edits:
        raise UserError(f"{where} holds no edits; write one {{'image', 'instruction'}} object per line.")
    _check_sizes(edits, where)
    return edits


@lru_cache(maxsize=256)
def _read_image(path: str):
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(path) as im:
        arr = np.asarray(im.convert("RGB"))
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 255  # (3, H, W) in [0, 1]


def with_source_images(metadata: dict) -> dict:
    """A copy of `metadata` with SOURCE_IMAGES read from its SOURCE_PATHS (none: the copy as it is). The tensors are
    cached per file and shared: read, never modify them."""
    out = dict(metadata)
    if SOURCE_PATHS in out and SOURCE_IMAGES not in out:
        out[SOURCE_IMAGES] = [_read_image(p) for p in out[SOURCE_PATHS]]
    return out


def source_tensors(metadata: dict) -> list:
    """The sample's source images as (3, H, W) float32 tensors in [0, 1] (PIL images converted), [] without any."""
    import numpy as np
    import torch

    out = []
    for image in metadata.get(SOURCE_IMAGES) or []:
        if not torch.is_tensor(image):
            image = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).float() / 255
        out.append(image)
    return out


def to_pil(image):
    """(3, H, W) in [0, 1] -> a PIL image (uint8; exact for sources read from 8-bit files), for a stock pipeline's
    own image preprocessing."""
    from PIL import Image

    return Image.fromarray((image.permute(1, 2, 0).clamp(0, 1) * 255).round().byte().cpu().numpy())


def jsonable_metadata(metadata: dict) -> dict:
    """`metadata` without SOURCE_IMAGES (the tensors; SOURCE_PATHS names the files), for scores.json and JSON."""
    return {k: v for k, v in metadata.items() if k != SOURCE_IMAGES}


def edit_prompt_fn(path: str | Path, seed: int | None = None):
    """A prompt source over --edit_data: uniformly random (seeded) edits, their images read (`with_source_images`)."""
    edits = load_edit_data(path)
    rng = random.Random(seed)

    def prompt_fn() -> tuple[str, dict]:
        instruction, metadata = rng.choice(edits)
        return instruction, with_source_images(metadata)

    return prompt_fn
