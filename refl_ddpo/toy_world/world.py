"""The toy world: coloured shapes on grey, a tiny Stable Diffusion trained to draw them, and a judge.

Images are 32 x 32 RGB: a uniform grey background (128, 128, 128) and one filled shape (circle, square or
triangle), 10 to 24 pixels across, fully inside the image, in one of six palette colours. Prompts are exactly
`a {colour} {shape}` ("a cyan triangle"): 18 of them, split once and for all into 12 TRAIN_PROMPTS and 6
HELDOUT_PROMPTS (each colour once, each shape twice), also shipped as data/toy_world_{train,heldout}.txt.

The judge (`judge`, `colour_accuracy`) reads pixels only, with fixed thresholds on the 0..255 scale (RGB L2):
    shape pixels   farther than SHAPE_THRESHOLD (40) from the median colour of the image's 1-pixel border ring
    colour_ok      at least MIN_SHAPE_PIXELS (8) shape pixels, and their mean colour's nearest palette colour is
                   the prompt's colour
    dirty          fraction of pixels farther than CLEAN_THRESHOLD (60) from BOTH the nominal background grey
                   (128, 128, 128, not the border's median: a tinted background is dirty) and the prompt's palette
                   colour. Rendered images have 0; the base model's soft edges give a few percent.
    grey           fraction of pixels within CLEAN_THRESHOLD of the nominal background grey. A shape 10-24 pixels
                   across leaves most of the frame grey; a model that pleases a colour reward by filling the frame
                   with the colour lowers it while `dirty` stays low (seen with ReFL on toy-sd3 at lr 1e-2).
    ragged         fraction of the shape pixels that have a non-shape pixel among their 8 neighbours: about 0.31 on
                   average for rendered shapes (0.09 for the largest, 0.64 for the smallest); shapes broken into
                   strokes and specks raise it (0.276 -> 0.425 with a ReFL LoRA on toy-sd3), which `dirty` misses.
                   Strokes that reach the border move its median off grey and hide from it; `grey` falls then.

The base models are deliberately imperfect (colour accuracy about 40 % at DDIM 50 steps, CFG 7.5): their training
captions confused colour words in pairs (red/magenta, green/yellow, blue/cyan) half of the time, so they draw
"a red ..." red or magenta about equally; see refl_ddpo.testing.toy_build. Two families of the same world: toy-sd/
(SD 1.x, a UNet) and toy-sd3/ (SD3, an MMDiT trained by flow matching on the same VAE, no T5).

The trained models (built by `refl_ddpo.testing.toy_build`, deterministically from seeds, on one CPU thread) are
committed under toy_world.DATA_DIR with their SHA256SUMS, so every machine tests on the same weights;
`toy_files.write_toy_world(out)` (`python -m refl_ddpo.tiny OUT --toy_world`) copies them after checking the sums.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from refl_ddpo.core.errors import UserError
from refl_ddpo.toy_world import DATA_DIR

SIZE = 32
BACKGROUND = (128, 128, 128)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (40, 70, 230),
    "yellow": (235, 215, 40),
    "magenta": (215, 40, 215),
    "cyan": (40, 205, 215),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
MIN_EXTENT, MAX_EXTENT = 10, 24
PROMPTS: tuple[str, ...] = tuple(f"a {c} {s}" for c in COLOURS for s in SHAPES)
# Held out: colour i with shape (i + 1) % 3 -> each colour once, each shape twice.
HELDOUT_PROMPTS: tuple[str, ...] = tuple(f"a {c} {SHAPES[(i + 1) % 3]}" for i, c in enumerate(COLOURS))
TRAIN_PROMPTS: tuple[str, ...] = tuple(p for p in PROMPTS if p not in HELDOUT_PROMPTS)


def word_prompts(colour: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """One colour word's training prompts (2) and held-out prompt (1)."""
    return tuple(p for p in TRAIN_PROMPTS if p.split()[1] == colour), tuple(
        p for p in HELDOUT_PROMPTS if p.split()[1] == colour
    )


