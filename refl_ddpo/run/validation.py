"""Validation during training: held-out prompts, fixed seeds, the long deterministic sampler, the training reward(s).

Every trainer validates the same way (`Validator`), before its first step, every N steps (ReFL: optimizer steps;
DDPO / GRPO: epochs) and after its last:

    image j of prompt i      seeded --seed + i x num_validation_images + j (`refl_ddpo.core.generate.plan_images`)
    sampler                  the family's deterministic one: DDIM with eta 0 (SD 1.x/2.x, SDXL), the flow ODE (SD3,
                             FLUX.1), --validation_num_steps steps, CFG --validation_guidance_scale (FLUX.1-dev:
                             its embedded guidance) (`generate_batch`)
    scores                   the training reward(s), `validation/<reward>/mean|std` (a weighted sum: `total` and
                             each part), logged to every tracker with a captioned grid `validation/images`; and
                             --validation_reward's, rewards never trained on, beside them (refl_ddpo.run.guard)
    drift                    `validation/drift/<name>` (refl_ddpo.run.drift): brightness, saturation, the change
                             from the baseline's images, the diversity across a prompt's seeds, the trained
                             weights' norm; logged beside the scores
    files                    output_dir/validation/{step|epoch}-N.png (the grid) and .json (the model family, the
                             sampler, each image's prompt, seed and reward, the means and the drift monitors),
                             which the model card reads

So the images change only with the weights, and `inference_lora.py --seed S --num_images_per_prompt n
--num_inference_steps T --prompts_file FILE` draws the same ones from a saved LoRA. The main process alone validates
(no collective runs in it, the other processes wait at the next one), from its own generators: the training's random
streams do not move, so a resumed run stays bit-exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

VALIDATION_DIR = "validation"  # output_dir/validation/{unit}-{N}.png|json
GRID_TAG = "validation/images"
VIDEO_TAG = "validation/videos"  # videos: also the grid of each frame in turn, animated (outputs.log_video)
# a weighted --validation_reward's total: validation/validation_reward/...
VALIDATION_TOTAL = "validation_reward"
SCORED = "validation_reward/"  # --validation_reward's per-image scores among the parts draw_and_score returns


@dataclass
class ValidationResult:
    count: int  # the step or epoch after which it ran (0: before training)
    unit: str  # "step" (ReFL's optimizer steps) or "epoch" (DDPO, GRPO)
    metrics: dict[str, float]  # validation/<reward>/mean|std
    grid: Path  # the captioned grid, output_dir/validation/{unit}-{count}.png
    records: list[dict]  # per image: prompt, seed, reward
    images: torch.Tensor  # (N, 3, H, W) in [0, 1], on the CPU
    drift: dict[str, float] = field(default_factory=dict)  # validation/drift/<name> (refl_ddpo.run.drift)


def validation_files(output_dir: str | Path) -> list[dict]:
    """The validation records (.json) in output_dir/validation, oldest first."""
    folder = Path(output_dir) / VALIDATION_DIR
    records = []
    for path in folder.glob("*.json") if folder.is_dir() else []:
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r.get("count", 0))


def check_validation_prompts(cfg) -> None:
    """Before any model loads: --validation_prompts_file reads (a one-line error naming the flag if not)."""
    if not cfg.validation_prompts_file:
        return
    from refl_ddpo.core.errors import UserError
    from refl_ddpo.core.prompts import load_records

    try:
        load_records(cfg.validation_prompts_file, edits=bool(cfg.edit_data))
    except UserError as e:
        flag = "--edit_data" if cfg.edit_data else "--prompts_file"
        raise UserError(str(e).replace(flag, "--validation_prompts_file", 1)) from None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class ValidationSpec:
    """What validation draws and how (the --validation_* flags, resolved): built once by refl_ddpo.run.session; the model
    card's examples draw the same images again from it."""

    prompts_file: str | None  # --validation_prompts_file; None: no validation
    num_images: int  # per prompt (--num_validation_images)
    seed: int  # image j of prompt i is seeded seed + i x num_images + j
    num_steps: int
    guidance_scale: float
    batch_size: int
    resolution: int
    edits: bool = False  # the file holds edit records (an editing run, --edit_data): prompts with sources


