"""FSDP2 through accelerate (--fsdp): the trained network sharded per block over the processes.

accelerate's `FullyShardedDataParallelPlugin(fsdp_version=2)` wraps every block the network names in its
`_no_split_modules` (SD3's JointTransformerBlock, FLUX.1's two block kinds, the UNet's attention and resnet blocks)
and the root in torch's `fully_shard`. The trained weights are the fp32 master copy; with --mixed_precision bf16|fp16
the blocks compute in that dtype and reduce gradients in fp32 (`MixedPrecisionPolicy`). The frozen parts (text
encoders, VAE, rewards) stay whole on every process; with --fsdp_shard_text_encoders the text encoders are sharded
too (`shard_frozen`: fully_shard per block and the root, for inference under no_grad).

Every process loads the network into host memory and keeps it there through LoRA and the fp32 upcast
(`training.load_trainable_family`); `prepare`'s fully_shard moves it to the device block by block and keeps only the
process' shard there, so no GPU holds the whole network (accelerate's `cpu_ram_efficient_loading`, rank 0 loading
and broadcasting, is not used: each process reads the weights itself).

accelerate makes the FSDP state only on GPUs; on the CPU (the tests, over gloo) `hold_fsdp_state` sets the same
state after the fact, so that the loops, `prepare`, the gradient clipping and the accumulation run accelerate's FSDP2
code either way.

The final weights, and checkpoints by default (--fsdp_checkpoint gathered), are gathered
(`torch.distributed.checkpoint.state_dict` with full_state_dict): every process takes part, the main process writes
the LoRA (diffusers format) or the full network (diffusers folder) and the optimizer state as safetensors, and every
process loads them back into its shards, so a resume is bit-exact and the files are those of a run without FSDP (plus
the optimizer's). With --fsdp_checkpoint sharded, checkpoint-N holds instead each process' shards of the trained
weights and their optimizer state, written and read by torch.distributed.checkpoint (DCP) in its own format under
checkpoint-N/fsdp_shards/ (`save_shards`, `load_shards`): nothing is gathered.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer_fsdp.safetensors"  # the gathered optimizer state (tensors)
OPTIMIZER_GROUPS = "optimizer_fsdp.json"  # its param_groups and the names of the parameters in order
# --fsdp_checkpoint sharded: DCP's files in checkpoint-N (.metadata, one __<rank>_0.distcp per process)
SHARDS_DIR = "fsdp_shards"


def fsdp_plugin(mixed_precision: str, cpu_offload: bool = False):
    """accelerate's FSDP2 plugin: per-block sharding (the network's `_no_split_modules`), resharded after forward;
    `mixed_precision` ("no", "fp16", "bf16"): compute in it, gradients reduced in fp32; `cpu_offload`: the shards
    and their optimizer state live on the CPU between uses."""
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else None
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        cpu_offload=cpu_offload,
        mixed_precision_policy=policy,
        state_dict_type="FULL_STATE_DICT",
        cpu_ram_efficient_loading=False,  # every process has loaded the model (on the host): nothing to broadcast
        activation_checkpointing=False,  # --gradient_checkpointing: the network's own, which composes with FSDP2
    )


def shard_frozen(module: torch.nn.Module) -> torch.nn.Module:
    """Shard a frozen module (a text encoder) over the processes with torch's FSDP2 `fully_shard`: each block its
    class names in `_no_split_modules` (transformers' own list: CLIPEncoderLayer, T5Block, Qwen2_5_VLDecoderLayer
    ...), innermost first, then the root, each resharded after its forward. Between forwards a process holds 1/N of
    the weights on the device; a forward all-gathers one block at a time (a collective: every process must run it).
    The module must be on the host or the device; fully_shard moves each shard to the device of the default mesh
    (the one accelerate's prepare uses for the network)."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(module, "_no_split_modules", None) or ())
    for sub in reversed(list(module.modules())):  # descendants before their ancestors
        if sub is not module and type(sub).__name__ in blocks:
            fully_shard(sub, reshard_after_forward=True)
    # explicit: the root reshards too (left to default, the root keeps its weights gathered for the backward)
    sharded = fully_shard(module, reshard_after_forward=True)
    _keep_output_capture(sharded)
    return sharded


def _keep_output_capture(module: torch.nn.Module) -> None:
    """transformers 5 records `output_hidden_states` only for a model whose class it registered when the model was
    built (keyed by the class), and fully_shard gives each sharded module a new class (FSDPQwen3Model ...): without
    this a sharded Qwen3Model (Z-Image's text encoder) returns no hidden states. Registers each such model's
    `_can_record_outputs` under its new class."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # a transformers without the registry records outputs otherwise
        return
    for sub in module.modules():
        if hasattr(sub, "_can_record_outputs") and str(type(sub)) not in _CAN_RECORD_REGISTRY:
            _CAN_RECORD_REGISTRY[sub] = sub._can_record_outputs


def hold_fsdp_state(accelerator, plugin) -> None:
    """Make accelerate's FSDP state hold for the whole run, on the CPU too.

    accelerate sets `distributed_type = FSDP` in its AcceleratorState, only for GPU processes, and every later
    `AcceleratorState()` (each AcceleratedOptimizer makes one) copies the process state's `distributed_type` back over
    it. Set FSDP in both, so that `prepare` shards with fully_shard and save_state, clip_grad_norm_ and the
    accumulation take accelerate's FSDP2 paths on GPUs and on the CPU (gloo) alike."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    _before.setdefault("distributed_type", PartialState._shared_state["distributed_type"])
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


_before: dict = {}  # the process state's distributed_type before hold_fsdp_state


def release_fsdp_state() -> None:
    """Undo hold_fsdp_state's change to the process state (a later run in this process may not shard)."""
    from accelerate.state import PartialState

    if "distributed_type" in _before and PartialState._shared_state:
        PartialState._shared_state["distributed_type"] = _before.pop("distributed_type")


def is_sharded(accelerator) -> bool:
    """Whether the trained network is sharded with FSDP (then every process must run each of its forwards)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def unsharded_class(module) -> type:
    """The module's own class: fully_shard swaps it for a subclass (FSDPSD3Transformer2DModel of FSDPModule and
    SD3Transformer2DModel) that no diffusers loader knows."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def trainable_params(network) -> list[torch.nn.Parameter]:
    """The trained tensors of `network` in named_parameters order (after sharding: the DTensor parameters)."""
    return [p for p in network.parameters() if p.requires_grad]


