"""DDPO's presets (--preset NAME): ddpo-pytorch's experiments and the toy world's, as plain data."""

from __future__ import annotations

from typing import Any

from refl_ddpo.toy_world import DATA_DIR as TOY_WORLD_DIR

# The toy world's 6 held-out colour / shape combinations, 2 seeds each, 20 deterministic steps, at epochs 0, 8 and 16:
# 10 s per validation on a 2-core machine under a load of 9.
TOY_VALIDATION = {
    "validation_prompts_file": "toy_world_heldout",
    "validation_epochs": 8,
    "num_validation_images": 2,
    "validation_num_steps": 20,
}

# ddpo-pytorch config/dgx.py: its experiments ran on 8 GPUs; the batch numbers below are per GPU, as there.
_COMPRESSIBILITY = {
    "num_epochs": 100,
    "save_freq": 1,
    "checkpoints_total_limit": None,
    "use_lora": True,
    "sample_batch_size": 8,
    "sample_num_batches_per_epoch": 4,  # 8 GPUs x 8 x 4 = 256 samples per epoch
    "train_batch_size": 4,
    "train_gradient_accumulation_steps": 2,  # (8 x 4) / (4 x 2) = 4 optimizer steps per epoch
    "prompt_fn": "imagenet_animals",
    "reward": "jpeg_compressibility",
    "per_prompt_stat_tracking": True,
    "per_prompt_stat_tracking_buffer_size": 16,
    "per_prompt_stat_tracking_min_count": 16,
}
DDPO_PRESETS: dict[str, dict[str, Any]] = {
    # The toy world (refl_ddpo.toy_world.world): its committed model, the programmatic colour reward, and the colour word
    # green alone (toy_world_green: "a green circle", "a green square"; "a green triangle" is held out). It learns in
    # 3 CPU minutes (docs/toy_world.md: MEASURED); it also draws the partner word's prompts green. On all 12
    # training prompts a policy gradient needs ~10^4 images here: partner colours' gradients cancel but for their
    # difference. It trains the cross-attention keys / values on the first 4 of 6 steps, where the colour is decided.
    "toy_world": {
        "pretrained_model": str(TOY_WORLD_DIR / "toy-sd"),
        "reward_model_dir": str(TOY_WORLD_DIR),
        "reward": "toy_color_match",
        "prompt_fn": "toy_world_green",
        "resolution": 32,
        "sample_num_steps": 6,
        "sample_guidance_scale": 7.5,
        "sample_batch_size": 16,
        "sample_num_batches_per_epoch": 4,
        "train_batch_size": 16,
        "train_gradient_accumulation_steps": 2,
        "train_timestep_fraction": 1.0,
        "train_skip_last_steps": 2,
        "train_clip_range": 0.2,
        "lora_target_modules": ["attn2.to_k", "attn2.to_v"],
        "learning_rate": 2e-3,  # 3e-3 learned faster on 4 of 5 seeds but collapsed on one (dirty images)
        "per_prompt_stat_tracking": False,
        "num_epochs": 16,
        "save_freq": 8,
        "checkpoints_total_limit": 1,
        **TOY_VALIDATION,
    },
    "compressibility": _COMPRESSIBILITY,
    "incompressibility": {**_COMPRESSIBILITY, "reward": "jpeg_incompressibility"},
    "aesthetic": {  # harder to optimise: 2 optimizer steps per epoch, a longer buffer, 200 epochs
        **_COMPRESSIBILITY,
        "num_epochs": 200,
        "reward": "aesthetic",
        "train_gradient_accumulation_steps": 4,
        "prompt_fn": "simple_animals",
        "per_prompt_stat_tracking_buffer_size": 32,
    },
    # ddpo-pytorch's LLaVA + BERTScore experiment: any VLM on an OpenAI-compatible server (OPENAI_BASE_URL) describes
    # the image, BERTScore recall of the prompt is computed here (reward_model_dir/bertscore or roberta-large).
    # ddpo-pytorch's prompts were "a(n) {animal} {activity}"; here the animals alone (simple_animals).
    "prompt_image_alignment": {
        **_COMPRESSIBILITY,
        "reward": "vlm_bertscore",
        "prompt_fn": "simple_animals",
        "num_epochs": 200,
        "sample_num_batches_per_epoch": 6,
        "train_gradient_accumulation_steps": 6,
        "per_prompt_stat_tracking_buffer_size": 32,
    },
}


# The same on toy-sd3 (flow matching), as GRPO's toy_world_sd3: the flow SDE step at noise level 0.7, LoRA on the
# text stream's keys and values, the colour word cyan ("a cyan circle" held out), lr 3e-3. 16 epochs, twice GRPO's:
# at 8 held-out accuracy varied from seed to seed (0.36 / 0.72), at 16 it rose on every seed measured, 0.234 ->
# 0.81-1.00 over 6 seeds (docs/toy_world.md).
DDPO_PRESETS["toy_world_sd3"] = {
    **DDPO_PRESETS["toy_world"],
    "pretrained_model": str(TOY_WORLD_DIR / "toy-sd3"),
    "prompt_fn": "toy_world_cyan",
    "sample_eta": 0.7,
    "lora_target_modules": ["add_k_proj", "add_v_proj"],
    "learning_rate": 3e-3,
}
