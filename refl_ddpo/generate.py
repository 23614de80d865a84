"""Before/after inference: the same prompts and seeds through the base model or base + LoRA, scored with
ImageReward or any rewards of the registry (`--rewards`; `refl_ddpo.compare` pairs two such runs).

`inference/inference.py` and `inference/inference_lora.py` are thin entry points to `main_base` and `main_lora`.
The images come from the shared loop (`refl_ddpo.sampling`) on the model family's adapter (`refl_ddpo.families`) and
the LoRA core (`refl_ddpo.lora`); nothing here is a copy of a pipeline.

Seeds: image j of prompt i is drawn from its own CPU generator seeded `seed + i * num_images_per_prompt + j` (the
stochastic scheduler steps, with eta > 0, use the same generator). Its starting noise therefore depends only on that
seed, not on the batch it ran in nor on which script ran it, so both scripts draw the same noise for the same
(prompt, seed); with the same batch size the images are bit-identical run to run.

Scores: `--rewards a,b,...` names rewards of `refl_ddpo.rewards` (default: imagereward, as before); each record of
`scores.json` has one field per reward, named as given, scored on the 8-bit images as saved (so a score can be
reproduced from its PNG). ImageReward keeps its official PIL preprocessing, and without its files its scores are
null with the reason in `score_error`; any other reward must load, or the run stops before generating.

A run folder holds one PNG per image (prompt, seed and settings in its PNG text chunks), `grid.png` and
`scores.json`; `scores.json` is written last and atomically. An earlier run's files in the folder (its PNGs, grid and
scores) are deleted, scores first, once the models have loaded, so a failed run never leaves scores that do not
belong to its images nor images of another run; a folder holding any other file is refused before anything loads.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from refl_ddpo.config import ConfigBase, field_, parse_config
from refl_ddpo.errors import UserError, cli_main
from refl_ddpo.images import caption_grid, to_uint8, write_json_atomic
from refl_ddpo.lora import (
    CONFIG_NAME,
    FULL_UNET_DIR,
    LORA_WEIGHTS_NAME,
    check_lora_dir,
    load_lora_into_pipeline,
    read_saved_config,
)
from refl_ddpo.models import check_pretrained_model, torch_dtype
from refl_ddpo.prompts import DATA_DIR, load_prompts

DEFAULT_PROMPTS_FILE = DATA_DIR / "eval_prompts.txt"
DEFAULT_BASE_MODEL = "checkpoint/stable-diffusion-v1-4"  # relative to where the command runs (the repo root)
SCORES_FILE = "scores.json"
GRID_FILE = "grid.png"
SCORE_KEY = "imagereward"  # the default reward, and the score field of each record that old scores.json hold
IMAGE_FILE = re.compile(r"\d{4,}_\d{2,}_seed-?\d+\.png")  # ImageSpec.file

# Settings that change the images; compare.py notes when two runs differ in any of them.
GENERATION_SETTINGS = (
    "pretrained_model",
    "num_inference_steps",
    "guidance_scale",
    "scheduler",
    "eta",
    "resolution",
    "dtype",
)


# --------------------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------------------


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
        "SD3: load without the T5 text encoder (a folder without text_encoder_3 loads without it anyway).",
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
    seed: int = field_(
        42, "Image j of prompt i uses its own generator seeded seed + i * num_images_per_prompt + j."
    )
    num_images_per_prompt: int = field_(4, "Images generated for each prompt (each with its own seed).")
    num_inference_steps: int = field_(50, "Denoising steps of the sampler.")
    guidance_scale: float = field_(7.5, "Classifier-free guidance scale (1 or less turns CFG off).")
    scheduler: Literal["ddim", "euler"] | None = field_(
        None,
        "Sampler, built from the model's scheduler config: ddim (SD 1.x/2.x; eta 0 is deterministic) or euler "
        "(SD 1.x/2.x's Euler, or SD3's flow-matching one); default: the model family's first (ddim for SD 1.x/2.x, "
        "euler for SD3).",
    )
    eta: float = field_(
        0.0, "DDIM eta: 0 is deterministic DDIM, 1 is DDPM-like noise (drawn from each image's seed)."
    )
    resolution: int | None = field_(
        None, "Image side in pixels (a multiple of the VAE scale factor); default: the model's native one."
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
        if self.guidance_scale < 0:
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
            from refl_ddpo.hub import download, is_hub_id

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


# --------------------------------------------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSpec:
    """One image to generate: prompt i, image j of it, and its own seed."""

    prompt_index: int
    image_index: int
    prompt: str
    metadata: dict
    seed: int

    @property
    def file(self) -> str:
        return f"{self.prompt_index:04d}_{self.image_index:02d}_seed{self.seed}.png"


def plan_images(prompts: list[tuple[str, dict]], num_images_per_prompt: int, seed: int) -> list[ImageSpec]:
    """Every (prompt, image) pair in order, image j of prompt i seeded seed + i * num_images_per_prompt + j."""
    return [
        ImageSpec(i, j, prompt, metadata, seed + i * num_images_per_prompt + j)
        for i, (prompt, metadata) in enumerate(prompts)
        for j in range(num_images_per_prompt)
    ]


def load_inference_family(cfg: InferenceConfig):
    """The frozen model family (base, plus the LoRA for a `LoraInferenceConfig`) with the chosen scheduler set as
    `family.pipe.scheduler`; `cfg.resolution` resolved to the model's native one where unset."""
    from refl_ddpo.families import load_family

    try:
        family = load_family(cfg.pretrained_model, torch_dtype(cfg.dtype), cfg.device, drop_t5=cfg.drop_t5)
    except UserError as e:
        if getattr(cfg, "base_from_lora_config", False):
            raise UserError(
                f"{e} (this base model is recorded in {Path(cfg.lora_dir) / CONFIG_NAME}; pass "
                "--pretrained_model to use another)."
            ) from None
        raise
    if cfg.scheduler is None:
        cfg.scheduler = next(iter(family.schedulers))
    if cfg.scheduler not in family.schedulers:
        raise UserError(
            f"--scheduler {cfg.scheduler} does not fit a {family.name} model; use one of "
            f"{', '.join(family.schedulers)}."
        )
    if cfg.eta and cfg.scheduler != "ddim":
        raise UserError(
            f"--eta {cfg.eta} needs --scheduler ddim, which a {family.name} model does not offer."
        )
    family.pipe.scheduler = family.scheduler(family.schedulers[cfg.scheduler])
    if cfg.resolution is None:
        cfg.resolution = family.native_resolution
    if cfg.resolution % family.vae_scale_factor:
        raise UserError(
            f"--resolution {cfg.resolution} must be a multiple of this VAE's scale factor "
            f"{family.vae_scale_factor}."
        )
    if isinstance(cfg, LoraInferenceConfig):
        load_lora_into_pipeline(family.pipe, cfg.lora_dir, cfg.lora_scale)
    return family


