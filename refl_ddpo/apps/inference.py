"""Before/after inference: the same prompts and seeds through the base model or base + LoRA, scored with any rewards
of the registry (`--rewards`, default imagereward; `refl_ddpo.apps.compare` pairs two such runs).

`inference/inference.py` and `inference/inference_lora.py` are thin entry points to `main_base` and `main_lora`; their
flags are `refl_ddpo.apps.inference_config`'s, the images `refl_ddpo.core.generate`'s (`plan_images`, `generate_batch`: the
seeds are explained there), loaded with the LoRA core (`refl_ddpo.core.lora`).

Scores: `--rewards a,b,...` names rewards of `refl_ddpo.rewards`; each record of `scores.json` has one field per
reward, named as given. Every reward, ImageReward included, is scored only through the registry (`build_reward`), on
the 8-bit images as saved (`RewardScorer`), so a score equals what the registry, or a `remote:` server running the
same reward, gives for the PNG. Without ImageReward's files its scores are null with the reason in `score_error`;
any other reward must load, or the run stops before generating.

A run folder holds one PNG per image (prompt, seed and settings in its PNG text chunks), `grid.png` and
`scores.json`; `scores.json` is written last and atomically. An earlier run's files in the folder (its PNGs, grid and
scores) are deleted, scores first, once the models have loaded, so a failed run never leaves scores that do not
belong to its images nor images of another run; a folder holding any other file is refused before anything loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from refl_ddpo.apps.inference_config import (
    GENERATION_SETTINGS,
    GRID_FILE,
    SCORE_KEY,
    SCORES_FILE,
    InferenceConfig,
    LoraInferenceConfig,
    reward_label,
    reward_list,
)
from refl_ddpo.apps.video_outputs import VIDEO_FILE, save_video
from refl_ddpo.core.edit_data import SOURCE_PATHS, load_edit_data, with_source_images
from refl_ddpo.core.errors import UserError, cli_main
from refl_ddpo.core.generate import IMAGE_FILE, ImageSpec, generate_batch, plan_images
from refl_ddpo.core.images import caption_grid, fmt_score, to_uint8, write_json_atomic
from refl_ddpo.core.lora import CONFIG_NAME, load_lora_into_pipeline
from refl_ddpo.core.lora import read_saved_config as _read_saved
from refl_ddpo.core.models import torch_dtype
from refl_ddpo.core.prompts import load_prompts
from refl_ddpo.run.flags import parse_config

if TYPE_CHECKING:
    from refl_ddpo.core.families.base import ModelFamily

__all__ = ["InferenceConfig", "LoraInferenceConfig", "main_base", "main_lora", "run_inference"]


def load_inference_family(cfg: InferenceConfig) -> tuple[ModelFamily, InferenceConfig]:
    """The frozen model family (base, plus the LoRA for a `LoraInferenceConfig`) with the chosen scheduler set as
    `family.pipe.scheduler`, and the config as used: a copy with what the model decides where the flag was left
    unset (the family's first scheduler, its native resolution, its default guidance). `cfg` is not changed."""
    from refl_ddpo.core.families import load_family, resolve_guidance

    try:
        family = load_family(
            cfg.pretrained_model,
            torch_dtype(cfg.dtype),
            cfg.device,
            drop_t5=cfg.drop_t5,
            offload_text_encoders=cfg.offload_text_encoders,
        )
    except UserError as e:
        if getattr(cfg, "base_from_lora_config", False):
            raise UserError(
                f"{e} (this base model is recorded in {Path(cfg.lora_dir) / CONFIG_NAME}; pass "
                "--pretrained_model to use another)."
            ) from None
        raise
    scheduler = cfg.scheduler or next(iter(family.schedulers))
    if scheduler not in family.schedulers:
        raise UserError(
            f"--scheduler {scheduler} does not fit a {family.name} model; use one of "
            f"{', '.join(family.schedulers)}."
        )
    if cfg.eta and scheduler != "ddim":
        raise UserError(
            f"--eta {cfg.eta} needs --scheduler ddim, which a {family.name} model does not offer."
        )
    family.pipe.scheduler = family.scheduler(family.schedulers[scheduler])
    resolution = cfg.resolution or family.native_resolution
    if resolution % family.vae_scale_factor:
        raise UserError(
            f"--resolution {resolution} must be a multiple of this VAE's scale factor {family.vae_scale_factor}."
        )
    if isinstance(cfg, LoraInferenceConfig):
        expert = _read_saved(cfg.lora_dir).get("wan_expert") if hasattr(family, "train_expert") else None
        load_lora_into_pipeline(family.pipe, cfg.lora_dir, cfg.lora_scale, expert)
    video = {}
    if hasattr(family, "num_frames"):  # a video model (Wan): its frames and its second expert's guidance
        family.num_frames = cfg.num_frames or family.num_frames
        family.guidance_scale_2 = cfg.guidance_scale_2
        video = {"num_frames": family.num_frames}
    if hasattr(
        family, "video_resolution"
    ):  # image-to-video: the first frames are resized to the videos' size
        family.video_resolution = resolution
    used = dataclasses.replace(cfg, scheduler=scheduler, resolution=resolution, **video)
    if hasattr(cfg, "base_from_lora_config"):  # set by check() beside the fields: kept on the copy
        used.base_from_lora_config = cfg.base_from_lora_config
    return family, resolve_guidance(used, type(family))


class RewardScorer:
    """One reward of --rewards, the only way inference scores: `refl_ddpo.rewards.build_reward(name, ...)` in fp32,
    without gradient, so that ImageReward has one path (the registry's, which ReFL trains on and a `remote:` server
    runs) and a recorded score equals what those give for the same image.

    It scores the 8-bit images that are written to the PNGs (as floats in [0, 1]), not the decoder's float output:
    a score is then reproduced from its file alone, equal to what a reward server that is sent the saved PNGs
    answers (tests/test_remote_reward.py checks both to 1e-6). Without ImageReward's files its scores are None, with
    `error` saying why; any other reward must load. A non-finite score stops the run."""

    def __init__(self, spec: str, model_dir: str, device: str, video_reduction: str = "mean"):
        from refl_ddpo.rewards import build_reward

        self.spec, self.device = spec, torch.device(device)
        self.reward, self.error = None, None
        try:
            self.reward = build_reward(
                spec, self.device, torch.float32, model_dir, video_reduction=video_reduction
            )
        except (UserError, ImportError) as e:
            if spec != SCORE_KEY:  # only ImageReward's files may be missing (check_reward_list let them pass)
                raise
            self.error = str(e)
            print(f"warning: no ImageReward scores ({self.error})", file=sys.stderr, flush=True)

    def __call__(
        self, prompts: list[str], pixels: torch.Tensor, metadata: list[dict] | None = None
    ) -> list[float | None]:
        """Scores of `pixels` (B, H, W, 3) uint8, the images as saved (or videos' frames (B, T, H, W, 3)), for their
        prompts (and metadata)."""
        if self.reward is None:
            return [None] * len(prompts)
        # (B, 3, H, W) in [0, 1], contiguous as decoded images and the remote client's batches are: the resize
        # before a reward model rounds differently on a channels-last view (by up to about 1e-6)
        batch = (pixels.movedim(-1, -3).contiguous().float() / 255).to(self.device)
        with torch.no_grad():
            rewards, _ = self.reward(batch, list(prompts), [dict(m) for m in metadata or [{}] * len(prompts)])
        scores = [float(r) for r in rewards.detach().float().cpu()]
        bad = [k for k, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            what = "ImageReward" if self.spec == SCORE_KEY else f"reward {self.spec}"
            raise UserError(
                f"{what} gave {len(bad)} non-finite score(s) (NaN or inf) of {len(scores)} images (e.g. for "
                f"'{prompts[bad[0]]}'); check its files in --reward_model_dir."
            )
        return scores


def make_scorers(
    spec: str, model_dir: str, device: str, video_reduction: str = "mean"
) -> dict[str, RewardScorer]:
    """name -> scorer(prompts, uint8 pixels, metadata) -> [score or None], for each reward of --rewards in order."""
    return {name: RewardScorer(name, model_dir, device, video_reduction) for name in reward_list(spec)}


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
        if path.name in (SCORES_FILE, GRID_FILE, f".{SCORES_FILE}.tmp") or _own_file(path.name):
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


def _own_file(name: str) -> bool:
    return bool(IMAGE_FILE.fullmatch(name) or VIDEO_FILE.fullmatch(name))


def _save_batch(out_dir: Path, batch: list[ImageSpec], pixels: torch.Tensor, scores: dict, settings: dict):
    """The batch's PNGs (generation settings in their text chunks) and one record each (prompt, seed, file, every
    reward's score). Videos (`pixels` (B, T, H, W, 3)): each video's file, frame PNGs and strip
    (`refl_ddpo.apps.video_outputs`), listed in its record."""
    from PIL import Image

    records = []
    for b, spec in enumerate(batch):
        if pixels.ndim == 5:
            stem = Path(spec.file).stem
            files = save_video(out_dir, stem, pixels[b], settings["fps"], _png_info(spec, settings))
        else:
            Image.fromarray(pixels[b].numpy()).save(out_dir / spec.file, pnginfo=_png_info(spec, settings))
            files = {"file": spec.file}
        record = {
            "prompt": spec.prompt,
            "seed": spec.seed,
            **files,
            **{n: values[b] for n, values in scores.items()},
            "prompt_index": spec.prompt_index,
            "image_index": spec.image_index,
        }
        if SOURCE_PATHS in spec.metadata:  # an edit: its source image(s) and instruction
            record["source_image"] = spec.metadata[SOURCE_PATHS]
            record["instruction"] = spec.prompt
        if spec.metadata:
            record["metadata"] = spec.metadata
        records.append(record)
    return records


def _save_grid(
    path: Path, grid_images: list[torch.Tensor], records: list[dict], names: list[str], per_prompt: int
):
    """grid.png: the first images (H, W, 3) uint8, each captioned with its scores, seed and prompt."""
    from PIL import Image

    captions = [
        " ".join([fmt_score(r[names[0]])] if len(names) == 1 else [f"{n} {fmt_score(r[n])}" for n in names])
        + f" s{r['seed']} {r['prompt']}"
        for r in records[: len(grid_images)]
    ]
    grid = caption_grid(
        torch.stack(grid_images).permute(0, 3, 1, 2).float() / 255,
        captions,
        # a prompt's images on whole rows (at most 8 a row), else a near-square grid
        cols=per_prompt if per_prompt > 1 else math.ceil(math.sqrt(len(grid_images))),
        caption_lines=1 + len(names) if len(names) > 1 else 2,
    )
    Image.fromarray(grid.permute(1, 2, 0).numpy()).save(path)


def _write_scores(out_dir: Path, cfg, scorers: dict, records: list[dict], seconds: float) -> dict:
    """scores.json (written last: its presence means the run finished), and the summary line; returns its content."""
    names = list(scorers)
    # The first reward's mean / std / score_error stay at the top (as when ImageReward was the only score); every
    # reward's are under "scores".
    summaries = {
        n: dict(zip(("mean", "std"), score_summary([r[n] for r in records]), strict=True)) for n in names
    }
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


def run_inference(cfg: InferenceConfig) -> dict:
    """Generate, save and score every image of the prompts file; returns what it wrote to scores.json."""
    from refl_ddpo.core.progress import progress_bar
    from refl_ddpo.run.outputs import check_output_dir
    from refl_ddpo.run.threads import set_cpu_threads

    # ---- everything a user can get wrong, before any model is loaded ----
    prompts = load_edit_data(cfg.edit_data) if cfg.edit_data else load_prompts(cfg.prompts_file)
    specs = plan_images(prompts, cfg.num_images_per_prompt, cfg.seed)
    out_dir = check_output_dir(cfg.output_dir)
    earlier = earlier_outputs(out_dir)
    print(f"{type(cfg).__name__}:\n{cfg.pretty()}", flush=True)
    print(
        f"  -> {len(prompts)} prompts x {cfg.num_images_per_prompt} images = {len(specs)} images, batches of "
        f"{cfg.batch_size}",
        flush=True,
    )

    set_cpu_threads()  # unless OMP_NUM_THREADS says otherwise (refl_ddpo.run.threads)

    # ---- models ----
    quiet_hf_logging()
    family, cfg = load_inference_family(cfg)  # the settings the model decides, where left unset
    resolved = {k: getattr(cfg, k) for k in ("scheduler", "resolution", "guidance_scale")}
    print("  used: " + ", ".join(f"{k} {v}" for k, v in resolved.items()), flush=True)
    scorers = make_scorers(cfg.rewards, cfg.reward_model_dir, cfg.device, cfg.video_reduction)
    names = list(scorers)
    settings = {
        k: getattr(cfg, k) for k in (*GENERATION_SETTINGS, "fps", "lora_dir", "lora_scale") if hasattr(cfg, k)
    }

    # ---- generate: from here on the folder's old results are stale (scores.json goes first) ----
    for path in earlier:
        path.unlink(missing_ok=True)
    records, grid_images = [], []
    start = time.perf_counter()
    with progress_bar(total=len(specs), desc="images", unit="img") as bar:
        for batch in _batches(specs, cfg.batch_size):
            batch_metadata = [with_source_images(s.metadata) for s in batch]  # an edit's sources read
            images = generate_batch(
                family,
                [s.prompt for s in batch],
                [s.seed for s in batch],
                cfg.resolution,
                cfg.num_inference_steps,
                cfg.guidance_scale,
                cfg.eta,
                metadata=batch_metadata,
            )
            bad = int((~torch.isfinite(images)).flatten(1).any(1).sum())
            if bad:  # NaN pixels would be written as black and scored
                raise UserError(
                    f"the model gave {bad} of {len(batch)} images with NaN or inf pixels (e.g. "
                    f"'{batch[0].prompt}'); check --pretrained_model, --lora_dir and --dtype (fp16 can overflow)."
                )
            pixels = to_uint8(images.flatten(0, -4)).unflatten(0, images.shape[:-3])  # (B, [T,] H, W, 3)
            batch_prompts = [s.prompt for s in batch]
            scores = {n: fn(batch_prompts, pixels, batch_metadata) for n, fn in scorers.items()}  # as saved
            records += _save_batch(out_dir, batch, pixels, scores, settings)
            firsts = pixels[:, 0] if pixels.ndim == 5 else pixels  # a video's first frame in the grid
            grid_images.extend(firsts[: max(0, cfg.grid_max_images - len(grid_images))])
            bar.set_postfix(  # the running mean of each reward
                {n: fmt_score(score_summary([r[n] for r in records])[0]) for n in names}, refresh=False
            )
            bar.update(len(batch))
    seconds = time.perf_counter() - start

    # ---- grid, then scores.json last ----
    if grid_images:
        _save_grid(out_dir / GRID_FILE, grid_images, records, names, cfg.num_images_per_prompt)
    result = _write_scores(out_dir, cfg, scorers, records, seconds)
    return result


@cli_main
def main_base(argv: list[str] | None = None) -> None:
    """Entry point of inference/inference.py (and the refl-ddpo-inference command)."""
    run_inference(parse_config(InferenceConfig, argv, description=InferenceConfig.__doc__))


@cli_main
def main_lora(argv: list[str] | None = None) -> None:
    """Entry point of inference/inference_lora.py (and the refl-ddpo-inference-lora command)."""
    run_inference(parse_config(LoraInferenceConfig, argv, description=LoraInferenceConfig.__doc__))
