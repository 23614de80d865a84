"""The report of a run: times in ms / s, the results table in Markdown, and files written whole (then renamed)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.measure import GIB


def write_files(out: Path, files: dict[str, str]) -> None:
    """Each file of `files` (name -> text) in `out`, written whole under a temporary name, then renamed: no
    half-written results."""
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def workloads(opts: dict, benches: set[str]) -> list[str]:
    """One phrase per kind of case that ran: its steps and guidance."""
    phrases = []
    if any(b.endswith("refl") for b in benches):  # every family's ReFL case, as models.run_configs tells them
        phrases.append(
            f"ReFL: {opts['refl_steps']} steps of the family's sampler, grad at fixed step k = {opts['refl_k']} "
            f"({opts['refl_k'] + 1} network calls), CFG off"
        )
    if benches & {"ddpo_sample", "ddpo_train"}:
        phrases.append(
            f"DDPO: {opts['ddpo_steps']} steps, CFG {opts['ddpo_guidance_scale']}, train micro-batch "
            f"{opts['ddpo_train_batch_size']}"
        )
    if any(b.startswith("flux_grpo") for b in benches):
        phrases.append(
            f"GRPO on FLUX.1: {opts['ddpo_steps']} flow SDE steps, embedded guidance {opts['ddpo_guidance_scale']}, "
            f"train micro-batch {opts['ddpo_train_batch_size']}"
        )
    if "inference" in benches:
        phrases.append(
            f"inference: {opts['inference_steps']} DDIM steps, CFG {opts['inference_guidance_scale']}"
        )
    return phrases


def markdown_table(results: dict) -> str:
    meta, rows = results["meta"], results["cases"]
    cuda = meta["device"].startswith("cuda")
    mem_head = "peak mem (GiB, allocated)" if cuda else "peak RSS (GiB, process)"
    head = ["case", "one run", "median", "min-max", "per image", mem_head, "TFLOP/run", "TFLOP/s"]
    if cuda:
        head += ["MFU", "host syncs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['unit']} | {r['error']} |" + " |" * (len(head) - 3))
            continue
        mem = r.get("peak_mem_bytes", r.get("peak_rss_bytes", 0)) / GIB
        cells = [
            r["name"],
            r["unit"],
            fmt_s(r["median_s"]),
            f"{fmt_s(r['min_s'])} - {fmt_s(r['max_s'])}",
            fmt_s(r["per_image_s"]),
            f"{mem:.2f}",
            f"{r['flops'] / 1e12:.3g}",
            f"{r['tflops_per_s']:.3g}",
        ]
        if cuda:
            cells += [f"{100 * r['mfu']:.1f} %", str(r["host_syncs"])]
        lines.append("| " + " | ".join(cells) + " |")
    params = ", ".join(
        f"{k} {v / 1e9:.4g}B" if v >= 1e9 else f"{k} {v / 1e6:.4g}M" for k, v in meta["parameters"].items()
    )
    opts = meta["options"]
    on_off = {True: "on", False: "off"}
    # results written before "models" was recorded ran SD v1.5 only
    models = (
        meta.get("models", "tiny models" if meta["tiny"] else "SD v1.5 architecture") + ", random weights"
    )
    machine = meta["machine"].get("gpu") or meta["machine"].get("cpu")
    tf32 = on_off[opts["tf32"]] if cuda else "n/a"
    notes = [
        f"Models: {models}; parameters: {params}.",
        (
            f"Device {meta['device']} ({machine}, CPU threads: {meta['machine']['cpu_threads']}), dtype "
            f"{meta['dtype']}, {meta['resolution']} px, attention {opts['attention']}, TF32 {tf32}, channels_last "
            f"{on_off[opts['channels_last']]}, gradient checkpointing {on_off[opts['gradient_checkpointing']]}, "
            f"compile {on_off[opts['compile']]}"
            + ("" if opts.get("cudnn_attention", True) else ", cuDNN attention off")
            + "."
        ),
        f"Median of {opts['repeats']} runs after {opts['warmup']} warm-up run(s); "
        + ("CUDA events." if cuda else "perf_counter."),
        "; ".join(workloads(opts, {r["bench"] for r in rows})) + ".",
        "TFLOP/run: model FLOPs of one run (torch.utils.flop_counter; no checkpointing recomputation)."
        + (f" MFU against {opts['peak_tflops']:g} TFLOP/s." if cuda else ""),
    ]
    if not cuda:
        notes.append(
            "Peak RSS is process-wide and monotone: each row includes everything that ran before it."
        )
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    sites = [(r["name"], r["sync_sites"]) for r in results["cases"] if r.get("sync_sites")]
    if sites:
        text += "\nWhere the host syncs come from (Python line: syncs in one run):\n\n"
        text += "\n".join(f"- {name}: " + "; ".join(s) for name, s in sites) + "\n"
    return text
