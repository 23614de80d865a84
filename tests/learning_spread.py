"""The spread of the toy-world learning proofs over training seeds x CPU numeric paths, and how far each bound lies
from the measured mean in units of that spread.

    python tests/learning_spread.py run OUT [--cases refl draft3 ...] [--seeds 42 0 1 ... 8]
        [--paths avx2 native baseline] [--workers 2] [--keep] [--extra FLAGS]
    python tests/learning_spread.py report OUT [OUT ...] > table.md

`run` trains every case x seed x numeric path through the case's shell script (one CPU thread each, `--workers` at a
time) and judges the held-out images under the same numeric path as the training, against the base model judged
under that path too. Results go to OUT/results.jsonl as they come; a second `run` into the same OUT skips what is
there. `report` prints a markdown table per case and recipe (the flags of `--extra`), from one or several OUTs, and,
for each gated quantity, its mean, standard deviation, the bound in tests/learning_cases.py and how many standard
deviations the mean clears it by: the proofs want >= 5, over at least MIN_SEEDS distinct training seeds (on the proofs
that fail, three seeds gave a standard deviation 1.5 to 8 times smaller than 11 or more: docs/record/learning_spread.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from learning_cases import CASES, NUMERIC_PATHS, REPO, lora_digest, numeric_env

QUANTITIES = (  # name, the bound's field, +1 if larger is better
    ("gain", "min_gain", 1),
    ("grey_drop", "max_grey_drop", -1),
    ("dirty_rise", "max_dirty_rise", -1),
    ("ragged_rise", "max_ragged_rise", -1),
)
RULE = 5.0  # the bound must lie at least this many standard deviations from the mean, on the safe side
MIN_SEEDS = 10  # distinct training seeds before a standard deviation counts (numeric paths alone add little)


def _evaluate_in_subprocess(case: str, lora: Path | None, path: str) -> dict[str, float]:
    env = numeric_env(path)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "evaluate", case] + ([str(lora)] if lora else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"evaluate {case} {lora} under {path} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _load(*outs: Path) -> list[dict]:
    files = [out / "results.jsonl" for out in outs]
    return [
        json.loads(line) for f in files if f.exists() for line in f.read_text().splitlines() if line.strip()
    ]


def _jobs(done: set, cases: list[str], seeds: list[int], paths: list[str]) -> list[tuple]:
    """What is left to do: the base model's evaluation once per judged prompt set and path, then each run."""
    jobs = []
    bases = {}
    for name in cases:
        bases.setdefault(CASES[name].eval_key, name)
    for key, name in bases.items():
        for path in paths:
            if ("base", None, "/".join(key), None, path) not in done:
                jobs.append(("base", name, None, path))
    for name in cases:
        for seed in seeds:
            for path in paths:
                if ("run", name, None, seed, path) not in done:
                    jobs.append(("run", name, seed, path))
    return jobs


def run(
    out: Path,
    cases: list[str],
    seeds: list[int],
    paths: list[str],
    workers: int,
    extra: list[str],
    keep: bool = False,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    done = {(r["kind"], r.get("case"), r.get("key"), r.get("seed"), r["path"]) for r in _load(out)}
    lock = threading.Lock()

    def record(row: dict) -> None:
        with lock, open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    jobs = _jobs(done, cases, seeds, paths)

    def do(job) -> None:
        kind, name, seed, path = job
        case = CASES[name]
        if kind == "base":
            record(
                {
                    "kind": "base",
                    "key": "/".join(case.eval_key),
                    "path": path,
                    "metrics": _evaluate_in_subprocess(name, None, path),
                }
            )
            return
        with tempfile.TemporaryDirectory(prefix=f"spread_{name}_") as tmp:
            lora = (out / "loras" / f"{name}_{seed}_{path}") if keep else Path(tmp) / "lora"
            t0 = time.monotonic()
            r = case.train(lora, *extra, "--seed", str(seed), env=numeric_env(path), timeout=None)
            train_s = time.monotonic() - t0
            if r.returncode != 0:
                record(
                    {"kind": "error", "case": name, "seed": seed, "path": path, "stderr": r.stderr[-2000:]}
                )
                return
            metrics = _evaluate_in_subprocess(name, lora, path)
            digest = lora_digest(lora)
        record(
            {
                "kind": "run",
                "case": name,
                "seed": seed,
                "path": path,
                "metrics": metrics,
                "train_s": round(train_s, 1),
                "lora_sha256": digest,
                "extra": extra,
            }
        )

    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(do, j) for j in jobs]:
            f.result()


def _fmt(x: float) -> str:
    return f"{x:+.3f}"


