"""How a case is measured: time (CUDA events on a GPU, perf_counter on a CPU), peak memory, model FLOPs of one run
(torch.utils.flop_counter), device->host syncs (GPU), and the machine and library versions."""

from __future__ import annotations

import collections
import gc
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.cases import Case
from benchmarks.harness import Bench, set_checkpointing

GIB = 2**30


def time_runs(run: Callable[[], torch.Tensor], n: int, device: torch.device) -> list[float]:
    """Seconds of each of `n` runs: CUDA events around the run on a GPU (the run's device work, queued after
    everything before it), the host clock on a CPU (where every op has finished when it returns)."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return times


def flop_counter_mode():
    """torch.utils.flop_counter.FlopCounterMode that also counts the CPU SDPA kernel."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    # PyTorch's counter has formulas for the CUDA SDPA kernels only; the CPU kernel computes the same products.
    # custom_mapping passes shapes (q, k, v) / (grad_out, q, k, v) in the kernels' argument order.
    cpu_sdpa = {
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *args, out_shape=None, **kw: (
            flop_counter.sdpa_flop_count(q, k, v)
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *args, out_shape=None, **kw: (
            flop_counter.sdpa_backward_flop_count(g, q, k, v)
        ),
    }
    return flop_counter.FlopCounterMode(display=False, custom_mapping=cpu_sdpa)


def count_flops(
    run: Callable[[], torch.Tensor], models: dict, checkpointed: bool
) -> tuple[int, torch.Tensor]:
    """FLOPs of one run (matmuls, convolutions, attention; forward and backward), as model FLOPs: gradient
    checkpointing's recomputation is left out (switched off for this run) and compiled modules run eagerly."""
    if checkpointed:
        set_checkpointing(False, models.get("unet"), models.get("vae"), models.get("reward"))
    try:
        with torch.compiler.set_stance("force_eager"), flop_counter_mode() as counter:
            output = run()
    finally:
        if checkpointed:
            set_checkpointing(True, models.get("unet"), models.get("vae"), models.get("reward"))
    return counter.get_total_flops(), output


def count_syncs(run: Callable[[], torch.Tensor], top: int = 12) -> tuple[int, list[str]]:
    """Host<->device synchronisations in one run, as torch.cuda.set_sync_debug_mode reports them (CUDA only), and
    the `top` Python lines that caused most of them ("path:line count", path from the package folder on)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(
        f"{_short_path(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    return sum(sites.values()), [f"{site} {n}" for site, n in sites.most_common(top)]


def _short_path(path: str) -> str:
    """.../site-packages/diffusers/x.py -> diffusers/x.py; the repository's files relative to it."""
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    try:
        return str(Path(path).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return path


def profile_run(run: Callable[[], torch.Tensor], device: torch.device, rows: int = 25) -> str:
    """torch.profiler's table of one run (ops by self device time, or CPU time on a CPU), with the wall time and
    the busy time of the device: a device busy far less than the wall is waiting on the host."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    busy = sum(getattr(e, sort) for e in events) / 1e6
    head = f"wall {wall:.3f} s (profiled), {'device' if device.type == 'cuda' else 'CPU'} self time {busy:.3f} s\n"
    return head + events.table(sort_by=sort, row_limit=rows, max_name_column_width=60)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def measure(b: Bench, case: Case) -> dict:
    cfg, device = b.cfg, b.device
    result = {
        "name": case.name,
        "bench": case.bench,
        "unit": case.unit,
        "images": case.images,
        "settings": case.settings,
    }
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t_build = time.perf_counter()
    run, models = None, {}
    try:
        run, models = case.setup(b)
        if cuda:
            torch.cuda.synchronize(device)
        result["setup_s"] = time.perf_counter() - t_build
        warm = time_runs(run, cfg.warmup, device)
        result["warmup_s"] = warm
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = time_runs(run, cfg.repeats, device)
        if cuda:
            result["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        else:
            result["peak_rss_bytes"] = peak_rss_bytes()
        result.update(times_s=times, median_s=statistics.median(times), min_s=min(times), max_s=max(times))
        result["per_image_s"] = result["median_s"] / case.images
        result["flops"], output = count_flops(run, models, cfg.gradient_checkpointing)
        if not torch.isfinite(output).all():  # random weights must not time NaN/inf arithmetic
            result["error"] = "non-finite output: the timing ran on NaN/inf values"
        result["tflops_per_s"] = result["flops"] / result["median_s"] / 1e12
        if cuda:
            result["mfu"] = result["tflops_per_s"] / cfg.peak_tflops
            result["host_syncs"], result["sync_sites"] = count_syncs(run)
        if cfg.profile:
            result["profile"] = profile_run(run, device)
    except torch.OutOfMemoryError as e:
        result["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
    finally:
        del run, models
        b.text_encoder_family = b.text_encoder_bytes = None
        b.accelerator.free_memory()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return result


def machine_info(device: torch.device) -> dict:
    import diffusers
    import peft
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / GIB, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info
