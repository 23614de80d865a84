"""Wan 2.2's two experts as one trained module (--wan_expert both): `transformer` (high noise) and `transformer_2`
(low noise), each with its own LoRA, trained together by one optimizer.

Why one module: everything that carries "the trained network" through a run (accelerate's `prepare` and its DDP
wrapper, the optimizer over its trainable tensors, the gradient accumulation, checkpoint-N's save and load hooks,
the weight digests, the LoRA fold of the no-grad calls, the adapters switched off for the base model) takes one
module, and takes this pair as it takes one network. A call names its expert, `pair(expert, hidden_states=...)`,
so that it goes through whatever wraps the pair (DDP's gradient hooks, accelerate's autocast) and reaches that
expert only: a step's loss reaches the expert that ran it. The experts stay the pipeline's own (`pipe.transformer`,
`pipe.transformer_2`): a call without the pair (validation, inference) meets the same LoRA layers.

On disk (`lora_parts`): the high-noise expert's LoRA is `pytorch_lora_weights.safetensors` at the top of the
folder, the low-noise one's the same file in `transformer_2/`, so the stock pipeline loads both in two calls:
`pipe.load_lora_weights(DIR)` and `pipe.load_lora_weights(DIR, subfolder="transformer_2",
load_into_transformer_2=True)`.
"""

from __future__ import annotations

import copy

import torch

from refl_ddpo.core.lora import EXPERT_2_DIR  # the low-noise expert's LoRA: this subfolder of a LoRA folder


class WanExperts(torch.nn.Module):
    """The pair (transformer, transformer_2) as one module; `forward(expert, **kwargs)` calls that expert."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2

    def forward(self, expert: str, **kwargs):
        return getattr(self, expert)(**kwargs)

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        return self.transformer, self.transformer_2

    @property
    def config(self):
        """The high-noise expert's config (the two share their shapes: channels, patch size)."""
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def lora_parts(self) -> list[tuple[str, torch.nn.Module, str]]:
        """(name, expert, its folder in a LoRA folder): where `refl_ddpo.core.lora` writes and reads each."""
        return [("transformer", self.transformer, ""), ("transformer_2", self.transformer_2, EXPERT_2_DIR)]

    # ---- what the LoRA core and the trainers call on a network, for both experts ----
    @property
    def peft_config(self) -> dict:
        return getattr(self.transformer, "peft_config", {})

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
