#!/usr/bin/env bash
# GRPO with LoRA: bash train_scripts/train_grpo.sh [--preset toy_world|toy_world_sd3|flow_grpo_sd35m|flow_grpo_flux|flow_grpo_fast_flux|dance_grpo_flux] [--flag value ...]
# DDPO's trainer with prompts sampled in groups (--group_size) and group advantages; see refl_ddpo/trainers/grpo.py.
# Env knobs GPUS, NUM_PROCESSES, MAIN_PROCESS_PORT, PYTHON: see launch.sh. Flags given here override the defaults.
source "$(dirname "$0")/launch.sh"
launch refl_ddpo.trainers.grpo --output_dir checkpoint/grpo_lora -- "$@"
