"""Guards against reward hacking (issue 64): the drift monitors against closed forms, the validation grid's cells read
back exactly, and GRPO-Guard's RatioNorm against its closed form on hand-made tensors. CPU, no model."""

import math

import pytest
import torch

from refl_ddpo.algorithms.policy import ratio_norm
from refl_ddpo.core.images import caption_grid, grid_cells
from refl_ddpo.run import drift

# ---- drift monitors ----


def test_brightness_and_saturation_of_constant_images():
    grey = torch.full((2, 3, 8, 8), 0.25)
    assert drift.brightness(grey) == pytest.approx(0.25, abs=1e-7)  # the luma weights sum to 1
    assert drift.saturation(grey) == 0.0
    black = torch.zeros(1, 3, 4, 4)
    assert drift.brightness(black) == 0.0 and drift.saturation(black) == 0.0  # HSV: saturation 0 on black
    red = torch.zeros(1, 3, 4, 4)
    red[:, 0] = 0.8
    assert drift.brightness(red) == pytest.approx(0.299 * 0.8, abs=1e-7)
    assert drift.saturation(red) == pytest.approx(1.0, abs=1e-7)
    pastel = torch.tensor([0.8, 0.4, 0.6]).view(1, 3, 1, 1).expand(1, 3, 5, 5)
    assert drift.saturation(pastel) == pytest.approx((0.8 - 0.4) / 0.8, abs=1e-7)
    both = torch.cat([grey[:1, :, :4, :4], red])  # the mean over every pixel of every image
    assert drift.brightness(both) == pytest.approx((0.25 + 0.299 * 0.8) / 2, abs=1e-7)


def test_mean_abs_difference_and_diversity_closed_forms():
    a, b = torch.zeros(1, 3, 4, 4), torch.full((1, 3, 4, 4), 0.5)
    b[..., 0, :] = 1.0  # one row of four: mean |a - b| = (3 x 0.5 + 1) / 4
    assert drift.mean_abs_difference(a, b) == pytest.approx(0.625, abs=1e-7)
    assert drift.mean_abs_difference(
        torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.full((2, 3, 2, 2), 51, dtype=torch.uint8)
    ) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="cannot be compared"):
        drift.mean_abs_difference(a, b[..., :2])

    same = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)).expand(3, 3, 16, 16)
    assert drift.diversity(same, per_prompt=3) == 0.0  # identical images: no spread
    assert drift.diversity(same, per_prompt=1) is None  # no pair
    # two prompts of two images: black / white (RMS distance 1) and two greys 0.2 apart (0.2): mean 0.6
    pairs = torch.stack(
        [torch.zeros(3, 8, 8), torch.ones(3, 8, 8), torch.full((3, 8, 8), 0.4), torch.full((3, 8, 8), 0.6)]
    )
    assert drift.diversity(pairs, per_prompt=2) == pytest.approx(0.6, abs=1e-7)
    # three images of one prompt, constant 0, 0.3, 1: pairs 0.3, 1.0, 0.7
    three = torch.stack([torch.full((3, 4, 4), v) for v in (0.0, 0.3, 1.0)])
    assert drift.diversity(three, per_prompt=3) == pytest.approx(2.0 / 3, abs=1e-7)
    # downscaled to 32 x 32 by area: a 64 px image of 2 x 2 blocks is its 32 px version
    small = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    big = small.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    assert drift.diversity(big, per_prompt=2) == pytest.approx(drift.diversity(small, per_prompt=2), abs=1e-7)
    with pytest.raises(ValueError, match="whole prompts"):
        drift.diversity(three, per_prompt=2)


def test_weights_norm_and_the_named_metrics():
    assert drift.weights_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == pytest.approx(5.0)
    assert drift.weights_norm([]) == 0.0
    images = torch.full((4, 3, 8, 8), 0.5)
    cells = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    out = drift.drift_metrics(images, 2, cells, cells + 255, norm=2.5)
    assert out == {
        "validation/drift/brightness": pytest.approx(0.5),
        "validation/drift/saturation": 0.0,
        "validation/drift/change_from_baseline": 1.0,
        "validation/drift/diversity": 0.0,
        "validation/drift/weights_norm": 2.5,
    }
    assert set(drift.drift_metrics(images, 1)) == {
        "validation/drift/brightness",
        "validation/drift/saturation",
    }


