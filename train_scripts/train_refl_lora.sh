#!/usr/bin/env bash
# ReFL with LoRA: the recipe of the ImageReward LoRA hackathon (learning rate 1e-4, grad_scale 0.01), weights to
# checkpoint/refl_lora. Flags after the script name are passed through and override these defaults, e.g.
#
#   GPUS=6,7 bash train_scripts/train_refl_lora.sh --max_train_steps 200 --train_batch_size 2
#
# Env knobs (see launch.sh): GPUS, NUM_PROCESSES, MAIN_PROCESS_PORT, PYTHON. All flags: python -m
# refl_ddpo.trainers.refl --help.
source "$(dirname "$0")/launch.sh"
launch refl_ddpo.trainers.refl --learning_rate 1e-4 --grad_scale 0.01 --output_dir checkpoint/refl_lora -- "$@"
