"""Policy-gradient learning with groups, proved on the toy world: GRPO through `train_grpo.sh --preset toy_world`
(toy-sd, SD 1.x's DDIM step, 8 groups of 8 with one x_T per group, trained on the colour word green) raises the colour
accuracy of the held-out "a green triangle" on 64 fixed seeds and keeps the shapes (tests/learning_cases.py, case
grpo)."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_grpo_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["grpo"], tmp_path, record_property, base_judgement)
