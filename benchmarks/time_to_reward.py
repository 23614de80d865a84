"""Time-to-reward on the toy world: CPU seconds until held-out colour accuracy reaches a target, per trainer
configuration, over several seeds.

    python benchmarks/time_to_reward.py [--out DIR] [--configs a,b,...] [--seeds 0,1,2] [--jobs N]

Each run is the trainer's shell script with `--preset toy_world` (one thread, `--device cpu`, no validation) plus
the configuration's flags, checkpointing at fixed intervals. While it runs, the CPU seconds of its process tree are
read each time a `checkpoint-N/` appears (the folder is renamed into place once complete). Afterwards each
checkpoint's LoRA is judged exactly as the learning tests judge a final LoRA (`toy_world.evaluate`: the 6 held-out
prompts x 16 seeds, 20 deterministic steps, CFG 7.5). Results: `DIR/results.json` (every point), `DIR/results.md`
(a table and a reward-vs-time chart in Mermaid, which GitHub renders), `DIR/runs/` (the runs). A finished run
(its `points.json` present) is reused, so the work can be split over several calls.

The target is the final held-out accuracy of DDPO's preset (`ddpo`), the mean over seeds, and a second one the base's
accuracy + GAIN; each configuration's time to them is read off its seed-mean curve (linear between checkpoints).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> (script, flags, checkpoint flag and interval, what it is)
CONFIGS: dict[str, tuple[str, list[str], list[str], str]] = {
    "ddpo": (
        "train_ddpo.sh",
        ["--num_epochs", "64", "--prompt_fn", "toy_world_train"],
        ["--save_freq", "16"],
        (
            "DDPO, the toy_world preset on all 12 training prompts run 4x longer (64 epochs of 64 images, "
            "batch-normalised advantages, the first 4 of 6 steps trained)"
        ),
    ),
    "grpo_window": (
        "train_grpo.sh",
        [
            "--num_epochs",
            "64",
            "--sde_window",
            "2",
            "--sde_window_start",
            "0",
            "--prompt_fn",
            "toy_world_train",
            "--reward",  # as measured (the preset has added toy_clean since)
            "toy_color_match",
        ],
        ["--save_freq", "16"],
        "GRPO, groups of 8 with one x_T each, only the first 2 steps stochastic and trained (Flow-GRPO-Fast's window)",
    ),
    "refl": (
        "train_refl_lora.sh",
        [],
        ["--checkpointing_steps", "40"],
        "ReFL, the toy_world preset (160 steps of 8, toy_classifier)",
    ),
    "draft3": (
        "train_refl_lora.sh",
        ["--backprop_steps", "3", "--max_train_steps", "80", "--learning_rate", "2e-3"],
        ["--checkpointing_steps", "20"],
        "DRaFT-3 (reward backprop through the last 3 of 10 steps)",
    ),
}
TARGET_CONFIG = "ddpo"
GAIN = 0.10  # a second target: the base's accuracy plus this


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid, cpu
    total, frontier = 0.0, [pid]
    while frontier:
        p = frontier.pop()
        total += stats.get(p, (0, 0.0))[1]
        frontier += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


def train(name: str, seed: int, runs: Path, python: str) -> dict:
    """One run; returns {"checkpoints": [(step, cpu_s)], "cpu_s": total} and writes RUN/points.json."""
    run = runs / f"{name}-seed{seed}"
    done = run / "points.json"
    if done.exists():
        return json.loads(done.read_text())
    script, flags, ckpt, _ = CONFIGS[name]
    cmd = [
        "bash",
        f"train_scripts/{script}",
        "--preset",
        "toy_world",
        "--output_dir",
        str(run),
        "--seed",
        str(seed),
        "--device",
        "cpu",
        "--report_to",
        "none",
        "--validation_prompts_file",
        "",
        "--overwrite_output_dir",
        "--checkpoints_total_limit",
        "1000",
        *flags,
        *ckpt,
    ]
    env = {**os.environ, "PYTHON": python, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("NUM_PROCESSES", None)
    env.pop("GPUS", None)
    run.mkdir(parents=True, exist_ok=True)
    seen: dict[int, float] = {}
    with open(run.parent / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        cpu = 0.0
        while proc.poll() is None:
            cpu = max(cpu, tree_cpu_seconds(proc.pid))
            for d in run.glob("checkpoint-*"):
                step = int(d.name.split("-")[1])
                seen.setdefault(step, cpu)
            time.sleep(0.5)
    if proc.returncode != 0:
        sys.exit(
            f"error: {name} seed {seed} failed (exit {proc.returncode}); see {run.parent / run.name}.log"
        )
    for d in run.glob("checkpoint-*"):  # one written in the last half second
        seen.setdefault(int(d.name.split("-")[1]), cpu)
    result = {"checkpoints": sorted(seen.items()), "cpu_s": cpu}
    done.write_text(json.dumps(result))
    return result


def judge(lora_dir: Path | None) -> float:
    """Held-out colour accuracy of the base toy-sd plus a LoRA folder (None: the base), as the learning tests judge."""
    import torch

    from refl_ddpo import toy_world

    torch.set_num_threads(1)
    return toy_world.evaluate_model(lora_dir=lora_dir)["accuracy"]


def judged(run: Path, step: int) -> float:
    cache = run / "accuracy.json"
    scores = json.loads(cache.read_text()) if cache.exists() else {}
    if str(step) not in scores:
        scores[str(step)] = judge(run / f"checkpoint-{step}")
        cache.write_text(json.dumps(scores))
    return scores[str(step)]


def mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Seed-mean (cpu_s, accuracy) at each checkpoint index (runs of one configuration checkpoint at the same steps)."""
    n = min(len(c) for c in curves)
    return [
        (sum(c[i][0] for c in curves) / len(curves), sum(c[i][1] for c in curves) / len(curves))
        for i in range(n)
    ]


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """First CPU time at which the piecewise-linear curve reaches `target`; None if it never does."""
    if curve and curve[0][1] >= target:
        return curve[0][0]
    for (t0, a0), (t1, a1) in itertools.pairwise(curve):
        if a1 >= target:  # and a0 < target, else an earlier point had returned
            return t0 + (t1 - t0) * (target - a0) / (a1 - a0)
    return None