def make_validator(
    accelerator,
    family,
    reward,
    reward_spec: str,
    spec: ValidationSpec,
    output_dir: str | Path,
    *,
    every: int,
    unit: str,
    last: int,
    start: int,
    scorers: tuple = (),
):
    """The trainer's Validator, or None without a prompts file; the records of validations after `start` (from a
    run that went further and was not resumed from there) are forgotten. `scorers`: (spec, reward) of
    --validation_reward, or nothing."""
    if not spec.prompts_file:
        return None
    validator = Validator(
        accelerator, family, reward, reward_spec, spec, output_dir, every=every, unit=unit, last=last
    )
    validator.scorers = scorers
    validator.forget_after(start)
    return validator


class Validator:
    """Validates the family's current weights on the validation prompts; see the module doc.

    `reward` is the trainer's reward (refl_ddpo.rewards), `reward_spec` its --reward string; `spec` what to draw;
    files go to output_dir/validation; `every` is N in the trainer's `unit`, 0 for only before the first and after
    the last."""

    def __init__(
        self,
        accelerator,
        family,
        reward,
        reward_spec: str,
        spec: ValidationSpec,
        output_dir: str | Path,
        *,
        every: int,
        unit: str,
        last: int,
    ):
        from refl_ddpo.core.generate import plan_images
        from refl_ddpo.core.prompts import load_records

        self.accelerator, self.family, self.reward, self.reward_spec = (
            accelerator,
            family,
            reward,
            reward_spec,
        )
        self.every, self.unit, self.last = every, unit, last
        self.specs = plan_images(load_records(spec.prompts_file, spec.edits), spec.num_images, spec.seed)
        self.per_prompt = spec.num_images
        self.num_steps, self.guidance_scale = spec.num_steps, spec.guidance_scale
        self.batch_size, self.resolution = spec.batch_size, spec.resolution
        self.folder = Path(output_dir) / VALIDATION_DIR
        # The family's first sampler is its deterministic inference one (DDIM / flow Euler), run with eta 0.
        self.scheduler_name = next(iter(family.schedulers.values()))
        self.scheduler = family.scheduler(self.scheduler_name)
        # whole prompts per row, at least 4 wide
        self.grid_cols = self.per_prompt * math.ceil(4 / self.per_prompt)
        # the baseline validation's images as its grid shows them (N, 3, 256, 256) uint8: kept from count 0, or
        # read back from its files by a resumed run (None until then, or when they are not there)
        self.baseline_cells: torch.Tensor | None = None
        self.baseline_read = False
        self.scorers: tuple = ()  # (spec, reward) of --validation_reward: scored and logged, never trained on

    def forget_after(self, count: int) -> None:
        """Delete the files of validations after `count` (all of them from 0): a run that starts or resumes there
        redoes them, and the model card must not show those of an earlier attempt (main process)."""
        if not self.accelerator.is_main_process or not self.folder.is_dir():
            return
        for record in validation_files(self.folder.parent):
            if count == 0 or record.get("count", 0) > count:
                name = Path(record.get("grid", "")).stem
                for suffix in (".json", ".png"):
                    (self.folder / f"{name}{suffix}").unlink(missing_ok=True)

    def due(self, count: int) -> bool:
        """Whether to validate after `count` steps or epochs: 0 (the baseline), every N, the last."""
        return count == 0 or count == self.last or bool(self.every and count % self.every == 0)

    def __call__(self, count: int, log_step: int) -> ValidationResult | None:
        """Validate (main process only; None elsewhere) and log at tracker step `log_step`. A sharded network
        (FSDP) needs every process in each forward: all draw and score the images, the main process writes and logs
        them."""
        from refl_ddpo.core.sharding import is_sharded

        if not self.accelerator.is_main_process:
            if is_sharded(self.accelerator):
                with torch.no_grad():
                    self.draw_and_score()
                self.trained_norm()
            return None
        from tqdm.auto import tqdm

        from refl_ddpo.rewards import reward_stats
        from refl_ddpo.run.outputs import log_grid, log_video

        images_all, rewards_all, parts, videos = self.draw_and_score()
        norm = self.trained_norm()
        stats = reward_stats(self.reward_spec, rewards_all, parts)
        metrics = {"validation/" + k.removeprefix("reward/"): v for k, v in stats.items()}
        metrics.update(self.scorer_stats(parts))
        name = f"{self.unit}-{count}"
        grid = self.grid(images_all, rewards_all)
        drift = self.drift(count, images_all, grid, norm)
        records = self.write(name, count, metrics, drift, grid, rewards_all)
        self.accelerator.log({**metrics, **drift, f"validation/{self.unit}": count}, step=log_step)
        log_grid(self.accelerator, GRID_TAG, grid, log_step)
        if videos and self.accelerator.trackers:
            log_video(self.accelerator, VIDEO_TAG, self.grid(torch.cat(videos), rewards_all), log_step)
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.endswith("/mean"))
        tqdm.write(f"validation after {self.unit} {count}: {shown} ({len(records)} images)")
        return ValidationResult(
            count, self.unit, metrics, self.folder / f"{name}.png", records, images_all, drift
        )

    def scorer_stats(self, parts: dict[str, torch.Tensor]) -> dict[str, float]:
        """validation/<name>/mean|std of --validation_reward (a weighted sum's total as validation_reward), from the
        per-image scores draw_and_score keeps under the "validation_reward/" prefix in `parts`."""
        from refl_ddpo.rewards import reward_stats

        out = {}
        for spec, _ in self.scorers:
            scored = {k.removeprefix(SCORED): v for k, v in parts.items() if k.startswith(SCORED)}
            stats = reward_stats(spec, scored.pop(""), scored)
            out.update({"validation/" + k.removeprefix("reward/"): v for k, v in stats.items()})
        return {
            k.replace("validation/total/", f"validation/{VALIDATION_TOTAL}/", 1): v for k, v in out.items()
        }

    def trained_norm(self) -> float | None:
        """The L2 norm of the network's trained tensors (None without any); with FSDP every process calls it (the
        squares of each process' shards are summed over the processes)."""
        from refl_ddpo.core.sharding import is_sharded, local, trainable_params
        from refl_ddpo.run.drift import sum_of_squares

        params = trainable_params(self.family.network)
        if not params:
            return None
        squares = sum_of_squares([local(p) for p in params])
        if is_sharded(self.accelerator):
            import torch.distributed as dist

            dist.all_reduce(squares)
        return float(squares.sqrt())

    def drift(
        self, count: int, images: torch.Tensor, grid: torch.Tensor, norm: float | None
    ) -> dict[str, float]:
        """The drift monitors of this validation (refl_ddpo.run.drift); the baseline's (count 0) grid cells are
        kept for the change from it."""
        from refl_ddpo.core.images import grid_cells
        from refl_ddpo.run.drift import drift_metrics

        cells = grid_cells(grid, len(images), self.grid_cols)
        if count == 0:
            self.baseline_cells, self.baseline_read = cells, True
        elif not self.baseline_read:
            self.baseline_cells, self.baseline_read = self.read_baseline(len(images)), True
        return drift_metrics(images, self.per_prompt, cells, self.baseline_cells, norm)

    def read_baseline(self, n: int) -> torch.Tensor | None:
        """The baseline validation's grid cells from its files (a resumed run), or None when they are not there or
        drew other prompts, seeds or sampler settings."""
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor

        from refl_ddpo.core.images import grid_cells

        record = next((r for r in validation_files(self.folder.parent) if r.get("count") == 0), None)
        path = self.folder / str((record or {}).get("grid", ""))
        if record is None or not path.is_file():
            return None
        drawn = [(r.get("prompt"), r.get("seed")) for r in record.get("records", [])]
        sampler = record.get("sampler", {})
        if drawn != [(s.prompt, s.seed) for s in self.specs] or sampler != self.sampler():
            return None
        with Image.open(path) as im:
            grid = pil_to_tensor(im.convert("RGB"))
        try:
            return grid_cells(grid, n, self.grid_cols)
        except ValueError:
            return None

    def sampler(self) -> dict:
        """How the validation images are drawn, as its records say."""
        return {
            "scheduler": self.scheduler_name,
            "eta": 0.0,
            "num_inference_steps": self.num_steps,
            "guidance_scale": self.guidance_scale,
        }

    def draw_and_score(self) -> tuple:
        """Every validation image with the deterministic sampler, in batches, and its reward: (images (N, 3, H, W)
        in [0, 1] (videos: frame 0), rewards (N,), its per-image parts, videos [(B, T, 3, H, W) uint8] or []), all
        on the CPU; the network's mode restored."""
        from refl_ddpo.core.edit_data import with_source_images
        from refl_ddpo.core.generate import generate_batch

        network = self.family.network
        was_training = network.training
        network.eval()
        images, rewards, parts, videos = [], [], {}, []
        try:
            for start in range(0, len(self.specs), self.batch_size):
                batch = self.specs[start : start + self.batch_size]
                prompts = [s.prompt for s in batch]
                metadata = [with_source_images(s.metadata) for s in batch]  # an edit's sources read
                with self.accelerator.autocast():
                    pixels = generate_batch(
                        self.family,
                        prompts,
                        [s.seed for s in batch],
                        self.resolution,
                        self.num_steps,
                        self.guidance_scale,
                        eta=0.0,
                        scheduler=self.scheduler,
                        metadata=metadata,
                    ).clone()  # (B, 3, H, W) in [0, 1]; out of inference mode for the reward
                with torch.no_grad():
                    r, info = self.reward(pixels, prompts, [dict(m) for m in metadata])
                    info = {**info, **self.score(pixels, prompts, [dict(m) for m in metadata])}
                images.append((pixels[:, 0] if pixels.ndim == 5 else pixels).float().cpu())  # videos: frame 0
                videos += [pixels.float().mul(255).round().byte().cpu()] if pixels.ndim == 5 else []
                rewards.append(r.detach().float().cpu())
                for name, value in info.items():
                    if isinstance(value, torch.Tensor) and value.shape == r.shape:
                        parts.setdefault(name, []).append(value.detach().float().cpu())
        finally:
            network.train(was_training)
        return torch.cat(images), torch.cat(rewards), {k: torch.cat(v) for k, v in parts.items()}, videos

    def score(
        self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> dict[str, torch.Tensor]:
        """--validation_reward's scores of a batch (B,), and its parts', under the "validation_reward/" prefix."""
        out = {}
        for _, scorer in self.scorers:
            r, info = scorer(pixels, prompts, metadata)
            r = torch.as_tensor(r, dtype=torch.float32)
            out[SCORED] = r
            out.update(
                {SCORED + k: v for k, v in info.items() if isinstance(v, torch.Tensor) and v.shape == r.shape}
            )
        return out

    def grid(self, images_all: torch.Tensor, rewards_all: torch.Tensor) -> torch.Tensor:
        """The captioned grid (3, H, W) uint8: each image with its reward, seed and prompt (videos: one a frame)."""
        from refl_ddpo.core.images import caption_grid, caption_video_grid, fmt_score

        captions = [
            f"{fmt_score(float(r))} s{s.seed} {s.prompt}"
            for s, r in zip(self.specs, rewards_all, strict=True)
        ]
        grid_fn = caption_video_grid if images_all.ndim == 5 else caption_grid
        return grid_fn(images_all, captions, cols=self.grid_cols)

    def write(
        self,
        name: str,
        count: int,
        metrics: dict,
        drift: dict,
        grid: torch.Tensor,
        rewards_all: torch.Tensor,
    ) -> list[dict]:
        """validation/NAME.png (the grid) and NAME.json (metrics, drift monitors, sampler, one record per image);
        returns the records."""
        from PIL import Image

        from refl_ddpo.core.images import write_json_atomic

        self.folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(self.folder / f"{name}.png")
        records = [  # an edit's record names its source image(s), as inference's scores.json
            {"prompt": s.prompt, "seed": s.seed, "reward": _finite(float(r))}
            | ({"source_image": s.metadata["source_paths"]} if "source_paths" in s.metadata else {})
            for s, r in zip(self.specs, rewards_all, strict=True)
        ]
        summary = {
            "count": count,
            "unit": self.unit,
            "metrics": {k: _finite(v) for k, v in metrics.items()},
            "drift": {k: _finite(v) for k, v in drift.items()},
            "grid": f"{name}.png",
            "family": self.family.name,
            "sampler": self.sampler(),
            "records": records,
        }
        write_json_atomic(self.folder / f"{name}.json", summary)
        return records