# The policy-gradient presets train on one colour word (docs/toy_world.md): on toy-sd green's two training
# prompts (data/toy_world_green.txt), "a green triangle" held out. The toy-sd3 presets train cyan
# (data/toy_world_cyan.txt), "a cyan circle" held out: toy-sd3 draws the green prompts green 1 time in 8, so most
# groups of 8 have all-equal rewards and nothing to learn from.
PG_COLOUR, SD3_COLOUR = "green", "cyan"
PG_TRAIN_PROMPTS, PG_HELDOUT_PROMPTS = word_prompts(PG_COLOUR)
SD3_TRAIN_PROMPTS, SD3_HELDOUT_PROMPTS = word_prompts(SD3_COLOUR)

SHAPE_THRESHOLD = 40.0
MIN_SHAPE_PIXELS = 8
CLEAN_THRESHOLD = 60.0

SD_DIRNAME = "toy-sd"
SD3_DIRNAME = "toy-sd3"
CLASSIFIER_NAME = "toy_classifier"

_COLOUR_NAMES = tuple(COLOURS)
_PALETTE = torch.tensor([COLOURS[c] for c in _COLOUR_NAMES], dtype=torch.float32)  # (6, 3)


def parse_prompt(prompt: str) -> tuple[str, str]:
    """'a cyan triangle' -> ('cyan', 'triangle'); anything outside the grammar is a one-line UserError."""
    words = prompt.strip().lower().split()
    if len(words) != 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES:
        raise UserError(
            f"toy world prompt {prompt!r} is not 'a {{colour}} {{shape}}' with colour one of "
            f"{', '.join(COLOURS)} and shape one of {', '.join(SHAPES)}"
        )
    return words[1], words[2]


