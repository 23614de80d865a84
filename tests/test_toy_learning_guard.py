"""Guarded training, proved on the toy world: DiffusionNFT through `train_nft.sh --preset toy_world` on the colour
reward alone for 16 epochs (tests/learning_cases.py, GUARDED) raises the colour accuracy of the held-out "a green
triangle" and hacks it: its last weights grow the shapes until they fill the frame. Validated every epoch by `toy_judge`, a measure the run
never optimises, the run keeps in best/ weights that hold at least half of the colour gain with the shapes inside the
learning proofs' bounds (docs/guards.md)."""

import json
import time

import pytest
from learning_cases import GUARDED, check_guard
from test_toy_learning import check_only_the_lora_changed

from refl_ddpo.run.runs import BEST_DIR

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)


def test_the_guard_keeps_the_weights_from_before_the_hack(tmp_path, record_property, base_judgement):
    case = GUARDED["nft_guard"]
    base = base_judgement(case)
    out = tmp_path / case.name
    t0 = time.monotonic()
    r = case.train(out)
    train_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    record_property("lora_sha256", check_only_the_lora_changed(out))
    best = json.loads((out / BEST_DIR / "best.json").read_text())
    last, kept = case.evaluate(out), case.evaluate(out / BEST_DIR)
    record_property(
        "judged",
        f"accuracy {base['accuracy']:.3f} -> last {last['accuracy']:.3f} (grey {base['grey']:.3f} -> "
        f"{last['grey']:.3f}), kept epoch {best['epoch']} {kept['accuracy']:.3f} (grey {kept['grey']:.3f}); "
        f"trained in {train_s:.0f} s",
    )
    check_guard(case, base, last, kept)
