"""DiffusionNFT and AWM end to end through their shell scripts on the tiny models: two processes with groups spread
over them, the metrics each logs, the model card, a killed run resumed bit for bit, one-line refusals before any
model loads. The maths is tests/test_forward.py's; the learning proof is tests/test_toy_learning_nft.py's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import kill_after, refused, script_env, trainer_flags
from safetensors.torch import load_file

from refl_ddpo.core.lora import LORA_WEIGHTS_NAME

REPO = Path(__file__).resolve().parent.parent
RES = 32
MODELS = {
    "nft": "tiny-sd3",
    "awm": "stable-diffusion",
}  # one family each; the maths holds for both (test_forward)
EMA = {"nft": "ema", "awm": "old"}  # the released weights' tensors in checkpoint-N's train_state


def _flags(tiny_models, algo: str, out: Path, *extra: str) -> list[str]:
    """Two CPU processes x 6 samples in groups of 4 (group 1 spans both), 3 sampler steps (2 trained per sample),
    the KL to the base; 2 epochs, a checkpoint after each."""
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=MODELS[algo],
        resolution=RES,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_num_steps=3,
        sample_batch_size=3,
        sample_num_batches_per_epoch=2,
        train_batch_size=3,
        group_size=4,
        kl_weight="0.01",
        learning_rate="3e-2",
        lora_init="default",
        num_epochs=2,
        save_freq=1,
        device="cpu",
    )


def _script(algo: str, args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "train_scripts" / f"train_{algo}.sh"), *args],
        cwd=REPO,
        env=script_env(NUM_PROCESSES=str(processes)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


_runs: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}


@pytest.fixture(scope="module")
def two_process_run(tiny_models, tmp_path_factory):
    def run(algo: str) -> tuple[Path, subprocess.CompletedProcess]:
        if algo not in _runs:
            out = tmp_path_factory.mktemp(algo) / "run"
            r = _script(algo, _flags(tiny_models, algo, out, "--report_to", "tensorboard"))
            assert r.returncode == 0, r.stderr[-3000:]
            _runs[algo] = out, r
        return _runs[algo]

    yield run
    _runs.clear()


def _scalars(out: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for f in (out / "logs").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        scalars.update({t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]})
    return scalars


@pytest.mark.parametrize("algo", ["nft", "awm"])
def test_script_trains_groups_over_two_processes_and_saves_a_lora(two_process_run, algo):
    """Rewards and group ids are gathered before the advantages; the processes end with identical weights; the LoRA
    moved from its init; the final LoRA is the EMA (NFT's own, AWM's old policy) that checkpoint-N keeps beside the
    trained weights; the model card names the method and the released weights; the trackers get the loss, the KL to
    the base (0 at the first step: the LoRA starts at the base model), and the old policy's decay on each
    reference's clock (NFT: optimizer steps, AWM: epochs from 0)."""
    out, r = two_process_run(algo)
    assert "groups (prompts) per epoch: 3" in r.stdout and "trained timesteps per sample: 2" in r.stdout
    assert r.stdout.count("12 rewards from 2 process(es)") == 2
    assert "weights identical on all 2 process(es)" in r.stdout
    lora, first = load_file(out / LORA_WEIGHTS_NAME), load_file(out / "checkpoint-1" / LORA_WEIGHTS_NAME)
    assert any(not torch.equal(first[k], lora[k]) for k in lora), "the second epoch trained"
    trained = load_file(out / "checkpoint-2" / LORA_WEIGHTS_NAME)
    ema = [
        t
        for k, t in load_file(out / "checkpoint-2" / "train_state.safetensors").items()
        if k.startswith(f"{EMA[algo]}/")
    ]
    assert len(ema) == len(lora) and all(any(torch.equal(t, e) for e in ema) for t in lora.values()), (
        "the EMA"
    )
    assert any(not torch.equal(trained[k], lora[k]) for k in lora), "the EMA is not the trained weights"
    card = (out / "README.md").read_text()
    name, source = {"nft": ("DiffusionNFT", "arXiv 2509.16117"), "awm": ("AWM", "Flow-Factory")}[algo]
    assert name in card and source in card and "| release_weights | `ema` |" in card
    scalars = _scalars(out)
    for key in ("loss", "kl", "grad_norm", "old_decay", "zero_std_groups"):
        assert f"{algo}/{key}" in scalars, (key, sorted(scalars))
    assert len(scalars[f"{algo}/loss"]) == 4  # two optimizer steps per epoch (6 samples, 3 per step)
    clock = {"nft": [0.001 * 2, 0.001 * 4], "awm": [0.0, 0.0003]}[algo]  # d = rate x (steps, or epoch index)
    assert scalars[f"{algo}/old_decay"] == pytest.approx(clock)
    if algo == "nft":
        assert scalars["nft/old_deviate"][0] == 0, "the old policy is the initial weights at the first step"
    else:
        assert abs(scalars["awm/ratio"][0] - 1) <= 1e-5, "on-policy: ll_old is the weights' own at the start"
        assert "awm/old_kl" in scalars


