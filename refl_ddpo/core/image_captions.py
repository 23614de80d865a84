"""An image-caption folder (diffusers' text-to-image layout) for ReFL's pretraining loss."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from refl_ddpo.core.errors import UserError, read_utf8


class PretrainData:
    """An image-caption folder for the pretraining loss: images + `metadata.jsonl`, one JSON object per line with
    `file_name` and a caption in `text` (or `caption` / `prompt`), the layout of diffusers' text-to-image examples."""

    CAPTION_KEYS = ("text", "caption", "prompt")

    def __init__(self, folder: str):
        from PIL import Image, UnidentifiedImageError

        root = Path(folder)
        meta = root / "metadata.jsonl"
        if not meta.is_file():
            raise UserError(
                f"--pretrain_data_dir {folder} has no metadata.jsonl "
                '(one {"file_name": ..., "text": ...} per line).'
            )
        self.items: list[tuple[Path, str]] = []
        for n, line in enumerate(read_utf8(meta, f"--pretrain_data_dir {meta}").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                caption = next(record[k] for k in self.CAPTION_KEYS if k in record)
                path = root / record["file_name"]
            except (json.JSONDecodeError, StopIteration, KeyError, TypeError):
                raise UserError(
                    f'--pretrain_data_dir {meta} line {n}: expected {{"file_name": ..., "text": ...}}.'
                ) from None
            try:
                Image.open(path).close()  # reads the header only
            except (OSError, UnidentifiedImageError):
                raise UserError(
                    f"--pretrain_data_dir {meta} line {n}: {path} is missing or not an image."
                ) from None
            self.items.append((path, str(caption)))
        if not self.items:
            raise UserError(f"--pretrain_data_dir {meta} lists no images.")

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, indices: list[int], resolution: int) -> tuple[torch.Tensor, list[str]]:
        """(images [B, 3, R, R] in [0, 1]: resized (short side), centre-cropped, captions)."""
        from PIL import Image
        from torchvision import transforms

        transform = transforms.Compose(
            [
                transforms.Resize(
                    resolution, interpolation=transforms.InterpolationMode.BILINEAR, antialias=True
                ),
                transforms.CenterCrop(resolution),
                transforms.ToTensor(),  # [3, R, R] in [0, 1]
            ]
        )
        images = []
        for i in indices:
            with Image.open(self.items[i][0]) as im:
                images.append(transform(im.convert("RGB")))
        return torch.stack(images), [self.items[i][1] for i in indices]
