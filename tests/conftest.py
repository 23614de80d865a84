import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Tiny random models in the checkpoint/ layout, built once per test session."""
    from refl_ddpo.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_sd(tiny_models) -> Path:
    return tiny_models / "stable-diffusion"
