#!/usr/bin/env bash
# One DDPO epoch of refl_ddpo against TRL 0.23.1's DDPOTrainer, side by side on this machine (CPU, tiny SD model).
#
#   bash benchmarks/peer.sh [--out DIR] [--pairs N] [--epochs E] [--venv DIR]
#
#   --out DIR     where results.json (per-case times, `ratio` = ours / TRL), results.md and runs/ go;
#                 default benchmarks/results/peer_cpu_tiny. DIR/scratch/ holds the models, logs and work folders.
#   --pairs N     interleaved pairs of runs (one process per side per pair, the order alternating); default 5
#   --epochs E    epochs per run; all but the first two are timed (default 4: two timed epochs per run)
#   --venv DIR    the side virtualenv with benchmarks/peer_requirements.txt (TRL 0.23.1 and its libraries); built
#                 here when missing, reused when it has those pins. Default: $PEER_VENV, else
#                 ${XDG_CACHE_HOME:-~/.cache}/refl_ddpo/peer-venv.
#   PYTHON=...    the project's interpreter (default: python); the side virtualenv reuses its torch files (the
#                 project's site-packages come after the side's own on its path), so both sides run the same torch.
#
# Steps: build or reuse the side virtualenv; write the tiny SD model (python -m refl_ddpo.tiny) and a copy in the
# layout transformers 4.x reads; check that both sides' UNet outputs on one input are identical; run the pairs
# (OMP_NUM_THREADS=1); write the report (benchmarks/peer.py says what an epoch is and how it is timed and counted).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$HERE")"
PYTHON="${PYTHON:-python}"
OUT="benchmarks/results/peer_cpu_tiny"
PAIRS=5
EPOCHS=4
VENV="${PEER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/refl_ddpo/peer-venv}"
ARGS="$*"

die() { echo "error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }
positive() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer (got '$2')."; }

while (( $# )); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out|--pairs|--epochs|--venv)
      (( $# >= 2 )) || die "$1 needs a value; see bash benchmarks/peer.sh --help."
      case "$1" in
        --out) OUT="$2" ;;
        --pairs) positive --pairs "$2"; PAIRS="$2" ;;
        --epochs) positive --epochs "$2"; EPOCHS="$2" ;;
        --venv) VENV="$2" ;;
      esac
      shift 2 ;;
    *) die "unknown argument '$1'; flags: --out DIR, --pairs N, --epochs E, --venv DIR (see --help)." ;;
  esac
done
(( EPOCHS >= 3 )) || die "--epochs must be >= 3 (the first two epochs are not timed; got $EPOCHS)."
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON: no such interpreter; set PYTHON to the project's python."

PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c "import refl_ddpo, torch" 2>/dev/null \
  || die "PYTHON=$PYTHON cannot import refl_ddpo and torch; set PYTHON to the project's python."
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$REPO_ROOT"
export OMP_NUM_THREADS=1 PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
SCRATCH="$OUT/scratch"
mkdir -p "$SCRATCH/logs"
rm -rf "$OUT/runs" "$SCRATCH/work"
mkdir -p "$OUT/runs"
trl_python() { env -u PYTHONPATH "$VENV/bin/python" "$@"; }  # the side never sees this checkout's refl_ddpo

# ---- the side virtualenv ----
PINS="$(grep -v '^#' "$HERE/peer_requirements.txt")"
if [[ -f "$VENV/.peer-pins" && "$(cat "$VENV/.peer-pins")" == "$PINS" ]]; then
  echo "side virtualenv: reusing $VENV"
else
  [[ ! -e "$VENV" || -f "$VENV/pyvenv.cfg" ]] || die "--venv $VENV exists and is not a virtualenv; choose another folder."
  echo "side virtualenv: building $VENV (pip log: $SCRATCH/logs/venv.log; about a minute)"
  "$("$PYTHON" -c 'import sys; print(sys._base_executable)')" -m venv --clear "$VENV"
  TORCH_SITE="$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
  SIDE_SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$TORCH_SITE" > "$SIDE_SITE/_refl_ddpo_project_torch.pth"
  "$VENV/bin/python" -m pip install -r "$HERE/peer_requirements.txt" > "$SCRATCH/logs/venv.log" 2>&1 \
    || die "pip could not install benchmarks/peer_requirements.txt into $VENV; see $SCRATCH/logs/venv.log."
  echo "$PINS" > "$VENV/.peer-pins"  # last: a half-built virtualenv is rebuilt next time
fi

# ---- the same tiny model for both sides ----
MODEL="$SCRATCH/models/stable-diffusion"
if [[ ! -f "$MODEL/model_index.json" ]]; then
  "$PYTHON" -m refl_ddpo.tiny "$SCRATCH/models" > "$SCRATCH/logs/tiny.log" 2>&1 \
    || die "python -m refl_ddpo.tiny failed; see $SCRATCH/logs/tiny.log."
fi
"$PYTHON" benchmarks/peer.py convert "$MODEL" "$SCRATCH/models/stable-diffusion-trl"
printf '%s\n' "a photo of a cat" "a photo of a dog" "a red circle" "a horse in a field" > "$SCRATCH/prompts.txt"
"$PYTHON" benchmarks/peer.py unet --side ours --model "$MODEL" --out "$OUT/unet_ours.safetensors" \
  > "$SCRATCH/logs/unet_ours.log" 2>&1 || die "the UNet check of side ours failed; see $SCRATCH/logs/unet_ours.log."
trl_python benchmarks/peer.py unet --side trl --model "$SCRATCH/models/stable-diffusion-trl" \
  --out "$OUT/unet_trl.safetensors" > "$SCRATCH/logs/unet_trl.log" 2>&1 \
  || die "the UNet check of side trl failed; see $SCRATCH/logs/unet_trl.log."
check="$("$PYTHON" benchmarks/peer.py check --out "$OUT" 2>&1)" || die "UNet check: ${check//$'\n'/ }"
echo "UNet check: $check"

# ---- interleaved pairs ----
run_side() {  # run_side SIDE PAIR
  local log="$SCRATCH/logs/$1_$2.log"
  local args=(benchmarks/peer.py epoch --side "$1" --prompts "$SCRATCH/prompts.txt" --epochs "$EPOCHS"
              --work "$SCRATCH/work/$1_$2" --out "$OUT/runs/$1_$2.json")
  if [[ "$1" == ours ]]; then
    "$PYTHON" "${args[@]}" --model "$MODEL" > "$log" 2>&1 || die "side ours, pair $2 failed; see $log."
  else
    trl_python "${args[@]}" --model "$SCRATCH/models/stable-diffusion-trl" > "$log" 2>&1 \
      || die "side trl, pair $2 failed; see $log."
  fi
  rm -rf "$SCRATCH/work/$1_$2"
}
for (( pair = 1; pair <= PAIRS; pair++ )); do
  if (( pair % 2 )); then order=(ours trl); else order=(trl ours); fi
  for side in "${order[@]}"; do run_side "$side" "$pair"; done
  echo "pair $pair/$PAIRS done (load average: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?'))"
done

# ---- the report ----
"$PYTHON" benchmarks/peer.py report --out "$OUT" --command_line "bash benchmarks/peer.sh${ARGS:+ $ARGS}"
echo "wrote $OUT/results.json and $OUT/results.md"
