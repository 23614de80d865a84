"""Does a checkpoint fit this run: its trainer, the settings it was trained with (`RESUME_SETTINGS`, and the LoRA's
when both use LoRA), its process count and step, each mismatch one line that says which flag to pass."""

from __future__ import annotations

import os
from pathlib import Path

from refl_ddpo.core.errors import UserError

# Config fields a resumed run must share with its checkpoint (the LoRA ones only when both use LoRA).
RESUME_SETTINGS = ("pretrained_model", "resolution", "seed", "use_lora")
LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_target_modules")


def settings(cfg) -> dict:
    """The settings of `cfg` that checkpoint.json records and a resumed run must share."""
    model = cfg.pretrained_model
    settings = {
        "pretrained_model": str(Path(model).resolve()) if os.path.exists(model) else model,
        "resolution": cfg.resolution,
        "seed": cfg.seed,
        "use_lora": cfg.use_lora,
    }
    if cfg.use_lora:
        settings.update(
            lora_rank=cfg.lora_rank,
            lora_alpha=cfg.resolved_lora_alpha,
            lora_target_modules=sorted(cfg.lora_target_modules),
        )
    if cfg.wan_expert != "transformer":  # Wan 2.2: which expert(s) the LoRA is on (absent: the default)
        settings["wan_expert"] = cfg.wan_expert
    return settings


def check_resume_fits(
    path: Path, record: dict, cfg, trainer: str, steps_field: str, num_processes: int
) -> None:
    """The checkpoint's trainer, settings, process count and step against this run: one line per mismatch."""
    where = f"--resume_from_checkpoint {path}"
    if record.get("trainer") != trainer:
        raise UserError(
            f"{where} was written by the {record.get('trainer')} trainer, this is the {trainer} trainer; resume it "
            f"with refl_ddpo.trainers.{record.get('trainer')} or pick a {trainer} checkpoint."
        )
    saved, ours = record.get("settings", {}), settings(cfg)
    names = RESUME_SETTINGS + (LORA_SETTINGS if saved.get("use_lora") and cfg.use_lora else ())
    for name in names:
        if name == "resolution" and cfg.resolution is None:
            continue  # the model's native one: compared after loading (check_resumed_resolution)
        if name in saved and saved[name] != ours[name]:
            raise UserError(_mismatch(where, name, ours[name], saved[name]))
    expert = saved.get("wan_expert", "transformer")  # Wan 2.2: the expert(s) the checkpoint's LoRA is on
    if expert != cfg.wan_expert:
        raise UserError(_mismatch(where, "wan_expert", cfg.wan_expert, expert))
    if record.get("num_processes", 1) != num_processes:
        raise UserError(
            f"{where} was written by {record.get('num_processes')} process(es), this run has {num_processes}; "
            f"resume it with NUM_PROCESSES={record.get('num_processes')} (each process continues its own "
            "random stream)."
        )
    limit = getattr(cfg, steps_field)
    if int(record.get("step", 0)) > limit:
        raise UserError(
            f"{where} is past --{steps_field} {limit} (it is checkpoint {record['step']}); raise "
            f"--{steps_field} or resume an earlier checkpoint-N."
        )


def _flag_value(name: str, value) -> str:
    if name == "use_lora":
        return "--use_lora" if value else "--no-use_lora"
    if isinstance(value, list):
        return f"--{name} {' '.join(map(str, value))}"
    return f"--{name} {value}"


def _mismatch(where: str, name: str, ours, saved) -> str:
    return (
        f"{where} was trained with {_flag_value(name, saved)}, this run has {_flag_value(name, ours)}; pass "
        f"{_flag_value(name, saved)} to resume it (or start a new run in another --output_dir)."
    )


def check_resumed_resolution(cfg, info) -> None:
    """After loading: a resolution left to the model's default must be the one the checkpoint was trained at.
    `info`: start_run's RunInfo (None outside a run)."""
    if info is None or info.resume_record is None:
        return
    saved = info.resume_record.get("settings", {}).get("resolution")
    if saved is not None and saved != cfg.resolution:
        raise UserError(
            _mismatch(f"--resume_from_checkpoint {info.resume}", "resolution", cfg.resolution, saved)
        )
