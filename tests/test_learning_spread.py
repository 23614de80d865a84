"""tests/learning_spread.py's report: runs from several result folders merged, one table per case and recipe, and a
margin counted only over enough distinct training seeds."""

import json

from learning_cases import CASES
from learning_spread import MIN_SEEDS, report


def _write(folder, rows):
    folder.mkdir()
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(seed, accuracy, extra=()):
    metrics = {"accuracy": accuracy, "grey": 0.6, "dirty": 0.3, "ragged": 0.3}
    return {
        "kind": "run",
        "case": "nft_sd3",
        "seed": seed,
        "path": "avx2",
        "metrics": metrics,
        "train_s": 1.0,
        "lora_sha256": "x",
        "extra": list(extra),
    }


def test_report_merges_folders_splits_recipes_and_wants_enough_seeds(tmp_path):
    base = {
        "kind": "base",
        "key": "/".join(CASES["nft_sd3"].eval_key),
        "path": "avx2",
        "metrics": {"accuracy": 0.25, "grey": 0.6, "dirty": 0.3, "ragged": 0.3},
    }
    # gains alternate 0.6 / 0.8: mean 0.7, std over n seeds known in closed form
    _write(tmp_path / "a", [base] + [_run(s, 0.85 + 0.2 * (s % 2)) for s in range(MIN_SEEDS // 2)])
    _write(
        tmp_path / "b",
        [_run(s, 0.85 + 0.2 * (s % 2)) for s in range(MIN_SEEDS // 2, MIN_SEEDS)]
        + [_run(s, 0.3, extra=["--num_epochs", "2"]) for s in range(3)],
    )
    text = report(tmp_path / "a", tmp_path / "b")
    preset, trial = text.split("### nft_sd3")[1:]
    recipe = " ".join(
        ("train_nft.sh", "--preset", "toy_world_sd3", *CASES["nft_sd3"].flags, "--num_epochs", "2")
    )
    assert "--num_epochs 2" not in preset and f"`{recipe}`" in trial
    assert f"{MIN_SEEDS} runs, {MIN_SEEDS} distinct training seeds:" in preset
    n = MIN_SEEDS
    std = 0.1 * (n / (n - 1)) ** 0.5  # half the values 0.1 above the mean, half 0.1 below
    clear = (0.7 - CASES["nft_sd3"].min_gain) / std
    assert f"| gain | +0.700 | {std:.3f} | +0.600 | +0.500 | {clear:.1f} **under 5** |" in preset
    assert f"3 runs, 3 distinct training seeds (**fewer than {MIN_SEEDS}**" in trial
    assert "| grey drop | +0.000 | 0.000 | +0.000 | +0.200 | inf (too few seeds) |" in trial
