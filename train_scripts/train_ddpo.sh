#!/usr/bin/env bash
# DDPO with LoRA: bash train_scripts/train_ddpo.sh [--preset NAME] [--flag value ...]; presets: compressibility,
# incompressibility, aesthetic, prompt_image_alignment, toy_world, toy_world_sd3.
# Defaults: ddpo-pytorch config/base.py (JPEG compressibility on ImageNet animals). Env knobs GPUS, NUM_PROCESSES,
# MAIN_PROCESS_PORT: see launch.sh. Flags given here come later and override the defaults below.
source "$(dirname "$0")/launch.sh"
launch refl_ddpo.trainers.ddpo --output_dir checkpoint/ddpo_lora -- "$@"
