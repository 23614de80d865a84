"""Forward-process RL, proved on the toy world: DiffusionNFT through `train_nft.sh --preset toy_world_sd3 --prompt_fn
toy_world_green --kl_weight 1` (toy-sd3, 8 epochs of 2 groups of 16 clean samples from the flow ODE, the
forward-process loss and a KL to the base, trained on the colour word green) raises the colour accuracy of the
held-out "a green triangle" on 64 fixed seeds and keeps the shapes (tests/learning_cases.py, case nft_sd3)."""

import pytest
from learning_cases import CASES
from test_toy_learning import prove

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_nft_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["nft_sd3"], tmp_path, record_property, base_judgement)
