"""The paired comparison of two inference runs (base vs base + LoRA): per-prompt deltas, win rate, paired bootstrap
CI, a side-by-side picture. `inference/compare.py` is its entry point.

    python inference/compare.py outputs/base outputs/lora [--out outputs/compare]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from refl_ddpo.errors import UserError, cli_main, read_utf8
from refl_ddpo.generate import GENERATION_SETTINGS, SCORE_KEY, SCORES_FILE, fmt_score
from refl_ddpo.images import caption_grid, write_json_atomic

COMPARE_JSON = "compare.json"
COMPARE_PNG = "compare.png"


def load_run(run_dir: str | Path) -> dict:
    """scores.json of a run folder, with one-line errors when it is missing or not ours."""
    path = Path(run_dir) / SCORES_FILE
    if not path.is_file():
        raise UserError(
            f"{run_dir} has no {SCORES_FILE}: run inference/inference.py (or inference_lora.py) with "
            f"--output_dir {run_dir} first."
        )
    try:
        run = json.loads(read_utf8(path, str(path)))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); run inference again.") from None
    if not isinstance(run, dict) or not isinstance(run.get("records"), list):
        raise UserError(f"{path} has no 'records' list: it was not written by inference/inference.py.")
    for i, record in enumerate(run["records"]):
        check_record(record, f"{path} record {i}")
    return run


def check_record(record, where: str) -> None:
    """A scores.json record as inference writes it: prompt, seed, file, and a finite score or null."""
    if not isinstance(record, dict):
        raise UserError(f"{where} is not an object; run inference again.")
    for key, kind in (("prompt", str), ("seed", int), ("file", str)):
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise UserError(
                f"{where} has no {kind.__name__} '{key}' (got {record.get(key)!r}); run inference again."
            )
    score = record.get(SCORE_KEY)
    if score is not None and (
        isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)
    ):
        raise UserError(
            f"{where} ('{record['prompt']}', seed {record['seed']}) has {SCORE_KEY} {score!r}, not a finite "
            "number or null; run inference again."
        )


def paired_bootstrap_ci(
    differences, num_resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences: resample the pairs with replacement."""
    import numpy as np

    diffs = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.concatenate(
        [  # in chunks: at most 1000 x n indices in memory
            diffs[rng.integers(0, len(diffs), size=(min(1000, num_resamples - k), len(diffs)))].mean(axis=1)
            for k in range(0, num_resamples, 1000)
        ]
    )
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def match_pairs(before: dict, after: dict, before_name: str, after_name: str) -> list[tuple[dict, dict]]:
    """Records paired by (prompt, seed), in the order of `before`; a UserError unless both hold the same pairs."""

    def index(run: dict, name: str) -> dict:
        out = {}
        for r in run["records"]:
            key = (r["prompt"], r["seed"])
            if key in out:
                raise UserError(f"{name} holds (prompt, seed) {key} twice; regenerate it.")
            out[key] = r
        return out

    b, a = index(before, before_name), index(after, after_name)
    only_b, only_a = [k for k in b if k not in a], [k for k in a if k not in b]
    if only_b or only_a:
        example = (only_b or only_a)[0]
        raise UserError(
            f"{before_name} and {after_name} hold different (prompt, seed) pairs ({len(only_b)} only in "
            f"the first, {len(only_a)} only in the second, e.g. {example}); generate both with the same "
            "--prompts_file, --seed and --num_images_per_prompt."
        )
    return [(b[k], a[k]) for k in b]


def _same_path(value):
    """A setting as compared between runs: two spellings of one existing folder are the same model."""
    return os.path.realpath(value) if isinstance(value, str) and os.path.exists(value) else value


def compare_runs(
    before: dict,
    after: dict,
    before_name: str = "before",
    after_name: str = "after",
    num_resamples: int = 10_000,
    seed: int = 0,
) -> dict:
    """Paired statistics of two runs' ImageReward scores: means, per-prompt deltas, win rate, bootstrap CI."""
    pairs = match_pairs(before, after, before_name, after_name)
    result: dict = {"count": len(pairs)}
    settings = [
        {k: _same_path(run.get("config", {}).get(k)) for k in GENERATION_SETTINGS} for run in (before, after)
    ]
    differ = {
        k: [settings[0][k], settings[1][k]] for k in GENERATION_SETTINGS if settings[0][k] != settings[1][k]
    }
    if differ:
        result["settings_differ"] = differ
    errors = [
        f"{name}: {run['score_error']}"
        for name, run in ((before_name, before), (after_name, after))
        if run.get("score_error")
    ]
    missing = any(b.get(SCORE_KEY) is None or a.get(SCORE_KEY) is None for b, a in pairs)
    result["pairs"] = [
        {
            "prompt": b["prompt"],
            "seed": b["seed"],
            "before_file": b["file"],
            "after_file": a["file"],
            "before": b.get(SCORE_KEY),
            "after": a.get(SCORE_KEY),
            "delta": None if missing else a[SCORE_KEY] - b[SCORE_KEY],
        }
        for b, a in pairs
    ]
    if missing:
        result["score_error"] = "; ".join(errors) or "some images have no score"
        return result

    before_scores = [b[SCORE_KEY] for b, _ in pairs]
    after_scores = [a[SCORE_KEY] for _, a in pairs]
    deltas = [a - b for b, a in zip(before_scores, after_scores)]
    wins, ties = sum(d > 0 for d in deltas), sum(d == 0 for d in deltas)
    per_prompt: dict[str, list[tuple[float, float]]] = {}  # prompt -> [(before, after)] over its seeds
    for (rb, _), b, a in zip(pairs, before_scores, after_scores):
        per_prompt.setdefault(rb["prompt"], []).append((b, a))
    lo, hi = paired_bootstrap_ci(deltas, num_resamples, seed)
    result.update(
        {
            "mean_before": sum(before_scores) / len(pairs),
            "mean_after": sum(after_scores) / len(pairs),
            "mean_difference": sum(deltas) / len(pairs),
            "bootstrap_ci95": [lo, hi],
            "num_bootstrap": num_resamples,
            "bootstrap_seed": seed,
            "win_rate": (wins + 0.5 * ties) / len(pairs),  # ties count half
            "wins": wins,
            "ties": ties,
            "losses": len(pairs) - wins - ties,
            "per_prompt": [
                {
                    "prompt": p,
                    "n": len(v),
                    "before_mean": sum(b for b, _ in v) / len(v),
                    "after_mean": sum(a for _, a in v) / len(v),
                    "delta": sum(a - b for b, a in v) / len(v),
                }
                for p, v in per_prompt.items()
            ],
        }
    )
    return result


