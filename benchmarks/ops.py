"""Ops per network call without a GPU (`--ops_only`): the kernels one call of the denoising network would launch,
counted on the meta device with CUDA's autocast emulated (benchmarks/meta.py), for the kit's contexts, set up and
run by the trainers' own functions (benchmarks/cases.py), against the floor: the stock network in the dtype without
autocast (the inference pipeline's path).

- `OpCount` sits below autograd (a `TorchDispatchMode`, on `PeakMemory`, whose made-up host reads it keeps) and
  counts, while a network call runs, every op that is no view (`OpOverload.is_view`) and launches a kernel (the
  allocations and aliases in `NO_KERNEL` do not), and of them the casts: `_to_copy` / `copy_` between floating
  dtypes. A call starts and ends with the network module's forward hooks; a call with grad also takes the ops of
  its backward, from when the gradient reaches the call's output to the end of `torch.autograd.backward`.
- Each op is put to its site: the innermost Python frame outside torch (file:line, e.g. peft's LoRA line); in
  backward, the autograd node that runs it (e.g. `MmBackward0`).
- Contexts: `refl_nograd` and `refl_grad` (ReFL's step: the calls before k, and call k with its backward),
  `ddpo_rollout` (the policy-gradient trainers' `sample_epoch`), `nft_rollout` (the forward-process trainers'
  `sample_clean`), `inference` (`generate_batch`); `floor` is the stock network's own call, `grad_floor` the stock
  network's forward + backward (to its input) under the trainers' autocast: what the same graph costs without LoRA.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._pytree import tree_flatten

from benchmarks.config import BenchConfig
from benchmarks.meta import PeakMemory, cuda_on_meta
from benchmarks.models import model_configs
from benchmarks.report import write_files

aten = torch.ops.aten
NO_KERNEL = {  # no view by schema, yet no kernel: allocations and aliases
    aten._unsafe_view.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.lift_fresh.default,
    aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset,
}
CAST_OPS = {aten._to_copy.default, aten.copy_.default}
SKIP_FILES = (str(Path(torch.__file__).parent), __file__, str(Path(__file__).with_name("meta.py")))
FAMILIES = ("sd15", "sd35m", "sdxl", "flux1")
CONTEXTS = ("ddpo_rollout", "refl_nograd", "refl_grad", "nft_rollout", "inference")
TOP_SITES = 12  # op sites kept per record


def _site() -> str:
    """The innermost Python frame outside torch and the counter: 'file:line'; in backward the autograd node."""
    node = torch._C._current_autograd_node()
    if node is not None:
        return f"backward {node.name()}"
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(SKIP_FILES):
        frame = frame.f_back
    if frame is None:
        return "?"
    parts = Path(frame.f_code.co_filename).parts
    short = "/".join(parts[-3:])
    return f"{short}:{frame.f_lineno}"


def _is_cast(func, args, kwargs) -> bool:
    if func is aten._to_copy.default:
        dtype = kwargs.get("dtype")
        return dtype is not None and dtype != args[0].dtype and args[0].is_floating_point()
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.dtype != src.dtype and dst.is_floating_point() and src.is_floating_point()
    return False


class CallRecord:
    """One network call's ops: the count per (op, site), and the casts."""

    def __init__(self, grad: bool):
        self.grad = grad
        self.ops: Counter = Counter()  # (op name, site) -> count
        self.casts = 0

    @property
    def kernel_ops(self) -> int:
        return sum(self.ops.values())

    def top_sites(self, n: int = TOP_SITES) -> list[dict]:
        return [{"op": op, "site": site, "count": c} for (op, site), c in self.ops.most_common(n)]


