"""Learning beyond one step, proved on the toy world: DRaFT-3 (`--backprop_steps 3`: the whole 10-step run, gradient
through the last 3 steps, the final image scored) raises the colour accuracy of held-out prompts and keeps the shapes
(tests/learning_cases.py, case draft3)."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_draft3_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["draft3"], tmp_path, record_property, base_judgement)
