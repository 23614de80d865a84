"""The paired comparison of two inference runs (base vs base + LoRA): per-prompt deltas, win rate, paired bootstrap
CI, a side-by-side picture, for every reward both runs scored. `inference/compare.py` is its entry point.

compare.json keeps the first shared reward's statistics at its top (as when ImageReward was the only score) and
every shared reward's under "per_reward"; compare.png has a header with each reward's means, difference, 95 % CI and
win rate, then before | after per pair (the first seeds of every prompt) with the pair's scores and delta under it.
Runs scored with toy_color_match are of the toy world: its judge's colour accuracy, grey, dirty and ragged fractions
before -> after head the picture and go to compare.json's "toy_judge", each pair's judgement under its images.

    python inference/compare.py outputs/base outputs/lora [--out outputs/compare]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from refl_ddpo.apps.compare_judge import judged, toy_judgement
from refl_ddpo.apps.compare_picture import compare_picture
from refl_ddpo.apps.inference_config import GENERATION_SETTINGS, SCORE_KEY, SCORES_FILE, reward_label
from refl_ddpo.core.errors import UserError, cli_main, read_utf8
from refl_ddpo.core.images import write_json_atomic

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
    rewards = run_rewards(run)
    if not isinstance(rewards, list) or not rewards or not all(isinstance(r, str) for r in rewards):
        raise UserError(f"{path} has a malformed 'rewards' list ({rewards!r}); run inference again.")
    for i, record in enumerate(run["records"]):
        check_record(record, f"{path} record {i}", rewards)
    return run


def run_rewards(run: dict) -> list[str]:
    """The rewards a run scored, in order (a scores.json from before --rewards holds ImageReward only)."""
    return run.get("rewards", [SCORE_KEY])


def check_record(record, where: str, rewards: list[str] = (SCORE_KEY,)) -> None:
    """A scores.json record as inference writes it: prompt, seed, file, and per reward a finite score or null."""
    if not isinstance(record, dict):
        raise UserError(f"{where} is not an object; run inference again.")
    for key, kind in (("prompt", str), ("seed", int), ("file", str)):
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise UserError(
                f"{where} has no {kind.__name__} '{key}' (got {record.get(key)!r}); run inference again."
            )
    for name in rewards:
        score = record.get(name)
        if score is not None and (
            isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score)
        ):
            raise UserError(
                f"{where} ('{record['prompt']}', seed {record['seed']}) has {name} {score!r}, not a finite "
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
    """Paired statistics of two runs for every reward both scored: means, per-prompt deltas, win rate, bootstrap
    CI under "per_reward"; the first shared reward's also at the top, and each pair's scores under "pairs"."""
    pairs = match_pairs(before, after, before_name, after_name)
    shared = [r for r in run_rewards(before) if r in run_rewards(after)]
    if not shared:
        raise UserError(
            f"{before_name} (rewards {', '.join(run_rewards(before))}) and {after_name} (rewards "
            f"{', '.join(run_rewards(after))}) share no reward; run inference on both with the same --rewards."
        )
    result: dict = {"count": len(pairs), "rewards": shared}
    settings = [
        {k: _same_path(run.get("config", {}).get(k)) for k in GENERATION_SETTINGS} for run in (before, after)
    ]
    differ = {
        k: [settings[0][k], settings[1][k]] for k in GENERATION_SETTINGS if settings[0][k] != settings[1][k]
    }
    if differ:
        result["settings_differ"] = differ
    per_reward = {
        name: paired_statistics(
            pairs, name, _score_errors(name, before, after, before_name, after_name), num_resamples, seed
        )
        for name in shared
    }
    primary = shared[0]
    result["pairs"] = [
        {
            "prompt": b["prompt"],
            "seed": b["seed"],
            "before_file": b["file"],
            "after_file": a["file"],
            "before": b.get(primary),
            "after": a.get(primary),
            "delta": _delta(b, a, primary, per_reward[primary]),
            "scores": {
                name: {
                    "before": b.get(name),
                    "after": a.get(name),
                    "delta": _delta(b, a, name, per_reward[name]),
                }
                for name in shared
            },
        }
        | ({"source_image": b["source_image"]} if "source_image" in b else {})  # an edit's source(s)
        for b, a in pairs
    ]
    result.update(per_reward[primary])
    result["per_reward"] = per_reward
    return result


def _delta(b: dict, a: dict, name: str, stats: dict) -> float | None:
    return None if "score_error" in stats else a[name] - b[name]


def _score_errors(name: str, before: dict, after: dict, before_name: str, after_name: str) -> list[str]:
    """Why a run has no `name` scores, as its scores.json says (per reward, or at its top for the first one)."""
    errors = []
    for run_name, run in ((before_name, before), (after_name, after)):
        error = run.get("scores", {}).get(name, {}).get("score_error")
        if error is None and name == run_rewards(run)[0]:
            error = run.get("score_error")
        if error:
            errors.append(f"{run_name}: {error}")
    return errors


def paired_statistics(
    pairs: list[tuple[dict, dict]], name: str, errors: list[str], num_resamples: int, seed: int
) -> dict:
    """One reward's paired statistics over the (before, after) records; {"score_error"} if a score is missing."""
    if any(b.get(name) is None or a.get(name) is None for b, a in pairs):
        return {"score_error": "; ".join(errors) or "some images have no score"}
    before_scores = [b[name] for b, _ in pairs]
    after_scores = [a[name] for _, a in pairs]
    deltas = [a - b for b, a in zip(before_scores, after_scores, strict=True)]
    wins, ties = sum(d > 0 for d in deltas), sum(d == 0 for d in deltas)
    per_prompt: dict[str, list[tuple[float, float]]] = {}  # prompt -> [(before, after)] over its seeds
    for (rb, _), b, a in zip(pairs, before_scores, after_scores, strict=True):
        per_prompt.setdefault(rb["prompt"], []).append((b, a))
    lo, hi = paired_bootstrap_ci(deltas, num_resamples, seed)
    return {
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


def format_comparison(result: dict, before_name: str, after_name: str) -> str:
    """The printed tables: per shared reward, one row per prompt, then the paired summary."""
    lines = []
    for key, (b, a) in result.get("settings_differ", {}).items():
        lines.append(f"note: the runs differ in {key}: {b!r} vs {a!r}")
    for name in result.get("rewards", [SCORE_KEY]):
        r = result.get("per_reward", {}).get(name, result)
        label = reward_label(name)
        if len(result.get("rewards", [])) > 1:
            lines.append(f"== {label}")
        if "mean_difference" not in r:
            lines.append(f"{result['count']} pairs matched; no comparison of {label} ({r['score_error']})")
            continue
        width = min(60, max(len("prompt"), *(len(p["prompt"]) for p in r["per_prompt"])))
        lines.append(f"{'prompt':<{width}}  {'n':>3}  {'before':>8}  {'after':>8}  {'delta':>8}")
        for p in r["per_prompt"]:
            prompt = p["prompt"] if len(p["prompt"]) <= width else p["prompt"][: width - 3] + "..."
            lines.append(
                f"{prompt:<{width}}  {p['n']:>3}  {p['before_mean']:>8.3f}  {p['after_mean']:>8.3f}  "
                f"{p['delta']:>+8.3f}"
            )
        lo, hi = r["bootstrap_ci95"]
        lines.append(
            f"mean {label}: {before_name} {r['mean_before']:.3f}, {after_name} "
            f"{r['mean_after']:.3f}, difference {r['mean_difference']:+.3f} "
            f"(95% paired bootstrap CI [{lo:+.3f}, {hi:+.3f}], {r['num_bootstrap']} resamples)"
        )
        lines.append(
            f"{after_name} beats {before_name} in {r['win_rate']:.1%} of {result['count']} pairs "
            f"({r['wins']} wins, {r['ties']} ties, {r['losses']} losses)"
        )
    return "\n".join(lines)


def shown_pairs(pairs: list[dict], max_pairs: int) -> list[dict]:
    """The pairs compare.png shows: all when at most `max_pairs`; else the first `max_pairs // prompts` seeds of
    every prompt (at least one each, in the runs' order), so that every prompt is shown. 0: none."""
    if len(pairs) <= max_pairs or max_pairs == 0:
        return pairs[:max_pairs]
    each = max(1, max_pairs // len({pair["prompt"] for pair in pairs}))
    taken: dict[str, int] = {}
    shown = []
    for pair in pairs:
        if taken.get(pair["prompt"], 0) < each:
            taken[pair["prompt"]] = taken.get(pair["prompt"], 0) + 1
            shown.append(pair)
    return shown


def pair_cells(pair: dict, before_dir: str, after_dir: str) -> list:
    """A pair's images in compare.png (PIL, RGB): before, after; an edit's source first."""
    from PIL import Image

    paths = [pair["source_image"][0]] if "source_image" in pair else []
    paths += [Path(before_dir) / pair["before_file"], Path(after_dir) / pair["after_file"]]
    cells = []
    for path in paths:
        with Image.open(path) as im:
            cells.append(im.convert("RGB"))  # sizes may differ: each is resized to the cell
    return cells


def run_compare(
    before_dir: str,
    after_dir: str,
    out_dir: str | None = None,
    num_resamples: int = 10_000,
    seed: int = 0,
    max_pairs: int = 32,
) -> dict:
    """compare.png (a header of statistics, then before | after per prompt and seed with their scores; source |
    before | after for edits) and compare.json for two run folders."""

    from refl_ddpo.run.outputs import check_output_dir

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
    if judged(result["rewards"]):
        result["toy_judge"] = toy_judgement(before_dir, after_dir, result["pairs"])
    out = check_output_dir(out_dir or str(Path(after_dir).resolve().parent / "compare"))
    (out / COMPARE_JSON).unlink(missing_ok=True)

    shown = shown_pairs(result["pairs"], max_pairs)
    if shown:
        cells = [cell for pair in shown for cell in pair_cells(pair, before_dir, after_dir)]
        title = f"before: {before_dir}  |  after: {after_dir}"
        if len(shown) < len(result["pairs"]):
            prompts = len({pair["prompt"] for pair in shown})
            title += f"  ({len(shown)} of {len(result['pairs'])} pairs shown, of all {prompts} prompts)"
        compare_picture(result, cells, title, shown).save(out / COMPARE_PNG)
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
        help="compare.png shows at most this many pairs, the first seeds of every prompt (default 32; at least "
        "one pair per prompt; 0: no image).",
    )
    return parser


@cli_main
def main(argv: list[str] | None = None) -> None:
    """Entry point of inference/compare.py (and the refl-ddpo-compare command)."""
    args = build_parser().parse_args(argv)
    run_compare(args.before, args.after, args.out, args.num_bootstrap, args.seed, args.max_pairs)
