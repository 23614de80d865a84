"""Early stopping, the best weights kept and the divergence line (issue 64, items 1, 3, 4), on the tiny models: a
validation reward logged beside the training reward's, best/ and run.json's fields, the stop line and the run cut
short, --final_weights best in the final folder and the card, the divergence line, a resumed run that stops where an
unbroken one does bit for bit; ReFL (reward backprop, also on two FSDP processes), NFT (forward process) and GRPO
(policy gradient). The metrics are scripted by tests/user_functions.py's gold_schedule / proxy_schedule (one value
per validation), so that each improvement and each stall is forced. The guard's own bookkeeping and the checks before loading: without a model. CPU."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, grpo_flags, refl_flags, run_in_process, run_two, saved_lora, trainer_flags

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.lora import CONFIG_NAME, LORA_WEIGHTS_NAME
from refl_ddpo.run.flags import parse_config
from refl_ddpo.run.guard import BEST_DIR, BEST_FILE, Guard, check_guard
from refl_ddpo.run.runs import RUN_FILE
from refl_ddpo.run.validation import validation_files
from refl_ddpo.trainers.refl_config import ReFLConfig

GOLD = "validation/user_functions:gold_schedule/mean"
PROXY = "validation/user_functions:proxy_schedule/mean"


@pytest.fixture
def held_out(tmp_path) -> Path:
    path = tmp_path / "held_out.txt"
    path.write_text("held-out a red circle\nheld-out a blue square\n")
    return path


def _schedule(monkeypatch, tmp_path: Path, name: str, values: list[float], calls: int = 0) -> None:
    monkeypatch.setenv(f"{name}_VALUES", ",".join(map(str, values)))
    monkeypatch.setenv(f"{name}_CALLS", str(tmp_path / f"{name.lower()}_calls"))
    (tmp_path / f"{name.lower()}_calls").write_text(str(calls))


def _guard_flags(held_out: Path, every: str, patience: int, *extra: str) -> list[str]:
    """Validation after each step or epoch on the two held-out prompts (one batch: one scripted value each time),
    scored by gold_schedule too, stopped on it."""
    return [
        *("--validation_prompts_file", str(held_out), every, "1", "--num_validation_images", "1"),
        *("--validation_num_steps", "2", "--validation_batch_size", "4"),
        *("--validation_reward", "user_functions:gold_schedule", "--early_stop_metric", GOLD),
        *("--early_stop_patience", str(patience), *extra),
    ]


# ---- the guard alone ----


def test_guard_keeps_the_best_counts_patience_and_says_when_proxy_and_gold_part():
    guard = Guard(GOLD, "max", 2, 0.01, "step", keep_best=True)
    seen = []
    for count, (proxy, gold) in enumerate([(0.1, 0.2), (0.2, 0.5), (0.3, 0.4), (0.4, 0.505)]):
        verdict = guard.observe({PROXY: proxy, GOLD: gold}, count, 10 * count)
        seen.append((verdict.improved, verdict.stop))
    assert seen == [
        (True, False),
        (True, False),
        (False, False),
        (False, True),
    ]  # 0.505: not by more than 0.01
    assert guard.best_record() == {"metric": GOLD, "mode": "max", "value": 0.5, "step": 1}
    assert verdict.lines == [
        f"{GOLD} has not improved on 0.5 at step 1 for 2 validations: stopped; kept step 1",
    ]
    # the gold fell then rose: no divergence; a min metric that rises while the proxy rises, twice in a row, is one
    low = Guard("validation/drift/brightness", "min", 0, 0.0, "epoch", keep_best=False)
    for count, (proxy, value) in enumerate([(0.1, 0.3), (0.2, 0.4), (0.3, 0.5), (0.2, 0.6)]):
        verdict = low.observe({PROXY: proxy, "validation/drift/brightness": value}, count, count)
        assert not verdict.stop
        if count == 2:
            assert verdict.lines == [
                (
                    f"divergence at epoch 2: {PROXY} rose to 0.3 while validation/drift/brightness rose to 0.5 "
                    "over the last two validations (the training reward may be hacked)"
                )
            ]
        else:
            assert verdict.lines == []
    restored = Guard("validation/drift/brightness", "min", 0, 0.0, "epoch", keep_best=False)
    restored.restore(json.loads(json.dumps(low.state())))  # as checkpoint-N's counters carry it
    assert restored == low and restored.best_count == 0
    assert low.notes == [low.notes[0]] and "best 0.3 at epoch 0" in "\n".join(low.card_lines())


def test_the_guard_flags_are_checked_before_loading(tmp_path, held_out):
    def check(*argv: str) -> None:
        check_guard(parse_config(ReFLConfig, ["--output_dir", str(tmp_path / "out"), *argv]))

    check()  # nothing set: nothing to check
    check("--validation_prompts_file", str(held_out), "--early_stop_metric", "validation/drift/brightness")
    for argv, message in [
        (["--early_stop_metric", GOLD], "needs validation: set --validation_prompts_file"),
        (["--early_stop_patience", "3"], "--early_stop_patience needs --early_stop_metric"),
        (["--final_weights", "best"], "--final_weights best needs --early_stop_metric"),
        (["--validation_reward", "toy_judge"], "--validation_reward toy_judge scores the validation images"),
        (
            ["--validation_prompts_file", str(held_out), "--early_stop_metric", "reward/imagereward/mean"],
            "validation logs no such key with these flags; pick one of validation/imagereward/mean",
        ),
        (
            ["--validation_prompts_file", str(held_out), "--validation_reward", "no_such_reward"],
            "--validation_reward",
        ),
    ]:
        with pytest.raises(UserError, match=message.replace("/", ".")) as e:
            check(*argv)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="--early_stop_patience must be a number >= 0"):
        check("--early_stop_patience", "-1")


# ---- ReFL ----


def test_refl_stops_keeps_the_best_and_says_when_the_proxy_and_the_gold_part(
    tiny_models, tmp_path, held_out, monkeypatch, capsys
):
    """Gold 0.25, 0.5, 0.375, 0.125 while the proxy rises: best/ at step 1, divergence and stop at step 3
    (patience 2) of 6; the final folder holds best/'s LoRA. (Values exact in float32, as the rewards are.)"""
    _schedule(monkeypatch, tmp_path, "GOLD", [0.25, 0.5, 0.375, 0.125, 0.875, 0.875, 0.875])
    _schedule(monkeypatch, tmp_path, "PROXY", [0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875])
    out = tmp_path / "run"
    guard = _guard_flags(held_out, "--validation_steps", 2)
    args = refl_flags(tiny_models, out, "--reward", "user_functions:proxy_schedule", "--max_train_steps", "6")
    run_in_process(monkeypatch, "train_refl_lora.sh", [*args, *guard, "--checkpointing_steps", "0"])
    said = capsys.readouterr().out

    records = validation_files(out)
    assert [r["count"] for r in records] == [0, 1, 2, 3], "stopped after step 3 of 6"
    assert {PROXY, GOLD, GOLD.replace("mean", "std")} <= records[-1]["metrics"].keys()
    assert [r["metrics"][GOLD] for r in records] == [0.25, 0.5, 0.375, 0.125]
    stop = f"{GOLD} has not improved on 0.5 at step 1 for 2 validations: stopped; kept step 1"
    divergence = (
        f"divergence at step 3: {PROXY} rose to 0.5 while {GOLD} fell to 0.125 over the last two validations "
        "(the training reward may be hacked)"
    )
    assert stop in said and divergence in said and "saved the best weights (step 1, from best/)" in said

    best = out / BEST_DIR
    assert {LORA_WEIGHTS_NAME, CONFIG_NAME, "step-1.png", BEST_FILE} <= {p.name for p in best.iterdir()}
    assert [p.name for p in best.glob("*.png")] == ["step-1.png"], "the baseline's grid (step 0) was replaced"
    assert json.loads((best / BEST_FILE).read_text()) == {
        "metric": GOLD,
        "mode": "max",
        "value": 0.5,
        "step": 1,
        "grid": "step-1.png",
    }
    assert (best / "step-1.png").read_bytes() == (out / "validation" / "step-1.png").read_bytes()
    run = json.loads((out / RUN_FILE).read_text())
    assert (run["best_step"], run["best_metric"], run["early_stop_metric"]) == (1, 0.5, GOLD)
    assert (out / LORA_WEIGHTS_NAME).read_bytes() == (best / LORA_WEIGHTS_NAME).read_bytes()
    card = (out / "README.md").read_text()
    assert "| optimizer steps | 3 |" in card and "The weights here are the best validation's (best/)" in card
    assert "best 0.5 at step 1" in card and stop in card and divergence in card