@torch.inference_mode()
def generate_batch(
    family,
    prompts: list[str],
    seeds: list[int],
    resolution: int,
    num_inference_steps: int,
    guidance_scale: float,
    eta: float = 0.0,
    scheduler=None,
) -> torch.Tensor:
    """Images (B, 3, H, W) float32 in [0, 1] on the model's device; image b from a CPU generator seeded seeds[b].
    `scheduler`: the sampler to run (default: `family.pipe.scheduler`); its timesteps are set here.

    Runs in inference mode: no autograd graph is kept (the pipeline's memory for one no-grad forward), even if
    LoRA parameters require grad.
    """
    from refl_ddpo.sampling import denoise

    # CPU generators: the same seed gives the same noise on any device (diffusers' randn_tensor draws on the CPU
    # and moves); a list gives each image its own stream, whatever the batch.
    generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    cond, uncond = family.encode_prompts(prompts, with_negative=guidance_scale > 1.0)
    dtype = next(iter(cond.values())).dtype
    noise = family.initial_noise(len(prompts), resolution, generators, dtype)  # as the pipeline draws it
    out = denoise(
        family,
        family.pipe.scheduler if scheduler is None else scheduler,
        cond,
        uncond,
        noise,
        num_inference_steps,
        guidance_scale=guidance_scale,
        eta=eta,
        generator=generators,
    )
    return family.decode(out.latents)  # (B, 3, H, W)