def format_comparison(result: dict, before_name: str, after_name: str) -> str:
    """The printed table: one row per prompt, then the paired summary."""
    lines = []
    for key, (b, a) in result.get("settings_differ", {}).items():
        lines.append(f"note: the runs differ in {key}: {b!r} vs {a!r}")
    if "mean_difference" not in result:
        lines.append(f"{result['count']} pairs matched; no comparison of scores ({result['score_error']})")
        return "\n".join(lines)
    width = min(60, max(len("prompt"), *(len(r["prompt"]) for r in result["per_prompt"])))
    lines.append(f"{'prompt':<{width}}  {'n':>3}  {'before':>8}  {'after':>8}  {'delta':>8}")
    for r in result["per_prompt"]:
        prompt = r["prompt"] if len(r["prompt"]) <= width else r["prompt"][: width - 3] + "..."
        lines.append(
            f"{prompt:<{width}}  {r['n']:>3}  {r['before_mean']:>8.3f}  {r['after_mean']:>8.3f}  "
            f"{r['delta']:>+8.3f}"
        )
    lo, hi = result["bootstrap_ci95"]
    lines.append(
        f"mean ImageReward: {before_name} {result['mean_before']:.3f}, {after_name} "
        f"{result['mean_after']:.3f}, difference {result['mean_difference']:+.3f} "
        f"(95% paired bootstrap CI [{lo:+.3f}, {hi:+.3f}], {result['num_bootstrap']} resamples)"
    )
    lines.append(
        f"{after_name} beats {before_name} in {result['win_rate']:.1%} of {result['count']} pairs "
        f"({result['wins']} wins, {result['ties']} ties, {result['losses']} losses)"
    )
    return "\n".join(lines)


def run_compare(
    before_dir: str,
    after_dir: str,
    out_dir: str | None = None,
    num_resamples: int = 10_000,
    seed: int = 0,
    max_pairs: int = 32,
) -> dict:
    """compare.png (before | after per prompt and seed, score under each) and compare.json for two run folders."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    from refl_ddpo.training import check_output_dir

    if num_resamples <= 0:
        raise UserError(f"--num_bootstrap must be > 0 (got {num_resamples}).")
    if max_pairs < 0:
        raise UserError(f"--max_pairs must be >= 0 (got {max_pairs}); 0 writes no compare.png.")
    before, after = load_run(before_dir), load_run(after_dir)
    result = {
        "before_dir": str(before_dir),
        "after_dir": str(after_dir),
        **compare_runs(before, after, str(before_dir), str(after_dir), num_resamples, seed),
    }
    for run_dir, key in ((before_dir, "before_file"), (after_dir, "after_file")):
        for pair in result["pairs"]:
            if not (Path(run_dir) / pair[key]).is_file():
                raise UserError(
                    f"{Path(run_dir) / pair[key]} is listed in {SCORES_FILE} but missing; run it again."
                )
    out = check_output_dir(out_dir or str(Path(after_dir).resolve().parent / "compare"))
    (out / COMPARE_JSON).unlink(missing_ok=True)

    shown = result["pairs"][:max_pairs]
    if shown:
        cells, captions = [], []
        for pair in shown:
            for side, run_dir in (("before", before_dir), ("after", after_dir)):
                with Image.open(Path(run_dir) / pair[f"{side}_file"]) as im:
                    cells.append(
                        pil_to_tensor(im.convert("RGB")).float() / 255
                    )  # (3, H, W); sizes may differ
                captions.append(f"{side} {fmt_score(pair[side])} s{pair['seed']} {pair['prompt']}")
        grid = caption_grid(cells, captions, cols=2)  # every cell is resized to the same side
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(out / COMPARE_PNG)
    write_json_atomic(out / COMPARE_JSON, result)
    print(format_comparison(result, "before", "after"), flush=True)
    print(f"wrote {out / COMPARE_PNG if shown else '(no image)'} and {out / COMPARE_JSON}", flush=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference/compare.py",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("before", help="Run folder of the base model (holds scores.json), e.g. outputs/base.")
    parser.add_argument("after", help="Run folder of the base + LoRA, e.g. outputs/lora.")
    parser.add_argument(
        "--out", default=None, help="Where compare.png / compare.json go (default: AFTER/../compare)."
    )
    parser.add_argument(
        "--num_bootstrap", type=int, default=10_000, help="Paired bootstrap resamples (default 10000)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the bootstrap resampling (default 0).")
    parser.add_argument(
        "--max_pairs",
        type=int,
        default=32,
        help="compare.png shows the first this-many pairs (default 32; 0: no image).",
    )
    return parser


@cli_main
def main(argv: list[str] | None = None) -> None:
    """Entry point of inference/compare.py (and the refl-ddpo-compare command)."""
    args = build_parser().parse_args(argv)
    run_compare(args.before, args.after, args.out, args.num_bootstrap, args.seed, args.max_pairs)
