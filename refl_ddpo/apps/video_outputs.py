"""The files of one generated video in an inference run folder: the video itself (mp4 where PyAV is installed, else
an animated WebP, else a GIF: PIL writes both), each frame as a lossless PNG, and a frame strip (the frames side by
side in one PNG). `scores.json` lists them per record: `"file"` (the video), `"frames"` and `"strip"`."""

from __future__ import annotations

import re
from pathlib import Path

import torch

# the files `save_video` writes for ImageSpec.file's stem (earlier runs' are recognised by this)
VIDEO_FILE = re.compile(r"\d{4,}_\d{2,}_seed-?\d+(_f\d{3,}\.png|_strip\.png|\.mp4|\.webp|\.gif)")


def video_format() -> str:
    """'mp4' with PyAV installed, else 'webp' where PIL writes WebP, else 'gif'."""
    import importlib.util

    from PIL import features

    if importlib.util.find_spec("av") is not None:
        return "mp4"
    return "webp" if features.check("webp") else "gif"


def write_video(path: Path, frames: torch.Tensor, fps: int) -> None:
    """`frames` (T, H, W, 3) uint8 as a video at `fps`, in the format of `path`'s suffix."""
    if path.suffix == ".mp4":
        import av

        with av.open(str(path), mode="w") as out:
            stream = out.add_stream("libx264", rate=fps)
            stream.height, stream.width = frames.shape[1], frames.shape[2]
            stream.pix_fmt = "yuv420p"
            for frame in frames.numpy():
                out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            out.mux(stream.encode())
        return
    from PIL import Image

    images = [Image.fromarray(f) for f in frames.numpy()]
    duration = round(1000 / fps)
    images[0].save(path, save_all=True, append_images=images[1:], duration=duration, loop=0)


def save_video(out_dir: Path, stem: str, frames: torch.Tensor, fps: int, pnginfo=None) -> dict:
    """Write the video, its frames and its strip for `frames` (T, H, W, 3) uint8; returns the record's fields
    {"file", "frames", "strip"} (names inside `out_dir`)."""
    from PIL import Image

    file = f"{stem}.{video_format()}"
    write_video(out_dir / file, frames, fps)
    names = []
    for t, frame in enumerate(frames.numpy()):
        names.append(f"{stem}_f{t:03d}.png")
        Image.fromarray(frame).save(out_dir / names[-1], pnginfo=pnginfo)
    strip = f"{stem}_strip.png"
    Image.fromarray(torch.cat(list(frames), dim=1).numpy()).save(out_dir / strip, pnginfo=pnginfo)
    return {"file": file, "frames": names, "strip": strip}