class ImageRewardScorer:
    """ImageReward of saved images, or None for every image (with `error` saying why) when the files are missing.

    Scores the 8-bit images as written to the PNGs, through the official PIL preprocessing (`ImageRewardModel.score`),
    in fp32, so a score can be reproduced from its file alone.
    """

    def __init__(self, model_dir: str, device: str):
        self.model = None
        self.error: str | None = None
        try:
            from refl_ddpo.rewards import imagereward

            self.model = imagereward.load(model_dir, device, torch.float32)
        except (UserError, ImportError) as e:
            self.error = str(e)
            print(f"warning: no ImageReward scores ({self.error})", file=sys.stderr, flush=True)

    def __call__(self, prompts: list[str], images, metadata: list[dict] | None = None) -> list[float | None]:
        if self.model is None:
            return [None] * len(prompts)
        scores: list[float | None] = [None] * len(prompts)
        for prompt in dict.fromkeys(prompts):  # one text encoding per distinct prompt of the batch
            idx = [k for k, p in enumerate(prompts) if p == prompt]
            for k, s in zip(idx, self.model.score(prompt, [images[k] for k in idx])):
                scores[k] = float(s)
        bad = [k for k, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            raise UserError(
                f"ImageReward gave {len(bad)} non-finite score(s) (NaN or inf) of {len(scores)} images (e.g. for "
                f"'{prompts[bad[0]]}'); check its files in --reward_model_dir."
            )
        return scores


class RegistryScorer:
    """A reward of the registry (`refl_ddpo.rewards.build_reward`) on saved images: the 8-bit pixels as written to
    the PNGs, as floats in [0, 1], in fp32 and without gradient; a non-finite score stops the run."""

    error: str | None = None

    def __init__(self, spec: str, model_dir: str, device: str):
        from refl_ddpo.rewards import build_reward

        self.spec, self.device = spec, torch.device(device)
        self.reward = build_reward(spec, self.device, torch.float32, model_dir)

    def __call__(self, prompts: list[str], images, metadata: list[dict] | None = None) -> list[float]:
        import numpy as np

        pixels = torch.from_numpy(
            np.stack([np.asarray(im.convert("RGB")) for im in images])
        )  # (B, H, W, 3) uint8
        batch = (pixels.permute(0, 3, 1, 2).float() / 255).to(self.device)  # (B, 3, H, W) in [0, 1]
        with torch.no_grad():
            rewards, _ = self.reward(batch, list(prompts), [dict(m) for m in metadata or [{}] * len(prompts)])
        scores = [float(r) for r in rewards.detach().float().cpu()]
        bad = [k for k, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            raise UserError(
                f"reward {self.spec} gave {len(bad)} non-finite score(s) (NaN or inf) of {len(scores)} images (e.g. "
                f"for '{prompts[bad[0]]}'); check its files in --reward_model_dir."
            )
        return scores


def make_scorers(spec: str, model_dir: str, device: str) -> dict:
    """name -> scorer(prompts, PIL images, metadata) -> [score or None], for each reward of --rewards in order."""
    return {
        name: ImageRewardScorer(model_dir, device)
        if name == SCORE_KEY
        else RegistryScorer(name, model_dir, device)
        for name in reward_list(spec)
    }


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _png_info(spec: ImageSpec, settings: dict):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("prompt", spec.prompt)
    info.add_text("seed", str(spec.seed))
    info.add_text("parameters", json.dumps(settings))
    return info


def score_summary(scores: list[float | None]) -> tuple[float | None, float | None]:
    """(mean, sample std with n - 1) of the scores; None where there are no scores (std needs two)."""
    values = [s for s in scores if s is not None]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, std


def quiet_hf_logging() -> None:
    """Keep the scripts' output to our lines and one progress bar: no loading bars or info chatter."""
    import diffusers
    import transformers

    for lib in (diffusers, transformers):
        lib.utils.logging.set_verbosity_error()
        lib.utils.logging.disable_progress_bar()


def earlier_outputs(out_dir: Path) -> list[Path]:
    """An earlier inference run's files in `out_dir` (its PNGs, grid.png, scores.json), scores.json first, to be
    replaced; a one-line UserError if the folder holds anything else (hidden files aside): nothing of a training run
    or of the user is ever deleted."""
    own, other = [], []
    for path in sorted(out_dir.iterdir()):
        if path.name in (SCORES_FILE, GRID_FILE, f".{SCORES_FILE}.tmp") or IMAGE_FILE.fullmatch(path.name):
            own.append(path)
        elif not path.name.startswith("."):
            other.append(path.name)
    if other:
        shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
        raise UserError(
            f"--output_dir {out_dir} holds files that no inference run wrote ({shown}); pick an empty or new folder "
            "(an earlier inference run's PNGs, grid.png and scores.json are replaced)."
        )
    return sorted(own, key=lambda p: p.name != SCORES_FILE)


def run_inference(cfg: InferenceConfig) -> dict:
    """Generate, save and score every image of the prompts file; returns what it wrote to scores.json."""
    from PIL import Image

    from refl_ddpo.outputs import check_output_dir
    from refl_ddpo.progress import progress_bar
    from refl_ddpo.threads import set_cpu_threads

    # ---- everything a user can get wrong, before any model is loaded ----
    prompts = load_prompts(cfg.prompts_file)
    specs = plan_images(prompts, cfg.num_images_per_prompt, cfg.seed)
    out_dir = check_output_dir(cfg.output_dir)
    earlier = earlier_outputs(out_dir)
    print(f"{type(cfg).__name__}:\n{cfg.pretty()}", flush=True)
    print(
        f"  -> {len(prompts)} prompts x {cfg.num_images_per_prompt} images = {len(specs)} images, batches of "
        f"{cfg.batch_size}",
        flush=True,
    )

    set_cpu_threads()  # unless OMP_NUM_THREADS says otherwise (refl_ddpo.threads)

    # ---- models ----
    quiet_hf_logging()
    family = load_inference_family(cfg)
    scorers = make_scorers(cfg.rewards, cfg.reward_model_dir, cfg.device)
    names = list(scorers)
    settings = {
        k: getattr(cfg, k) for k in (*GENERATION_SETTINGS, "lora_dir", "lora_scale") if hasattr(cfg, k)
    }

    # ---- generate: from here on the folder's old results are stale (scores.json goes first) ----
    for path in earlier:
        path.unlink(missing_ok=True)
    records, grid_images = [], []
    start = time.perf_counter()
    with progress_bar(total=len(specs), desc="images", unit="img") as bar:
        for batch in _batches(specs, cfg.batch_size):
            images = generate_batch(
                family,
                [s.prompt for s in batch],
                [s.seed for s in batch],
                cfg.resolution,
                cfg.num_inference_steps,
                cfg.guidance_scale,
                cfg.eta,
            )
            bad = int((~torch.isfinite(images)).flatten(1).any(1).sum())
            if bad:  # NaN pixels would be written as black and scored
                raise UserError(
                    f"the model gave {bad} of {len(batch)} images with NaN or inf pixels (e.g. "
                    f"'{batch[0].prompt}'); check --pretrained_model, --lora_dir and --dtype (fp16 can overflow)."
                )
            pixels = to_uint8(images)  # (B, H, W, 3)
            pil_images = [Image.fromarray(p.numpy()) for p in pixels]
            batch_prompts, batch_metadata = [s.prompt for s in batch], [s.metadata for s in batch]
            scores = {n: fn(batch_prompts, pil_images, batch_metadata) for n, fn in scorers.items()}
            for b, (spec, pil) in enumerate(zip(batch, pil_images)):
                pil.save(out_dir / spec.file, pnginfo=_png_info(spec, settings))
                record = {
                    "prompt": spec.prompt,
                    "seed": spec.seed,
                    "file": spec.file,
                    **{n: scores[n][b] for n in names},
                    "prompt_index": spec.prompt_index,
                    "image_index": spec.image_index,
                }
                if spec.metadata:
                    record["metadata"] = spec.metadata
                records.append(record)
            grid_images.extend(pixels[: max(0, cfg.grid_max_images - len(grid_images))])
            bar.set_postfix(  # the running mean of each reward
                {n: fmt_score(score_summary([r[n] for r in records])[0]) for n in names}, refresh=False
            )
            bar.update(len(batch))
    seconds = time.perf_counter() - start

    # ---- grid, then scores.json last ----
    if grid_images:
        captions = [
            " ".join(
                [fmt_score(r[names[0]])] if len(names) == 1 else [f"{n} {fmt_score(r[n])}" for n in names]
            )
            + f" s{r['seed']} {r['prompt']}"
            for r in records[: len(grid_images)]
        ]
        grid = caption_grid(
            torch.stack(grid_images).permute(0, 3, 1, 2).float() / 255,
            captions,
            cols=cfg.num_images_per_prompt if cfg.num_images_per_prompt > 1 else 4,
            caption_lines=1 + len(names) if len(names) > 1 else 2,
        )
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(out_dir / GRID_FILE)
    # The first reward's mean / std / score_error stay at the top (as when ImageReward was the only score); every
    # reward's are under "scores".
    summaries = {n: dict(zip(("mean", "std"), score_summary([r[n] for r in records]))) for n in names}
    for n, fn in scorers.items():
        if fn.error:
            summaries[n]["score_error"] = fn.error
    result = {"scorer": names[0], "rewards": names, "count": len(records), **summaries[names[0]]}
    result["scores"] = summaries
    result.update({"seconds_per_image": seconds / len(records), "config": cfg.to_dict(), "records": records})
    write_json_atomic(out_dir / SCORES_FILE, result)
    summary = ", ".join(
        f"{reward_label(n)} mean {fmt_score(v['mean'])} std {fmt_score(v['std'])}"
        if v["mean"] is not None
        else f"no {reward_label(n)} scores"
        for n, v in summaries.items()
    )
    print(f"{len(records)} images ({seconds / len(records):.2f} s/image) in {out_dir}: {summary}", flush=True)
    return result


def reward_label(name: str) -> str:
    """How a reward is named in printed lines: ImageReward as its paper writes it, others as given."""
    return "ImageReward" if name == SCORE_KEY else name


def fmt_score(x: float | None, sign: bool = False) -> str:
    """A score as printed and captioned: three decimals, n/a for None."""
    return "n/a" if x is None else (f"{x:+.3f}" if sign else f"{x:.3f}")


@cli_main
def main_base(argv: list[str] | None = None) -> None:
    """Entry point of inference/inference.py (and the refl-ddpo-inference command)."""
    run_inference(parse_config(InferenceConfig, argv, description=InferenceConfig.__doc__))


@cli_main
def main_lora(argv: list[str] | None = None) -> None:
    """Entry point of inference/inference_lora.py (and the refl-ddpo-inference-lora command)."""
    run_inference(parse_config(LoraInferenceConfig, argv, description=LoraInferenceConfig.__doc__))
