"""The meta device as a CUDA GPU, for counting without one: `PeakMemory` (the live device bytes and their peak, below
autograd), `CudaOnMeta` / `cuda_on_meta` (what CUDA does differently from meta tensors) and `fake_ranks` (FSDP2 over
N ranks in one process). Used by benchmarks/memory.py's `--memory_only` count.

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
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

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
