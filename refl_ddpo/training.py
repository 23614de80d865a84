"""What both trainers share around their loops: accelerator, trainable UNet, optimizer, checkpoints, logging."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from refl_ddpo.config import CommonConfig
from refl_ddpo.errors import UserError
from refl_ddpo.lora import FULL_UNET_DIR, add_lora, load_lora_into_unet, save_lora, trainable_full_unet

TRAIN_STATE_JSON = "train_state.json"  # our own counters, JSON
TRAIN_STATE_TENSORS = "train_state.safetensors"  # our own generator states and tensors (no pickle)


# ---- checks before anything is loaded ----


def check_output_dir(path: str) -> Path:
    """Create `path` (and check we may write there) before any model is loaded."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test.{os.getpid()}"  # one per process: ranks check at the same time
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--output_dir {path} is not writable ({e.strerror}); pick a folder you can write to.")
    return out


def resolve_resume(cfg: CommonConfig) -> Path | None:
    """'latest' -> the newest output_dir/checkpoint-N (None if there is none yet); a path must exist."""
    if not cfg.resume_from_checkpoint:
        return None
    if cfg.resume_from_checkpoint == "latest":
        found = list_checkpoints(cfg.output_dir)
        return found[-1] if found else None
    path = Path(cfg.resume_from_checkpoint)
    if not (path / TRAIN_STATE_JSON).is_file():
        raise UserError(f"--resume_from_checkpoint {path} is not a checkpoint-N folder written by this kit.")
    return path


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """checkpoint-N folders with a complete state, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if re.fullmatch(r"checkpoint-\d+", p.name) and (p / TRAIN_STATE_JSON).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


# ---- accelerator and model ----


def make_accelerator(cfg: CommonConfig, gradient_accumulation_steps: int):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    log_with = None if cfg.report_to == "none" else cfg.report_to
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                            logging_dir=os.path.join(cfg.output_dir, cfg.logging_dir)),
        cpu=cfg.device == "cpu",
    )
    if cfg.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return accelerator


def weight_dtype(accelerator) -> torch.dtype:
    """Dtype of the frozen weights: the mixed-precision dtype (fp32 without it)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


def make_trainable(unet, cfg: CommonConfig) -> list[torch.nn.Parameter]:
    """LoRA adapters (or the whole UNet) trainable in fp32; gradient checkpointing if asked."""
    if cfg.use_lora:
        params = add_lora(unet, cfg.lora_rank, cfg.resolved_lora_alpha, cfg.lora_target_modules, cfg.lora_init)
    else:
        params = trainable_full_unet(unet)
    if cfg.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    return params


def make_optimizer(params: list[torch.nn.Parameter], cfg: CommonConfig) -> torch.optim.Optimizer:
    if cfg.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UserError("--use_8bit_adam needs bitsandbytes: pip install bitsandbytes (or drop the flag).") from None
        cls = bnb.optim.AdamW8bit
    else:
        cls = torch.optim.AdamW
    return cls(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
               weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon)


def register_unet_hooks(accelerator, unet) -> None:
    """accelerate save/load_state keep only the LoRA (diffusers format) or the full UNet, not a pickled model."""

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for model in models:
                save_lora(accelerator.unwrap_model(model), output_dir)
        weights.clear()  # nothing else of the model is written by accelerate

    def load_hook(models, input_dir):
        while models:
            model = accelerator.unwrap_model(models.pop())
            if getattr(model, "peft_config", None):
                load_lora_into_unet(model, input_dir)
            else:
                from diffusers import UNet2DConditionModel

                loaded = UNet2DConditionModel.from_pretrained(Path(input_dir) / FULL_UNET_DIR)
                model.load_state_dict(loaded.state_dict())

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


# ---- checkpoints ----


def save_checkpoint(accelerator, cfg: CommonConfig, step: int, counters: dict,
                    tensors: dict[str, torch.Tensor]) -> Path:
    """output_dir/checkpoint-N: accelerate state (LoRA, optimizer, lr scheduler) + our counters and generators.

    The folder is written under a temporary name and renamed, so a run killed mid-save leaves no half checkpoint.
    """
    final = Path(cfg.output_dir) / f"checkpoint-{step}"
    tmp = Path(cfg.output_dir) / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / TRAIN_STATE_TENSORS))
        (tmp / TRAIN_STATE_JSON).write_text(json.dumps(counters, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if cfg.checkpoints_total_limit:
            for old in list_checkpoints(cfg.output_dir)[: -cfg.checkpoints_total_limit]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore accelerate state from `path`; return our (counters, tensors)."""
    from safetensors.torch import load_file

    accelerator.load_state(str(path))
    counters = json.loads((path / TRAIN_STATE_JSON).read_text())
    tensors = load_file(str(path / TRAIN_STATE_TENSORS)) if (path / TRAIN_STATE_TENSORS).is_file() else {}
    return counters, tensors


def save_final(accelerator, unet, cfg: CommonConfig) -> None:
    """The final LoRA (diffusers format) and the resolved config at the top of output_dir."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_lora(accelerator.unwrap_model(unet), cfg.output_dir, config=cfg.to_dict())
        print(f"saved final weights and config.json to {cfg.output_dir}", flush=True)
    accelerator.wait_for_everyone()


# ---- logging ----


def log_image_grid(accelerator, tag: str, images: torch.Tensor, captions: list[str], step: int) -> None:
    """A captioned grid of images (B, 3, H, W) in [0, 1] to tensorboard (main process only)."""
    if not accelerator.is_main_process or accelerator.trackers == []:
        return
    grid = caption_grid(images, captions)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(tag, grid, step)


def caption_grid(images: torch.Tensor, captions: list[str], cell: int = 256, cols: int = 4) -> torch.Tensor:
    """(3, H, W) uint8 grid: each image resized to `cell` px with its caption drawn under it."""
    from PIL import Image, ImageDraw
    from torchvision.transforms.functional import pil_to_tensor, to_pil_image

    n = len(images)
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    text_h = 28
    canvas = Image.new("RGB", (cols * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (img, cap) in enumerate(zip(images, captions)):
        x, y = (i % cols) * cell, (i // cols) * (cell + text_h)
        canvas.paste(to_pil_image(img.detach().float().clamp(0, 1).cpu()).resize((cell, cell)), (x, y))
        draw.text((x + 4, y + cell + 2), cap[:48], fill="black")
        if len(cap) > 48:
            draw.text((x + 4, y + cell + 14), cap[48:96], fill="black")
    return pil_to_tensor(canvas)


def print_config(cfg: CommonConfig, extra: dict | None = None) -> None:
    print(f"{type(cfg).__name__}:\n{cfg.pretty()}", flush=True)
    for k, v in (extra or {}).items():
        print(f"  {k}: {v}", flush=True)
