#!/usr/bin/env bash
# DiffusionNFT with LoRA: bash train_scripts/train_nft.sh [--preset toy_world|toy_world_sd3|nft_sd35m] [--flag value ...]
# Clean samples from a deterministic sampler, group advantages, the denoising loss on forward-noised samples; see
# refl_ddpo/trainers/nft.py. Env knobs GPUS, NUM_PROCESSES, MAIN_PROCESS_PORT, PYTHON: see launch.sh.
source "$(dirname "$0")/launch.sh"
launch refl_ddpo.trainers.nft --output_dir checkpoint/nft_lora -- "$@"