def _unfinished(out: Path, into: Path) -> None:
    """The folder a run killed after checkpoint-2 leaves: all but the final weights, config.json and the card."""
    shutil.copytree(out, into)
    for name in (
        LORA_WEIGHTS_NAME,
        CONFIG_NAME,
        "README.md",
        "validation/step-3.json",
        "validation/step-3.png",
    ):
        (into / name).unlink()


def test_a_resumed_refl_run_stops_where_an_unbroken_one_does_bit_for_bit(
    tiny_models, tmp_path, held_out, monkeypatch, capsys
):
    """Gold 0.25, 0.5, 0.375, 0.4375: checkpoint-2 holds the best (0.5 at step 1) and one validation waited; resumed
    there, the run stops at step 3 as the unbroken one does, with the same last weights (--final_weights last)
    and the same best/."""
    values = [0.25, 0.5, 0.375, 0.4375, 0.875, 0.875, 0.875]
    _schedule(monkeypatch, tmp_path, "GOLD", values)
    guard = _guard_flags(held_out, "--validation_steps", 2, "--final_weights", "last")
    args = refl_flags(tiny_models, tmp_path / "run", "--max_train_steps", "6", *guard)
    run_in_process(monkeypatch, "train_refl_lora.sh", args)
    stop = (
        f"{GOLD} has not improved on 0.5 at step 1 for 2 validations: stopped; kept the last weights "
        "(best/ holds step 1)"
    )
    assert stop in capsys.readouterr().out

    resumed = tmp_path / "resumed"
    _unfinished(tmp_path / "run", resumed)
    _schedule(monkeypatch, tmp_path, "GOLD", values, calls=3)  # validations 0, 1 and 2 were done
    args = refl_flags(
        tiny_models, resumed, "--max_train_steps", "6", *guard, "--resume_from_checkpoint", "latest"
    )
    run_in_process(monkeypatch, "train_refl_lora.sh", args)
    said = capsys.readouterr().out
    assert "at step 2" in said and stop in said
    assert [r["count"] for r in validation_files(resumed)] == [0, 1, 2, 3]
    assert (resumed / BEST_DIR / BEST_FILE).read_bytes() == (
        tmp_path / "run" / BEST_DIR / BEST_FILE
    ).read_bytes()
    for folder in (
        Path(),
        Path(BEST_DIR),
    ):  # the tensors (the file's metadata header may list its keys in any order)
        unbroken, again = saved_lora(tmp_path / "run" / folder), saved_lora(resumed / folder)
        assert unbroken.keys() == again.keys() and all(torch.equal(unbroken[k], again[k]) for k in unbroken)
    last, best = saved_lora(resumed), saved_lora(resumed / BEST_DIR)
    assert any(not torch.equal(last[k], best[k]) for k in last), "the last weights are not the best's"
    assert json.loads((resumed / RUN_FILE).read_text())["best_step"] == 1


