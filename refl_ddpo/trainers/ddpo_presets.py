"""DDPO's presets (--preset NAME): ddpo-pytorch's experiments and the toy world's, as plain data."""

from __future__ import annotations

from typing import Any

from refl_ddpo.toy_world import DATA_DIR as TOY_WORLD_DIR

# The toy world's validation: its 6 held-out colour / shape combinations, 2 seeds each, 20 deterministic steps, every
# 8 epochs.
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
    # The toy world's DDPO recipe: toy-sd, the colour word green ("a green triangle" held out), the colour reward,
    # LoRA on the cross-attention keys / values, the first 4 of 6 steps trained (docs/toy_world.md).
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
        "learning_rate": 2e-3,
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


# The same on toy-sd3 (flow matching; Flow-GRPO's SDE at noise level 0.7): the colour word cyan ("a cyan circle"
# held out), LoRA on the text stream's keys / values, lr 3e-3, 16 epochs (docs/toy_world.md).
DDPO_PRESETS["toy_world_sd3"] = {
    **DDPO_PRESETS["toy_world"],
    "pretrained_model": str(TOY_WORLD_DIR / "toy-sd3"),
    "prompt_fn": "toy_world_cyan",
    "sample_eta": 0.7,
    "lora_target_modules": ["add_k_proj", "add_v_proj"],
    "learning_rate": 3e-3,
}
