"""Config dataclasses -> command-line flags, in layers, with checks before anything is loaded.

Every field carries `help` in its metadata (`field_(default, "sentence", group=..., flags=...)`); the flag `--name`
is generated from the field name (plus any extra option strings in `flags`), its type from the annotation
(`bool` -> `--x/--no-x`, `Literal[...]` -> choices), and `--help` lists the fields by group. Values come in layers,
each overriding the one before:

    the dataclass defaults
    < the calling script's defaults (train_scripts/*.sh pass them in REFL_DDPO_DEFAULTS)
    < a preset (`--preset NAME`, from the config's PRESETS table) where the config has one
    < --config FILE (yaml or json)
    < the flags on the command line (later flags win over earlier ones)

Aliases of a field (`ALIASES = {alias: field}` on the config class) are resolved per layer: an alias and its field
given in the same layer must agree. Cross-field checks live in each config's `check()` and raise `UserError` naming
the fields; they run before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import shlex
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from refl_ddpo.errors import UserError, read_utf8

DEFAULTS_ENV = "REFL_DDPO_DEFAULTS"  # a script's defaults, as flags (a layer below --config)
PROG_ENV = "REFL_DDPO_PROG"  # how the user called the program, for --help and usage lines


def field_(default: Any, help: str, group: str | None = None, flags: tuple[str, ...] = (), **kw) -> Any:
    """A dataclass field with a help sentence; `group` starts a --help section that the fields after it share
    (until the next group); `flags` are extra option strings (aliases). Mutable defaults are copied per instance.

    Numbers: `gt` / `ge` / `lt` / `le` bound the value (checked by `ConfigBase.check_numbers`); a float must be
    finite unless `allow_inf=True` (NaN never passes)."""
    metadata = {"help": help, "group": group, "flags": tuple(flags), **kw}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class ConfigBase:
    """What every config dataclass can do: dict/JSON out, a readable print, shared checks."""

    ALIASES: ClassVar[dict[str, str]] = {}  # alias field -> the field it stands for
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}  # --preset NAME -> field values (a defaults layer)

    def __post_init__(self) -> None:
        """An alias left unset reads as its field (the saved config reads either way)."""
        for alias, name in self.ALIASES.items():
            if getattr(self, alias) is None:
                object.__setattr__(
                    self, alias, getattr(self, name)
                )  # during construction: frozen configs too

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
        """Field and cross-field checks; subclasses extend and call super().check()."""
        self.check_numbers()


def accelerate_mixed_precision() -> str:
    """The mixed_precision of the user's accelerate config (`accelerate config`), or 'no' without one."""
    try:
        from accelerate.commands.config.config_args import default_config_file
    except ImportError:
        return "no"
    path = Path(os.environ.get("ACCELERATE_CONFIG_FILE", default_config_file))
    if not path.is_file():
        return "no"
    import yaml

    try:
        data = (
            yaml.safe_load(path.read_text())
            if path.suffix in (".yaml", ".yml")
            else json.loads(path.read_text())
        )
    except (OSError, ValueError, yaml.YAMLError):
        return "no"
    value = str(data.get("mixed_precision", "no")) if isinstance(data, dict) else "no"
    return value if value in ("no", "fp16", "bf16") else "no"


