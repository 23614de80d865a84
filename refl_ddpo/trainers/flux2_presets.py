"""FLUX.2's presets (--preset NAME) for GRPO and DiffusionNFT, as plain data: X-GenGroup/Flow-Factory's example
configs for FLUX.2 [dev] and [klein], scaled to one GPU; and what Flow-Factory's examples share at one GPU's share
(`FLOW_FACTORY_GRPO`, `FLOW_FACTORY_NFT`), which the Z-Image presets of grpo_config.py and forward_config.py use too.

Flow-Factory's examples run on 8 GPUs, one image per GPU and batch, 48 prompts per epoch in groups of 16 (96 images
per GPU); one GPU here samples one group of 16 per epoch, in 4 batches of 4. Their "default" LoRA targets are the
kit's FLUX.2 defaults (their `attn.to_out.0` reaches the double blocks only, as the kit's `to_out.0`), so
--lora_target_modules stays unset. Their SDE window is one step drawn per trajectory from a list of steps; the kit's
window of one step starts anywhere before the last --train_skip_last_steps steps (it has no lower bound), so the
earliest step, which theirs leaves out, is drawn too. Their EMA of the GRPO weights (decay 0.9 every 4 epochs) has no
counterpart in the kit's GRPO. They evaluate at 1024 px; the kit validates at the training resolution.
"""

from __future__ import annotations

from typing import Any

# What Flow-Factory's GRPO and NFT examples share at one GPU's share: one group of 16 per epoch in 4 batches of 4,
# each group's own std, no KL (kl_beta 0), weight decay 1e-4, gradient norm 1, LoRA r 64 / alpha 128, bf16.
_FLOW_FACTORY = {
    "sample_batch_size": 4,
    "sample_num_batches_per_epoch": 4,
    "group_size": 16,
    "global_std": False,
    "train_batch_size": 4,
    "kl_weight": 0.0,
    "adam_weight_decay": 1e-4,
    "max_grad_norm": 1.0,
    "lora_rank": 64,
    "lora_alpha": 128,
    "mixed_precision": "bf16",
    "num_epochs": 1000,  # theirs run until stopped by hand
}
# Their GRPO examples (examples/grpo/lora/): one SDE step per trajectory, clip 1e-4, advantages clipped to 5, lr
# 3e-4, 2 optimizer steps per epoch.
FLOW_FACTORY_GRPO = {
    **_FLOW_FACTORY,
    "sde_window": 1,
    "train_gradient_accumulation_steps": 2,
    "train_clip_range": 1e-4,
    "train_adv_clip_max": 5.0,
    "learning_rate": 3e-4,
}
# Their NFT examples (examples/nft/lora/): one optimizer step per epoch, beta 0.1, the old policy's decay piecewise
# linear (flat 0, rate 0.001, at most 0.5).
FLOW_FACTORY_NFT = {
    **_FLOW_FACTORY,
    "train_gradient_accumulation_steps": 4,
    "nft_beta": 0.1,
    "old_decay_flat": 0,
    "old_decay_rate": 0.001,
    "old_decay_max": 0.5,
}
# Their FLUX.2 GRPO examples (examples/grpo/lora/flux2*/) save every 20 epochs.
_FF_GRPO = {**FLOW_FACTORY_GRPO, "save_freq": 20}

FLUX2_GRPO_PRESETS: dict[str, dict[str, Any]] = {
    # FLUX.2 [dev] (examples/grpo/lora/flux2/t2i.yaml): 8 steps at 512 px with the embedded guidance 4, noise level
    # 1.0 in one SDE step among steps 1-3 (here 0-3), CLIP score and PickScore weighted 1 : 0.5; evaluated with 28
    # steps at guidance 4.
    "flow_factory_flux2": {
        **_FF_GRPO,
        "pretrained_model": "black-forest-labs/FLUX.2-dev",
        "reward": "clip_score:1,pickscore:0.5",
        "resolution": 512,
        "sample_num_steps": 8,
        "sample_eta": 1.0,
        "sample_guidance_scale": 4.0,
        "train_skip_last_steps": 4,
        "validation_num_steps": 28,
        "validation_guidance_scale": 4.0,
    },
    # The step-distilled FLUX.2 [klein] 9B (examples/grpo/lora/flux2_klein/default.yaml): its 4 steps at 384 px,
    # no guidance (the pipeline ignores any), noise level 0.5 in one SDE step among steps 1-2 (here 0-2), PickScore;
    # evaluated with 10 steps.
    "flow_factory_flux2_klein": {
        **_FF_GRPO,
        "pretrained_model": "black-forest-labs/FLUX.2-klein-9B",
        "reward": "pickscore",
        "resolution": 384,
        "sample_num_steps": 4,
        "sample_eta": 0.5,
        "sample_guidance_scale": 1.0,
        "train_skip_last_steps": 1,
        "validation_num_steps": 10,
        "validation_guidance_scale": 1.0,
    },
    # The undistilled FLUX.2 [klein] base 9B (examples/grpo/lora/flux2_klein_base/default.yaml): 8 steps at 384 px
    # with CFG 4, noise level 0.7 in one SDE step among steps 1-3 (here 0-3), PickScore; evaluated with 28 steps at
    # CFG 4.
    "flow_factory_flux2_klein_base": {
        **_FF_GRPO,
        "pretrained_model": "black-forest-labs/FLUX.2-klein-base-9B",
        "reward": "pickscore",
        "resolution": 384,
        "sample_num_steps": 8,
        "sample_eta": 0.7,
        "sample_guidance_scale": 4.0,
        "train_skip_last_steps": 4,
        "validation_num_steps": 28,
        "validation_guidance_scale": 4.0,
    },
}

FLUX2_NFT_PRESETS: dict[str, dict[str, Any]] = {
    # DiffusionNFT on the FLUX.2 [klein] base 4B (examples/nft/lora/flux2_klein_base/default.yaml): 8 ODE steps at
    # 384 px, CFG-free, groups of 16, PickScore, beta 0.1, 2 trained timesteps per sample from the noisier half
    # (their timestep_range 0.5: here 2 of the first 4 steps), no KL, advantages clipped to 5, lr 1e-4, one
    # optimizer step per epoch, LoRA r 64 / alpha 128, the old policy an EMA of decay min(0.001 epoch, 0.5) (their
    # piecewise-linear schedule stepped per epoch); evaluated with 28 steps.
    "nft_flux2_klein_base": {
        **FLOW_FACTORY_NFT,
        "pretrained_model": "black-forest-labs/FLUX.2-klein-base-4B",
        "reward": "pickscore",
        "resolution": 384,
        "sample_num_steps": 8,
        "sample_guidance_scale": 1.0,
        "train_skip_last_steps": 4,
        "train_timestep_fraction": 0.5,
        "train_adv_clip_max": 5.0,
        "old_decay_clock": "epochs",
        "learning_rate": 1e-4,
        "save_freq": 20,
        "validation_num_steps": 28,
        "validation_guidance_scale": 1.0,
    },
}
