"""Config dataclasses: every field with its help sentence and --help section (`field_`), the fields every trainer
shares (`CommonConfig`), their checks. A config is resolved once (refl_ddpo.run.flags: script defaults < --preset <
--config FILE < flags) and frozen; cross-field checks live in each config's `check()` and raise `UserError` naming
the fields, before any model is loaded."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from refl_ddpo.core.errors import UserError

# Appended to the help of every guidance-scale flag: FLUX.1's guidance is an input of the network (families/flux.py).
FLUX_GUIDANCE = " FLUX.1-dev takes it as its embedded guidance instead (unset: the pipeline's default, 3.5; schnell ignores it)."


def field_(default: Any, help: str, group: str | None = None, flags: tuple[str, ...] = (), **kw) -> Any:
    """A dataclass field with a help sentence; `group` starts a --help section that the fields after it share
    (until the next group); `flags` are extra option strings (aliases). Mutable defaults are copied per instance.

    Numbers: `gt` / `ge` / `lt` / `le` bound the value (checked by `ConfigBase.check_numbers`); a float must be
    finite unless `allow_inf=True` (NaN never passes)."""
    metadata = {"help": help, "group": group, "flags": tuple(flags), **kw}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_sections(cls: type) -> list[tuple[str, list[dataclasses.Field]]]:
    """A config's fields by `--help` section: a field's `group` starts a section that the fields after it share (a
    field a subclass redefines without a group keeps the group its base gave it); fields before any group are in
    `options` (argparse's, beside --config). Sections of the same title are merged, in order of first appearance."""
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


def guidance_field(cfg_default: float, help: str, **kw) -> Any:
    """A guidance-scale flag, None (unset) until the model's family is known: `refl_ddpo.core.families.resolve_guidance`
    then gives it `cfg_default` on a family with classifier-free guidance and the pipeline's embedded guidance on
    FLUX.1 (`ModelFamily.default_guidance_scale`); a value the user sets always wins. The printed and saved config
    show the value used."""
    return field_(None, f"{help} Default: {cfg_default:g}.{FLUX_GUIDANCE}", cfg_default=cfg_default, **kw)


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
        "A folder without text_encoder_3 loads without T5 anyway. FLUX.1 refuses it (T5 reads its prompt).",
    )
    offload_text_encoders: bool = field_(
        False,
        "Keep the text encoders on the CPU and move them to the GPU only while they encode a batch of prompts, so "
        "their weights are not resident during sampling, backprop and rewards (FLUX.1's T5-XXL + CLIP-L: about 9.1 "
        "GiB in bf16; Qwen-Image's Qwen2.5-VL: about 15.4 GiB). Costs one host-to-GPU copy of them per encoded batch.",
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
    guidance_scale: float | None = guidance_field(
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
        "Module names of the network that get LoRA adapters; default: the model family's (SD 1.x/2.x and SDXL: "
        "to_q to_k to_v to_out.0; SD3: those and add_q_proj add_k_proj add_v_proj to_add_out; FLUX.1: SD3's and "
        "proj_mlp proj_out; Qwen-Image: SD3's and img_mlp.net.0.proj img_mlp.net.2 txt_mlp.net.0.proj txt_mlp.net.2).",
    )
    lora_init: Literal["gaussian", "default", "random"] = field_(
        "gaussian",
        "LoRA init: 'gaussian' (peft: Gaussian A, zero B, so training starts at the base model), 'default' "
        "(Kaiming A, zero B), or 'random' (A and B random: the output changes at once; for tests).",
    )
    gradient_checkpointing: bool = field_(False, "Recompute network activations in backward to save memory.")
    fsdp: bool = field_(
        False,
        "Shard the trained network per block over the processes with FSDP2 (accelerate's FSDP plugin): fp32 master "
        "weights, --mixed_precision compute, gradients reduced in fp32; text encoders (but with "
        "--fsdp_shard_text_encoders), VAE and rewards stay whole. Final weights are written gathered, as without it; "
        "checkpoints as --fsdp_checkpoint says. See docs/multi_gpu.md.",
    )
    fsdp_checkpoint: Literal["gathered", "sharded"] = field_(
        "gathered",
        "With --fsdp, how checkpoint-N holds the trained weights and their optimizer state: 'gathered' (the main "
        "process writes them whole: the LoRA or unet/ in diffusers format, the optimizer as safetensors) or "
        "'sharded' (each process writes its own shards with torch.distributed.checkpoint, in DCP's own format "
        "under checkpoint-N/fsdp_shards/: no gathering, for networks too big for one process' memory; resume "
        "with the same process count). The final weights are written gathered either way.",
    )
    fsdp_cpu_offload: bool = field_(
        False,
        "With --fsdp: keep the shards and their optimizer state on the CPU between uses (slower, less GPU).",
    )
    deepspeed_zero: Literal[2, 3] | None = field_(
        None,
        "Run the trained network in DeepSpeed's engine with ZeRO stage 2 (accelerate's DeepSpeed plugin): the "
        "optimizer state and gradients partitioned over the processes, the weights whole on each; clipping at "
        "--max_grad_norm by DeepSpeed. Stage 3 is refused (use --fsdp). Needs deepspeed (requirements.txt). See "
        "docs/multi_gpu.md.",
    )
    fsdp_shard_text_encoders: bool = field_(
        False,
        "With --fsdp: shard the frozen text encoders too (FSDP2 per block, resharded after each encode), so each GPU "
        "holds 1/N of them (FLUX.1's T5-XXL + CLIP-L: about 9.1 GiB in bf16 whole; Qwen-Image's Qwen2.5-VL: about "
        "15.4 GiB). Every process takes part in each encode. Not with --offload_text_encoders (pick one).",
    )
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
        "ODE (SD3, FLUX.1, Qwen-Image), as inference.py runs them.",
    )
    validation_guidance_scale: float | None = guidance_field(
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
        if self.fsdp_cpu_offload and not self.fsdp:
            raise UserError("--fsdp_cpu_offload offloads FSDP's shards: add --fsdp (or drop it).")
        if self.fsdp_checkpoint != "gathered" and not self.fsdp:
            raise UserError(
                f"--fsdp_checkpoint {self.fsdp_checkpoint} writes FSDP's shards: add --fsdp (or drop it)."
            )
        if self.fsdp_shard_text_encoders and not self.fsdp:
            raise UserError("--fsdp_shard_text_encoders shards them with FSDP: add --fsdp (or drop it).")
        if self.fsdp_shard_text_encoders and self.offload_text_encoders:
            raise UserError(
                "--fsdp_shard_text_encoders and --offload_text_encoders both move the text encoders off the GPU: "
                "pick one."
            )
        check_deepspeed(self.deepspeed_zero, self.fsdp)
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