class OpCount(PeakMemory):
    """The kernels each call of the watched network dispatches (and, for a call with grad, its backward), per call
    in `calls`."""

    def __init__(self):
        super().__init__()
        self.calls: list[CallRecord] = []
        self.current: CallRecord | None = None
        self._handles = []
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with (
                self
            ):  # inference mode dispatches composite ops (`to`, `linear` ...) whole: their parts count
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        record = self.current
        if record is None or func in NO_KERNEL or func.is_view:
            return out
        cast = func in CAST_OPS and _is_cast(func, args, kwargs)
        record.ops[(str(func.overloadpacket.__name__), _site())] += 1
        record.casts += cast
        return out

    def _pre(self, module, args, kwargs):
        self.current = CallRecord(torch.is_grad_enabled())
        self.calls.append(self.current)

    def _post(self, module, args, kwargs, out):
        record, self.current = self.current, None
        if not record.grad:
            return
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]

        def backward_starts(grad):
            self.current = record

        for t in tensors:
            t.register_hook(backward_starts)

    def watch(self, network: torch.nn.Module) -> None:
        """Count the calls of `network` from now on."""
        self._handles = [
            network.register_forward_pre_hook(self._pre, with_kwargs=True),
            network.register_forward_hook(self._post, with_kwargs=True),
        ]

    def unwatch(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):  # entered again (nested) to decompose an op: the outermost entry patches backward
        self._depth += 1
        if self._depth == 1:
            backward = self._backward = torch.autograd.backward

            def counted_backward(*args, **kwargs):
                try:
                    return backward(*args, **kwargs)
                finally:
                    self.current = None

            torch.autograd.backward = counted_backward
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            torch.autograd.backward = self._backward
        return super().__exit__(*exc)


def call_summary(calls: list[CallRecord]) -> CallRecord:
    """The call a context is summed up by: its last one (every call of a context dispatches the same ops)."""
    if not calls:
        raise RuntimeError("the context made no network call")
    return calls[-1]


# ---- the families and contexts ----

NETWORK = {"sd15": "unet", "sd35m": "sd3_transformer", "sdxl": "sdxl_unet", "flux1": "flux_transformer"}


def _family_class(family: str):
    from refl_ddpo.core.families.flux import Flux
    from refl_ddpo.core.families.sd import StableDiffusion
    from refl_ddpo.core.families.sd3 import StableDiffusion3
    from refl_ddpo.core.families.sdxl import StableDiffusionXL

    return {"sd15": StableDiffusion, "sd35m": StableDiffusion3, "sdxl": StableDiffusionXL, "flux1": Flux}[
        family
    ]


def _wrap(b, family: str, network):
    """The family object around `network` with fresh frozen parts, as `load_family` gives it (SD3.5 without T5)."""
    if family == "sd15":
        return b.family(network)
    if family == "sd35m":
        return b.sd3_family(network, False)
    return b.sdxl_family(network) if family == "sdxl" else b.flux_family(network)


def trained_family(b, family: str, config=None):
    """(family, trained params): the network with LoRA on the family's default targets, as the trainers set it up."""
    targets = list(_family_class(family).lora_target_modules)
    base, params = b.trainable_unet("lora", config, name=NETWORK[family], targets=targets)
    return _wrap(b, family, base), params


def stock_family(b, family: str):
    """The family around the stock network: frozen, in the bench's dtype, no LoRA."""
    return _wrap(b, family, b.build(NETWORK[family]))


def _refl(b, family: str):
    from benchmarks.family_memory import refl_run

    fam, params = trained_family(b, family)
    prompts, metadata = b.prompts(1)
    run, _ = refl_run(b, fam, params, prompts, metadata)
    return fam.network, run


def _policy(b, family: str):
    from benchmarks.cases import policy_setup

    config = b.ddpo_config()
    fam, params = trained_family(b, family, config)
    return policy_setup(b, config, fam, fam.policy_scheduler(), params)


def _ddpo_rollout(b, family: str):
    from benchmarks.cases import sample_run

    setup = _policy(b, family)
    return setup[1].network, sample_run(b, setup)[0]


