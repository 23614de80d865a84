"""The parts every trainer's config is made of: small frozen dataclasses of fields, each field with its help sentence
and --help section (`field_`). A trainer's config inherits the parts it uses (refl_ddpo.run.config.SHARED_PARTS,
then its own, refl_ddpo.trainers.*_config) and reads them as flat attributes (`cfg.seed`, `cfg.lora_rank`)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# Appended to the help of every guidance-scale flag: FLUX.1's guidance is an input of the network (families/flux.py).
FLUX_GUIDANCE = " FLUX.1-dev takes it as its embedded guidance instead (unset: the pipeline's default, 3.5; schnell ignores it)."
Z_IMAGE_GUIDANCE = " On Z-Image it is the pipeline's guidance_scale + 1; unset on Z-Image-Turbo: 1 (no CFG)."


def field_(default: Any, help: str, group: str | None = None, flags: tuple[str, ...] = (), **kw) -> Any:
    """A dataclass field with a help sentence; `group` starts a --help section that the fields after it share
    (until the next group); `flags` are extra option strings (aliases). Mutable defaults are copied per instance.

    Numbers: `gt` / `ge` / `lt` / `le` bound the value (checked by `ConfigBase.check_numbers`); a float must be
    finite unless `allow_inf=True` (NaN never passes). `fill`: a function of the config that gives the field's value
    when it is left None (`ConfigBase.__post_init__`)."""
    metadata = {"help": help, "group": group, "flags": tuple(flags), **kw}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def guidance_field(cfg_default: float, help: str, **kw) -> Any:
    """A guidance-scale flag, None (unset) until the model's family is known: `refl_ddpo.core.families.resolve_guidance`
    then gives it `cfg_default` on a family with classifier-free guidance and the pipeline's embedded guidance on
    FLUX.1 (`ModelFamily.default_guidance_scale`); a value the user sets always wins. The printed and saved config
    show the value used."""
    help = f"{help} Default: {cfg_default:g}.{FLUX_GUIDANCE}{Z_IMAGE_GUIDANCE}"
    return field_(None, help, cfg_default=cfg_default, **kw)


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
class RunPart:
    """The base model, the reward models' folder, the output folder, the prompts and the seed."""

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
    edit_data: str | None = field_(
        None,
        "Image editing (FLUX.1 Kontext, Qwen-Image-Edit-Plus, FLUX.2's reference images): a JSONL of {'image': "
        "path or [paths], 'instruction': ...} lines (paths relative to it) or a folder with one as metadata.jsonl; "
        "the instructions are the prompts (it replaces --prompts_file / --prompt_fn) and the images, one size, "
        "sides multiples of 16, are the sources.",
    )
    seed: int = field_(42, "Seed for noise, timestep choices and data order (each process adds its rank).")


@dataclass(frozen=True)
class SamplerPart:
    """The image size and the sampler's steps and guidance."""

    resolution: int | None = field_(
        None,
        "Image side in pixels; default: the model's native one (its sample_size x VAE scale factor).",
        group="sampling",
    )
    num_inference_steps: int = field_(40, "Denoising steps of the sampler.")
    guidance_scale: float | None = guidance_field(
        7.5, "Classifier-free guidance scale used when sampling (1 turns CFG off)."
    )
    num_frames: int | None = field_(
        None,
        "Video models (Wan): frames per video, 1 + 4 k for Wan's VAE (e.g. 17, 33, 81); default: the pipeline's 81.",
    )
    wan_expert: Literal["transformer", "transformer_2", "both"] = field_(
        "transformer",
        "Wan 2.2 (two experts): the expert that gets the LoRA, transformer (high noise, t >= boundary_ratio x 1000) "
        "or transformer_2 (low noise), the other running frozen; or both: a LoRA on each, trained together (the "
        "low-noise one saved in transformer_2/).",
    )
    video_reduction: str = field_(
        "mean",
        "Video models: how an image reward scores a video from its frames: mean, min, mean:K / min:K over K "
        "frames evenly spaced (the first and the last among them), or first:K, the mean over the first K frames "
        "(ReFL / DRaFT / AlignProp then decode those frames alone, from the latent frames they need).",
    )


@dataclass(frozen=True)
class OptimizerPart:
    """AdamW, the batch per micro-batch and per optimizer step, the precision."""

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
        fill=lambda cfg: accelerate_mixed_precision(),
    )
    allow_tf32: bool = field_(True, "Allow TF32 matmuls on Ampere+ GPUs (faster, ~1e-3 relative error).")
    fold_lora: bool = field_(
        True,
        "With a 16-bit base, run the no-grad network calls (sampling, ReFL's steps before k, validation) with the "
        "LoRA folded into 16-bit copies of its target weights, as the stock pipeline runs a fused LoRA: the stock "
        "network's kernels and no more, at the memory of those copies while sampling (about 0.2 GiB for SD v1.5, "
        "1.1 GiB for SD3.5-M, 11 GiB for FLUX.1-dev with every linear layer targeted). --no-fold_lora: the "
        "LoRA layers as trained, under autocast.",
    )
    channels_last: bool = field_(
        False,
        "The network's weights (so its activations) in channels_last memory format: faster convolutions on GPUs "
        "(the UNets'; a transformer has none to change).",
    )
    compile: bool = field_(
        False,
        "torch.compile the network (it compiles in the first steps, once more for each new shape and for the "
        "no-grad calls' folded form).",
    )


