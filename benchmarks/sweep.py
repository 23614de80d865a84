"""The option sweep (`--sweep`): one child benchmark per speed option, each in a fresh process, then a
before/after table."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.config import BenchConfig
from benchmarks.measure import GIB
from benchmarks.report import fmt_s
from refl_ddpo.core.errors import UserError

BENCH_SCRIPT = Path(__file__).resolve().parent / "bench.py"


def sweep_variants(device: torch.device) -> list[tuple[str, str, list[str]]]:
    """(folder, label, flags): a ladder where each row changes one thing from the row before it."""
    if device.type == "cuda":
        return [
            (
                "fp32_eager_notf32",
                "fp32, eager attention, no TF32",
                ["--dtype", "fp32", "--attention", "eager", "--no-tf32"],
            ),
            ("fp32_eager", "+ TF32", ["--dtype", "fp32", "--attention", "eager"]),
            ("bf16_eager", "+ bf16 weights and autocast", ["--dtype", "bf16", "--attention", "eager"]),
            ("bf16", "+ SDPA (the default)", ["--dtype", "bf16"]),
            ("fp16", "fp16 instead of bf16", ["--dtype", "fp16"]),
            ("bf16_cl", "bf16 + channels_last", ["--dtype", "bf16", "--channels_last"]),
            ("bf16_gc", "bf16 + gradient checkpointing", ["--dtype", "bf16", "--gradient_checkpointing"]),
            ("bf16_compile", "bf16 + torch.compile", ["--dtype", "bf16", "--compile"]),
        ]
    # CPU: no TF32; torch.compile is left out (minutes of C++ compilation per case on a small CPU).
    return [
        ("fp32_eager", "fp32, eager attention", ["--dtype", "fp32", "--attention", "eager"]),
        ("fp32", "+ SDPA (the default)", ["--dtype", "fp32"]),
        ("fp32_cl", "fp32 + channels_last", ["--dtype", "fp32", "--channels_last"]),
        ("fp32_gc", "fp32 + gradient checkpointing", ["--dtype", "fp32", "--gradient_checkpointing"]),
        ("bf16", "bf16 weights and autocast", ["--dtype", "bf16"]),
    ]


_VARIANT_FIELDS = {"dtype", "attention", "tf32", "channels_last", "gradient_checkpointing", "compile"}


def child_flags(cfg: BenchConfig) -> list[str]:
    """The flags of `cfg` that every variant shares (everything but the speed options, --out and --sweep)."""
    flags = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in _VARIANT_FIELDS | {"out", "sweep"} or value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{f.name}" if value else f"--no-{f.name}")
        elif isinstance(value, list):
            flags += [f"--{f.name}", *map(str, value)]
        else:
            flags += [f"--{f.name}", str(value)]
    return flags


def run_sweep(cfg: BenchConfig) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    shared = child_flags(cfg)
    done: list[tuple[str, dict]] = []
    for folder, label, flags in sweep_variants(cfg.resolved_device):
        argv = [*shared, *flags, "--out", str(out / folder)]
        results_file = out / folder / "results.json"
        if results_file.is_file():
            old = json.loads(results_file.read_text())
            if old["meta"].get("argv") == argv:
                print(f"sweep: {label}: kept {results_file}", flush=True)
                done.append((label, old))
                continue
        print(f"sweep: {label}: python benchmarks/bench.py {' '.join(argv)}", flush=True)
        proc = subprocess.run([sys.executable, str(BENCH_SCRIPT), *argv], check=False)
        if proc.returncode != 0:
            raise UserError(
                f"sweep variant '{label}' failed (exit {proc.returncode}); its command is printed above."
            )
        done.append((label, json.loads(results_file.read_text())))
    table = sweep_table(done)
    (out / "sweep.md").write_text(table)
    (out / "sweep.json").write_text(json.dumps({label: r for label, r in done}, indent=2) + "\n")
    print("\n" + table, flush=True)


def sweep_table(done: list[tuple[str, dict]]) -> str:
    """Rows: cases; columns: variants; cells: median time and peak memory."""
    cuda = done[0][1]["meta"]["device"].startswith("cuda")
    names = [r["name"] for r in done[0][1]["cases"]]
    head = ["case", *(label for label, _ in done)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells = [name]
        for _, results in done:
            r = next((c for c in results["cases"] if c["name"] == name), None)
            if r is None or "error" in r:
                cells.append("OOM" if r and "memory" in r["error"] else "-")
                continue
            mem = r.get("peak_mem_bytes", r.get("peak_rss_bytes", 0)) / GIB
            cells.append(
                f"{fmt_s(r['median_s'])}, {mem:.2f} GiB" + (f", {100 * r['mfu']:.0f} %" if cuda else "")
            )
        lines.append("| " + " | ".join(cells) + " |")
    meta = done[0][1]["meta"]
    note = (
        f"Median time per run, peak {'allocated GPU memory' if cuda else 'process RSS (monotone within a run)'}"
        + (", MFU" if cuda else "")
        + f"; {meta['device']}, {meta['resolution']} px, "
        f"{meta.get('models', 'tiny models' if meta['tiny'] else 'SD v1.5 architecture')}; each column is a separate "
        "process."
    )
    return "\n".join(lines) + "\n\n" + note + "\n"
