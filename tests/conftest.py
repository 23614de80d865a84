import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
# one thread: tiny models gain nothing from more, and subprocess runs (2 ranks) would oversubscribe 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Tiny random models in the checkpoint/ layout, built once per test session."""
    from refl_ddpo.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_sd(tiny_models) -> Path:
    return tiny_models / "stable-diffusion"