def prompt_indices(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(colour index, shape index) tensors [B] of prompts, indices into COLOURS / SHAPES."""
    parsed = [parse_prompt(p) for p in prompts]
    return (
        torch.tensor([_COLOUR_NAMES.index(c) for c, _ in parsed], dtype=torch.long),
        torch.tensor([SHAPES.index(s) for _, s in parsed], dtype=torch.long),
    )


def render_batch(
    colour_idx: torch.Tensor, shape_idx: torch.Tensor, generator: torch.Generator, size: int = SIZE
) -> torch.Tensor:
    """uint8 images (B, 3, size, size) of the given colours / shapes (index tensors [B]); extent and position
    random from `generator` (extent 10..24 px, shape fully inside). Pixels are exact palette or background colours
    (a pixel is inside when its centre is)."""
    n = len(colour_idx)
    extent = torch.randint(MIN_EXTENT, MAX_EXTENT + 1, (n,), generator=generator)
    u = torch.rand(n, 2, generator=generator)
    x0 = (u[:, 0] * (size - extent + 1)).floor().clamp(max=size - extent).view(n, 1, 1)
    y0 = (u[:, 1] * (size - extent + 1)).floor().clamp(max=size - extent).view(n, 1, 1)
    s = extent.view(n, 1, 1).float()
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    dx, dy = xs - x0, ys - y0  # (n, size, size), in [0, s) inside the bounding box
    in_box = (dx >= 0) & (dx < s) & (dy >= 0) & (dy < s)
    circle = (dx - s / 2) ** 2 + (dy - s / 2) ** 2 <= (s / 2) ** 2
    triangle = in_box & ((dx - s / 2).abs() <= dy / 2)  # apex at the top centre, base along the bottom
    masks = torch.stack([circle, in_box, triangle], 1)  # (n, 3 shapes, size, size)
    mask = masks[torch.arange(n), shape_idx.long()]  # (n, size, size)
    fg = _PALETTE[colour_idx.long()].view(n, 3, 1, 1)
    bg = torch.tensor(BACKGROUND, dtype=torch.float32).view(1, 3, 1, 1)
    return torch.where(mask.unsqueeze(1), fg, bg).to(torch.uint8)


def render(colour: str, shape: str, generator: torch.Generator, size: int = SIZE) -> torch.Tensor:
    """One uint8 image (3, size, size) of `colour` `shape`, deterministic from `generator`."""
    parse_prompt(f"a {colour} {shape}")
    return render_batch(
        torch.tensor([_COLOUR_NAMES.index(colour)]), torch.tensor([SHAPES.index(shape)]), generator, size
    )[0]


def render_prompts(prompts: list[str], generator: torch.Generator, size: int = SIZE) -> torch.Tensor:
    """uint8 images (B, 3, size, size) drawing each prompt."""
    c, s = prompt_indices(prompts)
    return render_batch(c, s, generator, size)


def random_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """n rendered images (uint8) of uniformly drawn prompts, and the prompts."""
    c = torch.randint(0, len(COLOURS), (n,), generator=generator)
    s = torch.randint(0, len(SHAPES), (n,), generator=generator)
    return render_batch(c, s, generator), [
        f"a {_COLOUR_NAMES[i]} {SHAPES[j]}" for i, j in zip(c, s, strict=True)
    ]


def _to_255(images: torch.Tensor) -> torch.Tensor:
    if images.dtype == torch.uint8:
        return images.float()
    return images.detach().float().clamp(0, 1) * 255


@torch.no_grad()
def judge(images: torch.Tensor, prompts: list[str]) -> dict:
    """Score images (B, 3, H, W) float in [0, 1] or uint8 against their prompts (see the module doc).

    Returns per-image tensors `colour_ok` (bool), `nearest` (palette index of the shape's mean colour, -1 when
    there is no shape), `shape_pixels` (count), `mean_colour` (B, 3, 0..255), `dirty` (fraction), `grey`
    (fraction), `ragged` (fraction, 0 without shape pixels), and the means `accuracy` and `dirty_mean` (floats)."""
    x = _to_255(images).cpu()
    b, _, h, w = x.shape
    colour_idx, _ = prompt_indices(prompts)
    ring = torch.ones(h, w, dtype=torch.bool)
    ring[1:-1, 1:-1] = False
    border = x[:, :, ring]  # (B, 3, n_ring)
    bg = border.median(dim=2).values.view(b, 3, 1, 1)
    shape_mask = (x - bg).norm(dim=1) > SHAPE_THRESHOLD  # (B, H, W)
    count = shape_mask.sum(dim=(1, 2))
    mean_colour = (x * shape_mask.unsqueeze(1)).sum(dim=(2, 3)) / count.clamp(min=1).unsqueeze(1)
    nearest = torch.cdist(mean_colour, _PALETTE).argmin(dim=1)
    has_shape = count >= MIN_SHAPE_PIXELS
    nearest = torch.where(has_shape, nearest, torch.full_like(nearest, -1))
    colour_ok = has_shape & (nearest == colour_idx)
    grey = torch.tensor(BACKGROUND, dtype=torch.float32).view(1, 3, 1, 1)
    target = _PALETTE[colour_idx].view(b, 3, 1, 1)
    dirty_px = ((x - grey).norm(dim=1) > CLEAN_THRESHOLD) & ((x - target).norm(dim=1) > CLEAN_THRESHOLD)
    dirty = dirty_px.float().mean(dim=(1, 2))
    grey_fraction = ((x - grey).norm(dim=1) <= CLEAN_THRESHOLD).float().mean(dim=(1, 2))
    # a shape pixel is inside when its whole 3 x 3 neighbourhood (within the image) is shape: min-pool as -max(-m)
    inside = (
        -nn.functional.max_pool2d(-shape_mask.float().unsqueeze(1), 3, stride=1, padding=1).squeeze(1) > 0.5
    )
    ragged = (shape_mask & ~inside).sum(dim=(1, 2)) / count.clamp(min=1)
    return {
        "colour_ok": colour_ok,
        "nearest": nearest,
        "shape_pixels": count,
        "mean_colour": mean_colour,
        "dirty": dirty,
        "grey": grey_fraction,
        "ragged": ragged,
        "accuracy": colour_ok.float().mean().item(),
        "dirty_mean": dirty.mean().item(),
    }


def colour_accuracy(images: torch.Tensor, prompts: list[str]) -> float:
    """Fraction of images whose shape's mean colour is nearest to the prompt's colour."""
    return judge(images, prompts)["accuracy"]


class ToyClassifier(nn.Module):
    """Colour / shape classifier of 32 x 32 images in [0, 1]: conv blocks (3x3 conv, ReLU, 2x2 max-pool after all
    but the last), global average + max pooling, two linear heads. `forward` -> (colour logits [B, 6], shape
    logits [B, 3])."""

    def __init__(
        self, channels: tuple[int, ...] = (16, 24, 32, 32), num_colours: int = 6, num_shapes: int = 3
    ):
        super().__init__()
        layers, c_in = [], 3
        for i, c in enumerate(channels):
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
            if i < len(channels) - 1:
                layers.append(nn.MaxPool2d(2))
            c_in = c
        self.features = nn.Sequential(*layers)
        self.colour_head = nn.Linear(2 * c_in, num_colours)
        self.shape_head = nn.Linear(2 * c_in, num_shapes)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(images * 2 - 1)
        f = torch.cat([f.mean(dim=(2, 3)), f.amax(dim=(2, 3))], dim=1)
        return self.colour_head(f), self.shape_head(f)


def load_classifier(folder: str | Path, device="cpu", dtype=torch.float32) -> ToyClassifier:
    """The classifier saved as FOLDER/toy_classifier.{safetensors,json}, in eval mode with frozen weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights, config = folder / f"{CLASSIFIER_NAME}.safetensors", folder / f"{CLASSIFIER_NAME}.json"
    if not (weights.is_file() and config.is_file()):
        raise UserError(
            f"no toy classifier in {folder} ({weights.name} + {config.name}); write it with "
            f"`python -m refl_ddpo.tiny OUT --toy_world` and pass OUT as the model dir"
        )
    cfg = json.loads(config.read_text())
    if list(cfg.get("colours", [])) != list(COLOURS) or list(cfg.get("shapes", [])) != list(SHAPES):
        raise UserError(
            f"{config}: its colours/shapes are not this toy world's ({', '.join(COLOURS)}; "
            f"{', '.join(SHAPES)})"
        )
    model = ToyClassifier(tuple(cfg["channels"]), len(cfg["colours"]), len(cfg["shapes"]))
    model.load_state_dict(load_file(str(weights)))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_classifier(model: ToyClassifier, folder: str | Path, channels: tuple[int, ...]) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    save_file(
        {k: v.detach().contiguous() for k, v in model.state_dict().items()},
        str(folder / f"{CLASSIFIER_NAME}.safetensors"),
    )
    (folder / f"{CLASSIFIER_NAME}.json").write_text(
        json.dumps(
            {
                "architecture": "refl_ddpo.toy_world.world.ToyClassifier",
                "channels": list(channels),
                "image_size": SIZE,
                "colours": list(COLOURS),
                "shapes": list(SHAPES),
                "input": "RGB in [0, 1], 32 x 32",
            },
            indent=2,
        )
        + "\n"
    )


EVAL_SEEDS: tuple[int, ...] = tuple(range(1000, 1016))  # fixed seeds for before/after on the held-out prompts
# the learning proofs judge on more seeds (tests/learning_cases.py): on one prompt, one standard error <= 0.063; on
# the 6 held-out prompts, judged on 16 seeds, the same LoRAs' gains spread 1.6 times wider (docs/record/learning_spread.md)
PROOF_EVAL_SEEDS: tuple[int, ...] = tuple(range(1000, 1064))


def evaluate(
    family,
    prompts: tuple[str, ...] | list[str] = HELDOUT_PROMPTS,
    seeds=EVAL_SEEDS,
    num_inference_steps: int = 20,
    guidance_scale: float = 7.5,
) -> dict[str, float]:
    """Colour accuracy, dirty, grey and ragged fractions of a model family's images of `prompts` x `seeds` (one CPU
    generator per image, the family's current sampler: deterministic with DDIM eta 0 on SD 1.x, the flow-matching
    Euler ODE on SD3): what the learning tests compare."""
    from refl_ddpo.core.generate import generate_batch

    all_prompts = [p for p in prompts for _ in seeds]
    all_seeds = [s for _ in prompts for s in seeds]
    images = generate_batch(family, all_prompts, all_seeds, SIZE, num_inference_steps, guidance_scale)
    return judge_means(judge(images, all_prompts))


def evaluate_model(
    model: str | Path | None = None,
    lora_dir: str | Path | None = None,
    prompts: tuple[str, ...] | list[str] = HELDOUT_PROMPTS,
    seeds=EVAL_SEEDS,
) -> dict[str, float]:
    """`evaluate` of a model folder (default: the committed toy-sd) plus a LoRA folder, at the evaluation defaults:
    DDIM eta 0 on SD 1.x, the folder's flow-matching scheduler on SD3."""
    from refl_ddpo.core.families import load_family
    from refl_ddpo.core.lora import load_lora_into_pipeline

    family = load_family(str(model or DATA_DIR / SD_DIRNAME))
    if family.name == "sd":
        family.pipe.scheduler = family.scheduler("DDIMScheduler")
    if lora_dir is not None:
        load_lora_into_pipeline(family.pipe, str(lora_dir))
    return evaluate(family, prompts, seeds)


def judge_files(paths: list[Path], prompts: list[str]) -> dict:
    """`judge` of PNG files (one per prompt), as an inference run wrote them."""
    import numpy as np
    from PIL import Image

    images = []
    for path in paths:
        with Image.open(path) as im:
            images.append(torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1))
    return judge(torch.stack(images).float() / 255, prompts)