@dataclass(frozen=True)
class CommonConfig(ConfigBase):
    """Fields shared by all trainers."""

    pretrained_model: str = field_(
        "checkpoint/stable-diffusion-v1-4",
        "Base model: a local diffusers folder (SD 1.x/2.x) or a hub id (e.g. CompVis/stable-diffusion-v1-4).",
        group="models",
        flags=("--pretrained_model_name_or_path",),
    )
    drop_t5: bool = field_(
        False,
        "SD3: load without the T5 text encoder (saves about 9 GB for SD3.5; SD3 was trained to work without it). "
        "A folder without text_encoder_3 loads without T5 anyway.",
    )
    reward_model_dir: str = field_(
        "checkpoint",
        "Folder with the reward models' files: ImageReward.pt, med_config.json and bert-base-uncased/ (or the hub id "
        "THUDM/ImageReward), aesthetic/, the toy world's toy_classifier.*.",
    )
    output_dir: str = field_(
        "checkpoint/out",
        "Where the final LoRA, its config.json and checkpoint-N/ go. A folder that already holds a run is refused "
        "unless --resume_from_checkpoint continues it or --overwrite_output_dir replaces it.",
        group="data and output",
    )
    overwrite_output_dir: bool = field_(
        False,
        "Replace the run in --output_dir: delete its checkpoints, final weights, run.json, logs, debug/, "
        "validation/ and model card first.",
    )
    prompts_file: str | None = field_(
        None, "Prompts: one per line, or a JSON list of strings / {'text'|'prompt': ...} objects."
    )
    seed: int = field_(42, "Seed for noise, timestep choices and data order (each process adds its rank).")
    resolution: int | None = field_(
        None,
        "Image side in pixels; default: the model's native one (its sample_size x VAE scale factor).",
        group="sampling",
    )
    num_inference_steps: int = field_(40, "Denoising steps of the sampler.")
    guidance_scale: float = field_(
        7.5, "Classifier-free guidance scale used when sampling (1 turns CFG off)."
    )
    learning_rate: float = field_(1e-4, "AdamW learning rate.", group="optimisation", gt=0)
    adam_beta1: float = field_(0.9, "AdamW beta1.", ge=0, lt=1)
    adam_beta2: float = field_(0.999, "AdamW beta2.", ge=0, lt=1)
    adam_weight_decay: float = field_(1e-2, "AdamW weight decay.", ge=0)
    adam_epsilon: float = field_(1e-8, "AdamW epsilon.", ge=0)
    use_8bit_adam: bool = field_(False, "Use bitsandbytes' 8-bit AdamW (must be installed).")
    max_grad_norm: float = field_(
        1.0, "Clip the gradient norm of the trained parameters to this (0 = off).", ge=0
    )
    train_batch_size: int = field_(1, "Images per optimizer micro-batch, per GPU.")
    gradient_accumulation_steps: int = field_(1, "Micro-batches accumulated into one optimizer step.")
    mixed_precision: Literal["no", "fp16", "bf16"] | None = field_(
        None,
        "Dtype of the frozen weights and of autocast; trainable weights stay float32. Default: the "
        "mixed_precision of your accelerate config (`accelerate config`), else no.",
    )
    allow_tf32: bool = field_(True, "Allow TF32 matmuls on Ampere+ GPUs (faster, ~1e-3 relative error).")
    use_lora: bool = field_(
        True, "Train LoRA adapters on the network; --no-use_lora fine-tunes all of it.", group="LoRA"
    )
    lora_rank: int = field_(4, "LoRA rank r.")
    lora_alpha: float | None = field_(None, "LoRA alpha (scale alpha/r); default: equal to the rank.", gt=0)
    lora_target_modules: list[str] | None = field_(
        None,
        "Module names of the network that get LoRA adapters; default: the model family's (SD 1.x/2.x: to_q to_k "
        "to_v to_out.0; SD3: those and add_q_proj add_k_proj add_v_proj to_add_out).",
    )
    lora_init: Literal["gaussian", "default", "random"] = field_(
        "gaussian",
        "LoRA init: 'gaussian' (peft: Gaussian A, zero B, so training starts at the base model), 'default' "
        "(Kaiming A, zero B), or 'random' (A and B random: the output changes at once; for tests).",
    )
    gradient_checkpointing: bool = field_(False, "Recompute network activations in backward to save memory.")
    checkpointing_steps: int = field_(
        0,
        "Save accelerate state to output_dir/checkpoint-N every N steps (0 = off).",
        group="state and logging",
    )
    checkpoints_total_limit: int | None = field_(None, "Keep at most this many checkpoint-N folders.")
    resume_from_checkpoint: str | None = field_(
        None,
        "'latest', a checkpoint-N path, or the hub id 'user/repo' of a run pushed with --push_to_hub (its newest "
        "checkpoint) to resume from.",
    )
    device: str | None = field_(
        None,
        "cpu or cuda (each process on its own GPU; refused without one); default: what accelerate picks.",
    )
    logging_dir: str = field_(
        "logs",
        "TensorBoard folder, relative to output_dir; each start of a trainer logs to a new run-N/ in it.",
    )
    report_to: Literal["tensorboard", "wandb", "all", "none"] = field_(
        "tensorboard",
        "Where scalars and images are logged, through accelerate's trackers: tensorboard (output_dir/logs), wandb "
        "(its run files in output_dir/logs/wandb; WANDB_MODE=offline needs no network nor account), all (both) or "
        "none.",
    )
    validation_prompts_file: str | None = field_(
        None,
        "Held-out prompts to validate on during training (a file, or a shipped list such as toy_world_heldout): "
        "before the first step, every --validation_steps, and after the last, the same seeds through the "
        "deterministic sampler, scored by the training reward(s), logged as validation/<reward>/mean and a "
        "captioned grid (also saved to output_dir/validation/). None = no validation.",
        group="validation",
    )
    num_validation_images: int = field_(
        2,
        "Images per validation prompt; image j of prompt i is seeded --seed + i x this + j, as inference.py seeds "
        "them, so only the weights change the validation images.",
    )
    validation_num_steps: int = field_(
        40,
        "Steps of the validation sampler, the long deterministic one: DDIM with eta 0 (SD 1.x/2.x) or the flow "
        "ODE (SD3), as inference.py runs them.",
    )
    validation_guidance_scale: float = field_(
        7.5, "Classifier-free guidance of the validation sampler (1 turns CFG off).", ge=0
    )
    validation_batch_size: int = field_(
        4, "Validation images per network batch: memory and speed (the images change only by float rounding)."
    )
    push_to_hub: bool = field_(
        False,
        "At the end, upload the final weights, config.json, the model card README.md, the last validation grid "
        "and the newest checkpoint-N (so that --resume_from_checkpoint REPO_ID continues it) to the hub repo "
        "--hub_model_id (huggingface_hub; HF_ENDPOINT picks another server).",
        group="hub",
    )
    hub_model_id: str | None = field_(
        None,
        "Hub repo for --push_to_hub: 'user/name' or 'name' (under the token's user); default: the name of "
        "--output_dir.",
    )
    hub_token: str | None = field_(
        None,
        "Hub token for --push_to_hub; default: HF_TOKEN or the one `hf auth login` saved. Never saved nor logged.",
        secret=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mixed_precision is None:  # during construction: the config is frozen afterwards
            object.__setattr__(self, "mixed_precision", accelerate_mixed_precision())

    def check(self) -> None:
        super().check()
        self.check_positive(
            "num_inference_steps",
            "train_batch_size",
            "gradient_accumulation_steps",
            "lora_rank",
            "learning_rate",
        )
        if self.resolution is not None:
            self.check_positive("resolution")
        if self.checkpointing_steps < 0:
            raise UserError("--checkpointing_steps must be >= 0 (0 turns periodic checkpoints off).")
        if self.lora_target_modules is not None and not self.lora_target_modules:
            raise UserError("--lora_target_modules is empty: name at least one module (e.g. to_q to_k).")
        check_train_device(self.device)
        self.check_positive("num_validation_images", "validation_num_steps", "validation_batch_size")
        check_trackers(self.report_to)
        if self.hub_model_id is not None and not self.push_to_hub:
            raise UserError("--hub_model_id names the repo of --push_to_hub: add --push_to_hub (or drop it).")

    @property
    def resolved_lora_alpha(self) -> float:
        return float(self.lora_rank if self.lora_alpha is None else self.lora_alpha)


TRACKERS = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "all": ["tensorboard", "wandb"], "none": []}


