"""Guards against reward hacking (issue 64): the drift monitors against closed forms, the validation grid's cells read
back exactly. CPU, no model."""

import pytest
import torch

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
