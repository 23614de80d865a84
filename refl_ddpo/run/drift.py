"""Drift monitors: what a validation's images and the trained weights say about reward hacking, apart from the reward.

Pure functions of tensors; the Validator (refl_ddpo.run.validation) logs them at every validation as
`validation/drift/<name>`:

    brightness              mean luma of the images, Rec. 601 (0.299 R + 0.587 G + 0.114 B, PIL's `convert("L")`),
                            in [0, 1]: images that brighten while the reward stays flat (DiffusionNFT#47)
    saturation              mean HSV saturation (max - min) / max per pixel (0 where max is 0), in [0, 1]
    change_from_baseline    mean absolute pixel difference, in [0, 1], to the baseline validation's (count 0) images
                            at the same prompts and seeds, each image as the validation grid shows it (its 256 px
                            cell, uint8): a run resumed from its files measures what an unbroken run measures
    diversity               mean over prompts of the mean distance between two of its images (all pairs of its
                            seeds): RMS difference of the images downscaled to 32 x 32 (area), in [0, 1]; absent
                            with one image per prompt. Falls when the seeds of a prompt collapse onto one picture.
    weights_norm            L2 norm of the trained tensors: the LoRA's A and B matrices, or the whole network's
                            weights in a full fine-tune (the network's parameters that require grad)
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

PREFIX = "validation/drift/"
DRIFT_NAMES = ("brightness", "saturation", "change_from_baseline", "diversity", "weights_norm")
DIVERSITY_SIZE = 32  # images are downscaled to this many pixels a side before their distances are taken
LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as PIL's convert("L")


def brightness(images: torch.Tensor) -> float:
    """Mean luma of images (N, 3, H, W) in [0, 1]."""
    weights = torch.tensor(LUMA, dtype=torch.float64).view(3, 1, 1)
    return _mean_per_image(images, lambda x: (x * weights).sum(dim=0))


def saturation(images: torch.Tensor) -> float:
    """Mean HSV saturation of images (N, 3, H, W) in [0, 1]: (max - min) / max over the channels, 0 on black."""

    def per_pixel(x: torch.Tensor) -> torch.Tensor:
        high, low = x.amax(dim=0), x.amin(dim=0)
        return torch.where(high > 0, (high - low) / high.clamp_min(1e-12), 0.0)

    return _mean_per_image(images, per_pixel)


def _mean_per_image(images: torch.Tensor, per_pixel) -> float:
    """The mean over images of the mean of `per_pixel(image (3, H, W) float64)`: one image at a time, so that a
    batch of large images is never copied whole."""
    return float(torch.stack([per_pixel(x.double().cpu()).mean() for x in images]).mean())


def mean_abs_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean |a - b| of two image batches of one shape: float in [0, 1], or uint8 (then divided by 255, summed in
    integers: exact)."""
    if a.shape != b.shape:
        raise ValueError(f"images of shape {tuple(a.shape)} and {tuple(b.shape)} cannot be compared")
    if a.dtype == torch.uint8 and b.dtype == torch.uint8:
        return int((a.long() - b.long()).abs().sum()) / (a.numel() * 255)
    return float((a.double() - b.double()).abs().mean())


def diversity(images: torch.Tensor, per_prompt: int, size: int = DIVERSITY_SIZE) -> float | None:
    """Mean over prompts of the mean pairwise RMS distance between a prompt's images, downscaled to `size` px.

    `images` (N, 3, H, W) in [0, 1] hold each prompt's `per_prompt` images one after the other (as the validation
    draws them); None when `per_prompt` < 2 (no pair)."""
    if per_prompt < 2:
        return None
    if len(images) % per_prompt:
        raise ValueError(f"{len(images)} images are not whole prompts of {per_prompt}")
    small = torch.stack([_downscaled(x.double().cpu(), size) for x in images])
    flat = small.flatten(1).view(-1, per_prompt, small[0].numel())  # (prompts, per_prompt, D)
    pairs = list(itertools.combinations(range(per_prompt), 2))
    first, second = (torch.tensor(idx) for idx in zip(*pairs, strict=True))
    distances = (flat[:, first] - flat[:, second]).square().mean(dim=2).sqrt()  # (prompts, pairs)
    return float(distances.mean())


def _downscaled(image: torch.Tensor, size: int) -> torch.Tensor:
    """An image (3, H, W) averaged over areas down to (3, size, size); one already that small is kept."""
    if image.shape[-1] <= size and image.shape[-2] <= size:
        return image
    return F.interpolate(image[None], size=(size, size), mode="area")[0]


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ ||t||² over tensors, a float64 scalar on the first tensor's device (0 on the CPU for none)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([t.detach().double().square().sum() for t in tensors]).sum()


def weights_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of all the tensors together, sqrt(Σ ||t||²)."""
    return float(sum_of_squares(tensors).sqrt())


def drift_metrics(
    images: torch.Tensor,
    per_prompt: int,
    cells: torch.Tensor | None = None,
    baseline_cells: torch.Tensor | None = None,
    norm: float | None = None,
) -> dict[str, float]:
    """The monitors of one validation, keyed `validation/drift/<name>`: brightness, saturation and diversity of
    `images` (N, 3, H, W) in [0, 1]; change_from_baseline of the grid's `cells` (N, 3, c, c) uint8 against
    `baseline_cells` when both are given; weights_norm when `norm` is."""
    out = {"brightness": brightness(images), "saturation": saturation(images)}
    if cells is not None and baseline_cells is not None:
        out["change_from_baseline"] = mean_abs_difference(cells, baseline_cells)
    spread = diversity(images, per_prompt)
    if spread is not None:
        out["diversity"] = spread
    if norm is not None:
        out["weights_norm"] = norm
    return {PREFIX + k: v for k, v in out.items()}
