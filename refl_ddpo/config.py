"""Config dataclasses -> command-line flags, `--config FILE` (yaml/json) with CLI overrides, checks, saving.

Every field carries `help` in its metadata (use `field_(default, "sentence")`); the flag `--name` is generated from
the field name, its type from the annotation (`bool` -> `--x/--no-x`, `Literal[...]` -> choices). Cross-field checks
live in each config's `check()` and raise `UserError` naming the fields; they run before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from refl_ddpo.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_DIR = REPO_ROOT / "checkpoint"


def field_(default: Any, help: str, **kw) -> Any:
    """A dataclass field with a help sentence (mutable defaults are copied per instance)."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return dataclasses.field(default=default, metadata={"help": help, **kw})


class ConfigBase:
    """What every config dataclass can do: dict/JSON out, a readable print."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def pretty(self) -> str:
        width = max(len(f.name) for f in fields(self))
        return "\n".join(f"  {f.name:<{width}} = {getattr(self, f.name)!r}" for f in fields(self))

    def check_positive(self, *names: str) -> None:
        """A one-line UserError naming the first of these fields that is not > 0."""
        for name in names:
            if getattr(self, name) <= 0:
                raise UserError(f"--{name} must be > 0 (got {getattr(self, name)}).")


@dataclass
class CommonConfig(ConfigBase):
    """Fields shared by both trainers."""

    # ---- models ----
    pretrained_model: str = field_(
        str(CHECKPOINT_DIR / "stable-diffusion-v1-4"),
        "Base Stable Diffusion: a local diffusers folder or a hub id (e.g. CompVis/stable-diffusion-v1-4).",
    )
    reward_model_dir: str = field_(
        str(CHECKPOINT_DIR),
        "Folder with ImageReward.pt, med_config.json and bert-base-uncased/ (or the hub id THUDM/ImageReward).",
    )
    output_dir: str = field_("checkpoint/out", "Where the final LoRA, its config.json and checkpoint-N/ go.")
    prompts_file: str | None = field_(
        None, "Prompts: one per line, or a JSON list of strings / {'text'|'prompt': ...} objects."
    )
    seed: int = field_(42, "Seed for noise, timestep choices and data order (each process adds its rank).")
    resolution: int = field_(512, "Image side in pixels; latents are resolution / vae_scale_factor.")
    num_inference_steps: int = field_(40, "Denoising steps of the sampler.")
    guidance_scale: float = field_(7.5, "Classifier-free guidance scale used when sampling (1 turns CFG off).")
    # ---- optimisation ----
    learning_rate: float = field_(1e-4, "AdamW learning rate.")
    adam_beta1: float = field_(0.9, "AdamW beta1.")
    adam_beta2: float = field_(0.999, "AdamW beta2.")
    adam_weight_decay: float = field_(1e-2, "AdamW weight decay.")
    adam_epsilon: float = field_(1e-8, "AdamW epsilon.")
    use_8bit_adam: bool = field_(False, "Use bitsandbytes' 8-bit AdamW (must be installed).")
    max_grad_norm: float = field_(1.0, "Clip the gradient norm of the trained parameters to this (0 = off).")
    train_batch_size: int = field_(1, "Images per optimizer micro-batch, per GPU.")
    gradient_accumulation_steps: int = field_(1, "Micro-batches accumulated into one optimizer step.")
    mixed_precision: Literal["no", "fp16", "bf16"] = field_(
        "no", "Dtype of the frozen weights and of autocast; trainable weights stay float32."
    )
    allow_tf32: bool = field_(True, "Allow TF32 matmuls on Ampere+ GPUs (faster, ~1e-3 relative error).")
    # ---- LoRA ----
    use_lora: bool = field_(True, "Train LoRA adapters on the UNet; --no-use_lora fine-tunes the whole UNet.")
    lora_rank: int = field_(4, "LoRA rank r.")
    lora_alpha: float | None = field_(None, "LoRA alpha (scale alpha/r); default: equal to the rank.")
    lora_target_modules: list[str] = field_(
        ["to_q", "to_k", "to_v", "to_out.0"], "UNet module names that get LoRA adapters."
    )
    lora_init: Literal["gaussian", "default", "random"] = field_(
        "gaussian",
        "LoRA init: 'gaussian' (peft: Gaussian A, zero B, so training starts at the base model), 'default' "
        "(Kaiming A, zero B), or 'random' (A and B random: the output changes at once; for tests).",
    )
    gradient_checkpointing: bool = field_(False, "Recompute UNet activations in backward to save memory.")
    # ---- state ----
    checkpointing_steps: int = field_(0, "Save accelerate state to output_dir/checkpoint-N every N steps (0 = off).")
    checkpoints_total_limit: int | None = field_(None, "Keep at most this many checkpoint-N folders.")
    resume_from_checkpoint: str | None = field_(None, "'latest' or a checkpoint-N path to resume from.")
    device: str | None = field_(None, "Force a device (e.g. cpu); default: what accelerate picks.")
    logging_dir: str = field_("logs", "TensorBoard folder, relative to output_dir.")
    report_to: Literal["tensorboard", "none"] = field_("tensorboard", "Where scalars and images are logged.")

    def check(self) -> None:
        """Cross-field checks common to all scripts; subclasses extend and call super().check()."""
        self.check_positive("resolution", "num_inference_steps", "train_batch_size", "gradient_accumulation_steps",
                            "lora_rank", "learning_rate")
        if self.checkpointing_steps < 0:
            raise UserError("--checkpointing_steps must be >= 0 (0 turns periodic checkpoints off).")
        if not self.lora_target_modules:
            raise UserError("--lora_target_modules is empty: name at least one UNet module (e.g. to_q to_k).")

    # ---- helpers ----
    @property
    def resolved_lora_alpha(self) -> float:
        return float(self.lora_rank if self.lora_alpha is None else self.lora_alpha)


# --------------------------------------------------------------------------------------------------------------
# dataclass -> argparse
# --------------------------------------------------------------------------------------------------------------


def _unwrap_optional(tp):
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_none(conv):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else conv(s)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def build_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per dataclass field, plus `--config FILE`."""
    parser = argparse.ArgumentParser(description=description or cls.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="A yaml or json file of field: value; flags override it.")
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kw: dict[str, Any] = {"help": f.metadata.get("help", ""), "dest": f.name, "default": default}
        origin = typing.get_origin(tp)
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kw["choices"] = list(typing.get_args(tp))
            kw["type"] = type(kw["choices"][0])
        elif origin is list:
            (inner,) = typing.get_args(tp)
            kw["nargs"] = "+"
            kw["type"] = inner
        else:
            kw["type"] = _parse_none(tp) if optional else tp
        parser.add_argument(f"--{f.name}", **kw)
    return parser


def _load_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file.")
    text = p.read_text()
    import yaml

    try:
        data = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:  # parse errors carry a line number
        raise UserError(f"--config {path} is not valid {p.suffix.lstrip('.') or 'json'}: {e}".splitlines()[0])
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of field: value.")
    return data


def parse_config(cls: type, argv: list[str] | None = None, description: str | None = None):
    """Parse flags (and `--config FILE`) into a checked `cls` instance. Flags on the command line win."""
    parser = build_parser(cls, description)
    names = {f.name for f in fields(cls)}
    args_list = list(argv) if argv is not None else None
    # find --config first so the file's values become defaults and explicit flags override them
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", default=None)
    known, _ = first.parse_known_args(args_list)
    config_path = known.config
    if config_path:
        data = _load_config_file(config_path)
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"--config {config_path}: unknown field(s) {', '.join(unknown)}; see --help for names.")
        parser.set_defaults(**data)
    ns = parser.parse_args(args_list)
    values = {k: v for k, v in vars(ns).items() if k in names}
    cfg = cls(**values)
    cfg.check()
    return cfg