def test_nft_resume_after_a_killed_run_gives_the_bit_identical_lora(two_process_run, tiny_models, tmp_path):
    """Killed (-9) after its first checkpoint and resumed with --resume_from_checkpoint latest: the LoRA (the EMA),
    the counters and the last checkpoint's trained weights, old policy and EMA equal the uninterrupted run's bit for
    bit (the old policy and the EMA travel in checkpoint-N)."""
    reference, _ = two_process_run("nft")
    out = tmp_path / "killed"
    flags = _flags(tiny_models, "nft", out, "--report_to", "none")
    kill_after(out / "checkpoint-1", "train_nft.sh", flags)  # in epoch 2
    assert (out / "checkpoint-1").is_dir() and not (out / LORA_WEIGHTS_NAME).exists(), "killed before the end"
    r = _script("nft", [*flags, "--resume_from_checkpoint", "latest"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "1 epoch(s) done" in r.stdout
    resumed, uninterrupted = load_file(out / LORA_WEIGHTS_NAME), load_file(reference / LORA_WEIGHTS_NAME)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert json.loads((out / "checkpoint-2" / "train_state.json").read_text()) == json.loads(
        (reference / "checkpoint-2" / "train_state.json").read_text()
    )
    for name in ("train_state.safetensors", LORA_WEIGHTS_NAME):
        resumed, uninterrupted = (load_file(d / "checkpoint-2" / name) for d in (out, reference))
        assert resumed.keys() == uninterrupted.keys()
        assert name == LORA_WEIGHTS_NAME or any(k.startswith("ema/") for k in resumed)
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), name


@pytest.mark.parametrize(
    ("algo", "extra", "says"),
    [
        ("nft", ("--no-use_lora",), "--kl_weight needs --use_lora"),
        ("awm", ("--group_size", "5"), "must be a multiple of --group_size 5"),
        ("nft", ("--train_timestep_fraction", "0.05"), "trains on no step"),
        ("awm", ("--awm_weighting", "huber"), "invalid choice"),
        ("nft", ("--nft_beta", "0"), "--nft_beta must be"),
        ("awm", ("--same_noise_per_group",), "draws the same image 8 times"),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_loading(
    tmp_path, algo, extra, says, capsys, monkeypatch
):
    """The first case of each trainer through its script, the others in this process (helpers.refused)."""
    out = tmp_path / "never"
    flags = ["--output_dir", str(out), "--pretrained_model", str(tmp_path / "missing"), *extra]
    first = extra == ("--no-use_lora",) or extra == ("--group_size", "5")
    code, err = refused(monkeypatch, capsys, f"train_{algo}.sh", flags, first, script_env(NUM_PROCESSES="1"))
    assert code != 0 and says in err, err[-2000:]
    assert "Traceback" not in err and not out.exists()
