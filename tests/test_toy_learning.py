"""Learning, proved on the toy world: each trainer, through its shell script and a toy-world preset, raises the colour
accuracy of fixed-seed images of HELD-OUT prompts (combinations never trained on) and keeps the shapes (grey, dirty,
ragged), and only the LoRA changes. The cases and their bounds are data (tests/learning_cases.py); this module has
ReFL on toy-sd, the others sit in files of their own so that pytest-xdist (--dist loadfile) runs them side by side.

The weights are committed (refl_ddpo/toy_world/data, checked against SHA256SUMS), not trained at test time, so every
machine starts from the same model; the CPU numeric path is pinned (conftest.py), so every x86-64 CPU computes the
same bits; and each bound lies at least 5 standard deviations of its spread over training seeds x numeric paths from
the measured mean (docs/learning_proofs.md, `python tests/learning_spread.py`).
"""

import time
from pathlib import Path

import pytest
from learning_cases import CASES, Case, lora_digest
from safetensors.torch import load_file

from refl_ddpo.core.lora import LORA_WEIGHTS_NAME
from refl_ddpo.toy_world import files as toy_files
from refl_ddpo.toy_world import world as toy_world

pytestmark = pytest.mark.learning  # a stage of its own: pytest -m learning (pyproject.toml)

N_COMMITTED = 26  # files listed in SHA256SUMS: toy-sd/ 10, toy-sd3/ 14, the classifier 2


def check_only_the_lora_changed(out: Path) -> str:
    """The committed weights still match their sums and every LoRA B matrix moved off zero; the LoRA's sha256."""
    assert len(toy_files.verify_sums(toy_world.DATA_DIR)) == N_COMMITTED, (
        "the committed weights must not change"
    )
    lora = load_file(str(out / LORA_WEIGHTS_NAME))
    ups = [v for k, v in lora.items() if "lora.up" in k or "lora_B" in k]
    assert ups and all(v.abs().sum() > 0 for v in ups), "every LoRA B matrix moved off its zero init"
    return lora_digest(out)


def prove(case: Case, tmp_path: Path, record_property, base_judgement) -> None:
    """Train `case` through its script, then check it against its bounds (base_judgement: conftest's fixture, the
    held-out judgement before, shared by the cases with the same evaluation key)."""
    base = base_judgement(case)
    t0 = time.monotonic()
    r = case.train(tmp_path / case.name)
    train_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    record_property("lora_sha256", check_only_the_lora_changed(tmp_path / case.name))
    after = case.evaluate(tmp_path / case.name)
    changes = case.changes(base, after)
    record_property(
        "judged",
        f"accuracy {base['accuracy']:.3f} -> {after['accuracy']:.3f}, "
        + ", ".join(f"{k.replace('_', ' ')} {v:+.3f}" for k, v in changes.items())
        + f"; trained in {train_s:.0f} s",
    )
    case.check(base, after)


def test_refl_raises_held_out_colour_accuracy(tmp_path, record_property, base_judgement):
    prove(CASES["refl"], tmp_path, record_property, base_judgement)
