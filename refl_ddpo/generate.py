"""Before/after inference: the same prompts and seeds through the base model or base + LoRA, scored with
ImageReward, and the paired comparison of two such runs.

`inference/inference.py`, `inference/inference_lora.py` and `inference/compare.py` are thin entry points to
`run_inference` and `run_compare`. The images come from the shared loop (`refl_ddpo.sampling`) on the shared loaders
(`refl_ddpo.models`, `refl_ddpo.lora`); nothing here is a copy of a pipeline.

Seeds: image j of prompt i is drawn from its own CPU generator seeded `seed + i * num_images_per_prompt + j` (the
stochastic scheduler steps, with eta > 0, use the same generator). Its starting noise therefore depends only on that
seed, not on the batch it ran in nor on which script ran it, so both scripts draw the same noise for the same
(prompt, seed); with the same batch size the images are bit-identical run to run.

A run folder holds one PNG per image (prompt, seed and settings in its PNG text chunks), `grid.png` and
`scores.json`; `scores.json` is written last and atomically, and a stale one is removed before the first image is
overwritten, so a failed run never leaves scores that do not belong to its images.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from refl_ddpo.config import CHECKPOINT_DIR, REPO_ROOT, ConfigBase, field_
from refl_ddpo.errors import UserError
from refl_ddpo.lora import (
    CONFIG_NAME,
    FULL_UNET_DIR,
    LORA_WEIGHTS_NAME,
    load_lora_into_pipeline,
    read_saved_config,
)
from refl_ddpo.models import check_pretrained_model, load_pipeline, torch_dtype
from refl_ddpo.prompts import DATA_DIR, load_prompts
from refl_ddpo.sampling import decode_latents, denoise, encode_prompts, initial_noise

DEFAULT_PROMPTS_FILE = DATA_DIR / "eval_prompts.txt"
OUTPUTS_DIR = REPO_ROOT / "outputs"
DEFAULT_BASE_MODEL = str(CHECKPOINT_DIR / "stable-diffusion-v1-4")
DEFAULT_RESOLUTION = 512
SCORES_FILE = "scores.json"
GRID_FILE = "grid.png"
COMPARE_JSON = "compare.json"
COMPARE_PNG = "compare.png"
SCORE_KEY = "imagereward"  # the score field of each record in scores.json

# --scheduler choices -> diffusers classes, built with from_config on the model's own scheduler config (keeps betas,
# steps_offset, set_alpha_to_one), as the trainers do. Only schedulers whose step returns pred_original_sample, which
# the shared loop reads (PNDM and DPM-Solver do not).
SCHEDULERS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler"}
# Settings that change the images; compare.py notes when two runs differ in any of them.
GENERATION_SETTINGS = ("pretrained_model", "num_inference_steps", "guidance_scale", "scheduler", "eta", "resolution",
                       "dtype")


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
    reward_model_dir: str = field_(
        str(CHECKPOINT_DIR),
        "Folder with ImageReward.pt, med_config.json and bert-base-uncased/; without them the images are still "
        "written and the scores are null, with the reason in scores.json.",
    )
    # ---- what to generate ----
    prompts_file: str = field_(
        str(DEFAULT_PROMPTS_FILE), "Prompts: one per line, or a JSON list of strings / {'prompt'|'text': ...} objects."
    )
    seed: int = field_(42, "Image j of prompt i uses its own generator seeded seed + i * num_images_per_prompt + j.")
    num_images_per_prompt: int = field_(4, "Images generated for each prompt (each with its own seed).")
    num_inference_steps: int = field_(50, "Denoising steps of the sampler.")
    guidance_scale: float = field_(7.5, "Classifier-free guidance scale (1 or less turns CFG off).")
    scheduler: Literal["ddim", "euler"] = field_(
        "ddim", "Sampler, built from the model's scheduler config (ddim with eta 0 is deterministic)."
    )
    eta: float = field_(0.0, "DDIM eta: 0 is deterministic DDIM, 1 is DDPM-like noise (drawn from each image's seed).")
    resolution: int = field_(DEFAULT_RESOLUTION, "Image side in pixels (a multiple of the VAE scale factor, 8 for SD).")
    # ---- how ----
    batch_size: int = field_(4, "Images per UNet batch (CFG doubles the UNet batch); lower it if memory runs out.")
    device: str | None = field_(None, "Device (cpu, cuda, cuda:1 ...); default: cuda if available, else cpu.")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = field_(
        "auto", "Dtype of the diffusion models; auto: fp16 on a GPU, fp32 on the CPU. ImageReward runs in fp32."
    )
    output_dir: str = field_(str(OUTPUTS_DIR / "base"), "Folder for the PNGs, grid.png and scores.json.")
    grid_max_images: int = field_(64, "grid.png shows the first this-many images (0: no grid).")

    def check(self) -> None:
        """Resolve the automatic defaults (device, dtype) and check the fields, before any model is loaded."""
        self.check_positive("num_images_per_prompt", "num_inference_steps", "batch_size", "resolution")
        if self.grid_max_images < 0:
            raise UserError(f"--grid_max_images must be >= 0 (got {self.grid_max_images}); 0 writes no grid.")
        if self.guidance_scale < 0:
            raise UserError(f"--guidance_scale must be >= 0 (got {self.guidance_scale}); 1 turns CFG off.")
        if self.eta < 0:
            raise UserError(f"--eta must be >= 0 (got {self.eta}); 0 is deterministic DDIM.")
        if self.eta and self.scheduler != "ddim":
            raise UserError(f"--eta {self.eta} needs --scheduler ddim (the {self.scheduler} sampler has no eta).")
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
        f"Image side in pixels; default: the resolution recorded in lora_dir/config.json, else {DEFAULT_RESOLUTION}.",
    )
    output_dir: str = field_(str(OUTPUTS_DIR / "lora"), "Folder for the PNGs, grid.png and scores.json.")
    lora_dir: str = field_(
        str(CHECKPOINT_DIR / "refl_lora"),
        "Trained LoRA folder (pytorch_lora_weights.safetensors, diffusers format; or unet/ of a full fine-tune), "
        "e.g. checkpoint/refl_lora or checkpoint/ddpo_lora.",
    )
    lora_scale: float = field_(1.0, "Multiplier of the LoRA update: 0 gives the base model, 1 the trained one.")

    def check(self) -> None:
        """Check lora_dir, fill pretrained_model / resolution from its config.json, then the common checks."""
        lora_dir = Path(self.lora_dir).expanduser()
        if not lora_dir.is_dir():
            raise UserError(f"--lora_dir {self.lora_dir} does not exist: train first (train_scripts/) or point it at "
                            "a LoRA folder.")
        if not ((lora_dir / LORA_WEIGHTS_NAME).is_file() or (lora_dir / FULL_UNET_DIR / "config.json").is_file()):
            raise UserError(f"--lora_dir {self.lora_dir} has no {LORA_WEIGHTS_NAME} (nor {FULL_UNET_DIR}/): point it "
                            "at the folder a trainer wrote its final weights to.")
        saved = _read_lora_config(lora_dir)
        if self.pretrained_model is None:
            recorded = saved.get("pretrained_model")
            self.pretrained_model = _recorded_path(recorded) if recorded else DEFAULT_BASE_MODEL
            self.base_from_lora_config = bool(recorded)  # errors about the base then say where it came from
            if recorded:
                try:
                    check_pretrained_model(self.pretrained_model)
                except UserError as e:
                    raise UserError(f"{e} (this base model is recorded in {lora_dir / CONFIG_NAME}; pass "
                                    "--pretrained_model to use another).") from None
        if self.resolution is None:
            self.resolution = int(saved.get("resolution") or DEFAULT_RESOLUTION)
        super().check()


def _read_lora_config(lora_dir: Path) -> dict:
    try:
        saved = read_saved_config(lora_dir)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{lora_dir / CONFIG_NAME} is not readable JSON ({e}); fix or delete it.") from None
    if not isinstance(saved, dict):
        raise UserError(f"{lora_dir / CONFIG_NAME} must hold a JSON object (the training config).")
    return saved


def _recorded_path(name: str) -> str:
    """A model path recorded by a trainer. The train scripts run from the repo root, so a relative path recorded
    there is read relative to the repo root when it does not exist from here."""
    if not os.path.isabs(name) and not os.path.exists(name) and (REPO_ROOT / name).exists():
        return str(REPO_ROOT / name)
    return name


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
    return [ImageSpec(i, j, prompt, metadata, seed + i * num_images_per_prompt + j)
            for i, (prompt, metadata) in enumerate(prompts) for j in range(num_images_per_prompt)]


def load_inference_pipeline(cfg: InferenceConfig):
    """The frozen pipeline (base, plus the LoRA for a `LoraInferenceConfig`) with the chosen scheduler."""
    import diffusers

    try:
        pipe = load_pipeline(cfg.pretrained_model, torch_dtype(cfg.dtype), cfg.device)
    except UserError as e:
        if getattr(cfg, "base_from_lora_config", False):
            raise UserError(f"{e} (this base model is recorded in {Path(cfg.lora_dir) / CONFIG_NAME}; pass "
                            "--pretrained_model to use another).") from None
        raise
    pipe.scheduler = getattr(diffusers, SCHEDULERS[cfg.scheduler]).from_config(pipe.scheduler.config)
    if cfg.resolution % pipe.vae_scale_factor:
        raise UserError(f"--resolution {cfg.resolution} must be a multiple of this VAE's scale factor "
                        f"{pipe.vae_scale_factor}.")
    if isinstance(cfg, LoraInferenceConfig):
        load_lora_into_pipeline(pipe, cfg.lora_dir, cfg.lora_scale)
    return pipe


@torch.inference_mode()
def generate_batch(pipe, prompts: list[str], seeds: list[int], resolution: int, num_inference_steps: int,
                   guidance_scale: float, eta: float = 0.0) -> torch.Tensor:
    """Images (B, 3, H, W) float32 in [0, 1] on the pipeline's device; image b from a CPU generator seeded seeds[b].

    Runs in inference mode: no autograd graph is kept (the pipeline's memory for one no-grad forward), even if
    LoRA parameters require grad.
    """
    device = pipe.device
    # CPU generators: the same seed gives the same noise on any device (diffusers' randn_tensor draws on the CPU
    # and moves); a list gives each image its own stream, whatever the batch.
    generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    prompt_embeds, negative_embeds = encode_prompts(pipe, prompts, device, with_negative=guidance_scale > 1.0)
    noise = initial_noise(len(prompts), pipe.unet, resolution, pipe.vae_scale_factor, generators, device,
                          prompt_embeds.dtype)  # (B, 4, resolution / f, resolution / f), as the pipeline draws it
    out = denoise(pipe.unet, pipe.scheduler, prompt_embeds, negative_embeds, noise, num_inference_steps,
                  guidance_scale=guidance_scale, eta=eta, generator=generators)
    return decode_latents(pipe.vae, out.latents)  # (B, 3, H, W)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) uint8 on the CPU, rounded as diffusers' numpy_to_pil."""
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu()


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

    def __call__(self, prompts: list[str], images) -> list[float | None]:
        if self.model is None:
            return [None] * len(prompts)
        scores: list[float | None] = [None] * len(prompts)
        for prompt in dict.fromkeys(prompts):  # one text encoding per distinct prompt of the batch
            idx = [k for k, p in enumerate(prompts) if p == prompt]
            for k, s in zip(idx, self.model.score(prompt, [images[k] for k in idx])):
                scores[k] = float(s)
        return scores


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _png_info(spec: ImageSpec, settings: dict):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("prompt", spec.prompt)
    info.add_text("seed", str(spec.seed))
    info.add_text("parameters", json.dumps(settings))
    return info


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file beside `path` and rename it over `path` (no half-written JSON)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


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


def run_inference(cfg: InferenceConfig) -> dict:
    """Generate, save and score every image of the prompts file; returns what it wrote to scores.json."""
    from PIL import Image
    from tqdm.auto import tqdm

    from refl_ddpo.training import caption_grid, check_output_dir

    # ---- everything a user can get wrong, before any model is loaded ----
    prompts = load_prompts(cfg.prompts_file)
    specs = plan_images(prompts, cfg.num_images_per_prompt, cfg.seed)
    out_dir = check_output_dir(cfg.output_dir)
    print(f"{type(cfg).__name__}:\n{cfg.pretty()}", flush=True)
    print(f"  -> {len(prompts)} prompts x {cfg.num_images_per_prompt} images = {len(specs)} images, batches of "
          f"{cfg.batch_size}", flush=True)

    # ---- models ----
    quiet_hf_logging()
    pipe = load_inference_pipeline(cfg)
    scorer = ImageRewardScorer(cfg.reward_model_dir, cfg.device)
    settings = {k: getattr(cfg, k) for k in (*GENERATION_SETTINGS, "lora_dir", "lora_scale") if hasattr(cfg, k)}

    # ---- generate: from here on the folder's old results are stale ----
    for name in (SCORES_FILE, GRID_FILE):
        (out_dir / name).unlink(missing_ok=True)
    records, grid_images = [], []
    start = time.perf_counter()
    with tqdm(total=len(specs), desc="images", unit="img") as bar:
        for batch in _batches(specs, cfg.batch_size):
            images = generate_batch(pipe, [s.prompt for s in batch], [s.seed for s in batch], cfg.resolution,
                                    cfg.num_inference_steps, cfg.guidance_scale, cfg.eta)
            pixels = to_uint8(images)  # (B, H, W, 3)
            pil_images = [Image.fromarray(p.numpy()) for p in pixels]
            scores = scorer([s.prompt for s in batch], pil_images)
            for spec, pil, score in zip(batch, pil_images, scores):
                pil.save(out_dir / spec.file, pnginfo=_png_info(spec, settings))
                record = {"prompt": spec.prompt, "seed": spec.seed, "file": spec.file, SCORE_KEY: score,
                          "prompt_index": spec.prompt_index, "image_index": spec.image_index}
                if spec.metadata:
                    record["metadata"] = spec.metadata
                records.append(record)
            grid_images.extend(pixels[: max(0, cfg.grid_max_images - len(grid_images))])
            bar.update(len(batch))
    seconds = time.perf_counter() - start

    # ---- grid, then scores.json last ----
    if grid_images:
        captions = [f"{_fmt(r[SCORE_KEY])} s{r['seed']} {r['prompt']}" for r in records[: len(grid_images)]]
        grid = caption_grid(torch.stack(grid_images).permute(0, 3, 1, 2).float() / 255, captions,
                            cols=cfg.num_images_per_prompt if cfg.num_images_per_prompt > 1 else 4)
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(out_dir / GRID_FILE)
    mean, std = score_summary([r[SCORE_KEY] for r in records])
    result = {"scorer": SCORE_KEY, "count": len(records), "mean": mean, "std": std}
    if scorer.error:
        result["score_error"] = scorer.error
    result.update({"seconds_per_image": seconds / len(records), "config": cfg.to_dict(), "records": records})
    write_json_atomic(out_dir / SCORES_FILE, result)
    summary = f"ImageReward mean {_fmt(mean)} std {_fmt(std)}" if mean is not None else "no ImageReward scores"
    print(f"{len(records)} images ({seconds / len(records):.2f} s/image) in {out_dir}: {summary}", flush=True)
    return result


def _fmt(x: float | None, sign: bool = False) -> str:
    return "n/a" if x is None else (f"{x:+.3f}" if sign else f"{x:.3f}")


# --------------------------------------------------------------------------------------------------------------
# comparison of two runs
# --------------------------------------------------------------------------------------------------------------


def load_run(run_dir: str | Path) -> dict:
    """scores.json of a run folder, with one-line errors when it is missing or not ours."""
    path = Path(run_dir) / SCORES_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} has no {SCORES_FILE}: run inference/inference.py (or inference_lora.py) with "
                        f"--output_dir {run_dir} first.")
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); run inference again.") from None
    if not isinstance(run, dict) or not isinstance(run.get("records"), list):
        raise UserError(f"{path} has no 'records' list: it was not written by inference/inference.py.")
    return run


