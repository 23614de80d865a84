#!/usr/bin/env bash
# The whole kit, end to end, in a few minutes on a CPU:
#   ReFL (LoRA) -> DDPO (LoRA) -> images before and after -> a side-by-side comparison.
#
# With the real weights in checkpoint/ (see checkpoint/README.md) it runs the real ReFL recipe instead (a GPU is
# needed for that to finish in reasonable time). Without them it runs on the toy world: a tiny model that really
# draws what it is asked (a coloured shape), so the before/after pictures show shapes taking the asked colour.
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

echo "== no weights in checkpoint/: the TOY WORLD (refl_ddpo/toy_world/data, committed): a tiny Stable Diffusion"
echo "   that draws one coloured shape on grey for 'a {colour} {shape}', right about 40 % of the time."
# One CPU numeric path (AVX2 for ATen, oneDNN and MKL), as the learning tests: the same seed then computes the same bits,
# and so the same numbers, on every x86-64 CPU (docs/record/learning_spread.md). Setting any of the three chooses another.
if [[ "$(uname -m)" == x86_64 && -z "${ATEN_CPU_CAPABILITY:-}${ONEDNN_MAX_CPU_ISA:-}${MKL_CBWR:-}" ]]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2
fi
TOY=refl_ddpo/toy_world/data
HELD_OUT=refl_ddpo/data/toy_world_heldout.txt   # combinations never trained on

echo "== ReFL (LoRA) on the toy classifier's reward, 12 training prompts"
bash train_scripts/train_refl_lora.sh --preset toy_world --device cpu --output_dir "$OUT/refl_lora" --overwrite_output_dir

echo "== DDPO (LoRA) on the programmatic colour reward, on toy-sd3 (the same world as an SD3: MMDiT, flow matching),"
echo "   the colour word cyan alone ('a cyan square', 'a cyan triangle'; 'a cyan circle' is held out)"
bash train_scripts/train_ddpo.sh --preset toy_world_sd3 --device cpu --output_dir "$OUT/ddpo_lora" --overwrite_output_dir

echo "== before / after on the held-out prompts (DDPO: its word's held-out prompt on toy-sd3): the same prompts and seeds"
# scored by the toy judge (toy_color_match: 1 where the colour is the prompt's; its mean is the colour accuracy) and the
# trained reward, not ImageReward, which the toy world does not use
GEN=(--prompts_file "$HELD_OUT" --num_images_per_prompt 8 --reward_model_dir "$TOY" --device cpu --rewards toy_color_match,toy_classifier)
"$PYTHON" inference/inference.py "${GEN[@]}" --pretrained_model "$TOY/toy-sd" --output_dir "$OUT/base"
"$PYTHON" inference/inference_lora.py "${GEN[@]}" --lora_dir "$OUT/refl_lora" --output_dir "$OUT/refl"
mkdir -p "$OUT" && echo "a cyan circle" > "$OUT/cyan_held_out.txt"
GEN_SD3=(--prompts_file "$OUT/cyan_held_out.txt" --num_images_per_prompt 16 --reward_model_dir "$TOY" --device cpu --rewards toy_color_match)
"$PYTHON" inference/inference.py "${GEN_SD3[@]}" --pretrained_model "$TOY/toy-sd3" --output_dir "$OUT/base_sd3"
"$PYTHON" inference/inference_lora.py "${GEN_SD3[@]}" --lora_dir "$OUT/ddpo_lora" --output_dir "$OUT/ddpo"
"$PYTHON" inference/compare.py "$OUT/base" "$OUT/refl" --out "$OUT/compare_refl"
"$PYTHON" inference/compare.py "$OUT/base_sd3" "$OUT/ddpo" --out "$OUT/compare_ddpo"
"$PYTHON" -m refl_ddpo.toy_world.world "$OUT/base" "$OUT/refl" "$OUT/base_sd3" "$OUT/ddpo"

echo "== done. Look at $OUT/compare_refl/compare.png and $OUT/compare_ddpo/compare.png (before | after, headed by"
echo "   the judge's colour accuracy, grey and dirty fractions before -> after, every prompt shown), and"
echo "   tensorboard --logdir $OUT"