def test_two_sharded_processes_stop_together_and_keep_the_gathered_best(tiny_models, tmp_path, held_out):
    """ReFL under FSDP on two processes: the main process decides, both stop after step 3 (no process left waiting),
    best/ holds the LoRA gathered from the shards at step 1, and so does the final folder."""
    out = tmp_path / "fsdp"
    calls = tmp_path / "gold_calls"
    env = {
        "GOLD_VALUES": "0.25,0.5,0.375,0.125,0.875,0.875,0.875",
        "GOLD_CALLS": str(calls),
        "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", str(REPO)), str(REPO / "tests")]),
    }
    guard = _guard_flags(held_out, "--validation_steps", 2)
    r = run_two(
        "train_refl_lora.sh", refl_flags(tiny_models, out, "--fsdp", "--max_train_steps", "6", *guard), **env
    )
    stop = f"{GOLD} has not improved on 0.5 at step 1 for 2 validations: stopped; kept step 1"
    assert (r.stdout + r.stderr).count(stop) == 1 and calls.read_text() == "4"
    assert [x["count"] for x in validation_files(out)] == [0, 1, 2, 3]
    assert (out / LORA_WEIGHTS_NAME).read_bytes() == (out / BEST_DIR / LORA_WEIGHTS_NAME).read_bytes()
    assert json.loads((out / BEST_DIR / BEST_FILE).read_text())["step"] == 1


