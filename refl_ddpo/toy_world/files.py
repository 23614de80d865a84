"""The toy world's committed weights as files: SHA256SUMS written and checked, and the checked copy into a folder
(`python -m refl_ddpo.tiny OUT --toy_world`)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from refl_ddpo.core.errors import UserError
from refl_ddpo.toy_world import world as toy_world

SUMS_NAME = "SHA256SUMS"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_sums(folder: Path) -> Path:
    """FOLDER/SHA256SUMS (`sha256sum` format, sorted relative paths) of every file under folder."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SUMS_NAME)
    lines = [f"{_sha256(p)}  {p.relative_to(folder).as_posix()}" for p in files]
    (folder / SUMS_NAME).write_text("\n".join(lines) + "\n")
    return folder / SUMS_NAME


def verify_sums(folder: Path) -> list[str]:
    """The relative paths listed in FOLDER/SHA256SUMS, after checking each; a missing or changed file is a
    UserError naming it."""
    sums = folder / SUMS_NAME
    if not sums.is_file():
        raise UserError(
            f"{sums} is missing: the committed toy world weights are incomplete (reinstall, or "
            f"rebuild with `python -m refl_ddpo.tiny OUT --rebuild_toy_world`)"
        )
    paths = []
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        digest, rel = line.split(maxsplit=1)
        rel = rel.strip().lstrip("*")
        p = folder / rel
        if not p.is_file():
            raise UserError(f"toy world file {p} listed in {sums} is missing")
        if _sha256(p) != digest:
            raise UserError(f"toy world file {p} does not match its SHA256 in {sums} (corrupted or changed)")
        paths.append(rel)
    return paths


def write_toy_world(out: str | Path, source: str | Path | None = None) -> Path:
    """OUT/toy-sd/ (a StableDiffusionPipeline folder), OUT/toy-sd3/ (a StableDiffusion3Pipeline folder) and
    OUT/toy_classifier.{safetensors,json}; returns OUT/toy-sd.

    Copies the committed weights (from `source`, default toy_world.DATA_DIR) after checking SHA256SUMS. To train
    them from scratch instead: `python -m refl_ddpo.tiny OUT --rebuild_toy_world` (refl_ddpo.testing.toy_build)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(source) if source is not None else toy_world.DATA_DIR
    for rel in verify_sums(src):
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, dst)
    return out / toy_world.SD_DIRNAME