def judge_means(result: dict) -> dict[str, float]:
    """The means of a `judge` result: colour accuracy and the dirty, grey and ragged fractions."""
    return {
        "accuracy": float(result["colour_ok"].float().mean()),
        "dirty": float(result["dirty"].float().mean()),
        "grey": float(result["grey"].mean()),
        "ragged": float(result["ragged"].mean()),
    }


def judge_run(run_dir: str | Path) -> dict[str, float]:
    """Colour accuracy, dirty, grey and ragged fractions of an inference run folder (its scores.json records and
    PNGs), and `by_prompt`: {prompt: (right, images)} in the run's order."""
    run = json.loads((Path(run_dir) / "scores.json").read_text())
    prompts = [record["prompt"] for record in run["records"]]
    result = judge_files([Path(run_dir) / record["file"] for record in run["records"]], prompts)
    by_prompt: dict[str, tuple[int, int]] = {}
    for prompt, ok in zip(prompts, result["colour_ok"].tolist(), strict=True):
        right, n = by_prompt.get(prompt, (0, 0))
        by_prompt[prompt] = (right + int(ok), n + 1)
    return {"images": len(prompts), "by_prompt": by_prompt, **judge_means(result)}


def main(argv: list[str] | None = None) -> None:
    """python -m refl_ddpo.toy_world.world RUN_DIR [RUN_DIR ...]: the judge's colour accuracy of inference runs."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m refl_ddpo.toy_world.world", description=main.__doc__, allow_abbrev=False
    )
    parser.add_argument(
        "runs", nargs="+", help="Folders written by inference/inference.py or inference_lora.py."
    )
    for run_dir in parser.parse_args(argv).runs:
        r = judge_run(run_dir)
        by_prompt = ", ".join(f"{p} {right}/{n}" for p, (right, n) in r["by_prompt"].items())
        print(
            f"{run_dir}: colour accuracy {r['accuracy']:.1%} of {r['images']} images, dirty {r['dirty']:.3f}, "
            f"grey {r['grey']:.3f}, ragged {r['ragged']:.3f} ({by_prompt})"
        )


if __name__ == "__main__":
    main()