# ---- NFT ----


def test_nft_stops_on_the_validation_reward_and_keeps_the_best_epoch(
    tiny_models, tmp_path, held_out, monkeypatch, capsys
):
    """Gold 0.375, 0.25, 0.25 over epochs: the baseline is the best, and one stalled epoch (patience 1) stops the run
    after epoch 1 of 3; best/ holds the baseline's LoRA (epoch 0), and so does the final folder."""
    _schedule(monkeypatch, tmp_path, "GOLD", [0.375, 0.25, 0.25, 0.25])
    out = tmp_path / "nft"
    args = trainer_flags(
        tiny_models,
        out,
        *_guard_flags(held_out, "--validation_epochs", 1),
        model="tiny-sd3",
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_num_steps=3,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        group_size=2,
        learning_rate="3e-2",
        lora_init="default",
        num_epochs=3,
        device="cpu",
        report_to="none",
    )
    run_in_process(monkeypatch, "train_nft.sh", args)
    said = capsys.readouterr().out
    assert f"{GOLD} has not improved on 0.375 at epoch 0 for 1 validations: stopped; kept epoch 0" in said
    records = validation_files(out)
    assert [r["count"] for r in records] == [0, 1]
    assert "validation/jpeg_compressibility/mean" in records[0]["metrics"] and GOLD in records[0]["metrics"]
    best = json.loads((out / BEST_DIR / BEST_FILE).read_text())
    assert best["epoch"] == 0 and best["value"] == 0.375 and best["grid"] == "epoch-0.png"
    run = json.loads((out / RUN_FILE).read_text())
    assert (run["best_epoch"], run["best_metric"]) == (0, 0.375)
    assert (out / LORA_WEIGHTS_NAME).read_bytes() == (out / BEST_DIR / LORA_WEIGHTS_NAME).read_bytes()
    card = (out / "README.md").read_text()
    assert "| epochs | 1 |" in card and f"Watched `{GOLD}` (max): best 0.375 at epoch 0" in card


# ---- GRPO ----


def test_grpo_stops_keeps_the_best_epoch_and_says_when_the_proxy_and_the_gold_part(
    tiny_models, tmp_path, held_out, monkeypatch, capsys
):
    """The policy-gradient loop: gold 0.25, 0.5, 0.375, 0.125 by epoch while the proxy rises: best/ at epoch 1, the
    divergence line and the stop after epoch 3 of 6; the final folder holds best/'s LoRA."""
    _schedule(monkeypatch, tmp_path, "GOLD", [0.25, 0.5, 0.375, 0.125, 0.875, 0.875, 0.875])
    _schedule(monkeypatch, tmp_path, "PROXY", [0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875])
    out = tmp_path / "grpo"
    guard = _guard_flags(held_out, "--validation_epochs", 2)
    args = grpo_flags(
        tiny_models, out, "--reward", "user_functions:proxy_schedule", "--num_epochs", "6", *guard
    )
    run_in_process(monkeypatch, "train_grpo.sh", args)
    said = capsys.readouterr().out
    stop = f"{GOLD} has not improved on 0.5 at epoch 1 for 2 validations: stopped; kept epoch 1"
    divergence = (
        f"divergence at epoch 3: {PROXY} rose to 0.5 while {GOLD} fell to 0.125 over the last two validations "
        "(the training reward may be hacked)"
    )
    assert stop in said and divergence in said
    assert [r["count"] for r in validation_files(out)] == [0, 1, 2, 3]
    best = json.loads((out / BEST_DIR / BEST_FILE).read_text())
    assert (best["epoch"], best["value"], best["grid"]) == (1, 0.5, "epoch-1.png")
    assert json.loads((out / RUN_FILE).read_text())["best_epoch"] == 1
    assert (out / LORA_WEIGHTS_NAME).read_bytes() == (out / BEST_DIR / LORA_WEIGHTS_NAME).read_bytes()
    card = (out / "README.md").read_text()
    assert "| epochs | 3 |" in card and stop in card and divergence in card
