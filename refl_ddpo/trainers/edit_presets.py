"""Image-editing presets (--preset NAME, with --edit_data FILE) as plain data: X-GenGroup/Flow-Factory's FLUX.1
Kontext and Qwen-Image-Edit-Plus examples, scaled to one GPU as the FLUX.2 presets are
(refl_ddpo.trainers.flux2_presets: one group of 16 per epoch in 4 batches of 4, their shared optimiser and LoRA
settings).

Their examples read their edits from a dataset folder (sharegpt4o_image_mini, train.jsonl) and resize each condition
image to `condition_image_size`; here the edits are --edit_data, sized as the stock pipelines size them (Kontext: at
their own size, one size with sides multiples of 16, so resize them to 384 x 384 beforehand for its setting). Their
advantage aggregation "gdpo" with one reward is the plain group normalisation (--reward_aggregation sum).
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
    # Qwen-Image-Edit-2509 (examples/grpo/lora/qwen_image_edit_plus/default.yaml; 2511 works the same): 10 steps at
    # 384 px with true CFG 4 (the empty prompt with the pictures as the negative), noise level 1.0 in one SDE step
    # among steps 1-3 (here 0-3), PickScore, gradient checkpointing; evaluated with 40 steps at 4 (theirs at
    # 1024 px). Their condition images are capped at 384 x 384 px; the kit sizes them as the stock pipeline does
    # (about 384 x 384 for the VLM, 1024 x 1024 for the reference latents).
    "flow_factory_qwen_image_edit_plus": {
        **FLOW_FACTORY_GRPO,
        "pretrained_model": "Qwen/Qwen-Image-Edit-2509",
        "reward": "pickscore",
        "resolution": 384,
        "sample_num_steps": 10,
        "sample_eta": 1.0,
        "sample_guidance_scale": 4.0,
        "train_skip_last_steps": 6,
        "gradient_checkpointing": True,
        "save_freq": 20,
        "validation_num_steps": 40,
        "validation_guidance_scale": 4.0,
    },
}
