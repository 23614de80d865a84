"""The second family, proved on the toy world: on toy-sd3 (an MMDiT trained by flow matching) ReFL
(`--preset toy_world_sd3`: 40 steps, the flow-matching x0 at the grad step), GRPO (Flow-GRPO's SDE step at noise level
0.7, 16 epochs of 8 groups of 8 with one x_T per group), DDPO (the same step, 16 epochs of 64 independent samples,
batch-normalised advantages) and DiffusionNFT (8 epochs of 2 groups of 16 clean samples, the forward-process loss)
each raise the colour accuracy of the held-out "a cyan circle" on 64 fixed seeds (the
presets train the colour word cyan alone), keeping the shapes (tests/learning_cases.py). The cases share one base
evaluation."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


@pytest.fixture(scope="module")
def base() -> dict[str, float]:
    return CASES["refl_sd3"].evaluate()


@pytest.mark.parametrize("name", ["ddpo_sd3", "refl_sd3", "grpo_sd3", "nft_sd3"])  # the longest first
def test_sd3_raises_held_out_colour_accuracy(tmp_path, record_property, base, name):
    assert CASES[name].eval_key == CASES["refl_sd3"].eval_key
    prove(CASES[name], tmp_path, record_property, base)
