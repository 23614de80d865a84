"""The flags of the inference scripts (`inference/inference.py`: `InferenceConfig`, `inference/inference_lora.py`:
`LoraInferenceConfig`), their checks before any model loads, and the names a run folder uses (scores.json's fields,
the settings that change the images), which `refl_ddpo.apps.compare` reads. Plain data: no model is loaded here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import check_edit_data
from refl_ddpo.core.lora import (
    CONFIG_NAME,
    FULL_UNET_DIR,
    LORA_WEIGHTS_NAME,
    check_lora_dir,
    read_saved_config,
)
from refl_ddpo.core.models import check_pretrained_model
from refl_ddpo.core.prompts import DATA_DIR
from refl_ddpo.run.config import ConfigBase
from refl_ddpo.run.parts import field_, guidance_field

DEFAULT_PROMPTS_FILE = DATA_DIR / "eval_prompts.txt"
DEFAULT_BASE_MODEL = "checkpoint/stable-diffusion-v1-4"  # relative to where the command runs (the repo root)
SCORES_FILE = "scores.json"
GRID_FILE = "grid.png"
SCORE_KEY = "imagereward"  # the default reward, and the score field of each record that old scores.json hold

# Settings that change the images; compare.py notes when two runs differ in any of them.
GENERATION_SETTINGS = (
    "pretrained_model",
    "num_inference_steps",
    "guidance_scale",
    "scheduler",
    "eta",
    "resolution",
    "dtype",
    "num_frames",
    "guidance_scale_2",
)


@dataclass
class InferenceConfig(ConfigBase):
    """Generate images for a prompts file with the base Stable Diffusion model and score them with ImageReward."""

    # ---- models ----
    pretrained_model: str = field_(
        DEFAULT_BASE_MODEL,
        "Base Stable Diffusion: a local diffusers folder or a hub id (e.g. CompVis/stable-diffusion-v1-4).",
    )
    drop_t5: bool = field_(
        False,
        "SD3: load without the T5 text encoder (a folder without text_encoder_3 loads without it anyway). FLUX.1 "
        "refuses it (T5 reads its prompt).",
    )
    offload_text_encoders: bool = field_(
        False,
        "Keep the text encoders on the CPU and move them to the device only while they encode a batch of prompts, "
        "so their weights are not resident while the network denoises and the VAE decodes.",
    )
    reward_model_dir: str = field_(
        "checkpoint",
        "Folder with ImageReward.pt, med_config.json and bert-base-uncased/ (and the files of other --rewards); "
        "without ImageReward's files the images are still written and its scores are null, with the reason in "
        "scores.json.",
    )
    rewards: str = field_(
        SCORE_KEY,
        "Rewards to score every image with, comma-separated names of the reward registry (e.g. "
        "imagereward,aesthetic,toy_color_match); each record of scores.json gets one field per reward, named as given.",
    )
    # ---- what to generate ----
    prompts_file: str = field_(
        str(DEFAULT_PROMPTS_FILE),
        "Prompts: one per line, or a JSON list of strings / {'prompt'|'text': ...} objects.",
    )
    edit_data: str | None = field_(
        None,
        "Image editing (FLUX.1 Kontext, Qwen-Image-Edit-Plus, FLUX.2's reference images): a JSONL of {'image': "
        "path or [paths], 'instruction': ...} lines (paths relative to it) or a folder with one as metadata.jsonl; "
        "its instructions replace --prompts_file, and each record of scores.json names its source image(s) and "
        "instruction.",
    )
    seed: int = field_(
        42, "Image j of prompt i uses its own generator seeded seed + i * num_images_per_prompt + j."
    )
    num_images_per_prompt: int = field_(4, "Images generated for each prompt (each with its own seed).")
    num_inference_steps: int = field_(50, "Denoising steps of the sampler.")
    guidance_scale: float | None = guidance_field(
        7.5, "Classifier-free guidance scale (1 or less turns CFG off)."
    )
    scheduler: Literal["ddim", "euler"] | None = field_(
        None,
        "Sampler, built from the model's scheduler config: ddim (SD 1.x/2.x, SDXL; eta 0 is deterministic) or "
        "euler (SD 1.x/2.x's and SDXL's Euler, or the flow-matching one of SD3, FLUX.1, Qwen-Image, Z-Image and "
        "FLUX.2); "
        "default: the model family's first (ddim for SD 1.x/2.x and SDXL, euler for the flow models).",
    )
    eta: float = field_(
        0.0, "DDIM eta: 0 is deterministic DDIM, 1 is DDPM-like noise (drawn from each image's seed)."
    )
    resolution: int | None = field_(
        None, "Image side in pixels (a multiple of the VAE scale factor); default: the model's native one."
    )
    num_frames: int | None = field_(
        None,
        "Video models (Wan): frames per video, 1 + 4 k for Wan's VAE (e.g. 17, 33, 81); default: the pipeline's 81.",
    )
    fps: int = field_(16, "Video models: frames per second of the written videos.", gt=0)
    guidance_scale_2: float | None = field_(
        None,
        "Wan 2.2: the guidance scale of its low-noise expert (transformer_2); default: --guidance_scale.",
    )
    video_reduction: str = field_(
        "mean",
        "Video models: how an image reward scores a video from its frames: mean, min, mean:K / min:K over K "
        "frames evenly spaced (the first and the last among them), or first:K, the mean over the first K frames.",
    )
    # ---- how ----
    batch_size: int = field_(
        4, "Images per UNet batch (CFG doubles the UNet batch); lower it if memory runs out."
    )
    device: str | None = field_(None, "Device (cpu, cuda, cuda:1 ...); default: cuda if available, else cpu.")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = field_(
        "auto",
        "Dtype of the diffusion models; auto: fp16 on a GPU, fp32 on the CPU. ImageReward runs in fp32.",
    )
    output_dir: str = field_(
        "outputs/base",
        "Folder for the PNGs, grid.png and scores.json. An earlier inference run's files there are deleted once the "
        "models have loaded; a folder with any other file is refused.",
    )
    grid_max_images: int = field_(64, "grid.png shows the first this-many images (0: no grid).")

    def check(self) -> None:
        """Resolve the automatic defaults (device, dtype) and check the fields, before any model is loaded."""
        super().check()  # every number finite
        self.check_positive("num_images_per_prompt", "num_inference_steps", "batch_size")
        if self.resolution is not None:
            self.check_positive("resolution")
        if self.grid_max_images < 0:
            raise UserError(f"--grid_max_images must be >= 0 (got {self.grid_max_images}); 0 writes no grid.")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise UserError(f"--guidance_scale must be >= 0 (got {self.guidance_scale}); 1 turns CFG off.")
        if self.eta < 0:
            raise UserError(f"--eta must be >= 0 (got {self.eta}); 0 is deterministic DDIM.")
        check_reward_list(self.rewards, self.reward_model_dir)
        if self.eta and self.scheduler not in (None, "ddim"):
            raise UserError(
                f"--eta {self.eta} needs --scheduler ddim (the {self.scheduler} sampler has no eta)."
            )
        self.device = resolve_device(self.device)
        if self.dtype == "auto":
            self.dtype = "fp16" if torch.device(self.device).type == "cuda" else "fp32"
        check_pretrained_model(self.pretrained_model)
        check_edit_data(self.pretrained_model, self.edit_data)
        check_video_flags(self)


def check_video_flags(cfg) -> None:
    """--num_frames, --guidance_scale_2 and --video_reduction fit the model (a video model; a frame count its VAE
    takes), before any model loads."""
    from refl_ddpo.core.video import check_video_flags as check
    from refl_ddpo.core.video import parse_reduction

    parse_reduction(cfg.video_reduction)
    check(cfg.pretrained_model, cfg.num_frames, guidance_scale_2=cfg.guidance_scale_2)


@dataclass
class LoraInferenceConfig(InferenceConfig):
    """Generate images for a prompts file with base Stable Diffusion + a trained LoRA, and score them."""

    pretrained_model: str | None = field_(
        None,
        "Base Stable Diffusion; default: the pretrained_model recorded in lora_dir/config.json, else "
        "checkpoint/stable-diffusion-v1-4.",
    )
    resolution: int | None = field_(
        None,
        "Image side in pixels; default: the resolution recorded in lora_dir/config.json, else the model's native one.",
    )
    num_frames: int | None = field_(
        None,
        "Video models (Wan): frames per video, 1 + 4 k; default: the num_frames recorded in lora_dir/config.json, "
        "else the pipeline's 81.",
    )
    output_dir: str = field_(
        "outputs/lora",
        "Folder for the PNGs, grid.png and scores.json. An earlier inference run's files there are deleted once the "
        "models have loaded; a folder with any other file is refused.",
    )
    lora_dir: str = field_(
        "checkpoint/refl_lora",
        "Trained LoRA folder (pytorch_lora_weights.safetensors, diffusers format; or unet/ of a full fine-tune), "
        "e.g. checkpoint/refl_lora or checkpoint/ddpo_lora, or the hub id 'user/repo' a trainer pushed it to "
        "(--push_to_hub).",
    )
    lora_scale: float = field_(
        1.0, "Multiplier of the LoRA update: 0 gives the base model, 1 the trained one."
    )

    def check(self) -> None:
        """Check lora_dir, fill pretrained_model / resolution from its config.json, then the common checks."""
        self.check_numbers()
        lora_dir = Path(self.lora_dir).expanduser()
        if not lora_dir.exists():
            from refl_ddpo.run.hub import download, is_hub_id

            if is_hub_id(
                self.lora_dir
            ):  # pushed with --push_to_hub: the weights, config and card, no checkpoints
                patterns = [LORA_WEIGHTS_NAME, f"{FULL_UNET_DIR}/*", CONFIG_NAME, "README.md"]
                lora_dir = download(self.lora_dir, "--lora_dir", allow_patterns=patterns)
                self.lora_dir = str(lora_dir)
        if not lora_dir.is_dir():
            raise UserError(
                f"--lora_dir {self.lora_dir} does not exist: train first (train_scripts/) or point it at "
                "a LoRA folder."
            )
        if not (
            (lora_dir / LORA_WEIGHTS_NAME).is_file() or (lora_dir / FULL_UNET_DIR / "config.json").is_file()
        ):
            checkpoints = sorted(
                p.name for p in lora_dir.glob("checkpoint-*") if (p / LORA_WEIGHTS_NAME).is_file()
            )
            hint = (
                f" (it holds {', '.join(checkpoints[-2:])}: point it at one of them)" if checkpoints else ""
            )
            raise UserError(
                f"--lora_dir {self.lora_dir} has no {LORA_WEIGHTS_NAME} (nor {FULL_UNET_DIR}/){hint}: point it "
                "at the folder a trainer wrote its final weights to."
            )
        saved = _read_lora_config(lora_dir)
        if self.pretrained_model is None:
            recorded = saved.get("pretrained_model")
            self.pretrained_model = recorded or DEFAULT_BASE_MODEL
            self.base_from_lora_config = bool(recorded)  # errors about the base then say where it came from
            if recorded:
                try:
                    check_pretrained_model(self.pretrained_model)
                except UserError as e:
                    raise UserError(
                        f"{e} (this base model is recorded in {lora_dir / CONFIG_NAME}; pass "
                        "--pretrained_model to use another)."
                    ) from None
        if self.resolution is None and saved.get("resolution"):
            self.resolution = int(saved["resolution"])
        if self.num_frames is None and saved.get("num_frames"):  # a video model's, as trained
            self.num_frames = int(saved["num_frames"])
        super().check()
        check_lora_dir(lora_dir)


def _read_lora_config(lora_dir: Path) -> dict:
    try:
        saved = read_saved_config(lora_dir)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{lora_dir / CONFIG_NAME} is not readable JSON ({e}); fix or delete it.") from None
    if not isinstance(saved, dict):
        raise UserError(f"{lora_dir / CONFIG_NAME} must hold a JSON object (the training config).")
    return saved


def reward_list(spec: str) -> list[str]:
    """'imagereward, aesthetic' -> ['imagereward', 'aesthetic']: the rewards of --rewards, as given."""
    return [part.strip() for part in spec.split(",") if part.strip()]


def check_reward_list(spec: str, model_dir: str) -> None:
    """--rewards names known rewards, each once, whose files are in --reward_model_dir (ImageReward's may be missing:
    its scores are then null); a one-line UserError otherwise, before any model is loaded."""
    from refl_ddpo.rewards import check_reward_files, parse_reward_spec

    names = reward_list(spec)
    if not names:
        raise UserError(f"--rewards is empty: name at least one reward, e.g. --rewards {SCORE_KEY}.")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserError(f"--rewards names {', '.join(repeated)} twice; name each reward once.")
    for name in names:
        try:
            parse_reward_spec(name)
            if name != SCORE_KEY:
                check_reward_files(name, model_dir)
        except UserError as e:
            raise UserError(
                str(e).replace("--reward:", "--rewards:", 1).replace("--reward ", "--rewards ", 1)
            ) from None


def resolve_device(name: str | None) -> str:
    """None -> 'cuda' if a GPU is visible else 'cpu'; a named device must parse and (for CUDA) exist."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name} is not a device name (use cpu, cuda or cuda:N).") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: no CUDA GPU is visible; use --device cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible.")
    return name


def reward_label(name: str) -> str:
    """How a reward is named in printed lines: ImageReward as its paper writes it, others as given."""
    return "ImageReward" if name == SCORE_KEY else name
