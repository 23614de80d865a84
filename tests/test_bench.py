"""benchmarks/ (bench.py, the CLI, and its modules): the real-size configs give SD v1.5's parameter counts, and a
minimal run of every case writes valid results (no timing is asserted)."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.config import BenchConfig
from benchmarks.models import parameter_counts, real_configs
from benchmarks.sweep import _VARIANT_FIELDS, child_flags
from refl_ddpo.config import parse_config

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    """The CLI script, loaded from its file (it is run as a script, not imported as a package module)."""
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_configs_have_sd15_and_imagereward_parameter_counts():
    # Built on the meta device: no memory, no init. Counts of the released checkpoints' architectures:
    # SD v1.5 UNet 859,520,964; VAE 83,653,863; CLIP ViT-L/14 text 123,060,480; BLIP ViT-L/16 without head
    # 303,301,632; BLIP's BERT-base with cross-attention to 1024-wide image tokens 141,977,088; ImageReward's MLP.
    counts = parameter_counts(real_configs())
    assert counts == {
        "unet": 859_520_964,
        "vae": 83_653_863,
        "text_encoder": 123_060_480,
        "reward": 446_206_689,
        "reward.vision": 303_301_632,
        "reward.text": 141_977_088,
    }


def test_sweep_children_get_the_parents_workload_flags():
    cfg = parse_config(
        BenchConfig,
        [
            "--tiny",
            "--device",
            "cpu",
            "--refl_batch_sizes",
            "2",
            "3",
            "--no-tf32",
            "--dtype",
            "bf16",
            "--sweep",
            "--out",
            "x",
        ],
    )
    child = parse_config(BenchConfig, child_flags(cfg) + ["--out", "y"])
    variant = _VARIANT_FIELDS | {"out", "sweep"}
    assert {k: v for k, v in dataclasses.asdict(child).items() if k not in variant} == {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in variant
    }
    assert child.refl_batch_sizes == [2, 3] and child.tiny and not child.sweep
    assert child.dtype is None and child.tf32  # speed options come from the variant, not the parent


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--only", "refl,nonsense"], "--only"),
        (["--compile", "--warmup", "0"], "--warmup"),
        (["--ddpo_sample_batch_size", "6", "--ddpo_train_batch_size", "4"], "--ddpo_train_batch_size"),
        (["--refl_k", "40"], "--refl_k"),
    ],
)
def test_bad_flags_fail_in_one_line_before_anything_runs(bench, tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_minimal_tiny_run_of_every_case_writes_results(tmp_path):
    out = tmp_path / "out"
    argv = [
        "--tiny",
        "--device",
        "cpu",
        "--cpu_threads",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
        "--only",
        "refl,ddpo_sample,ddpo_train,inference",
        "--refl_modes",
        "lora",
        "--refl_batch_sizes",
        "1",
        "--refl_steps",
        "3",
        "--refl_k",
        "1",
        "--ddpo_steps",
        "2",
        "--ddpo_sample_batch_size",
        "2",
        "--ddpo_train_batch_size",
        "1",
        "--inference_steps",
        "2",
        "--inference_batch_sizes",
        "2",
    ]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *argv],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [c["name"] for c in results["cases"]] == [
        "refl lora b1",
        "ddpo_sample b2",
        "ddpo_train b2",
        "inference b2",
    ]
    for case in results["cases"]:
        assert "error" not in case, case
        assert case["median_s"] > 0 and len(case["times_s"]) == 1
        assert case["flops"] > 0 and case["peak_rss_bytes"] > 0
    assert results["cases"][-1]["per_image_s"] == pytest.approx(results["cases"][-1]["median_s"] / 2)
    assert results["meta"]["tiny"] and results["meta"]["parameters"]["unet"] > 0
    table = (out / "results.md").read_text()
    assert all(f"| {c['name']} |" in table for c in results["cases"])