def test_grid_cells_are_the_images_as_the_grid_shows_them():
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor, to_pil_image

    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    grid = caption_grid(
        images, [f"image {i} with a caption long enough to wrap" for i in range(6)], cell=32, cols=4
    )
    cells = grid_cells(grid, 6, cols=4, cell=32)
    shown = torch.stack([pil_to_tensor(to_pil_image(img).resize((32, 32))) for img in images])
    assert cells.dtype == torch.uint8 and torch.equal(cells, shown)
    assert torch.equal(
        grid_cells(pil_to_tensor(Image.fromarray(grid.permute(1, 2, 0).numpy())), 6, 4, 32), cells
    )
    with pytest.raises(ValueError, match="is not one of 3 images"):
        grid_cells(grid, 3, cols=4, cell=32)


# ---- GRPO-Guard's RatioNorm ----


def _gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean over the non-batch dims of log N(x; mean, std^2), std (B,)."""
    s = std.view(-1, *([1] * (x.ndim - 1)))
    log_prob = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return log_prob.mean(dim=tuple(range(1, x.ndim)))


def test_ratio_norm_is_mean_eps_delta_whatever_the_step():
    """x_next = old_mean + s * eps scored under both means: RatioNorm gives mean(eps * delta) exactly, the same at
    steps of very different s, where the raw log-ratio mean(eps * delta) / s - mean(delta^2) / (2 s^2) is shifted
    left and scaled by 1 / s."""
    g = torch.Generator().manual_seed(0)
    eps = torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64)
    delta = 0.05 * torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64)
    old_mean = torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64)
    expected = (eps * delta).mean(dim=(1, 2, 3)).float()
    raw = []
    for s in (torch.tensor([0.02, 0.02, 0.02]), torch.tensor([0.5, 0.9, 1.3]), 0.3):
        std = torch.as_tensor(s, dtype=torch.float64).expand(3)
        x_next = old_mean + std.view(-1, 1, 1, 1) * eps
        log_prob, old_log_prob = (
            _gaussian_log_prob(x_next, old_mean + delta, std),
            _gaussian_log_prob(x_next, old_mean, std),
        )
        bias = (delta**2).mean(dim=(1, 2, 3)) / (2 * std**2)
        assert torch.allclose(
            log_prob - old_log_prob, (eps * delta).mean(dim=(1, 2, 3)) / std - bias, atol=1e-9
        )
        normed = ratio_norm(log_prob, old_log_prob, old_mean + delta, old_mean, s)
        assert normed.shape == (3,) and normed.dtype == torch.float32
        assert torch.allclose(normed, expected, atol=1e-6, rtol=1e-4)
        raw.append((log_prob - old_log_prob).float())
    assert (raw[0] - expected).abs().min() > 0.5, "the raw log-ratio at a small step is far from it"
    # on-policy (same mean): 0, the ratio 1, at any step
    same = ratio_norm(
        torch.tensor([-1.2, 0.3]),
        torch.tensor([-1.2, 0.3]),
        old_mean[:2],
        old_mean[:2],
        torch.tensor([0.1, 2.0]),
    )
    assert torch.equal(same, torch.zeros(2))


def test_ratio_norm_centres_the_ratio_over_the_noise():
    """Over many noise draws the raw log-ratio's mean is -mean(delta^2) / (2 s^2) and its std sqrt(mean(delta^2) / D)
    / s; RatioNorm's are 0 and sqrt(mean(delta^2) / D) at every s."""
    g = torch.Generator().manual_seed(1)
    n, d = 20000, 16
    delta = torch.full((1, d), 0.1, dtype=torch.float64).expand(n, d)
    old_mean = torch.zeros(n, d, dtype=torch.float64)
    eps = torch.randn(n, d, generator=g, dtype=torch.float64)
    spread = math.sqrt(0.01 / d)
    for s in (0.05, 0.4):
        std = torch.full((n,), s, dtype=torch.float64)
        x_next = old_mean + s * eps
        lp, old_lp = (
            _gaussian_log_prob(x_next, old_mean + delta, std),
            _gaussian_log_prob(x_next, old_mean, std),
        )
        raw = lp - old_lp
        assert raw.mean().item() == pytest.approx(
            -0.01 / (2 * s**2), rel=0.05, abs=4 * spread / s / math.sqrt(n)
        )
        normed = ratio_norm(lp, old_lp, old_mean + delta, old_mean, std).double()
        assert abs(normed.mean().item()) < 4 * spread / math.sqrt(n)
        assert normed.std().item() == pytest.approx(spread, rel=0.03)
