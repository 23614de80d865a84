"""Time to reward's report: the seed-mean accuracy curve of each configuration, the CPU time at which it reaches the
target, and the table and chart of one task (`DIR/TASK/results.md`); benchmarks/time_to_reward.py runs and judges."""

from __future__ import annotations

import itertools
from pathlib import Path

from benchmarks.time_to_reward import CONFIGS, GAIN


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


def report(results: dict, out: Path, target_config: str) -> str:
    """The table and chart of one task's results (`DIR/TASK/results.md`); `target_config`'s final accuracy is the
    target."""
    base = results["base_accuracy"]
    curves = {
        name: mean_curve(
            [[(0.0, base)] + [(p["cpu_s"], p["accuracy"]) for p in run] for run in runs.values()]
        )
        for name, runs in results["runs"].items()
    }
    target = curves[target_config][-1][1] if target_config in curves else None
    ref_time = curves[target_config][-1][0] if target_config in curves else None
    headline = f"Held-out colour accuracy of the base: {base:.3f}."
    if target is not None:
        headline += (
            f" Target: the final accuracy of `{target_config}` (seed mean) = {target:.3f}, reached there after "
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
            f"| `{name}`: {CONFIGS[name].what} | {len(runs)} | {sum(finals) / len(finals):.3f} ({min(finals):.3f}-"
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
        '    y-axis "accuracy" 0 --> 1',
    ]
    for curve in curves.values():
        values = [at(curve, t) for t in grid]
        last = max(i for i, v in enumerate(values) if v is not None)
        lines.append(f"    line [{', '.join(f'{v:.3f}' for v in values[: last + 1])}]")
    lines += ["```", "", "Lines in order: " + ", ".join(f"`{n}`" for n in curves) + "."]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text
