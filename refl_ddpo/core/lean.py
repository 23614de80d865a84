"""No-grad network calls at the stock pipeline's cost: with 16-bit base weights and a LoRA adapter, the calls that
keep no graph (sampling, ReFL's steps before k, validation) run the network as the stock pipeline runs it: each
LoRA layer's product folded into a 16-bit copy of its base weight (W + scale B A, computed in float32, rounded
once), the adapters switched off, no autocast (accelerate's per-forward region bypassed, its float32 output kept).
So a call launches the stock network's kernels and no more (benchmarks/ops.py counts them), at the cost of a
16-bit copy of the LoRA's target weights while folded.

Nothing changes in float32 (the base weights float32: nothing is folded, the calls are the trained ones), nor for a
network sharded (FSDP) or run in DeepSpeed's engine (their calls go through the wrapper as before).
"""

from __future__ import annotations

import contextlib

import torch

HALF = (torch.float16, torch.bfloat16)


def _lora_layers(module: torch.nn.Module) -> list:
    """peft's LoRA linear layers with their adapter on, unmerged."""
    from peft.tuners.lora import Linear

    return [
        m
        for m in module.modules()
        if isinstance(m, Linear) and not m.disable_adapters and not m.merged and m.active_adapters
    ]


def foldable(family, network) -> torch.nn.Module | None:
    """The module whose no-grad calls `Folded` makes lean: the family's network when `network` (the one the loop
    calls) is it or its DDP wrapper, it is not sharded (FSDP2), its base weights are 16-bit and it carries an active
    LoRA; else None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    module = family.network
    wrapped = isinstance(network, DistributedDataParallel) and network.module is module
    if (network is not None and network is not module and not wrapped) or isinstance(module, FSDPModule):
        return None
    layers = _lora_layers(module)
    if not layers or layers[0].base_layer.weight.dtype not in HALF:
        return None
    return module


class Folded:
    """The LoRA of `module` folded into its base weights while on (`on`), the trained layers back (`off`)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.saved: list | None = None  # (layer, its own weight tensor) while folded

    def step(self, with_grad: bool, network):
        """(the network to call at a step, the context to call it in): `network` as it is for a step with grad
        (folded no more), else the folded module without autocast."""
        if with_grad:
            self.off()
            return network, contextlib.nullcontext()
        return self.on(), no_autocast()

    def on(self) -> torch.nn.Module:
        """Fold (once) and return the module to call; its output as the prepared network gives it (float32)."""
        if self.saved is None:
            self.saved = []
            # no inference tensors in the module, under generate's inference mode too
            with torch.inference_mode(False), torch.no_grad():
                for layer in _lora_layers(self.module):
                    weight = layer.base_layer.weight
                    delta = sum(layer.get_delta_weight(a).float() for a in layer.active_adapters)
                    self.saved.append((layer, weight.data))
                    weight.data = (weight.data.float() + delta).to(weight.dtype)
                    layer._disable_adapters = True
            wrapped = self.module.__dict__.get("forward")
            self.saved.append((None, wrapped))
            original = getattr(self.module, "_original_forward", None)
            forward = original if wrapped is not None and original is not None else self.module.forward
            self.module.forward = _stock_call(forward, self.saved[0][1].dtype, original is not None)
        return self.module

    def off(self) -> None:
        """The trained layers and accelerate's forward back (bit for bit: the base weights were never written)."""
        if self.saved is None:
            return
        for layer, tensor in self.saved:
            if layer is None and tensor is None:
                del self.module.forward
            elif layer is None:
                self.module.forward = tensor
            else:
                layer.base_layer.weight.data = tensor
                layer._disable_adapters = False
        self.saved = None


def _stock_call(forward, dtype: torch.dtype, fp32_output: bool):
    """`forward` as the stock pipeline calls it: the latents and embeddings (floating tensors of 3 or more
    dimensions) in the weights' `dtype` (timesteps, positions and guidance as given); float32 output where
    accelerate's forward gave it."""
    from accelerate.utils.operations import convert_to_fp32
    from torch.utils._pytree import tree_map_only

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dim() >= 3 else t

    def call(*args, **kwargs):
        out = forward(*tree_map_only(torch.Tensor, cast, args), **tree_map_only(torch.Tensor, cast, kwargs))
        return convert_to_fp32(out) if fp32_output else out

    return call


@contextlib.contextmanager
def no_autocast():
    """Autocast off on every device type where it is on."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
