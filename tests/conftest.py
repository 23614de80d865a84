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


# The longest files start first, so that with several workers (pytest-xdist) they run beside the many short ones
# (pyproject's --no-loadscope-reorder keeps this order: xdist would otherwise start the files with the most tests).
LONG_FIRST = (
    "test_toy_learning_sd3",
    "test_toy_learning_grpo",
    "test_toy_learning",
    "test_toy_learning_draft",
    "test_grpo",
    "test_refl",
    "test_ddpo",
    "test_inference",
    "test_validation",
    "test_draft",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(LONG_FIRST)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Tiny random models in the checkpoint/ layout, built once per test session."""
    from refl_ddpo.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_sd(tiny_models) -> Path:
    return tiny_models / "stable-diffusion"