def report(results: dict, out: Path) -> str:
    base = results["base_accuracy"]
    curves = {
        name: mean_curve(
            [[(0.0, base)] + [(p["cpu_s"], p["accuracy"]) for p in run] for run in runs.values()]
        )
        for name, runs in results["runs"].items()
    }
    target = curves[TARGET_CONFIG][-1][1] if TARGET_CONFIG in curves else None
    ref_time = curves[TARGET_CONFIG][-1][0] if TARGET_CONFIG in curves else None
    headline = f"Held-out colour accuracy of the base: {base:.3f}."
    if target is not None:
        headline += (
            f" Target: the final accuracy of `{TARGET_CONFIG}` (seed mean) = {target:.3f}, reached there after "
            f"{ref_time:.0f} CPU s"
            + (" (not above the base, so every configuration starts at it)." if target <= base else ".")
        )
    columns = (
        "configuration",
        "seeds",
        "final accuracy, seed mean (min-max)",
        "CPU s, seed mean",
        "CPU s to the target",
        "fraction of the target run's time",
        f"CPU s to base + {GAIN:.2f}",
    )
    lines = [
        headline,
        "",
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
    ]
    for name, runs in results["runs"].items():
        finals = [run[-1]["accuracy"] for run in runs.values()]
        curve = curves[name]
        t = time_to(curve, target) if target is not None else None
        frac = f"{t / ref_time:.2f}" if t is not None and ref_time else "-"
        t_gain = time_to(curve, base + GAIN)
        lines.append(
            f"| `{name}`: {CONFIGS[name][3]} | {len(runs)} | {sum(finals) / len(finals):.3f} ({min(finals):.3f}-"
            f"{max(finals):.3f}) | {curve[-1][0]:.0f} | {'not reached' if t is None else f'{t:.0f}'} | {frac} | "
            f"{'not reached' if t_gain is None else f'{t_gain:.0f}'} |"
        )
    # Mermaid's xychart has one shared x axis: each curve resampled on a common CPU-time grid (step-wise hold).
    horizon = max(c[-1][0] for c in curves.values())
    grid = [horizon * i / 20 for i in range(21)]

    def at(curve, t):
        if t > curve[-1][0]:
            return None
        for (t0, a0), (t1, a1) in itertools.pairwise(curve):
            if t <= t1:
                return a0 + (a1 - a0) * (t - t0) / (t1 - t0) if t1 > t0 else a1
        return curve[-1][1]

    lines += [
        "",
        "```mermaid",
        "xychart-beta",
        '    title "Held-out colour accuracy vs CPU seconds (seed mean; each line ends where its runs end)"',
        "    x-axis [" + ", ".join(f"{t:.0f}" for t in grid) + "]",
        '    y-axis "accuracy" 0.3 --> 0.9',
    ]
    for curve in curves.values():
        values = [at(curve, t) for t in grid]
        last = max(i for i, v in enumerate(values) if v is not None)
        lines.append(f"    line [{', '.join(f'{v:.3f}' for v in values[: last + 1])}]")
    lines += ["```", "", "Lines in order: " + ", ".join(f"`{n}`" for n in curves) + "."]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/time_to_reward_cpu", help="results folder")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    a = ap.parse_args(argv)
    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        ap.error(
            f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CONFIGS)}"
        )
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers (got {a.seeds!r})")
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    out = Path(a.out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(n, s) for n in names for s in seeds]
    with ThreadPoolExecutor(a.jobs) as pool:
        trained = dict(zip(jobs, pool.map(lambda j: train(*j, runs_dir, sys.executable), jobs), strict=False))
    base_cache = out / "base_accuracy.json"
    if not base_cache.exists():
        base_cache.write_text(json.dumps(judge(None)))
    results = {"base_accuracy": json.loads(base_cache.read_text()), "configs": {}, "runs": {}}

    def judge_run(job):
        run = runs_dir / f"{job[0]}-seed{job[1]}"
        return [judged(run, step) for step, _ in trained[job]["checkpoints"]]

    with ThreadPoolExecutor(a.jobs) as pool:  # one run's checkpoints in order (one accuracy.json per run)
        accuracies = dict(zip(jobs, pool.map(judge_run, jobs), strict=False))
    for (name, seed), tr in trained.items():
        results["runs"].setdefault(name, {})[str(seed)] = [
            {"step": step, "cpu_s": round(cpu, 1), "accuracy": acc}
            for (step, cpu), acc in zip(tr["checkpoints"], accuracies[(name, seed)], strict=False)
        ]
    results["configs"] = {
        n: {"script": CONFIGS[n][0], "flags": CONFIGS[n][1] + CONFIGS[n][2], "what": CONFIGS[n][3]}
        for n in names
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(report(results, out))


if __name__ == "__main__":
    main()
