"""Config dataclasses: their --help sections (`field_sections`), what every config can do (`ConfigBase`: dict and
JSON out, a readable print, number checks), the parts every trainer shares (`SHARED_PARTS`, refl_ddpo.run.parts) and
their checks (`check_shared`). A config is resolved once (refl_ddpo.run.flags: script defaults < --preset < --config
FILE < flags) and frozen; cross-field checks live in each config's `check()` and raise `UserError` naming the fields,
before any model is loaded."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from refl_ddpo.core.errors import UserError
from refl_ddpo.run.parts import (
    HubPart,
    LoRAPart,
    MemoryPart,
    OptimizerPart,
    RunPart,
    SamplerPart,
    StatePart,
    ValidationPart,
)


def field_sections(cls: type) -> list[tuple[str, list[dataclasses.Field]]]:
    """A config's fields by `--help` section: a field's `group` starts a section that the fields after it share (a
    field that a later part or the config redefines without a group keeps the group it was given); fields before any
    group are in `options` (argparse's, beside --config). Sections of the same title are merged, in order of first
    appearance."""
    inherited: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        for f in getattr(base, "__dataclass_fields__", {}).values():
            if f.metadata.get("group"):
                inherited[f.name] = f.metadata["group"]
    sections: dict[str, list] = {"options": []}
    title = "options"
    for f in fields(cls):
        title = f.metadata.get("group") or inherited.get(f.name) or title
        sections.setdefault(title, []).append(f)
    return list(sections.items())


class ConfigBase:
    """What every config dataclass can do, the methods beside its fields: dict/JSON out, a readable print, checks."""

    ALIASES: ClassVar[dict[str, str]] = {}  # alias field -> the field it stands for
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}  # --preset NAME -> field values (a defaults layer)

    def __post_init__(self) -> None:
        """An alias left unset reads as its field (the saved config reads either way); a field with a `fill` left
        unset takes its value (during construction: frozen configs too)."""
        for alias, name in self.ALIASES.items():
            if getattr(self, alias) is None:
                object.__setattr__(self, alias, getattr(self, name))
        for f in fields(self):
            if "fill" in f.metadata and getattr(self, f.name) is None:
                object.__setattr__(self, f.name, f.metadata["fill"](self))

    def to_dict(self) -> dict:
        """The fields as a dict, secrets (a field with `secret=True`, e.g. --hub_token) as None: this is what
        config.json, the trackers and the printed config get."""
        out = dataclasses.asdict(self)
        for f in fields(self):
            if f.metadata.get("secret"):
                out[f.name] = None
        return out

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def pretty(self) -> str:
        width = max(len(f.name) for f in fields(self))
        shown = self.to_dict()
        return "\n".join(f"  {f.name:<{width}} = {shown[f.name]!r}" for f in fields(self))

    def check_positive(self, *names: str) -> None:
        """A one-line UserError naming the first of these fields that is not > 0 (NaN is not)."""
        for name in names:
            if not getattr(self, name) > 0:
                raise UserError(f"--{name} must be > 0 (got {getattr(self, name)}).")

    def check_numbers(self) -> None:
        """Every number field is finite (a float may be inf only with `allow_inf`; NaN never) and within the bounds
        of its metadata (`gt`, `ge`, `lt`, `le`): one line naming the flag, the range and the default. Aliases are
        skipped: their field is checked."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.ALIASES:  # the field it stands for is checked (and named)
                continue
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            m = f.metadata
            lower = ("(", m["gt"]) if "gt" in m else ("[", m["ge"]) if "ge" in m else None
            upper = (")", m["lt"]) if "lt" in m else ("]", m["le"]) if "le" in m else None
            ok = not math.isnan(value) and (m.get("allow_inf") or not math.isinf(value))
            if lower is not None:
                ok = ok and (value > lower[1] if lower[0] == "(" else value >= lower[1])
            if upper is not None:
                ok = ok and (value < upper[1] if upper[0] == ")" else value <= upper[1])
            if ok:
                continue
            if lower and upper:
                want = f"a number in {lower[0]}{lower[1]}, {upper[1]}{upper[0]}"
            elif lower or upper:
                op, bound = lower or upper
                want = f"a number {dict(zip('([)]', ('>', '>=', '<', '<='), strict=True))[op]} {bound}"
            else:
                want = "a finite number"
            if m.get("allow_inf"):
                want += " (or inf)"
            default = f.default if f.default is not dataclasses.MISSING else None
            hint = f"; the default is {default}" if default is not None else ""
            flag = " / ".join(
                f"--{n}" for n in [f.name, *(a for a, n in self.ALIASES.items() if n == f.name)]
            )
            raise UserError(f"{flag} must be {want} (got {value}){hint}.")

    def check(self) -> None:
        """Field and cross-field checks; a config extends them and calls super().check()."""
        self.check_numbers()


# The parts every trainer's config is made of, last first: a dataclass takes its fields from its bases in reverse
# order, so `class C(OwnPart, *SHARED_PARTS)` has the shared fields first (in the order of --help), then OwnPart's.
# ConfigBase, last, gives the methods.
SHARED_PARTS = (
    HubPart,
    ValidationPart,
    StatePart,
    MemoryPart,
    LoRAPart,
    OptimizerPart,
    SamplerPart,
    RunPart,
    ConfigBase,
)


@dataclass(frozen=True)
class CommonConfig(*SHARED_PARTS):
    """Fields shared by all trainers."""

    def check(self) -> None:
        super().check()
        check_shared(self)


def check_video(cfg: CommonConfig) -> None:
    """The video flags (--num_frames, --wan_expert, --video_reduction) fit the model, before it loads."""
    from refl_ddpo.core.video import check_video_flags, parse_reduction

    parse_reduction(cfg.video_reduction)
    expert = None if cfg.wan_expert == "transformer" else cfg.wan_expert
    if expert == "both" and (cfg.fsdp or cfg.deepspeed_zero or not cfg.use_lora):
        flag = "--fsdp" if cfg.fsdp else "--deepspeed_zero" if cfg.deepspeed_zero else "--no-use_lora"
        raise UserError(
            f"--wan_expert both trains a LoRA on each expert, on one process or several (DDP); {flag} is not "
            "supported with it: drop it, or train one expert (--wan_expert transformer or transformer_2)."
        )
    check_video_flags(cfg.pretrained_model, cfg.num_frames, wan_expert=expert)


def check_shared(cfg: CommonConfig) -> None:
    """The checks of the fields every trainer shares (SHARED_PARTS), after `ConfigBase.check`."""
    cfg.check_positive(
        "num_inference_steps",
        "train_batch_size",
        "gradient_accumulation_steps",
        "lora_rank",
        "learning_rate",
    )
    if cfg.resolution is not None:
        cfg.check_positive("resolution")
    check_video(cfg)
    if cfg.checkpointing_steps < 0:
        raise UserError("--checkpointing_steps must be >= 0 (0 turns periodic checkpoints off).")
    if cfg.lora_target_modules is not None and not cfg.lora_target_modules:
        raise UserError("--lora_target_modules is empty: name at least one module (e.g. to_q to_k).")
    check_train_device(cfg.device)
    cfg.check_positive("num_validation_images", "validation_num_steps", "validation_batch_size")
    check_trackers(cfg.report_to)
    if cfg.fsdp_cpu_offload and not cfg.fsdp:
        raise UserError("--fsdp_cpu_offload offloads FSDP's shards: add --fsdp (or drop it).")
    if cfg.fsdp_checkpoint != "gathered" and not cfg.fsdp:
        raise UserError(
            f"--fsdp_checkpoint {cfg.fsdp_checkpoint} writes FSDP's shards: add --fsdp (or drop it)."
        )
    if cfg.fsdp_shard_text_encoders and not cfg.fsdp:
        raise UserError("--fsdp_shard_text_encoders shards them with FSDP: add --fsdp (or drop it).")
    if cfg.fsdp_shard_text_encoders and cfg.offload_text_encoders:
        raise UserError(
            "--fsdp_shard_text_encoders and --offload_text_encoders both move the text encoders off the GPU: "
            "pick one."
        )
    check_deepspeed(cfg.deepspeed_zero, cfg.fsdp)
    if cfg.hub_model_id is not None and not cfg.push_to_hub:
        raise UserError("--hub_model_id names the repo of --push_to_hub: add --push_to_hub (or drop it).")


TRACKERS = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "all": ["tensorboard", "wandb"], "none": []}