@dataclass(frozen=True)
class LoRAPart:
    """LoRA adapters on the network, or the whole network trained."""

    use_lora: bool = field_(
        True, "Train LoRA adapters on the network; --no-use_lora fine-tunes all of it.", group="LoRA"
    )
    lora_rank: int = field_(4, "LoRA rank r.")
    lora_alpha: float | None = field_(None, "LoRA alpha (scale alpha/r); default: equal to the rank.", gt=0)
    lora_target_modules: list[str] | None = field_(
        None,
        "Module names of the network that get LoRA adapters; default: the model family's (SD 1.x/2.x and SDXL: "
        "to_q to_k to_v to_out.0; SD3: those and add_q_proj add_k_proj add_v_proj to_add_out; FLUX.1: SD3's and "
        "proj_mlp proj_out; Qwen-Image: SD3's and img_mlp.net.0.proj img_mlp.net.2 txt_mlp.net.0.proj txt_mlp.net.2; "
        "Z-Image: attention.to_q attention.to_k attention.to_v attention.to_out.0 feed_forward.w1 feed_forward.w2 "
        "feed_forward.w3; "
        "FLUX.2: SD3's and ff.linear_in ff.linear_out ff_context.linear_in ff_context.linear_out to_qkv_mlp_proj).",
    )
    lora_init: Literal["gaussian", "default", "random"] = field_(
        "gaussian",
        "LoRA init: 'gaussian' (peft: Gaussian A, zero B, so training starts at the base model), 'default' "
        "(Kaiming A, zero B), or 'random' (A and B random: the output changes at once; for tests).",
    )

    @property
    def resolved_lora_alpha(self) -> float:
        return float(self.lora_rank if self.lora_alpha is None else self.lora_alpha)


@dataclass(frozen=True)
class MemoryPart:
    """What saves GPU memory: activation checkpointing, FSDP2's shards, DeepSpeed ZeRO-2."""

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


@dataclass(frozen=True)
class StatePart:
    """Checkpoints and resuming, the device, logging and trackers."""

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


@dataclass(frozen=True)
class ValidationPart:
    """Validation on held-out prompts during training."""

    validation_prompts_file: str | None = field_(
        None,
        "Held-out prompts to validate on during training (a file, or a shipped list such as toy_world_heldout): "
        "before the first step, every --validation_steps, and after the last, the same seeds through the "
        "deterministic sampler, scored by the training reward(s), logged as validation/<reward>/mean and a "
        "captioned grid (also saved to output_dir/validation/). An editing run's (--edit_data) is a file of edit "
        "records as --edit_data's, each instruction validated with its source image(s). None = no validation.",
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
        "ODE (SD3, FLUX.1, Qwen-Image, FLUX.2), as inference.py runs them.",
    )
    validation_guidance_scale: float | None = guidance_field(
        7.5, "Classifier-free guidance of the validation sampler (1 turns CFG off).", ge=0
    )
    validation_batch_size: int = field_(
        4, "Validation images per network batch: memory and speed (the images change only by float rounding)."
    )
    validation_reward: str | None = field_(
        None,
        "Rewards the validation images are also scored by, which training never optimises (a gold measure beside "
        "the proxy): the grammar of --reward, weights and user functions included (e.g. toy_judge, or "
        "'aesthetic:1,my_module:judge:0.5'); each logged as validation/<name>/mean|std (a weighted sum's total as "
        "validation/validation_reward/mean|std) and written in the validation records. None = only the training "
        "reward.",
    )
    early_stop_metric: str | None = field_(
        None,
        "A validation key to keep the best weights by and stop on (e.g. validation/toy_judge/mean, "
        "validation/drift/brightness): each validation that improves it writes output_dir/best/ (the weights, the "
        "grid, best.json) and records best_step and best_metric in run.json. None = no early stopping.",
    )
    early_stop_mode: Literal["max", "min"] = field_(
        "max", "Whether --early_stop_metric improves upwards (max) or downwards (min)."
    )
    early_stop_patience: int = field_(
        0,
        "Stop after this many validations in a row without an improvement of --early_stop_metric (0: never stop, "
        "only keep the best weights).",
        ge=0,
    )
    early_stop_min_delta: float = field_(
        0.0, "An improvement counts when it is larger than this (in the metric's units).", ge=0
    )
    final_weights: Literal["auto", "best", "last"] = field_(
        "auto",
        "What the final folder, the model card and the hub push hold: the best validation's weights (best/) or the "
        "last ones; auto: best when --early_stop_metric is set, else last.",
    )


@dataclass(frozen=True)
class HubPart:
    """Pushing the run to the hub."""

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
