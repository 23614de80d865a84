"""Policy-gradient learning with groups, proved on the toy world: GRPO through `train_grpo.sh --preset toy_world`
(toy-sd, SD 1.x's DDIM step, 8 groups of 8 with one x_T per group) raises the colour accuracy of fixed-seed images of
the HELD-OUT prompt "a green triangle" (the preset trains on the colour word green alone; README, "The toy world").
A file of its own, so that pytest-xdist (--dist loadfile) runs it beside the other learning tests."""

import pytest

# _one_thread: test_toy_learning's autouse fixture (one torch thread in this module), imported to apply here too
from test_toy_learning import _check_only_the_lora_changed, _one_thread, _train  # noqa: F401

from refl_ddpo import toy_world

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def held_out_green(lora_dir=None) -> dict[str, float]:
    """Colour accuracy of the held-out prompt of the trained colour on 64 fixed seeds."""
    model = toy_world.DATA_DIR / toy_world.SD_DIRNAME
    return toy_world.evaluate_model(model, lora_dir, toy_world.PG_HELDOUT_PROMPTS, toy_world.PG_EVAL_SEEDS)


def test_grpo_raises_held_out_colour_accuracy(tmp_path):
    base = held_out_green()
    r = _train("train_grpo.sh", tmp_path / "grpo")
    assert r.returncode == 0, r.stderr[-3000:]
    _check_only_the_lora_changed(tmp_path / "grpo")
    after = held_out_green(tmp_path / "grpo")
    assert after["accuracy"] - base["accuracy"] >= GRPO_MARGIN, (base, after)


# Measured gains over seeds 0-4 (README, The toy world): +0.78, +0.63, +0.61, +0.61, +0.81 (mean +0.69, std 0.09);
# the margin is 3 std below the lowest seed.
GRPO_MARGIN = 0.3