def check_trackers(report_to: str) -> None:
    """--report_to's trackers are installed (before anything is loaded)."""
    import importlib.util

    for name in TRACKERS[report_to]:
        if importlib.util.find_spec(name) is None:
            raise UserError(
                f"--report_to {report_to} needs {name}: pip install -r requirements.txt (or --report_to none)."
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


# --------------------------------------------------------------------------------------------------------------
# dataclass -> argparse
# --------------------------------------------------------------------------------------------------------------


def _unwrap_optional(tp):
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_none(conv):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else conv(s)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; the description's own lines and paragraphs kept."""


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors are one line, without the usage block, and name the closest flags to an unknown one
    ("did you mean --learning_rate?")."""

    def error(self, message: str):
        hints = []
        if "unrecognized arguments:" in message:
            for flag in re.findall(r"(?<!\S)--?[A-Za-z][\w-]*", message.partition(":")[2]):
                close = difflib.get_close_matches(flag, self._option_string_actions, n=2, cutoff=0.7)
                if close:
                    hints.append(f"{flag}: did you mean {' or '.join(close)}?")
        tail = "; ".join(hints) or "--help lists the flags"
        self.exit(2, f"{self.prog}: error: {message} ({tail})\n")


def build_parser(
    cls: type,
    description: str | None = None,
    suppress_defaults: bool = False,
    prog: str | None = None,
    script_defaults: dict | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per dataclass field (grouped as the fields' `group`s), plus `--config`.

    `suppress_defaults`: unset flags are absent from the namespace (to read which flags were given);
    `script_defaults`: the calling script's values, shown as the defaults (so that --help shows what runs)."""
    parser = FlagParser(
        prog=prog or os.environ.get(PROG_ENV),
        usage="%(prog)s [--flag VALUE ...]   (--help: the flags by topic)",
        description=description or cls.__doc__,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
    )
    parser.add_argument("--config", help="A yaml or json file of field: value; flags override it.")
    hints = typing.get_type_hints(cls)
    group = parser
    for f in fields(cls):
        if f.metadata.get("group"):
            group = parser.add_argument_group(f.metadata["group"])
        tp, optional = _unwrap_optional(hints[f.name])
        kw: dict[str, Any] = {"help": f.metadata.get("help", ""), "dest": f.name}
        if not suppress_defaults:
            kw["default"] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
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
        if f.name == "preset" and getattr(cls, "PRESETS", None):
            kw["choices"] = list(cls.PRESETS)
            kw.pop("type", None)
        group.add_argument(f"--{f.name}", *f.metadata.get("flags", ()), **kw)
    if script_defaults and not suppress_defaults:
        parser.set_defaults(**script_defaults)
    return parser


def _load_config_file(path: str, cls: type) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file.")
    import yaml

    text = read_utf8(p, f"--config {path}")
    try:
        data = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:  # parse errors carry a line number
        raise UserError(
            f"--config {path} is not valid {p.suffix.lstrip('.') or 'json'}: {e}".splitlines()[0]
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of field: value.")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(map(str, data)) - names)
    if unknown:
        raise UserError(f"--config {path}: unknown field(s) {', '.join(unknown)}; see --help for names.")
    hints = typing.get_type_hints(cls)
    return {name: _file_value(hints[name], value, f"--config {path}: {name}") for name, value in data.items()}


_TRUE, _FALSE = ("true", "1"), ("false", "0")
_INVALID = object()  # a --config value that its field's type does not take


def _file_bool(value):
    """A YAML / JSON boolean, 0 / 1, or the strings true / false / 1 / 0, as a bool; else _INVALID."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    return text in _TRUE if text in _TRUE + _FALSE else _INVALID


def _file_number(tp: type, value):
    """An int / float field's value (a number, not a bool, or a string such as '1e-4'), else _INVALID."""
    if isinstance(value, tp if tp is int else (int, float)) and not isinstance(value, bool):
        return tp(value)
    if isinstance(value, str):
        try:
            return tp(value)
        except ValueError:
            pass
    return _INVALID


def _file_value(tp, value, where: str):
    """A --config value as its field's type, read as strictly as the flag would be: null only where the field may
    be None; booleans are YAML/JSON booleans, 0 / 1 or the strings true / false / 1 / 0 (not yes / no / on: a YAML
    file's unquoted yes / no are YAML 1.1 booleans already); numbers may be written as strings ('1e-4', which
    PyYAML reads as a string)."""
    tp, optional = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{where} is null; give {_describe(tp)}, or leave the key out for the default.")
    if tp is bool:
        converted = _file_bool(value)
    elif origin is Literal:
        converted = value if not isinstance(value, bool) and value in typing.get_args(tp) else _INVALID
    elif origin is list:
        (inner,) = typing.get_args(tp)
        ok = isinstance(value, list) and all(isinstance(v, inner) and not isinstance(v, bool) for v in value)
        converted = list(value) if ok else _INVALID
    elif tp in (int, float):
        converted = _file_number(tp, value)
    elif tp is str:
        converted = value if isinstance(value, str) else _INVALID
    else:
        converted = value
    if converted is not _INVALID:
        return converted
    raise UserError(f"{where} is {value!r} ({type(value).__name__}); give {_describe(tp)}.")


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin is list:
        return f"a list of {typing.get_args(tp)[0].__name__} values, e.g. [a, b]"
    return {int: "a whole number", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", "a value")
    )


def _resolve_aliases(cls: type, layer: dict, where: str) -> dict:
    """An alias in a layer sets its field; both in one layer must agree."""
    layer = dict(layer)
    for alias, name in getattr(cls, "ALIASES", {}).items():
        if alias in layer and layer[alias] is not None:
            if name in layer and layer[name] != layer[alias]:
                raise UserError(
                    f"--{alias} {layer[alias]} and --{name} {layer[name]} disagree{where}; --{alias} "
                    f"is an alias of --{name}: give only one of them."
                )
            layer[name] = layer.pop(alias)
        layer.pop(alias, None)
    return layer


def parse_layers(cls: type, argv: list[str] | None = None, description: str | None = None) -> dict:
    """The field values from every layer (see the module doc), merged, before the dataclass is built."""
    explicit = build_parser(cls, description, suppress_defaults=True)
    script = vars(explicit.parse_args(shlex.split(os.environ.get(DEFAULTS_ENV, ""))))
    script.pop("config", None)
    script = _resolve_aliases(cls, script, " in the script's defaults")
    # --help (with the script's values as the defaults), and argparse's own errors
    build_parser(cls, description, script_defaults=script).parse_args(argv)
    flags = vars(explicit.parse_args(argv))
    config_path = flags.pop("config", None)
    layers = [(script, "script")]
    file_layer = _load_config_file(config_path, cls) if config_path else {}
    flags_layer = _resolve_aliases(cls, flags, "")
    file_layer = _resolve_aliases(cls, file_layer, f" in --config {config_path}")
    preset = flags_layer.get("preset", file_layer.get("preset", layers[0][0].get("preset")))
    presets = getattr(cls, "PRESETS", {})
    if preset is not None:
        if preset not in presets:
            raise UserError(f"--preset {preset}: unknown; choose from {', '.join(presets) or 'none'}.")
        layers.append((dict(presets[preset]), "preset"))
    layers += [(file_layer, "file"), (flags_layer, "flags")]
    values: dict = {}
    for layer, _ in layers:
        values.update(layer)
    return values


def parse_config(cls: type, argv: list[str] | None = None, description: str | None = None):
    """Parse the layers (script defaults, preset, --config FILE, flags) into a checked `cls` instance."""
    cfg = cls(**parse_layers(cls, argv, description))  # aliases filled in by __post_init__
    cfg.check()
    return cfg
