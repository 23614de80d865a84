"""Image-editing presets (--preset NAME, with --edit_data FILE) as plain data: X-GenGroup/Flow-Factory's FLUX.1
Kontext example, scaled to one GPU as the FLUX.2 presets are (refl_ddpo.trainers.flux2_presets: one group of 16 per
epoch in 4 batches of 4, their shared optimiser and LoRA settings).

Their Kontext example reads its edits from a dataset folder (sharegpt4o_image_mini, train.jsonl) and resizes each
condition image to `condition_image_size`; here the edits are --edit_data, used at their own size (one size, sides
multiples of 16: resize them to 384 x 384 beforehand for their setting). Their advantage aggregation "gdpo" with one
reward is the plain group normalisation (--reward_aggregation sum).
"""

from __future__ import annotations

from typing import Any

from refl_ddpo.trainers.flux2_presets import FLOW_FACTORY_GRPO

EDIT_GRPO_PRESETS: dict[str, dict[str, Any]] = {
    # FLUX.1 Kontext [dev] (examples/grpo/lora/flux1_kontext/default.yaml): 10 steps at 384 px with the embedded
    # guidance 2.5, noise level 0.9 in one SDE step among steps 1-3 (here 0-3), PickScore; saved every 20 epochs;
    # evaluated with 20 steps at guidance 2.5.
    "flow_factory_flux1_kontext": {
        **FLOW_FACTORY_GRPO,
        "pretrained_model": "black-forest-labs/FLUX.1-Kontext-dev",
        "reward": "pickscore",
        "resolution": 384,
        "sample_num_steps": 10,
        "sample_eta": 0.9,
        "sample_guidance_scale": 2.5,
        "train_skip_last_steps": 6,
        "save_freq": 20,
        "validation_num_steps": 20,
        "validation_guidance_scale": 2.5,
    },
}
