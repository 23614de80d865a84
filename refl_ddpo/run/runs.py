"""Training output folders and checkpoints: which run wrote them, whether they are complete, whether they fit.

A training output folder belongs to one run:

    output_dir/run.json                  {"run_id", "trainer"}, written when the run starts (by one process)
    output_dir/checkpoint-N/             accelerate state (LoRA or unet/, optimizer, random states) and
                                         train_state.json / train_state.safetensors (the trainer's counters);
                                         with --fsdp_checkpoint sharded, fsdp_shards/ (DCP) in place of the
                                         LoRA or unet/ and the optimizer
    output_dir/checkpoint-N/checkpoint.json   written last: run id, trainer, N, process count, the settings a
                                         resumed run must share (`resume_fit.RESUME_SETTINGS`) and every file's size
    output_dir/config.json, pytorch_lora_weights.safetensors or unet/   the final weights (session.finish_run)

A checkpoint is *complete* when its checkpoint.json is there and every file it lists has the listed size; `latest`
resumes the newest complete one. A new run refuses a folder that already holds a run unless
`--resume_from_checkpoint` continues it or `--overwrite_output_dir` replaces it (its files are deleted first). A
resumed run keeps the run id of its checkpoint, and checkpoint rotation (`--checkpoints_total_limit`) deletes only
checkpoints of the run that is writing, so a checkpoint of another run is never deleted in place of its own.

Every refusal is one `UserError` line, raised before any model is loaded (except the resolution when it is left to
the model's default: `check_resumed_resolution` runs after loading, with start_run's RunInfo).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from refl_ddpo.core.errors import UserError
from refl_ddpo.run.resume_fit import check_resume_fits

RUN_FILE = "run.json"  # output_dir/run.json: the run the folder belongs to
MARKER = "checkpoint.json"  # checkpoint-N/checkpoint.json: written last, the checkpoint is complete
# session.finish_run writes these (transformer_2/: Wan 2.2's low-noise expert's LoRA, --wan_expert both)
FINAL_FILES = ("config.json", "pytorch_lora_weights.safetensors", "unet", "transformer_2")
BEST_DIR = (
    "best"  # output_dir/best/: the best weights so far (refl_ddpo.run.guard), config.json, grid, best.json
)
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
# checkpoints.save_checkpoint's folder before its rename
TMP_CHECKPOINT_NAME = re.compile(r"\.checkpoint-\d+\.tmp")
# output folders this process claimed (resolved path -> run id), for release_run
_claimed: dict[str, str] = {}


@dataclass
class RunInfo:
    """Who is writing output_dir: the run id (kept from the checkpoint when resuming) and the trainer's name."""

    run_id: str
    trainer: str
    resume: Path | None = None
    resume_record: dict | None = None  # the checkpoint.json of `resume`


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _preflight_only() -> bool:
    from refl_ddpo.run.launch import PREFLIGHT_ENV

    return bool(os.environ.get(PREFLIGHT_ENV))


# ---- checkpoints: record, completeness, contents ----


def write_marker(folder: Path, settings: dict, step: int, num_processes: int, info: RunInfo) -> None:
    """Write folder/checkpoint.json, last: the run, the `settings` to match on resume (resume_fit.settings), every
    file's size."""
    files = {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    record = {
        "run_id": info.run_id,
        "trainer": info.trainer,
        "step": step,
        "num_processes": num_processes,
        "settings": settings,
        "files": files,
    }
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, folder / MARKER)


def read_marker(folder: Path) -> tuple[dict | None, str | None]:
    """(checkpoint.json, None) for a complete checkpoint, else (None, why it is incomplete). Cheap: stats only."""
    marker = folder / MARKER
    if not marker.is_file():
        return None, f"it has no {MARKER} (written last, when a checkpoint is complete)"
    try:
        record = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{marker} is not readable JSON ({str(e).splitlines()[0]})"
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return None, f"{marker} is not a checkpoint record"
    for name, size in record["files"].items():
        path = folder / name
        if not path.is_file():
            return None, f"{path} is missing"
        if path.stat().st_size != size:
            return None, f"{path} has {path.stat().st_size} bytes, {size} when it was written"
    return record, None


def _content_problem(path: Path) -> str | None:
    """Why a file of a checkpoint cannot be read (None if it reads), by its kind; before any model is loaded."""
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                return "it is not a JSON object"
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                f.keys()
        elif path.suffix in (".bin", ".pt", ".pth"):  # torch.save writes a zip; testzip checks every CRC
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad is not None:
                return f"its entry {bad} fails its checksum"
    except (OSError, ValueError, zipfile.BadZipFile, SafetensorError) as e:  # JSONDecodeError is a ValueError
        return " ".join(str(e).split())[:200] or type(e).__name__
    return None