def _nft_rollout(b, family: str):
    """The forward-process trainers' sampling (`sample_clean`), CFG-free as NFT's default."""
    from benchmarks.cases import _pixel_mean_reward
    from refl_ddpo.trainers.epochs import EpochPlan
    from refl_ddpo.trainers.rollouts import CleanSampler, sample_clean

    config, fam, scheduler, network, *_ = _policy(b, family)
    cfg = SimpleNamespace(
        sample_batch_size=1,
        sample_num_batches_per_epoch=1,
        resolution=b.resolution,
        sample_num_steps=config.sample_num_steps,
        sample_guidance_scale=1.0,
    )
    run = SimpleNamespace(
        cfg=cfg, family=fam, accelerator=b.accelerator, network=network, reward=_pixel_mean_reward()
    )
    return fam.network, lambda: sample_clean(
        run, CleanSampler(scheduler), EpochPlan(b.prompt_fn), b.generator
    )


def _inference(b, family: str):
    from refl_ddpo.core.generate import generate_batch

    fam = stock_family(b, family)
    fam.pipe.scheduler = fam.policy_scheduler()  # DDIM on SD 1.x (--scheduler ddim), the flow Euler step
    prompts = [b.prompt_fn()[0]]

    def run():
        steps, scale = b.cfg.ddpo_steps, b.cfg.inference_guidance_scale
        return generate_batch(fam, prompts, [0], b.resolution, steps, scale, eta=0.0)

    return fam.network, run


def _stock_call(b, family: str, grad: bool):
    """The stock network's own call at x_T, the first timestep, one prompt, no CFG: without grad and autocast (the
    floor), or with grad to its input under the trainers' autocast, forward + backward (the gradient floor)."""
    fam = stock_family(b, family)
    scheduler = fam.policy_scheduler()
    cond, _ = fam.encode_prompts(b.prompts(1)[0], with_negative=False)
    noise = fam.initial_noise(1, b.resolution, b.generator, cond["prompt_embeds"].dtype)

    def run():
        t = fam.set_timesteps(scheduler, b.cfg.ddpo_steps, noise)[0].to(noise.device)
        if not grad:
            with torch.no_grad():
                return fam.predict(noise, t, scheduler, cond, None, 1.0)
        x = noise.detach().requires_grad_(True)
        with b.accelerator.autocast():
            out = fam.predict(x, t, scheduler, cond, None, 1.0)
        out.float().sum().backward()
        return x.grad

    return fam.network, run


SETUPS = {
    "floor": lambda b, f: _stock_call(b, f, False),
    "grad_floor": lambda b, f: _stock_call(b, f, True),
    "ddpo_rollout": _ddpo_rollout,
    "refl": _refl,
    "nft_rollout": _nft_rollout,
    "inference": _inference,
}


def counted_calls(
    cfg: BenchConfig, configs: dict, workdir: Path, family: str, setup: str
) -> tuple[list, int]:
    """Every network call of one run of `setup` (a key of SETUPS) on `family`, after a warm-up run, and the
    network's LoRA layers."""
    from benchmarks.memory import MetaBench

    with cuda_on_meta(), OpCount() as count:
        b = MetaBench(cfg, configs, workdir)
        network, run = SETUPS[setup](b, family)
        run()  # warm-up: the optimizer's states, the schedulers' tables
        count.watch(network)
        run()
        count.unwatch()
        layers = lora_layers(network)
    return count.calls, layers


def lora_layers(network: torch.nn.Module) -> int:
    return sum(1 for m in network.modules() if hasattr(m, "lora_A") and len(m.lora_A))


def _record(family: str, context: str, call: CallRecord, floor: CallRecord, **extra) -> dict:
    return {
        "family": family,
        "context": context,
        "kernel_ops": call.kernel_ops,
        "casts": call.casts,
        "floor_ops": floor.kernel_ops,
        "ratio_to_floor": round(call.kernel_ops / floor.kernel_ops, 3),
        **extra,
        "top_sites": call.top_sites(),
    }


