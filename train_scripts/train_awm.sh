#!/usr/bin/env bash
# AWM (Advantage Weighted Matching) with LoRA: bash train_scripts/train_awm.sh [--preset toy_world|toy_world_sd3|awm_sd35m] [--flag value ...]
# Clean samples from a deterministic sampler, group advantages, the denoising loss on forward-noised samples; see
# refl_ddpo/trainers/awm.py. Env knobs GPUS, NUM_PROCESSES, MAIN_PROCESS_PORT, PYTHON: see launch.sh.
source "$(dirname "$0")/launch.sh"
launch refl_ddpo.trainers.awm --output_dir checkpoint/awm_lora -- "$@"