def check_checkpoint_files(folder: Path, record: dict) -> None:
    """Every file the checkpoint lists reads as its kind (JSON, safetensors, torch zip): else one line naming it."""
    for name in record["files"]:
        problem = _content_problem(folder / name)
        if problem:
            raise UserError(
                f"--resume_from_checkpoint {folder}: {folder / name} is damaged ({problem}); resume another "
                "checkpoint-N (or start over with --overwrite_output_dir)."
            )


def list_checkpoints(output_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoint-N folders (of `run_id` only, if given), oldest first."""
    found = []
    for path in _checkpoint_dirs(output_dir):
        record, _ = read_marker(path)
        if record is not None and (run_id is None or record.get("run_id") == run_id):
            found.append(path)
    return found


def _checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if p.is_dir() and CHECKPOINT_NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def rotate_checkpoints(output_dir: str | Path, run_id: str, keep: int) -> None:
    """Delete the oldest complete checkpoints of run `run_id` beyond `keep`; other runs' checkpoints stay."""
    for old in list_checkpoints(output_dir, run_id)[:-keep]:
        shutil.rmtree(old)


# ---- resume: find, check, compare with this run's config ----


def find_resume(
    spec: str | None, output_dir: str | Path, token: str | None = None
) -> tuple[Path | None, dict | None]:
    """'latest' -> the newest complete checkpoint-N of output_dir (None if there is none); a path must be a
    complete checkpoint; a hub id 'user/repo' (refl_ddpo.run.hub) -> the newest complete checkpoint-N that --push_to_hub
    uploaded there (downloaded, with `token`). Returns (path, its checkpoint.json)."""
    if not spec:
        return None, None
    if spec == "latest":
        for path in reversed(_checkpoint_dirs(output_dir)):
            record, why = read_marker(path)
            if record is not None:
                return path, record
            if _is_main_rank() and not _preflight_only():
                print(f"note: skipping incomplete {path}: {why}", flush=True)
        return None, None
    path = Path(spec)
    if not path.is_dir():
        from refl_ddpo.run.hub import is_hub_id

        if not is_hub_id(spec):
            raise UserError(
                f"--resume_from_checkpoint {spec}: no such folder; give 'latest', a checkpoint-N folder or the hub "
                "repo id of a pushed run."
            )
        path = hub_checkpoint(spec, token)
    record, why = read_marker(path)
    if record is None:
        raise UserError(
            f"--resume_from_checkpoint {spec} is incomplete or damaged: {why}; resume another checkpoint-N."
        )
    return path, record


def hub_checkpoint(repo_id: str, token: str | None = None) -> Path:
    """--resume_from_checkpoint user/repo: the newest complete checkpoint-N of a pushed run (downloaded)."""
    from refl_ddpo.run.hub import download

    local = download(repo_id, "--resume_from_checkpoint", token)
    if (local / MARKER).is_file():  # the repo is one checkpoint folder
        return local
    complete = list_checkpoints(local)
    if not complete:
        raise UserError(
            f"--resume_from_checkpoint {repo_id}: the hub repo holds no complete checkpoint-N (push a run with "
            "--push_to_hub, which uploads its newest one)."
        )
    return complete[-1]


# ---- the output folder: whose run, claim, overwrite ----


def run_files(output_dir: Path) -> list[str]:
    """The names in output_dir that belong to a training run (its run.json, checkpoints, final weights)."""
    if not output_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in output_dir.iterdir()
        if p.name in (RUN_FILE, *FINAL_FILES)
        or CHECKPOINT_NAME.fullmatch(p.name)
        or TMP_CHECKPOINT_NAME.fullmatch(p.name)
    )


def _folder_run_ids(output_dir: Path) -> set[str]:
    ids = {r.get("run_id") for r in (read_marker(p)[0] for p in _checkpoint_dirs(output_dir)) if r}
    try:
        ids.add(json.loads((output_dir / RUN_FILE).read_text()).get("run_id"))
    except (OSError, ValueError, AttributeError):
        pass
    return ids - {None}


