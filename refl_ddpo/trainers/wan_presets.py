"""Wan's GRPO presets (--preset NAME), as plain data: X-GenGroup/Flow-Factory's LoRA example for Wan 2.1 / 2.2
text-to-video (examples/grpo/lora/wan21/t2v.yaml), scaled to one GPU as its FLUX.2 presets are
(`flux2_presets.FLOW_FACTORY_GRPO`: one group of 16 per epoch in 4 batches of 4, LoRA r 64 / alpha 128, bf16).

Their example trains Wan2.1-T2V-14B (and their examples/grpo/lora/wan22/t2v.yaml both experts of Wan2.2-T2V-A14B,
`target_components: ['transformer', 'transformer_2']` bundled into one prepared module, as --wan_expert both) at
256 px and 5 frames, 10 steps with CFG 5, noise level 0.9 in one SDE step drawn from steps 1-3 (the kit's window
start from 0-3), CLIP score and PickScore weighted 1 : 0.5 with GDPO's per-reward advantages, lr 1e-4, no KL; they
evaluate at 480 px and 13 frames with 28 steps, the kit at the training size. Their weight EMA (decay 0.9 every 4
epochs) has no counterpart in the kit's GRPO; their flow_shift 3.0 is the sampler's shift (the kit's Euler sampler
takes the folder's flow_shift, 3.0 in Wan-AI's 480p folders as well as their example).

Their image-to-video example for Wan 2.1 (examples/grpo/lora/wan21/i2v.yaml) is `flow_factory_wan21_i2v`, with the
first frames given by --edit_data (their dataset's images and prompts): the same sampler and optimiser at 240 px, with
PickScore alone (their "gdpo" with one reward is the plain group normalisation); they evaluate at 480 px with 28
steps, and the kit's validation has no first frames to draw from (refused for I2V). Their Wan 2.2 I2V example trains
both experts at once (`--wan_expert both`; no preset for it here).
"""

from __future__ import annotations

from typing import Any

from refl_ddpo.trainers.flux2_presets import FLOW_FACTORY_GRPO

_WAN_T2V = {
    **FLOW_FACTORY_GRPO,
    "save_freq": 20,
    "reward": "clip_score:1,pickscore:0.5",
    "reward_aggregation": "gdpo",
    "learning_rate": 1e-4,
    "resolution": 256,
    "num_frames": 5,
    "sample_num_steps": 10,
    "sample_eta": 0.9,
    "sample_guidance_scale": 5.0,
    "train_skip_last_steps": 6,
    "validation_num_steps": 28,
    "validation_guidance_scale": 5.0,
}

WAN_GRPO_PRESETS: dict[str, dict[str, Any]] = {
    "flow_factory_wan21": {**_WAN_T2V, "pretrained_model": "Wan-AI/Wan2.1-T2V-14B-Diffusers"},
    "flow_factory_wan21_i2v": {
        **{k: v for k, v in _WAN_T2V.items() if not k.startswith("validation_")},
        "pretrained_model": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        "reward": "pickscore",
        "reward_aggregation": "sum",
        "resolution": 240,
    },
    # Wan 2.2 A14B: a LoRA on each expert, as their wan22/t2v.yaml (target_components both): at shift 3 the window's
    # steps 0-2 of 10 (t 1000, 960, 913 >= 875) train the high-noise expert, step 3 (t 858) the low-noise one. Their
    # Wan 2.2 example's other settings (CFG 4 and 3 for the two experts, PickScore alone, 480 px) are not taken: the
    # kit's trainers sample both experts at one guidance scale.
    "flow_factory_wan22": {
        **_WAN_T2V,
        "pretrained_model": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "wan_expert": "both",
    },
}
