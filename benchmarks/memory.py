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
- CUDA's behaviour where it differs from meta tensors' is reproduced (`CudaOnMeta`): autocast with CUDA's op lists
  (matmuls and convolutions in bf16; norms, upsampling, exp/pow/rsqrt, softmax and sums in fp32) and its cache of
  the casts of fp32 leaf weights, kept until the outermost autocast region ends; `F.scaled_dot_product_attention`
  on the kernel an H100 picks (flash attention for 16-bit inputs with head dim <= 256 and no mask, else
  memory-efficient attention: their outputs and log-sum-exp are all they keep; the meta device would take the
  math path, which holds the whole attention matrix); the multi-tensor (`foreach`) paths of AdamW and gradient
  clipping that CUDA parameters take (AdamW's makes one temporary the size of all trained weights); gradient
  checkpointing's recomputation under the CUDA autocast state of its forward and under `CudaOnMeta` (the
  recomputation runs inside backward, where the torch-function mode stack is empty: without the mode again it
  would take meta's math attention and skip autocast's casts, and save other tensors than the forward did).
- Values are not computed: a device value read on the host (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`) gets
  True, 0.5 or 0. The benchmarked code only checks such values (finite, in range) or logs them, so the branches
  taken are the normal ones.

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
import math
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from benchmarks.cases import Case, make_cases
from benchmarks.config import BenchConfig
from benchmarks.measure import GIB
from benchmarks.models import Bench, architectures, model_configs
from benchmarks.report import write_files

BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
DEVICE = "meta"  # where the device tensors live during the count
aten = torch.ops.aten

# CUDA autocast's op lists (ATen/autocast_mode.h), by the name of the Python function that reaches each op.
LOWER_PRECISION = {
    *("conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    *(
        "convolution",
        "_convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "__matmul__",
        "__rmatmul__",
    ),
    *("einsum", "mm", "mv", "linalg_vecdot", "vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul"),
    *("multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "bilinear"),
}
FP32 = {
    *(
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
    ),
    *("sinh", "tan", "pow", "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "softplus", "layer_norm"),
    *(
        "rms_norm",
        "group_norm",
        "cosine_similarity",
        "normalize",
        "poisson_nll_loss",
        "cosine_embedding_loss",
    ),
    *("nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss"),
    *("margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss"),
    *(
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
    ),
    *("interpolate", "upsample", "upsample_nearest", "upsample_bilinear"),  # every upsampling kernel is fp32
}
FP32_OUTPUT_DTYPE = {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "linalg_vector_norm"}


def round_block(nbytes: int) -> int:
    return math.ceil(nbytes / BLOCK) * BLOCK


def _made_up(dtype: torch.dtype):
    """The value a host read of a device tensor gets: True, 0.5 or 0."""
    return True if dtype == torch.bool else (0.5 if dtype.is_floating_point else 0)


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE


class PeakMemory(TorchDispatchMode):
    """Live bytes of the device (meta) storages that ops create, rounded to 512-byte blocks, and their peak. A
    device value read on the host is made up (`_made_up`); a device tensor copied to the host becomes a real
    tensor filled with that value."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._blocks = (
            WeakIdKeyDictionary()
        )  # storage -> [its block size] (a storage resized in place changes it)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _free(self, block: list[int]) -> None:
        self.live -= block[0]

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # a DTensor (FSDP2's shards): the bytes are its local tensor's
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        if t.device.type != DEVICE:
            return
        storage = t.untyped_storage()
        if storage in self._blocks:
            return
        block = [round_block(storage.nbytes())]
        self._blocks[storage] = block
        self._add(block[0])
        weakref.finalize(storage, self._free, block)

    def _resized(self, storage, nbytes: int) -> None:
        """A device storage resized in place (FSDP2 frees and refills its all-gathered parameters so)."""
        block = self._blocks.get(storage)
        if block is not None:
            self._add(round_block(nbytes) - block[0])
            block[0] = round_block(nbytes)

    def __enter__(self):
        resize = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            out = resize(storage, nbytes)
            self._resized(storage, nbytes)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and _on_device(args[0]):
            return _made_up(args[0].dtype)
        if func is aten._to_copy.default and _on_device(args[0]):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != DEVICE:  # to the host: made-up values
                dtype = kwargs.get("dtype") or args[0].dtype
                return torch.full(args[0].shape, _made_up(dtype), dtype=dtype, device=device)
        if func is aten.copy_.default and not _on_device(args[0]) and _on_device(args[1]):
            return args[0].fill_(_made_up(args[0].dtype))
        out = func(*args, **kwargs)
        tree_map_only(torch.Tensor, self._track, out)
        return out


def _sdpa_kernel(q: torch.Tensor, attn_mask) -> str:
    """The fused kernel that PyTorch picks on an H100 (sm90) for these inputs."""
    if q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and q.shape[-1] <= 256:
        return "flash"
    return "efficient"


def _is_cuda(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class CudaOnMeta(TorchFunctionMode):
    """What CUDA does differently from the meta device, at the level of torch functions: autocast (its op lists
    and its cache of cast weights) while `torch.autocast("cuda")` is on, and scaled-dot-product attention on the
    H100's fused kernels. Tensors made or moved on `cuda` (the accelerator's device, as `MetaBench` sets it) go to
    the meta device."""

    def __init__(self):
        super().__init__()
        self.cache = WeakIdKeyDictionary()  # fp32 leaf weight -> its cast, until the outermost autocast exits

    def _cast(self, x, dtype: torch.dtype):
        if not (_on_device(x) and x.is_floating_point() and x.dtype not in (dtype, torch.float64)):
            return x
        cacheable = dtype != torch.float32 and x.dtype == torch.float32 and x.requires_grad and x.is_leaf
        if cacheable and x in self.cache:
            return self.cache[x]
        y = x.to(dtype)
        if cacheable:
            self.cache[x] = y
        return y

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):  # a tensor made on the accelerator's device (`cuda`) goes to meta
            kwargs = {**kwargs, "device": DEVICE}
        if func is torch.Tensor.to and any(_is_cuda(a) for a in args[1:]):
            args = tuple(DEVICE if _is_cuda(a) else a for a in args)
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        name = getattr(func, "__name__", None)
        if name not in LOWER_PRECISION and name not in FP32 and name not in FP32_OUTPUT_DTYPE:
            return func(*args, **kwargs)
        if not torch.is_autocast_enabled("cuda") or not any(
            _on_device(x) for x in tree_flatten((args, kwargs))[0]
        ):
            return func(*args, **kwargs)
        if name in FP32_OUTPUT_DTYPE:
            if kwargs.get("dtype") is None and args and _on_device(args[0]) and args[0].is_floating_point():
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        dtype = torch.get_autocast_dtype("cuda") if name in LOWER_PRECISION else torch.float32

        def cast(x):
            return self._cast(x, dtype)

        args, kwargs = tree_map_only(torch.Tensor, cast, (args, kwargs))
        with torch.autocast("cuda", enabled=False):
            return func(*args, **kwargs)

    def _attention(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args, strict=False)) | kwargs
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        if not _on_device(q) or q.dim() != 4 or a.get("enable_gqa"):
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cuda"):  # SDPA is on autocast's lower-precision list
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (self._cast(x, dtype) for x in (q, k, v))
            mask = self._cast(mask, dtype) if mask is not None else None
        p, causal, scale = a.get("dropout_p", 0.0), a.get("is_causal", False), a.get("scale")
        if _sdpa_kernel(q, mask) == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
        if mask is not None:
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
            mask = mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, grad, p, causal, scale=scale)[0]


@contextlib.contextmanager
def cuda_on_meta():
    """Device tensors on meta behaving as on an H100: CUDA autocast switched on without a GPU (its state only: the
    casts are `CudaOnMeta`'s), accelerate's state on `cuda` (its autocast is CUDA's), the foreach optimizer paths
    for meta tensors as for CUDA ones."""
    from accelerate.state import AcceleratorState, PartialState
    from torch.optim import optimizer as optim_module
    from torch.utils import _foreach_utils
    from torch.utils import checkpoint as checkpoint_module

    mode = CudaOnMeta()
    amp = torch.cuda.amp.common
    saved = (
        amp.amp_definitely_not_available,
        torch.cuda.is_bf16_supported,
        torch.clear_autocast_cache,
        optim_module._get_foreach_kernels_supported_devices,
        _foreach_utils._get_foreach_kernels_supported_devices,
        checkpoint_module._infer_device_type,
        checkpoint_module._CheckpointFrame,
        checkpoint_module.CheckpointFunction,
    )
    states = (PartialState._shared_state, AcceleratorState._shared_state)
    devices = [s.get("device") for s in states]
    clear = torch.clear_autocast_cache

    def clear_autocast_cache():
        clear()
        mode.cache.clear()

    def foreach_devices():
        return [*saved[3](), DEVICE]

    def infer_device_type(*args):  # gradient checkpointing recomputes under the autocast state of this type
        device_type = saved[5](*args)
        return "cuda" if device_type == DEVICE else device_type

    @contextlib.contextmanager
    def mode_on():
        # Gradient checkpointing recomputes a block inside backward, where the torch-function mode stack is empty:
        # without the mode there, the recomputation would take meta's math attention and no autocast casts, save
        # other tensors than the forward did, and torch.utils.checkpoint's check would fail.
        with contextlib.nullcontext() if mode in _get_current_function_mode_stack() else mode:
            yield

    class CheckpointFrame(saved[6]):  # non-reentrant checkpointing: the recomputation runs under the mode
        def __init__(self, recompute_fn, *args, **kwargs):
            def recompute(*inputs):
                with mode_on():
                    recompute_fn(*inputs)

            super().__init__(recompute, *args, **kwargs)

    class CheckpointFunction(saved[7]):  # reentrant checkpointing: its backward recomputes, under the mode
        @staticmethod
        def backward(ctx, *grads):
            with mode_on():
                return saved[7].backward(ctx, *grads)

    amp.amp_definitely_not_available = lambda: False
    checkpoint_module._infer_device_type = infer_device_type
    checkpoint_module._CheckpointFrame = CheckpointFrame
    checkpoint_module.CheckpointFunction = CheckpointFunction
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    torch.clear_autocast_cache = clear_autocast_cache
    optim_module._get_foreach_kernels_supported_devices = foreach_devices
    _foreach_utils._get_foreach_kernels_supported_devices = foreach_devices
    try:
        with mode:
            yield
    finally:
        (
            amp.amp_definitely_not_available,
            torch.cuda.is_bf16_supported,
            torch.clear_autocast_cache,
            optim_module._get_foreach_kernels_supported_devices,
            _foreach_utils._get_foreach_kernels_supported_devices,
            checkpoint_module._infer_device_type,
            checkpoint_module._CheckpointFrame,
            checkpoint_module.CheckpointFunction,
        ) = saved
        for s, d in zip(states, devices, strict=False):  # the accelerator was made with cpu=True
            if "device" in s:
                s["device"] = d if d is not None else torch.device("cpu")


@contextlib.contextmanager
def fake_ranks(world_size: int):
    """torch.distributed over `world_size` ranks in this one process, as rank 0 of torch's fake process group
    (collectives complete at once and write nothing: the count needs only their output buffers' shapes), with FSDP2
    placing its shards, all-gather and reduce-scatter buffers on the meta device: FSDP2 takes its device from the
    mesh (a CPU mesh here, there being no GPU), and refuses to run parameters left on meta (the count has no
    values to materialise)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_init,
        _fsdp_param_group,
        _fsdp_state,
        _fully_shard,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    elif dist.get_world_size() != world_size:
        raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is running, not {world_size}")
    handles = [_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state]
    saved = (
        _fully_shard._get_device_from_mesh,
        [m._get_device_handle for m in handles],
        _fsdp_param_group.FSDPParamGroup._validate_no_meta_params,
    )

    def device_handle(device_type: str):  # streams and events: torch.cpu's no-ops for the meta device
        return torch.cpu if device_type == DEVICE else saved[1][0](device_type)

    _fully_shard._get_device_from_mesh = lambda mesh: torch.device(DEVICE)
    for m in handles:
        m._get_device_handle = device_handle
    _fsdp_param_group.FSDPParamGroup._validate_no_meta_params = lambda self: None
    try:
        yield
    finally:
        _fully_shard._get_device_from_mesh = saved[0]
        for m, h in zip(handles, saved[1], strict=True):
            m._get_device_handle = h
        _fsdp_param_group.FSDPParamGroup._validate_no_meta_params = saved[2]
        if made:
            dist.destroy_process_group()


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