def _is_inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _check_claim(cfg, output_dir: Path, resume: Path | None, record: dict | None) -> bool:
    """Whether this run may write output_dir (one-line UserError if not); True: clear the old run first."""
    held = run_files(output_dir)
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if cfg.overwrite_output_dir:
        if resume is not None and _is_inside(resume, output_dir):
            raise UserError(
                f"--overwrite_output_dir would delete {resume}, the checkpoint --resume_from_checkpoint "
                "continues; drop one of the two flags."
            )
        return bool(held)
    if not held:
        return False
    if resume is None and cfg.resume_from_checkpoint == "latest":
        if not any(name in held for name in FINAL_FILES):
            return False  # nothing to resume: the earlier run stopped before its first complete checkpoint
        raise UserError(
            f"--output_dir {output_dir} holds a finished run ({shown}) and no complete checkpoint-N to resume; "
            "replace it with --overwrite_output_dir or pick another --output_dir."
        )
    if resume is None:
        raise UserError(
            f"--output_dir {output_dir} already holds a run ({shown}); continue it with --resume_from_checkpoint "
            "latest, replace it with --overwrite_output_dir, or pick another --output_dir."
        )
    others = _folder_run_ids(output_dir) - {record["run_id"]}
    if others:
        raise UserError(
            f"--output_dir {output_dir} holds another run ({', '.join(sorted(others))}) than {resume} "
            f"(run {record['run_id']}); resume into a new --output_dir, or add --overwrite_output_dir to "
            "replace that run."
        )
    return False


def clear_run(output_dir: Path, logging_dir: str) -> list[str]:
    """Delete the old run's files from output_dir (checkpoints, final weights, run.json, the logs in
    `logging_dir`, debug/, validation/, best/ and the model card)."""
    names = run_files(output_dir)
    logs = output_dir / logging_dir
    if logs.exists() and _is_inside(logs, output_dir) and logs.resolve() != output_dir.resolve():
        names.append(logging_dir)
    from refl_ddpo.run.model_card import CARD_NAME, is_our_card
    from refl_ddpo.run.validation import VALIDATION_DIR

    for extra in ("debug", VALIDATION_DIR, BEST_DIR):
        if (output_dir / extra).is_dir():
            names.append(extra)
    if (output_dir / CARD_NAME).is_file() and is_our_card(output_dir / CARD_NAME):  # a user's own stays
        names.append(CARD_NAME)
    for name in names:
        path = output_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return names


def start_run(cfg, trainer: str, steps_field: str) -> RunInfo:
    """Before any model is loaded: check output_dir (writable; free, continued or overwritten) and the checkpoint
    to resume (complete, readable, fitting this config and process count); claim output_dir for this run. Returns
    the run's RunInfo (its id, and `.resume`: the checkpoint to resume from, or None). `steps_field` is the config
    field that bounds the checkpoint number (max_train_steps, num_epochs).

    Only the main process (and launch.sh's preflight) checks and claims the folder; in launch.sh's preflight
    nothing is deleted or written."""
    from refl_ddpo.run.outputs import check_output_dir

    output_dir = check_output_dir(cfg.output_dir)
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by launch.sh / accelerate for every process
    resume, record = find_resume(cfg.resume_from_checkpoint, output_dir, getattr(cfg, "hub_token", None))
    if resume is not None:
        check_resume_fits(resume, record, cfg, trainer, steps_field, num_processes)
        if _is_main_rank():  # reads every file: once is enough
            check_checkpoint_files(resume, record)
    info = RunInfo(record["run_id"] if record else new_run_id(), trainer, resume, record)
    if _is_main_rank():
        clear = _check_claim(cfg, output_dir, resume, record)
        if not _preflight_only():
            if clear:
                print(
                    f"--overwrite_output_dir: deleted {', '.join(clear_run(output_dir, cfg.logging_dir))}",
                    flush=True,
                )
            tmp = output_dir / f".{RUN_FILE}.tmp"
            tmp.write_text(json.dumps({"run_id": info.run_id, "trainer": trainer}, indent=2) + "\n")
            os.replace(tmp, output_dir / RUN_FILE)
            _claimed[str(output_dir.resolve())] = info.run_id
    return info


def release_run(output_dir: str | None) -> None:
    """After a user error: give `output_dir` back if this process claimed it and nothing else was written there
    yet, so that the corrected command runs without --overwrite_output_dir."""
    if not isinstance(output_dir, str):
        return
    output_dir = Path(output_dir)
    run_id = _claimed.get(str(output_dir.resolve()))
    if run_id is None or run_files(output_dir) != [RUN_FILE]:
        return
    try:
        if json.loads((output_dir / RUN_FILE).read_text()).get("run_id") == run_id:
            (output_dir / RUN_FILE).unlink()
    except (OSError, ValueError, AttributeError):
        pass