def check_trackers(report_to: str) -> None:
    """--report_to's trackers are installed (before anything is loaded)."""
    import importlib.util

    for name in TRACKERS[report_to]:
        if importlib.util.find_spec(name) is None:
            raise UserError(
                f"--report_to {report_to} needs {name}: pip install -r requirements.txt (or --report_to none)."
            )


def check_deepspeed(stage: int | None, fsdp: bool) -> None:
    """--deepspeed_zero: stage 2 only, not with --fsdp, deepspeed installed (before anything is loaded)."""
    import importlib.util

    if stage is None:
        return
    if stage == 3:
        raise UserError(
            "--deepspeed_zero 3 empties every weight outside a forward, which the trainers read directly (the "
            "old-policy copy of NFT/AWM, --use_ema, weight digests, the LoRA save): use --fsdp to shard the network, "
            "or --deepspeed_zero 2."
        )
    if fsdp:
        raise UserError("--deepspeed_zero and --fsdp are two engines for the same network: choose one.")
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError(
            "--deepspeed_zero needs deepspeed: pip install -r requirements.txt (or drop the flag)."
        )


def check_train_device(device: str | None) -> None:
    """The trainers run where accelerate puts each process: --device cpu forces the CPU, --device cuda needs a visible
    GPU (each process gets its own); anything else is refused rather than ignored."""
    if device is None or device == "cpu":
        return
    if device != "cuda":
        raise UserError(
            f"--device {device}: the trainers take cpu or cuda (each process on its own GPU); choose GPUs with "
            "GPUS=... in train_scripts/ or CUDA_VISIBLE_DEVICES."
        )
    import torch

    if not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible; use --device cpu (or leave --device out).")