def paired_bootstrap_ci(differences, num_resamples: int = 10_000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences: resample the pairs with replacement."""
    import numpy as np

    diffs = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.concatenate([  # in chunks: at most 1000 x n indices in memory
        diffs[rng.integers(0, len(diffs), size=(min(1000, num_resamples - k), len(diffs)))].mean(axis=1)
        for k in range(0, num_resamples, 1000)
    ])
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def match_pairs(before: dict, after: dict, before_name: str, after_name: str) -> list[tuple[dict, dict]]:
    """Records paired by (prompt, seed), in the order of `before`; a UserError unless both hold the same pairs."""
    def index(run: dict, name: str) -> dict:
        out = {}
        for r in run["records"]:
            key = (r["prompt"], r["seed"])
            if key in out:
                raise UserError(f"{name} holds (prompt, seed) {key} twice; regenerate it.")
            out[key] = r
        return out

    b, a = index(before, before_name), index(after, after_name)
    only_b, only_a = [k for k in b if k not in a], [k for k in a if k not in b]
    if only_b or only_a:
        example = (only_b or only_a)[0]
        raise UserError(f"{before_name} and {after_name} hold different (prompt, seed) pairs ({len(only_b)} only in "
                        f"the first, {len(only_a)} only in the second, e.g. {example}); generate both with the same "
                        "--prompts_file, --seed and --num_images_per_prompt.")
    return [(b[k], a[k]) for k in b]


def _same_path(value):
    """A setting as compared between runs: two spellings of one existing folder are the same model."""
    return os.path.realpath(value) if isinstance(value, str) and os.path.exists(value) else value


def compare_runs(before: dict, after: dict, before_name: str = "before", after_name: str = "after",
                 num_resamples: int = 10_000, seed: int = 0) -> dict:
    """Paired statistics of two runs' ImageReward scores: means, per-prompt deltas, win rate, bootstrap CI."""
    pairs = match_pairs(before, after, before_name, after_name)
    result: dict = {"count": len(pairs)}
    settings = [{k: _same_path(run.get("config", {}).get(k)) for k in GENERATION_SETTINGS} for run in (before, after)]
    differ = {k: [settings[0][k], settings[1][k]] for k in GENERATION_SETTINGS if settings[0][k] != settings[1][k]}
    if differ:
        result["settings_differ"] = differ
    errors = [f"{name}: {run['score_error']}" for name, run in ((before_name, before), (after_name, after))
              if run.get("score_error")]
    missing = any(b.get(SCORE_KEY) is None or a.get(SCORE_KEY) is None for b, a in pairs)
    result["pairs"] = [{"prompt": b["prompt"], "seed": b["seed"], "before_file": b["file"], "after_file": a["file"],
                        "before": b.get(SCORE_KEY), "after": a.get(SCORE_KEY),
                        "delta": None if missing else a[SCORE_KEY] - b[SCORE_KEY]} for b, a in pairs]
    if missing:
        result["score_error"] = "; ".join(errors) or "some images have no score"
        return result

    before_scores = [b[SCORE_KEY] for b, _ in pairs]
    after_scores = [a[SCORE_KEY] for _, a in pairs]
    deltas = [a - b for b, a in zip(before_scores, after_scores)]
    wins, ties = sum(d > 0 for d in deltas), sum(d == 0 for d in deltas)
    per_prompt: dict[str, list[tuple[float, float]]] = {}  # prompt -> [(before, after)] over its seeds
    for (rb, _), b, a in zip(pairs, before_scores, after_scores):
        per_prompt.setdefault(rb["prompt"], []).append((b, a))
    lo, hi = paired_bootstrap_ci(deltas, num_resamples, seed)
    result.update({
        "mean_before": sum(before_scores) / len(pairs),
        "mean_after": sum(after_scores) / len(pairs),
        "mean_difference": sum(deltas) / len(pairs),
        "bootstrap_ci95": [lo, hi],
        "num_bootstrap": num_resamples,
        "bootstrap_seed": seed,
        "win_rate": (wins + 0.5 * ties) / len(pairs),  # ties count half
        "wins": wins, "ties": ties, "losses": len(pairs) - wins - ties,
        "per_prompt": [{"prompt": p, "n": len(v), "before_mean": sum(b for b, _ in v) / len(v),
                        "after_mean": sum(a for _, a in v) / len(v),
                        "delta": sum(a - b for b, a in v) / len(v)} for p, v in per_prompt.items()],
    })
    return result


def format_comparison(result: dict, before_name: str, after_name: str) -> str:
    """The printed table: one row per prompt, then the paired summary."""
    lines = []
    for key, (b, a) in result.get("settings_differ", {}).items():
        lines.append(f"note: the runs differ in {key}: {b!r} vs {a!r}")
    if "mean_difference" not in result:
        lines.append(f"{result['count']} pairs matched; no comparison of scores ({result['score_error']})")
        return "\n".join(lines)
    width = min(60, max(len("prompt"), *(len(r["prompt"]) for r in result["per_prompt"])))
    lines.append(f"{'prompt':<{width}}  {'n':>3}  {'before':>8}  {'after':>8}  {'delta':>8}")
    for r in result["per_prompt"]:
        prompt = r["prompt"] if len(r["prompt"]) <= width else r["prompt"][: width - 3] + "..."
        lines.append(f"{prompt:<{width}}  {r['n']:>3}  {r['before_mean']:>8.3f}  {r['after_mean']:>8.3f}  "
                     f"{r['delta']:>+8.3f}")
    lo, hi = result["bootstrap_ci95"]
    lines.append(f"mean ImageReward: {before_name} {result['mean_before']:.3f}, {after_name} "
                 f"{result['mean_after']:.3f}, difference {result['mean_difference']:+.3f} "
                 f"(95% paired bootstrap CI [{lo:+.3f}, {hi:+.3f}], {result['num_bootstrap']} resamples)")
    lines.append(f"{after_name} beats {before_name} in {result['win_rate']:.1%} of {result['count']} pairs "
                 f"({result['wins']} wins, {result['ties']} ties, {result['losses']} losses)")
    return "\n".join(lines)


def run_compare(before_dir: str, after_dir: str, out_dir: str | None = None, num_resamples: int = 10_000,
                seed: int = 0, max_pairs: int = 32) -> dict:
    """compare.png (before | after per prompt and seed, score under each) and compare.json for two run folders."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    from refl_ddpo.training import caption_grid, check_output_dir

    if num_resamples <= 0:
        raise UserError(f"--num_bootstrap must be > 0 (got {num_resamples}).")
    if max_pairs < 0:
        raise UserError(f"--max_pairs must be >= 0 (got {max_pairs}); 0 writes no compare.png.")
    before, after = load_run(before_dir), load_run(after_dir)
    result = {"before_dir": str(before_dir), "after_dir": str(after_dir),
              **compare_runs(before, after, str(before_dir), str(after_dir), num_resamples, seed)}
    for run_dir, key in ((before_dir, "before_file"), (after_dir, "after_file")):
        for pair in result["pairs"]:
            if not (Path(run_dir) / pair[key]).is_file():
                raise UserError(f"{Path(run_dir) / pair[key]} is listed in {SCORES_FILE} but missing; run it again.")
    out = check_output_dir(out_dir or str(Path(after_dir).resolve().parent / "compare"))
    (out / COMPARE_JSON).unlink(missing_ok=True)

    shown = result["pairs"][:max_pairs]
    if shown:
        cells, captions = [], []
        for pair in shown:
            for side, run_dir in (("before", before_dir), ("after", after_dir)):
                with Image.open(Path(run_dir) / pair[f"{side}_file"]) as im:
                    cells.append(pil_to_tensor(im.convert("RGB")).float() / 255)  # (3, H, W); sizes may differ
                captions.append(f"{side} {_fmt(pair[side])} s{pair['seed']} {pair['prompt']}")
        grid = caption_grid(cells, captions, cols=2)  # every cell is resized to the same side
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(out / COMPARE_PNG)
    write_json_atomic(out / COMPARE_JSON, result)
    print(format_comparison(result, "before", "after"), flush=True)
    print(f"wrote {out / COMPARE_PNG if shown else '(no image)'} and {out / COMPARE_JSON}", flush=True)
    return result

