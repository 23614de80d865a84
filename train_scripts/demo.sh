#!/usr/bin/env bash
# The whole kit, end to end, in a few minutes on a CPU:
#   ReFL (LoRA) -> DDPO (LoRA) -> images before and after with ImageReward scores -> a side-by-side comparison.
#
# With the real weights in checkpoint/ (see checkpoint/README.md) it runs the real recipes instead (a GPU is needed
# for that to finish in reasonable time). Without them it builds TINY RANDOM MODELS first: their images are noise and
# their rewards mean nothing; the demo then only shows that every step runs and what each one writes.
#
#   bash train_scripts/demo.sh            # outputs under outputs/demo/
#   DEMO_DIR=/tmp/demo bash train_scripts/demo.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"
OUT="${DEMO_DIR:-outputs/demo}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny models run faster on one thread per process

if [[ -f checkpoint/stable-diffusion-v1-4/model_index.json && -f checkpoint/ImageReward.pt ]]; then
  echo "== real weights found in checkpoint/: running the ReFL LoRA recipe, then before/after inference"
  bash train_scripts/train_refl_lora.sh
  "$PYTHON" inference/inference.py --output_dir "$OUT/base"
  "$PYTHON" inference/inference_lora.py --lora_dir checkpoint/refl_lora --output_dir "$OUT/lora"
  "$PYTHON" inference/compare.py "$OUT/base" "$OUT/lora"
  exit 0
fi

echo "== no weights in checkpoint/: building TINY RANDOM models in $OUT/models (outputs are noise; this only shows"
echo "   that every step runs). Put real weights in checkpoint/ (checkpoint/README.md) for the real thing."
"$PYTHON" -m refl_ddpo.tiny "$OUT/models"
M="$OUT/models"
MODEL=(--pretrained_model "$M/stable-diffusion" --resolution 32 --device cpu)

echo "== ReFL: 30 LoRA steps against the tiny ImageReward"
bash train_scripts/train_refl_lora.sh "${MODEL[@]}" --reward_model_dir "$M" --output_dir "$OUT/refl_lora" \
  --num_inference_steps 8 --k_lo 4 --k_hi 7 --train_batch_size 2 --learning_rate 3e-2 --max_train_steps 30 \
  --image_log_steps 10 --checkpointing_steps 15

echo "== DDPO: 3 epochs of JPEG compressibility"
bash train_scripts/train_ddpo.sh "${MODEL[@]}" --output_dir "$OUT/ddpo_lora" --reward jpeg_compressibility \
  --sample_num_steps 8 --sample_batch_size 4 --sample_num_batches_per_epoch 2 --train_batch_size 2 \
  --learning_rate 3e-3 --num_epochs 3 --per_prompt_stat_tracking_min_count 2

echo "== before / after: the same prompts and seeds, scored with the tiny ImageReward"
GEN=(--reward_model_dir "$M" --num_inference_steps 8 --num_images_per_prompt 2 --device cpu)
"$PYTHON" inference/inference.py "${GEN[@]}" --pretrained_model "$M/stable-diffusion" --resolution 32 \
  --output_dir "$OUT/base"
"$PYTHON" inference/inference_lora.py "${GEN[@]}" --lora_dir "$OUT/refl_lora" --output_dir "$OUT/lora"
"$PYTHON" inference/compare.py "$OUT/base" "$OUT/lora"

echo "== done. Look at $OUT/compare/compare.png, $OUT/*/scores.json, and tensorboard --logdir $OUT"
