"""The peer side by side's report (`python benchmarks/peer.py check` and `report`, side ours): the two UNets' outputs
compared, and results.json / results.md from the timed epochs of both sides (benchmarks/peer.py says what an epoch is
and how it is timed)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks.peer import LEARNING_RATE, SIDES, expected_work


def unet_check(out: Path) -> dict:
    """Max abs differences between the two sides' prompt embeddings and UNet outputs (both must be 0)."""
    from safetensors.torch import load_file

    ours, trl = (load_file(str(out / f"unet_{side}.safetensors")) for side in SIDES)
    check = {"input_ids_equal": bool(torch.equal(ours["input_ids"], trl["input_ids"]))}
    for key in ("prompt_embeds", "unet_output"):
        check[f"{key}_max_abs_diff"] = float((ours[key] - trl[key]).abs().max())
    check["identical"] = check["input_ids_equal"] and not any(
        v for k, v in check.items() if k.endswith("diff")
    )
    return check


def report(out: Path, command: str) -> dict:
    """results.json and results.md from out/runs/{ours,trl}_<pair>.json; exits if the work per epoch differs.

    A case is one timed epoch of each side in a pair, `ratio` the median over cases of ours / TRL in CPU seconds
    (one thread each: on a machine shared with other jobs the CPU time is what a quiet machine's wall time would be;
    the wall-time ratio is kept beside it)."""
    cases, versions_seen, loads, config = [], {}, [], None
    pairs = sorted(int(p.stem.split("_")[1]) for p in (out / "runs").glob("ours_*.json"))
    for pair in pairs:
        runs = {s: json.loads((out / "runs" / f"{s}_{pair}.json").read_text()) for s in SIDES}
        config = config or runs["ours"]["config"]
        for s in SIDES:
            versions_seen[s] = runs[s]["versions"]
            loads += runs[s]["load_average_1min"]
        if runs["ours"]["config"] != runs["trl"]["config"] or runs["ours"]["config"] != config:
            raise SystemExit(f"error: pair {pair}: the sides' configs differ from each other or from pair 1")
        expected = expected_work(config)
        for i, (a, b) in enumerate(zip(runs["ours"]["epochs"], runs["trl"]["epochs"], strict=False)):
            work = {k: a[k] for k in expected}
            if work != {k: b[k] for k in expected} or work != expected:
                raise SystemExit(f"error: pair {pair} epoch {i}: unequal work, ours {a}, TRL {b}")
            other = [k for k in a if k not in work]  # cpu_s, wall_s, context switches
            cases.append(
                {"pair": pair, "epoch": i}
                | {f"{side}_{k}": r[k] for side, r in (("ours", a), ("trl", b)) for k in other}
                | {"ratio": a["cpu_s"] / b["cpu_s"], "ratio_wall": a["wall_s"] / b["wall_s"], **work}
            )
    if not cases:
        raise SystemExit(f"error: no finished pairs in {out / 'runs'}")
    summary = {"pairs": len(pairs), "epochs_timed": len(cases)}
    for key in ("ratio", "ratio_wall", "ours_cpu_s", "trl_cpu_s", "ours_wall_s", "trl_wall_s"):
        values = [c[key] for c in cases]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    results = {
        "meta": {
            "command": command,
            "config": config | {"learning_rate": LEARNING_RATE, "reward": "jpeg_compressibility"},
            "work_per_epoch": expected_work(config),
            "versions": versions_seen,
            "machine": {"cpus": os.cpu_count(), "load_average_1min": [min(loads), max(loads)]},
            "unet_check": unet_check(out),
        },
        "ratio": summary["ratio"]["median"],
        "summary": summary,
        "cases": cases,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))
    return results


def markdown(results: dict) -> str:
    s, meta = results["summary"], results["meta"]
    v, work, check = meta["versions"], meta["work_per_epoch"], meta["unet_check"]

    def spread(key: str, fmt: str = ".3f") -> str:
        return f"{s[key]['median']:{fmt}} ({s[key]['min']:{fmt}}-{s[key]['max']:{fmt}})"

    head = (
        f"One DDPO epoch, ours / TRL {v['trl'].get('trl', '?')} `DDPOTrainer`, median (min-max) over "
        f"{s['epochs_timed']} epochs in {s['pairs']} interleaved pairs, one thread each:"
    )
    work_line = (
        f"Work per epoch, counted in both: {work['unet_calls']} UNet calls, {work['unet_calls_with_grad']} of "
        f"them with gradient, {work['optimizer_steps']} optimizer steps. UNet check (same weights): identical "
        f"{check['identical']}; max abs diff of the UNet output {check['unet_output_max_abs_diff']:g}, of the "
        f"prompt embeddings {check['prompt_embeds_max_abs_diff']:g}."
    )
    versions_line = "Versions: " + "; ".join(
        f"{x}: " + ", ".join(f"{k} {n}" for k, n in v[x].items()) for x in v
    )
    load = meta["machine"]["load_average_1min"]
    load_line = f"Load average (1 min) around the runs: {load[0]:.2f}-{load[1]:.2f} on {meta['machine']['cpus']} CPUs."
    lines = [
        head,
        "",
        "| measure | ours (s) | TRL (s) | ours / TRL |",
        "|---|---|---|---|",
        f"| CPU time | {spread('ours_cpu_s')} | {spread('trl_cpu_s')} | **{spread('ratio')}** |",
        f"| wall time | {spread('ours_wall_s')} | {spread('trl_wall_s')} | {spread('ratio_wall')} |",
        "",
        work_line,
        versions_line + ".",
        load_line,
        "",
        "| pair | epoch | ours CPU (s) | TRL CPU (s) | ours / TRL | ours wall (s) | TRL wall (s) | ours / TRL (wall) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cases"]:
        lines.append(
            f"| {c['pair']} | {c['epoch']} | {c['ours_cpu_s']:.3f} | {c['trl_cpu_s']:.3f} | {c['ratio']:.3f} | "
            f"{c['ours_wall_s']:.3f} | {c['trl_wall_s']:.3f} | {c['ratio_wall']:.3f} |"
        )
    return "\n".join(lines) + "\n"
