"""Peak device memory without a GPU (`--memory_only`): each case runs once with its device tensors on the meta
device (shapes, dtypes, strides and the autograd graph, no data, no arithmetic), and a dispatch mode keeps the
bytes of every live device storage and their peak: what `torch.cuda.max_memory_allocated` would report.

How the count is made:

- The case's own `setup` and `run` (the kit's functions, as the timed runs call them) run with the models on the
  meta device in place of the GPU. Host tensors stay real CPU tensors (generators, schedulers, host copies of the
  timesteps work as usual).
- `PeakMemory` sees every op below autograd. Each new device storage (a parameter, an op's output, a tensor saved
  for backward, a gradient, an optimizer state) is added when it appears, rounded up to 512 bytes as the CUDA
  caching allocator rounds a block, and taken off when the storage dies (a weak reference's callback): views and
  in-place ops add nothing. As the timed runs, the case is set up, run once (the warm-up: the optimizer states
  appear), the peak is reset to what is live then (weights, optimizer states), and the peak of a second run is
  reported.
- CUDA's behaviour where it differs from meta tensors' (autocast, the attention kernel, foreach AdamW,
  checkpointing's recomputation) and fake ranks for the sharded count: benchmarks/meta.py.

Sharded (`--fsdp_world_size N`, the kit's `--fsdp`): the count is rank 0's. The process joins torch's fake process
group as rank 0 of N (`fake_ranks`: collectives return at once and write nothing, their output buffers are allocated
as on a GPU), the Bench's accelerator holds the kit's FSDP state (`refl_ddpo.core.sharding.hold_fsdp_state` with
`fsdp_plugin`), and the case's own `prepare` shards the trained network with accelerate's FSDP2 code (`fully_shard`
per `_no_split_modules` block and the root, trained tensors upcast to fp32 master weights, bf16 compute, fp32
gradient reduction). So the count holds 1/N of every parameter (rank 0's padded chunk), of the gradients and AdamW
states, each block's bf16 parameters while FSDP2 has them all-gathered (its storage resized in place: `PeakMemory`
follows `UntypedStorage.resize_`), the unsharded gradients and their fp32 copies before the reduce-scatter, and
the activations. Frozen parts (text encoders, VAE, reward) are whole, as the kit keeps them by default; with
`--fsdp_shard_text_encoders` (FLUX.1 cases, and benchmarks/qwen_memory.py's) the text encoders are sharded after
setup by the kit's own `refl_ddpo.core.sharding.shard_frozen` and counted as FSDP2 allocates them. Two fixes for the meta
device only: accelerate maps the optimizer's parameters to the sharded ones by `data_ptr`, 0 for every meta tensor,
so `MetaBench.prepare` points them at the sharded parameters in order (what the mapping gives on a GPU), and a
`gc.collect()` after setup drops the unsharded parameters fully_shard replaced (reference cycles the collector frees
on its own on a GPU run). accelerate does not wrap a sharded network's forward in autocast (FSDP2's policy casts the
parameters instead), so the network's norms and softmax run in bf16 there, as on a GPU under `--fsdp`.

Text encoders offloaded (`--offload_text_encoders`, the kit's flag, FLUX.1 cases): the count builds them on the
meta device with the rest, and meta tensors cannot go to the host and back, so `offload_text_encoders` does the
flag's accounting instead of its moves: their weights leave the live bytes after setup and are added back only while
the family encodes (its `text_encoders_on_device`, where the flag moves them to the device), with the encoding's own
activations counted as usual. The peak is then the larger of the encode (every other weight, the optimizer states
and the encoders) and the rest of the run without them.

Not counted: memory a kernel allocates for itself inside one op (cuBLAS / cuBLASLt workspaces, cuDNN convolution
workspaces, flash attention's fp32 gradient accumulator, the padding of a mask for memory-efficient attention),
the caching allocator's fragmentation and reserved-but-free blocks (`max_memory_reserved`), the CUDA context and
kernels (outside what PyTorch reports), and NCCL buffers (sharded: NCCL's own staging memory for the all-gathers
and reduce-scatters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cases import Case, make_cases
from benchmarks.config import BenchConfig
from benchmarks.harness import Bench
from benchmarks.measure import GIB
from benchmarks.meta import DEVICE, PeakMemory, cuda_on_meta, fake_ranks
from benchmarks.models import architectures, model_configs
from benchmarks.report import write_files


class MetaBench(Bench):
    """A Bench whose models live on the meta device, with an accelerator that autocasts as on `cuda` and places
    nothing (build it inside `cuda_on_meta()`)."""

    def __init__(self, cfg: BenchConfig, configs: dict[str, dict], workdir: Path):
        super().__init__(cfg, configs, workdir)
        from accelerate.state import AcceleratorState, PartialState

        self.device = torch.device(DEVICE)
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            if "device" in shared:
                shared["device"] = torch.device("cuda", 0)
        self.accelerator.device_placement = False

    def prepare(self, unet, params, config, gradient_accumulation_steps: int = 1):
        """Bench.prepare; sharded, the optimizer's parameters set to the sharded ones: accelerate maps them by
        `data_ptr`, which is 0 for every meta tensor (all would map to one parameter); on a GPU its mapping gives
        these, in this order."""
        from refl_ddpo.core.sharding import _inner, is_sharded

        unet, optimizer = super().prepare(unet, params, config, gradient_accumulation_steps)
        if is_sharded(self.accelerator):
            (group,) = _inner(optimizer).param_groups  # make_optimizer's one group
            group["params"] = list(params)
        return unet, optimizer


def offload_text_encoders(mem: PeakMemory, family, nbytes: int) -> None:
    """The kit's --offload_text_encoders in the count: the text encoders' `nbytes` off the live bytes, and on them
    only inside `family.text_encoders_on_device` (the block that encodes), which this replaces on the object."""
    mem._add(-nbytes)

    @contextlib.contextmanager
    def on_device():
        mem._add(nbytes)
        try:
            yield
        finally:
            mem._add(-nbytes)

    family.text_encoders_on_device = on_device


def case_memory(cfg: BenchConfig, configs: dict[str, dict], workdir: Path, case: Case) -> dict:
    """Peak device bytes of one case, counted as the timed runs measure it: setup, one warm-up run, reset of the
    peak, one run. Sharded, accelerate's process state is given back afterwards (`release_fsdp_state`): what runs
    next in this process (a test) does not inherit the FSDP setting."""
    try:
        return _case_memory(cfg, configs, workdir, case)
    finally:
        if cfg.fsdp_world_size:
            from refl_ddpo.core.sharding import release_fsdp_state

            release_fsdp_state()


def _case_memory(cfg: BenchConfig, configs: dict[str, dict], workdir: Path, case: Case) -> dict:
    t0 = time.perf_counter()
    ranks = cfg.fsdp_world_size
    with fake_ranks(ranks) if ranks else contextlib.nullcontext(), cuda_on_meta(), PeakMemory() as mem:
        b = MetaBench(cfg, configs, workdir)
        if ranks:  # the kit's --fsdp: accelerate's prepare shards the trained network with fully_shard
            from refl_ddpo.core.sharding import fsdp_plugin, hold_fsdp_state

            hold_fsdp_state(b.accelerator, fsdp_plugin(b.accelerator.mixed_precision))
        run, _ = case.setup(b)
        te = b.text_encoder_bytes  # set by the FLUX.1 cases
        sharded_te = bool(ranks) and cfg.fsdp_shard_text_encoders and te is not None
        if sharded_te:  # the kit's --fsdp_shard_text_encoders (refl_ddpo.core.families.load_family)
            from refl_ddpo.core.sharding import shard_frozen

            for module in b.text_encoder_family.text_encoders():
                shard_frozen(module)
        gc.collect()  # the unsharded parameters that fully_shard replaced sit in reference cycles
        offloaded = cfg.offload_text_encoders and te is not None
        if offloaded:
            offload_text_encoders(mem, b.text_encoder_family, te)
        setup_live, setup_peak = mem.live, mem.peak
        run()
        steady = mem.live
        mem.reset_peak()
        run()
        result = {
            "name": case.name,
            "bench": case.bench,
            "images": case.images,
            "settings": case.settings,
            "setup_bytes": setup_live,
            "setup_peak_bytes": setup_peak,
            "steady_bytes": steady,
            "peak_bytes": mem.peak,
        }
        if offloaded:
            result["text_encoders_offloaded"] = True
        elif sharded_te:
            result["text_encoders_sharded"] = True
        elif te is not None:
            result["text_encoder_bytes"] = te
            result["peak_text_encoders_offloaded_bytes"] = mem.peak - te
        del run, b
    result["seconds"] = time.perf_counter() - t0
    return result


def memory_table(results: dict) -> str:
    meta = results["meta"]
    offload = any("text_encoder_bytes" in r for r in results["cases"])
    extra = (
        " text encoders' weights (GiB) | peak, text encoders off the device (GiB, derived) |"
        if offload
        else ""
    )
    lines = [
        "| case | one run | weights (GiB) | live before the run (GiB) | peak (GiB, computed) |"
        + extra
        + " counted in |",
        "|---|---|---|---|---|---|" + ("---|---|" if offload else ""),
    ]
    for r in results["cases"]:
        cells = ""
        if offload:
            te = r.get("text_encoder_bytes")
            cells = " - | - |" if te is None else f" {te / GIB:.2f} | {(r['peak_bytes'] - te) / GIB:.2f} |"
        lines.append(
            f"| {r['name']} | {r['unit']} | {r['setup_bytes'] / GIB:.2f} | {r['steady_bytes'] / GIB:.2f} | "
            f"{r['peak_bytes'] / GIB:.2f} |{cells} {r['seconds']:.0f} s |"
        )
    notes = [
        (
            f"Computed on the meta device, not measured: {meta['models']}, {meta['dtype']}, {meta['resolution']} px, "
            f"gradient checkpointing {'on' if meta['gradient_checkpointing'] else 'off'}."
        ),
        (
            "Peak: the largest sum of live device blocks (512-byte rounding) during the second run, after a warm-up "
            "run, as torch.cuda.max_memory_allocated after reset_peak_memory_stats (see benchmarks/memory.py for "
            "what is and is not counted). Weights: what is live after setup (frozen and trained weights). Live "
            "before the run: weights and optimizer states."
        ),
    ]
    ranks = meta.get("fsdp_world_size")
    if ranks:
        notes.append(
            f"Per rank, rank 0 of {ranks}: the trained network sharded with the kit's FSDP2 (--fsdp: fully_shard per "
            "block and the root through accelerate's prepare, fp32 master weights, bf16 compute, fp32 gradient "
            "reduction), run in one process over torch's fake process group; its shards, gradients and optimizer "
            "states are 1/N each, and the blocks FSDP2 all-gathers for forward and backward are counted as it "
            "allocates them. Frozen parts (text encoders, VAE, reward) stay whole on every rank"
            + (", the text encoders excepted (below)." if meta.get("fsdp_shard_text_encoders") else ".")
        )
    if meta.get("fsdp_shard_text_encoders"):
        notes.append(
            "--fsdp_shard_text_encoders (the FLUX.1 cases): the text encoders sharded like the network (fully_shard "
            "per block and the root, resharded after forward), 1/N per rank, each block all-gathered while it "
            "encodes; counted (not derived)."
        )
    if meta.get("offload_text_encoders"):
        notes.append(
            "--offload_text_encoders (the FLUX.1 cases): the text encoders' weights count on the device only while "
            "the prompts are encoded, counted (not derived)."
        )
    if offload:
        notes.append(
            "Text encoders off the device (derived, not counted): the peak less the text encoders' weights, what a "
            "trainer that ran them on the host or read precomputed prompt embeddings would hold (this kit keeps them "
            "on the device); they run before the rollout, whose backward holds the peak, so only their weights "
            "count there."
        )
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def run_memory_only(cfg: BenchConfig, argv: list[str]) -> dict:
    """--memory_only: every case's peak device memory, counted on the meta device."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.dtype = cfg.dtype or "bf16"  # the GPU default
    cfg.device = "cpu"  # the host; the models go to the meta device
    results = {
        "meta": {
            "command": " ".join(["python benchmarks/bench.py", *argv]),
            "models": "tiny (refl_ddpo.tiny)" if cfg.tiny else architectures(cfg.cases),
            "dtype": cfg.dtype,
            "resolution": cfg.resolution or (32 if cfg.tiny else 512),
            "gradient_checkpointing": cfg.gradient_checkpointing,
            "fsdp_world_size": cfg.fsdp_world_size,
            "offload_text_encoders": cfg.offload_text_encoders,
            "fsdp_shard_text_encoders": cfg.fsdp_shard_text_encoders,
            "options": dataclasses.asdict(cfg),
        },
        "cases": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        configs = model_configs(cfg.tiny, Path(workdir))
        for case in [c for c in make_cases(cfg) if c.bench != "forward"]:
            r = case_memory(cfg, configs, Path(workdir), case)
            r["unit"] = case.unit
            results["cases"].append(r)
            print(
                f"  {case.name:<24} peak {r['peak_bytes'] / GIB:.2f} GiB  ({r['seconds']:.1f} s)", flush=True
            )
            table = memory_table(results)
            write_files(out, {"memory.json": json.dumps(results, indent=2) + "\n", "memory.md": table})
    print("\n" + table, flush=True)
    return results
