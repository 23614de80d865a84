#!/usr/bin/env bash
# ReFL full fine-tune of the UNet: the reference recipe of ImageReward's ReFL (learning rate 1e-5, grad_scale 1e-3,
# 100 optimizer steps of 64 images each), weights to checkpoint/refl_full. Flags after the script name override these.
#
# Effective batch 64 on any number of GPUs: each optimizer step sees --total_batch_size 64 images over all
# processes; the trainer derives gradient_accumulation_steps = 64 / (train_batch_size 2 x processes), i.e. 4 on 8 GPUs,
# 16 on 2, 32 on one, and refuses a process count that does not divide 32.
#
#   GPUS=0,1,2,3,4,5,6,7 bash train_scripts/train_refl_full.sh
source "$(dirname "$0")/launch.sh"
launch refl_ddpo.trainers.refl --no-use_lora --learning_rate 1e-5 --grad_scale 1e-3 --max_train_steps 100 \
  --train_batch_size 2 --total_batch_size 64 --gradient_checkpointing --output_dir checkpoint/refl_full -- "$@"
