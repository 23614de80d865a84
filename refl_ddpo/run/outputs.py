"""Where results go: the output folder (created and checked writable before any model loads) and the trackers (an
image to each). Shared by the trainers, inference, comparison and validation; imports nothing of refl_ddpo but its
errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from refl_ddpo.core.errors import UserError

if TYPE_CHECKING:
    import torch


def check_output_dir(path: str) -> Path:
    """Create `path` (and check we may write there) before any model is loaded."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test.{os.getpid()}"  # one per process: ranks check at the same time
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"--output_dir {path} is not writable ({e.strerror}); pick a folder you can write to."
        ) from None
    return out


def log_grid(accelerator, tag: str, grid: torch.Tensor, step: int) -> None:
    """An image (3, H, W) uint8 to every tracker (main process only): tensorboard's add_image, wandb.Image."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(tag, grid, step)
        elif tracker.name == "wandb":
            import wandb

            tracker.run.log({tag: wandb.Image(grid.permute(1, 2, 0).numpy())}, step=step)
