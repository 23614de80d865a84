import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from learning_cases import NUMERIC_PATHS, NUMERIC_VARS, PINNED_PATH, describe_numeric_path

# The CPU numeric path, before torch computes anything: a test that trains and asserts a direction computes the same
# bits on every x86-64 CPU (AVX2 for ATen, oneDNN and MKL; tests/learning_cases.py). Setting any of the three
# variables chooses another path (tests/learning_spread.py measures the proofs under several).
if platform.machine().lower() in ("x86_64", "amd64") and not any(k in os.environ for k in NUMERIC_VARS):
    os.environ.update(NUMERIC_PATHS[PINNED_PATH])

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
# one thread: tiny models gain nothing from more, and subprocess runs (2 ranks) would oversubscribe 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


# The longest files start first, so that with several workers (pytest-xdist) they run beside the many short ones
# (pyproject's --no-loadscope-reorder keeps this order: xdist would otherwise start the files with the most tests).
# xdist hands each worker a second file while its first has 2 tests or fewer to go. Each learning proof has a file of
# its own, longest first (training and judging: docs/record/learning_spread.md), so that 2 workers split the stage evenly:
# ReFL and DDPO-SD3 start together, each judging a different base.
LONG_FIRST = (
    "test_toy_learning",
    "test_toy_learning_ddpo_sd3",
    "test_toy_learning_draft",
    "test_toy_learning_grpo_sd3",
    "test_toy_learning_grpo",
    "test_toy_learning_awm",
    "test_toy_learning_nft",
    "test_toy_learning_sd3",
    "test_family_trainers",
    "test_family_conformance",
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


def _shared_root(tmp_path_factory) -> Path:
    """The pytest run's temporary folder that every xdist worker sees (each worker's own is inside it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if "PYTEST_XDIST_WORKER" in os.environ else root


def _once(record: Path, make) -> str:
    """make()'s text, computed by the first xdist worker that asks and kept in `record`; a worker that asks while
    another computes it waits for it (a file lock)."""
    from filelock import FileLock

    with FileLock(f"{record}.lock"):
        if not record.is_file():
            record.write_text(make())
    return record.read_text()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Tiny random models in the checkpoint/ layout, built once per pytest run (under a lock, by the first worker
    that needs them): every worker's tests name the same paths, so a run one worker made (`two_process_runs`) fits
    another's. Tests never write to it."""
    from refl_ddpo.testing.tiny import write_tiny_models

    out = _shared_root(tmp_path_factory) / "tiny"
    _once(out.with_name("tiny.done"), lambda: str(write_tiny_models(out)))
    return out


@pytest.fixture(scope="session")
def tiny_sd(tiny_models) -> Path:
    return tiny_models / "stable-diffusion"


@pytest.fixture(scope="session")
def base_judgement(tmp_path_factory):
    """case -> the held-out judgement of its base model, computed once per pytest run and shared by every xdist
    worker: a JSON file per evaluation key in the run's common temporary folder, written under a lock (a worker that
    needs a base another is judging waits for it)."""
    root = _shared_root(tmp_path_factory)

    def judge(case) -> dict[str, float]:
        path = root / f"base-judgement-{'-'.join(case.eval_key)}.json"
        return json.loads(_once(path, lambda: json.dumps(case.evaluate())))

    return judge


def _one_thread():
    """One intra-op thread, the number before restored afterwards. Tiny models gain nothing from two, and with two
    OpenMP threads on a loaded 2-core machine a sampling loop took 14 s of CPU instead of 0.15 s (spin-waits); the
    trainer subprocesses get OMP_NUM_THREADS=1 likewise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A test file takes one of them with `pytestmark = pytest.mark.usefixtures("one_thread")` (around each test) or
# `... usefixtures("one_thread_module")` (once around the file, its module fixtures included).
one_thread = pytest.fixture(_one_thread, name="one_thread")
one_thread_module = pytest.fixture(_one_thread, scope="module", name="one_thread_module")


def pytest_report_header(config):
    return describe_numeric_path()


def pytest_terminal_summary(terminalreporter):
    """The numeric path, and for every LoRA a learning test trained its digest (`record_property("lora_sha256", ...)`:
    under the pinned path the same on every x86-64 CPU) and its held-out judgement (`"judged"`)."""
    reports = terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
    found = sorted(
        (report.nodeid, name, value)
        for report in reports
        if report.when == "call"
        for name, value in report.user_properties
        if name in ("lora_sha256", "judged")
    )
    terminalreporter.write_line(describe_numeric_path())
    for nodeid, name, value in found:
        terminalreporter.write_line(
            f"{'LoRA sha256' if name == 'lora_sha256' else 'held out'} {value}  {nodeid}"
        )


@pytest.fixture(scope="session")
def two_process_runs(tiny_models, tmp_path_factory):
    """Each named two-process run of helpers.TWO_PROCESS_RUNS once per pytest run, shared by every test file and
    xdist worker (as `base_judgement`: a folder in the run's common temporary folder, made under a lock; a worker
    that needs a run the other is making waits for it): run(name) -> (output folder, completed process). Tests read
    the folders and never write to them."""
    from helpers import TWO_PROCESS_RUNS, run_two

    root = _shared_root(tmp_path_factory)

    def run(name: str):
        out = root / f"two-process-{name}" / "run"

        def make() -> str:
            script, flags = TWO_PROCESS_RUNS[name]
            r = run_two(script, flags(tiny_models, out))
            return json.dumps({"stdout": r.stdout, "stderr": r.stderr})

        done = json.loads(_once(root / f"two-process-{name}.json", make))
        return out, subprocess.CompletedProcess([name], 0, done["stdout"], done["stderr"])

    return run
