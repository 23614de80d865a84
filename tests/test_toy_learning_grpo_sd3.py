"""Policy gradient with groups on the second family, proved on the toy world: GRPO through `train_grpo.sh --preset
toy_world_sd3 --num_epochs 16 --kl_weight 0.02` (toy-sd3, Flow-GRPO's SDE step at noise level 0.7 and its KL to the
base, 16 epochs of 8 groups of 8 with one x_T per group, trained on the colour word cyan) raises the colour accuracy of
the held-out "a cyan circle" on 64 fixed seeds and keeps the shapes (tests/learning_cases.py, case grpo_sd3)."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_grpo_sd3_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["grpo_sd3"], tmp_path, record_property, base_judgement)
