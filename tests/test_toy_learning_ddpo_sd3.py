"""Policy gradient on the second family, proved on the toy world: DDPO through `train_ddpo.sh --preset toy_world_sd3`
(toy-sd3, Flow-GRPO's SDE step at noise level 0.7, 16 epochs of 64 independent samples, batch-normalised advantages,
trained on the colour word cyan, with two magenta prompts the base already draws right beside cyan's two) raises the
colour accuracy of the held-out "a cyan circle" on 64 fixed seeds and keeps the shapes (tests/learning_cases.py, case
ddpo_sd3)."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_ddpo_sd3_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["ddpo_sd3"], tmp_path, record_property, base_judgement)
