"""Forward-process RL with advantage weights, proved on the toy world: AWM through `train_awm.sh --preset
toy_world_sd3 --prompt_fn toy_world_green --kl_weight 1 --reward toy_color_clean` (toy-sd3, 8 epochs of 2 groups of
16 clean samples from the flow ODE, the advantage-weighted flow-matching loss in PPO's clip and a KL to the base,
trained on the colour word green) raises the colour accuracy of the held-out "a green triangle" on 64 fixed seeds and
keeps the shapes (tests/learning_cases.py, case awm_sd3). A file of its own, so that pytest-xdist runs it beside the
other proofs."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_awm_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["awm_sd3"], tmp_path, record_property, base_judgement)
