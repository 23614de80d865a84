"""benchmarks/peer.sh and benchmarks/peer.py (the peer, TRL's DDPOTrainer, side by side) without the side
virtualenv: the script's flags, our side's timed epochs and their work counts, the model conversion and the report
(no timing is asserted)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.peer import EPOCH, convert, expected_work
from benchmarks.peer_report import report

REPO = Path(__file__).resolve().parent.parent
PEER_SH = REPO / "benchmarks" / "peer.sh"


def test_help_lists_the_flags():
    r = subprocess.run(["bash", str(PEER_SH), "--help"], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for flag in ("--out", "--pairs", "--epochs", "--venv", "PYTHON="):
        assert flag in r.stdout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--bogus"], ["--bogus"]),
        (["--pairs", "0"], ["--pairs", "positive"]),
        (["--pairs", "two"], ["--pairs", "positive"]),
        (["--pairs"], ["--pairs", "needs a value"]),
        (["--epochs", "2"], ["--epochs", ">= 3"]),
    ],
)
def test_bad_flags_fail_with_one_line_before_doing_anything(argv, words, tmp_path):
    r = subprocess.run(
        ["bash", str(PEER_SH), "--out", str(tmp_path / "out"), "--venv", str(tmp_path / "venv"), *argv],
        check=False,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert all(w in lines[0] for w in words)
    assert not (tmp_path / "out").exists() and not (tmp_path / "venv").exists()


def test_expected_work_of_the_epoch():
    # 2 batches x 10 steps of sampling (CFG batched: one call per step) + 4 images x 10 steps of training;
    # 2 x 10 + 8 images / train batch 2 x 5 steps
    assert expected_work() == {"unet_calls": 60, "unet_calls_with_grad": 40, "optimizer_steps": 4}
    other = EPOCH | {"sample_batch_size": 4, "train_batch_size": 2, "train_timestep_fraction": 0.5}
    assert expected_work(other) == {"unet_calls": 40, "unet_calls_with_grad": 20, "optimizer_steps": 4}


def test_our_side_times_epochs_and_counts_the_unet_calls(tiny_sd, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    out = tmp_path / "ours.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "peer.py"), "epoch", "--side", "ours"]
    cmd += ["--model", str(tiny_sd), "--prompts", str(prompts), "--work", str(tmp_path), "--epochs", "3"]
    cmd += ["--sample_num_steps", "2"]  # the epoch's config with 2 steps: a quick run
    r = subprocess.run([*cmd, "--out", str(out)], check=False, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["side"] == "ours" and record["threads"] == 1
    assert record["config"] == EPOCH | {"sample_num_steps": 2}
    assert len(record["epochs"]) == 1  # 3 epochs, the first two untimed
    epoch = record["epochs"][0]
    # counted by the hooks: 2 batches x 2 sampling steps + 4 images x 2 trained steps, one AdamW step per image
    assert {k: epoch[k] for k in expected_work()} == {
        "unet_calls": 12,
        "unet_calls_with_grad": 8,
        "optimizer_steps": 4,
    }
    assert 0 < epoch["cpu_s"] and 0 < epoch["wall_s"]


def test_convert_prefixes_the_text_encoder_keys_and_writes_the_slow_tokenizer(tiny_sd, tmp_path):
    dst = tmp_path / "sd-trl"
    convert(tiny_sd, dst)
    src_state = load_file(str(tiny_sd / "text_encoder" / "model.safetensors"))
    dst_state = load_file(str(dst / "text_encoder" / "model.safetensors"))
    assert sorted(dst_state) == sorted(f"text_model.{k}" for k in src_state)
    assert all(torch.equal(src_state[k], dst_state[f"text_model.{k}"]) for k in src_state)
    vocab = json.loads((dst / "tokenizer" / "vocab.json").read_text())
    assert vocab == json.loads((tiny_sd / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert (dst / "tokenizer" / "merges.txt").read_text().startswith("#version")
    assert (dst / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == (
        tiny_sd / "unet" / "diffusion_pytorch_model.safetensors"
    ).read_bytes()


def _write_runs(out: Path, times: dict[str, list[float]], work: dict | None = None) -> None:
    (out / "runs").mkdir(parents=True)
    for side, seconds in times.items():
        for pair, s in enumerate(seconds, start=1):
            epoch = {"wall_s": 2 * s, "cpu_s": s, **(work or expected_work()), "involuntary_switches": 1}
            record = {
                "side": side,
                "config": EPOCH,
                "epochs": [epoch],
                "versions": {},
                "load_average_1min": [1, 2],
            }
            (out / "runs" / f"{side}_{pair}.json").write_text(json.dumps(record))
    t = {"input_ids": torch.ones(1, 3, dtype=torch.long), "prompt_embeds": torch.ones(1, 3, 2)}
    save_file(t | {"unet_output": torch.zeros(1, 4, 2, 2)}, str(out / "unet_ours.safetensors"))
    save_file(t | {"unet_output": torch.full((1, 4, 2, 2), 0.5)}, str(out / "unet_trl.safetensors"))


def test_report_gives_the_median_ratio_of_the_pairs(tmp_path):
    _write_runs(tmp_path, {"ours": [1.0, 3.0, 2.0], "trl": [2.0, 2.0, 2.0]})
    results = report(tmp_path, "bash benchmarks/peer.sh --pairs 3")
    assert [c["ratio"] for c in results["cases"]] == [0.5, 1.5, 1.0]
    assert results["ratio"] == 1.0 and results["summary"]["ratio"]["max"] == 1.5
    assert results["meta"]["unet_check"]["unet_output_max_abs_diff"] == 0.5
    assert not results["meta"]["unet_check"]["identical"]
    assert json.loads((tmp_path / "results.json").read_text())["ratio"] == 1.0
    assert "**1.000 (0.500-1.500)**" in (tmp_path / "results.md").read_text()


def test_report_refuses_unequal_work(tmp_path):
    _write_runs(tmp_path, {"ours": [1.0], "trl": [1.0]}, work=expected_work() | {"unet_calls": 59})
    with pytest.raises(SystemExit, match="unequal work"):
        report(tmp_path, "")