def family_records(cfg: BenchConfig, configs: dict, workdir: Path, family: str, contexts: list[str]) -> list:
    """`family`'s floor, gradient floor and each of `contexts`' network call: results.json's records."""
    (floor,), _ = counted_calls(cfg, configs, workdir, family, "floor")
    records = [_record(family, "floor", floor, floor)]
    if "refl_grad" in contexts:
        (grad_floor,), _ = counted_calls(cfg, configs, workdir, family, "grad_floor")
        records.append(_record(family, "grad_floor", grad_floor, floor))
    refl = None
    for context in contexts:
        if context.startswith("refl"):
            refl = refl or counted_calls(cfg, configs, workdir, family, "refl")
            calls, layers = refl
            call = [c for c in calls if c.grad == (context == "refl_grad")][-1]
        else:
            calls, layers = counted_calls(cfg, configs, workdir, family, context)
            call = call_summary(calls)
        extra = {"lora_layers": layers}
        if context == "refl_grad":
            extra["grad_floor_ops"] = grad_floor.kernel_ops
            extra["extra_ops_per_lora_layer"] = round((call.kernel_ops - grad_floor.kernel_ops) / layers, 2)
        records.append(_record(family, context, call, floor, **extra))
    return records


def ops_table(records: list[dict]) -> str:
    lines = [
        "| family | context | ops / call | casts / call | floor ops | x floor | LoRA layers | top op site |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        top = r["top_sites"][0] if r["top_sites"] else {"op": "-", "site": "-", "count": 0}
        lines.append(
            f"| {r['family']} | {r['context']} | {r['kernel_ops']} | {r['casts']} | {r['floor_ops']} | "
            f"{r['ratio_to_floor']:.2f} | {r.get('lora_layers', '-')} | {top['count']} x {top['op']} "
            f"{top['site']} |"
        )
    note = (
        "Counted on the meta device with CUDA's autocast emulated (benchmarks/ops.py): the non-view ops one "
        "network call dispatches (a kernel launch each on a GPU), and of them the casts; refl_grad's with its "
        "backward. floor: the stock network in the dtype without autocast; grad_floor: the stock network's "
        "forward + backward to its input under the trainers' autocast."
    )
    return "\n".join(lines) + f"\n\n- {note}\n"


def ops_config(cfg: BenchConfig) -> BenchConfig:
    """The count's settings: bf16 as on a GPU, the host for what is not the device, the shortest runs that make
    every context's calls (per-call counts do not depend on the step counts or the batch)."""
    cfg.dtype = cfg.dtype or "bf16"
    cfg.device = "cpu"
    cfg.refl_steps, cfg.refl_k, cfg.ddpo_steps = 3, 2, 2
    cfg.ddpo_sample_batch_size = cfg.ddpo_train_batch_size = 1
    return cfg


def run_ops_only(cfg: BenchConfig, argv: list[str]) -> dict:
    """--ops_only: ops and casts per network call of each family's contexts, counted on meta; results.json and
    results.md in --out."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ops_config(cfg)
    results = {
        "meta": {
            "command": " ".join(["python benchmarks/bench.py", *argv]),
            "dtype": cfg.dtype,
            "resolution": cfg.resolution or 512,
            "lora_rank": cfg.lora_rank,
        },
        "records": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        configs = model_configs(cfg.tiny, Path(workdir))
        for family in cfg.ops_families:
            t0 = time.perf_counter()
            results["records"] += family_records(cfg, configs, Path(workdir), family, cfg.ops_contexts)
            print(f"  {family}: counted in {time.perf_counter() - t0:.0f} s", flush=True)
            table = ops_table(results["records"])
            write_files(out, {"results.json": json.dumps(results, indent=2) + "\n", "results.md": table})
    print("\n" + table, flush=True)
    return results
