"""Wan 2.2's two experts as one trained module: `transformer` (high noise) and `transformer_2` (low noise), a LoRA
on the trained one(s): both (--wan_expert both, trained together by one optimizer) or one (--wan_expert transformer
or transformer_2, the other frozen).

Why one module: everything that carries "the trained network" through a run (accelerate's `prepare` and its DDP
wrapper, the optimizer over its trainable tensors, the gradient accumulation, checkpoint-N's save and load hooks,
the weight digests, the LoRA fold of the no-grad calls, the adapters switched off for the base model) takes one
module, and takes this pair as it takes one network. A call names its experts' calls, `pair([(expert, kwargs),
...])`, so that they go through whatever wraps the pair (DDP's gradient hooks, accelerate's autocast) and reach
those experts only: a step's loss reaches the expert that ran it. All the calls of one prediction (CFG's two, and
both experts' where a batch straddles the boundary) are one forward: DDP with `find_unused_parameters` reads the
tensors used from the last forward before a backward, so a second forward would hide the first's (the processes
hang). A frozen expert's call under grad adds 0 x the pair's
first trainable tensor to its velocity, inside the call: every step's loss has a graph, and DDP (with
`find_unused_parameters`) sees a forward whose output reaches it, so every process runs the same all-reduce (a
link made outside the wrapped call fires a gradient hook DDP did not expect: the processes hang). The experts stay
the pipeline's own (`pipe.transformer`, `pipe.transformer_2`): a call without the pair (validation, inference)
meets the same LoRA layers.

On disk (`lora_parts`): both trained, the high-noise expert's LoRA is `pytorch_lora_weights.safetensors` at the top
of the folder, the low-noise one's the same file in `transformer_2/`, so the stock pipeline loads both in two calls:
`pipe.load_lora_weights(DIR)` and `pipe.load_lora_weights(DIR, subfolder="transformer_2",
load_into_transformer_2=True)`. One trained, its LoRA is the file at the top (a `transformer_2` one loads with
`load_into_transformer_2=True`).
"""

from __future__ import annotations

import copy

import torch

from refl_ddpo.core.lora import EXPERT_2_DIR  # the low-noise expert's LoRA: this subfolder of a LoRA folder

EXPERTS = ("transformer", "transformer_2")


class WanExperts(torch.nn.Module):
    """The pair (transformer, transformer_2) as one module, `trained` the names of the experts that carry a LoRA;
    `forward([(expert, kwargs), ...])` makes each call of that expert and returns their velocities."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, trained=EXPERTS):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.trained = tuple(trained)

    def forward(self, calls: list[tuple[str, dict]]) -> list[torch.Tensor]:
        """The velocity of each call (expert, its keyword arguments, `return_dict=False`), all in this one forward:
        DDP expects one forward before each backward, and a batch whose rows straddle the boundary calls both
        experts. A frozen expert's velocity gets the zero link (0 x a trained value: adds nothing, keeps a graph)."""
        outs = []
        for expert, kwargs in calls:
            v = getattr(self, expert)(**kwargs)[0]
            if (
                expert not in self.trained and torch.is_grad_enabled()
            ):  # a frozen expert: the zero link, in here
                p = next((p for p in self.parameters() if p.requires_grad), None)
                v = v if p is None else v + 0.0 * p.reshape(-1)[0]
            outs.append(v)
        return outs

    @property
    def experts(self) -> tuple[torch.nn.Module, ...]:
        """The trained experts (a LoRA on each)."""
        return tuple(getattr(self, name) for name in self.trained)

    @property
    def config(self):
        """The high-noise expert's config (the two share their shapes: channels, patch size)."""
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def lora_parts(self) -> list[tuple[str, torch.nn.Module, str]]:
        """(name, expert, its folder in a LoRA folder) of each trained expert: where `refl_ddpo.core.lora` writes
        and reads it (one trained: at the top)."""
        both = len(self.trained) > 1
        folder = {"transformer_2": EXPERT_2_DIR} if both else {}
        return [(name, getattr(self, name), folder.get(name, "")) for name in self.trained]

    # ---- what the LoRA core and the trainers call on a network, for the trained experts ----
    @property
    def peft_config(self) -> dict:
        return getattr(self.experts[0], "peft_config", {})

    def add_adapter(self, config) -> None:
        for expert in self.experts:  # each its own copy: peft keeps the config object per model
            expert.add_adapter(copy.deepcopy(config))

    def disable_adapters(self) -> None:
        for expert in self.experts:
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.experts:
            expert.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts:
            expert.enable_gradient_checkpointing()