def local(t: torch.Tensor) -> torch.Tensor:
    """The process' own shard of a DTensor, or `t`."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every process calls it), or `t`."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def any_process(flag: bool, device: torch.device) -> bool:
    """True on every process if `flag` is True on any (a collective when torch.distributed runs), reduced on
    `device` (where the process' shards live, which its process group reaches)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ---- gathered state: the final weights and checkpoint-N ----


def gathered_state(network, trainable_only: bool = True) -> dict[str, torch.Tensor]:
    """The network's whole tensors on the CPU, on the main process (empty elsewhere); every process must call it.
    `trainable_only`: only the tensors that train (the LoRA), else every one (a full fine-tune's network)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(network, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainable_only:
        names = {n for n, p in network.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in names}
    return state


def load_full_state(network, state: dict[str, torch.Tensor]) -> None:
    """Put whole tensors `state` (named as the network's state_dict) into the network's shards, strictly for the
    names given (the others stay)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    known = set(network.state_dict().keys())
    unknown = sorted(set(state) - known)
    if unknown:
        raise KeyError(f"{len(unknown)} tensor(s) the network does not have, e.g. {unknown[0]}")
    missing = sorted({n for n, p in network.named_parameters() if p.requires_grad} - set(state))
    if missing:
        raise KeyError(f"{len(missing)} trained tensor(s) missing, e.g. {missing[0]}")
    set_model_state_dict(network, state, options=StateDictOptions(full_state_dict=True, strict=False))


_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.(weight|bias)$")


def peft_keys_to_model(state: dict[str, torch.Tensor], adapter: str = "default") -> dict[str, torch.Tensor]:
    """peft's saved LoRA names (`x.lora_A.weight`) as the module's parameter names (`x.lora_A.default.weight`)."""
    return {_ADAPTER_KEY.sub(rf".\1.{adapter}.\2", k): v for k, v in state.items()}


def save_optimizer(network, optimizer, folder: Path, main: bool) -> None:
    """The optimizer's gathered state as safetensors (tensors) + JSON (param_groups, scalars); every process calls
    it, the main one writes."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        network, _inner(optimizer), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not main:
        return
    tensors, scalars = {}, {}
    for name, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{name}/{key}"] = value
    save_file(tensors, str(folder / OPTIMIZER_FILE))
    (folder / OPTIMIZER_GROUPS).write_text(
        json.dumps({"param_groups": state["param_groups"], "scalars": scalars}, indent=1) + "\n"
    )


def load_optimizer(network, optimizer, folder: Path) -> None:
    """Restore save_optimizer's files into the (sharded) optimizer; every process reads them."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    tensors = load_file(str(folder / OPTIMIZER_FILE))
    saved = json.loads((folder / OPTIMIZER_GROUPS).read_text())
    state: dict[str, dict] = {}
    for key, value in [*tensors.items(), *saved["scalars"].items()]:
        name, field = key.rsplit("/", 1)
        state.setdefault(name, {})[field] = value
    set_optimizer_state_dict(
        network,
        _inner(optimizer),
        {"state": state, "param_groups": saved["param_groups"]},
        options=StateDictOptions(full_state_dict=True),
    )


# ---- sharded state: checkpoint-N with --fsdp_checkpoint sharded ----


def _sharded_state(network, optimizer) -> dict:
    """{"model": the trained tensors, "optimizer": their optimizer state}, both as this process' shards (DTensors,
    not gathered); the frozen base of a LoRA is left out (it comes from the base model)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(network, _inner(optimizer))
    trained = {n for n, p in network.named_parameters() if p.requires_grad}
    return {"model": {k: v for k, v in model.items() if k in trained}, "optimizer": optim}


def save_shards(network, optimizer, folder: Path) -> None:
    """Every process writes its shards of the trained weights and their optimizer state to folder/SHARDS_DIR with
    torch.distributed.checkpoint (a collective: every process calls it)."""
    import torch.distributed.checkpoint as dcp

    (folder / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    dcp.save(_sharded_state(network, optimizer), checkpoint_id=folder / SHARDS_DIR)


def load_shards(network, optimizer, folder: Path) -> None:
    """save_shards' files back into every process' shards and optimizer state (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _sharded_state(network, optimizer)
    dcp.load(state, checkpoint_id=folder / SHARDS_DIR)
    set_state_dict(
        network,
        _inner(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=False),  # the trained tensors only
    )


def _inner(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer
