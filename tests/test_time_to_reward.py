"""benchmarks/time_to_reward.py without its long runs: the curve arithmetic, the report, the process-tree CPU clock
and one-line errors for bad flags (no timing is asserted)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.time_to_reward import CONFIGS, TASKS, summarise, tree_cpu_seconds
from benchmarks.time_to_reward_report import mean_curve, report, time_to

TARGET_CONFIG = TASKS["twelve"].target

REPO = Path(__file__).resolve().parent.parent


def test_time_to_interpolates_between_checkpoints():
    curve = [(0.0, 0.4), (100.0, 0.5), (200.0, 0.7)]
    assert time_to(curve, 0.45) == pytest.approx(50.0)
    assert time_to(curve, 0.6) == pytest.approx(150.0)
    assert time_to(curve, 0.4) == 0.0  # the base already reaches it
    assert (
        time_to([(0.0, 0.42), (100.0, 0.38), (200.0, 0.37)], 0.375) == 0.0
    )  # even if the run then falls below
    assert time_to(curve, 0.8) is None
    assert time_to([(0.0, 0.5), (10.0, 0.3), (20.0, 0.6)], 0.55) == pytest.approx(10 + 10 * 0.25 / 0.3)


def test_mean_curve_averages_seeds_checkpoint_by_checkpoint():
    assert mean_curve([[(0, 0.4), (10, 0.6)], [(0, 0.4), (20, 0.5), (30, 0.9)]]) == [(0, 0.4), (15, 0.55)]


def test_report_names_every_configuration_and_the_target(tmp_path):
    runs = {
        TARGET_CONFIG: {"0": [{"step": 16, "cpu_s": 100.0, "accuracy": 0.45}]},
        "refl": {
            "0": [{"step": 40, "cpu_s": 40.0, "accuracy": 0.6}],
            "1": [{"step": 40, "cpu_s": 50.0, "accuracy": 0.5}],
        },
    }
    text = report({"base_accuracy": 0.4, "runs": runs}, tmp_path, TARGET_CONFIG)
    assert (tmp_path / "results.md").read_text() == text
    assert "0.450" in text and "xychart-beta" in text
    refl_row = next(line for line in text.splitlines() if line.startswith("| `refl`"))
    # seed mean curve (0, 0.4) -> (45, 0.55): 0.45 is reached at a third of the way, 15 s, 0.15 of the target's 100 s;
    # base + 0.10 = 0.5 at two thirds, 30 s
    assert "| 15 | 0.15 | 30 |" in refl_row and "0.550 (0.500-0.600)" in refl_row
    assert "| not reached |" in next(
        line for line in text.splitlines() if line.startswith(f"| `{TARGET_CONFIG}`")
    )


def test_summarise_keeps_the_runs_an_earlier_call_recorded(tmp_path):
    """results.json keeps a configuration whose run folders are gone (runs/ is not committed), with its flags as run
    then, and the base accuracy it recorded; nothing is trained or judged."""
    import json

    folder = tmp_path / "twelve"
    folder.mkdir()
    earlier = {
        "base_accuracy": 0.4,
        "configs": {TARGET_CONFIG: {"script": "train_ddpo.sh", "flags": ["--as-run-then"], "what": "then"}},
        "runs": {TARGET_CONFIG: {"0": [{"step": 16, "cpu_s": 100.0, "accuracy": 0.45}]}},
    }
    (folder / "results.json").write_text(json.dumps(earlier))
    text = summarise("twelve", TASKS["twelve"], [], [0], tmp_path, 1, {})
    kept = json.loads((folder / "results.json").read_text())
    assert kept["runs"] == earlier["runs"] and kept["configs"] == earlier["configs"]
    assert kept["base_accuracy"] == 0.4 and "0.450" in text


def test_tree_cpu_seconds_counts_children():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while 1: pass'])",
        ]
    )
    try:
        deadline = (
            time.monotonic() + 60
        )  # however loaded the machine, the busy grandchild gets its half second
        while tree_cpu_seconds(child.pid) <= 0.5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tree_cpu_seconds(child.pid) > 0.5  # the grandchild's busy loop: the parent only waits
    finally:
        subprocess.run(["pkill", "-P", str(child.pid)], check=False)
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--configs", "bogus"], ["--configs", "bogus"]),
        (["--seeds", "a"], ["--seeds"]),
        (["--jobs", "0"], ["--jobs"]),
    ],
)
def test_bad_flags_fail_with_one_line(argv, words, tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/time_to_reward.py", "--out", str(tmp_path / "out"), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert all(w in last for w in words), r.stderr
    assert not (tmp_path / "out").exists()


def test_every_configuration_uses_a_shipped_script_and_a_task():
    from refl_ddpo.toy_world import world as toy_world

    for config in CONFIGS.values():
        assert (REPO / "train_scripts" / config.script).is_file()
        assert config.task in TASKS
    for task in TASKS.values():
        assert CONFIGS[task.target].task in TASKS and getattr(toy_world, task.prompts)
        assert (toy_world.DATA_DIR / task.model).is_dir() and getattr(toy_world, task.seeds)
