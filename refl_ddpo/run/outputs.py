"""Where results go: the output folder (created and checked writable before any model loads) and the trackers (an
image or a video to each). Shared by the trainers, inference, comparison and validation; imports nothing of refl_ddpo
but its errors.

A video goes to both trackers as an animated GIF that PIL writes: tensorboard's own `add_video` needs moviepy for
that one step, so the GIF is put in the same `Summary.Image` it would write (its image tab plays it); `wandb.Video`
takes the GIF's bytes as they are (only arrays need moviepy there)."""

from __future__ import annotations

import io
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


def gif_bytes(frames: torch.Tensor, fps: int) -> bytes:
    """Frames (T, 3, H, W) uint8 as an animated GIF, looping, at `fps` (PIL merges identical frames into one). Each
    frame gets its own 256 colours by PIL's fast octree, about 100 times faster than the median cut that GIF saving
    would run on RGB frames (0.4 s a frame at 1024 x 284 px)."""
    from PIL import Image

    octree = Image.Quantize.FASTOCTREE
    images = [Image.fromarray(f).quantize(256, method=octree) for f in frames.permute(0, 2, 3, 1).numpy()]
    out = io.BytesIO()
    duration = round(1000 / fps)
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)
    return out.getvalue()


VIDEO_FPS = 16  # Wan's frames per second (inference's --fps default)


def log_video(accelerator, tag: str, frames: torch.Tensor, step: int, fps: int = VIDEO_FPS) -> None:
    """A video, frames (T, 3, H, W) uint8, to every tracker (main process only) as an animated GIF."""
    if not accelerator.is_main_process or not accelerator.trackers:
        return
    gif = gif_bytes(frames, fps)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            from tensorboard.compat.proto.summary_pb2 import Summary

            h, w = frames.shape[2:]
            image = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=gif)
            summary = Summary(value=[Summary.Value(tag=tag, image=image)])
            tracker.writer._get_file_writer().add_summary(summary, step)  # as add_video writes its summary
        elif tracker.name == "wandb":
            import wandb

            tracker.run.log({tag: wandb.Video(io.BytesIO(gif), format="gif")}, step=step)