def report(*outs: Path) -> str:
    rows = _load(*outs)
    base = {(r["key"], r["path"]): r["metrics"] for r in rows if r["kind"] == "base"}
    runs = {}  # (case, extra flags) -> (seed, path) -> the last run recorded
    for r in rows:
        if r["kind"] == "run":
            runs.setdefault((r["case"], tuple(r.get("extra", []))), {})[(r["seed"], r["path"])] = r
    lines = []
    for (name, extra), by_seed in sorted(
        runs.items(), key=lambda kv: (list(CASES).index(kv[0][0]), kv[0][1])
    ):
        case = CASES[name]
        mine = [r for r in by_seed.values() if ("/".join(case.eval_key), r["path"]) in base]
        if not mine:
            continue
        mine.sort(key=lambda r: (list(NUMERIC_PATHS).index(r["path"]), r["seed"]))
        flags = " ".join(case.flags + extra)
        lines += [f"### {name}: `{case.script} --preset {case.preset}{' ' + flags if flags else ''}`", ""]
        lines += [
            "| numeric path | seed | accuracy | grey | dirty | ragged | gain | grey drop | dirty rise | ragged rise "
            + "| training s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        changes = []
        for r in mine:
            b, a = base[("/".join(case.eval_key), r["path"])], r["metrics"]
            c = case.changes(b, a)
            changes.append(c)
            lines.append(
                f"| {r['path']} | {r['seed']} | {b['accuracy']:.3f} -> {a['accuracy']:.3f} | "
                f"{b['grey']:.3f} -> {a['grey']:.3f} | {b['dirty']:.3f} -> {a['dirty']:.3f} | "
                f"{b['ragged']:.3f} -> {a['ragged']:.3f} | "
                + " | ".join(_fmt(c[q]) for q, _, _ in QUANTITIES)
                + f" | {r['train_s']:.0f} |"
            )
        seeds = len({r["seed"] for r in mine})
        few = f" (**fewer than {MIN_SEEDS}**: the spread is not measured yet)" if seeds < MIN_SEEDS else ""
        lines += [
            "",
            f"{len(mine)} runs, {seeds} distinct training seeds{few}:",
            "",
            "| quantity | mean | std | worst | bound | (mean - bound) / std |",
            "|---|---|---|---|---|---|",
        ]
        for q, field, sign in QUANTITIES:
            values = [c[q] for c in changes]
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            bound = getattr(case, field)
            worst = min(values) if sign > 0 else max(values)
            if bound is None:
                lines.append(
                    f"| {q.replace('_', ' ')} | {_fmt(mean)} | {std:.3f} | {_fmt(worst)} | not gated | |"
                )
                continue
            clear = sign * (mean - bound) / std if std > 0 else float("inf")
            verdict = " **under 5**" if clear < RULE else " (too few seeds)" if few else ""
            lines.append(
                f"| {q.replace('_', ' ')} | {_fmt(mean)} | {std:.3f} | {_fmt(worst)} | {_fmt(bound)} | "
                f"{clear:.1f}{verdict} |"
            )
        lines.append("")
    errors = [r for r in rows if r["kind"] == "error"]
    for r in errors:
        lines.append(
            f"- FAILED to train: {r['case']} seed {r['seed']} path {r['path']}: {r['stderr'][-300:]!r}"
        )
    head = [
        f"Measured {date.today().isoformat()} at {_commit()} on {_cpu()} ({os.cpu_count()} cores), "
        f"Python {platform.python_version()}, one torch thread per run. Numeric paths: "
        + "; ".join(
            f"{k}: {' '.join(f'{n}={v}' for n, v in env.items()) or 'nothing set'}"
            for k, env in NUMERIC_PATHS.items()
        ),
        "",
    ]
    return "\n".join(head + lines)


def _commit() -> str:
    r = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], check=False, cwd=REPO, capture_output=True, text=True
    )
    return r.stdout.strip() or "unknown"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", allow_abbrev=False)
    r.add_argument("out", type=Path)
    r.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    r.add_argument("--seeds", nargs="+", type=int, default=[42, *range(MIN_SEEDS - 1)])
    r.add_argument("--paths", nargs="+", default=list(NUMERIC_PATHS), choices=list(NUMERIC_PATHS))
    r.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    r.add_argument("--keep", action="store_true", help="keep each trained LoRA in OUT/loras/CASE_SEED_PATH")
    r.add_argument(
        "--extra", default="", help="flags added to every case's (a recipe to try), e.g. '--num_epochs 8'"
    )
    s = sub.add_parser("report", allow_abbrev=False)
    s.add_argument("out", type=Path, nargs="+", help="results of one or several `run`s, merged")
    e = sub.add_parser("evaluate", allow_abbrev=False)  # internal: one evaluation, printed as JSON
    e.add_argument("case", choices=list(CASES))
    e.add_argument("lora", nargs="?", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(args.out, args.cases, args.seeds, args.paths, args.workers, shlex.split(args.extra), args.keep)
    elif args.cmd == "report":
        print(report(*args.out))
    else:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(CASES[args.case].evaluate(args.lora)))


if __name__ == "__main__":
    main()
