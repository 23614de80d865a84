"""The second family, proved on the toy world: on toy-sd3 (an MMDiT trained by flow matching) ReFL through
`train_refl_lora.sh --preset toy_world_sd3` (40 steps, the flow-matching x0 at the grad step, trained on the colour
word cyan) raises the colour accuracy of the held-out "a cyan circle" on 64 fixed seeds and keeps the shapes
(tests/learning_cases.py, case refl_sd3). DDPO, GRPO, DiffusionNFT and AWM on toy-sd3 have files of their own, so that
pytest-xdist runs the proofs side by side; all share one base judgement (conftest.py)."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_refl_sd3_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["refl_sd3"], tmp_path, record_property, base_judgement)
