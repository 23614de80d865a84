#!/usr/bin/env bash
# Shared launcher for the train_*.sh scripts: env knobs -> accelerate launch -> python -m MODULE "$@".
#
#   GPUS=6,7              which GPUs to use (sets CUDA_VISIBLE_DEVICES before Python starts); unset: all visible
#   NUM_PROCESSES=2       processes to launch; default: the number of GPUs in use, 1 without a GPU
#   MAIN_PROCESS_PORT=..  rendezvous port; default: a free port picked now (no clash with other users' runs)
#   PYTHON=python3        the interpreter; default: python
#
# Usage (from the train_*.sh scripts): source this file, then `launch MODULE [script defaults...] -- "$@"`.
# The script's defaults travel in REFL_DDPO_DEFAULTS and are a layer *below* --config and the user's flags (see
# refl_ddpo/config.py), so a config file is never overridden by a script default.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
[[ "$PYTHON" == */* ]] && PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"  # survives the cd
CALLER_DIR="$PWD"
cd "$REPO_ROOT"  # relative defaults (checkpoint/...) mean the same from the repo root or from train_scripts/
# the caller's folder last: `--reward my_rewards:fn` finds my_rewards.py where the script was started
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}:$CALLER_DIR"

die() { echo "error: $*" >&2; exit 2; }

gpu_count() {  # GPUs the driver can see (0 without nvidia-smi or a GPU)
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

launch() {
  local module="$1"; shift
  local defaults=()
  while (( $# )) && [[ "$1" != "--" ]]; do defaults+=("$1"); shift; done
  (( $# )) && shift  # the "--"
  REFL_DDPO_DEFAULTS=""
  (( ${#defaults[@]} )) && REFL_DDPO_DEFAULTS="$(printf '%q ' "${defaults[@]}")"
  REFL_DDPO_PROG="bash train_scripts/$(basename "$0")"
  export REFL_DDPO_DEFAULTS REFL_DDPO_PROG
  local n_gpus; n_gpus="$(gpu_count)"
  if [[ -n "${GPUS:-}" ]]; then
    [[ "$GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "GPUS='$GPUS' is not a comma-separated list of GPU indices (e.g. GPUS=0,1)."
    local idx
    (( n_gpus > 0 )) || die "GPUS=$GPUS but this machine has no GPU that nvidia-smi can see; unset GPUS to run on the CPU."
    for idx in ${GPUS//,/ }; do
      (( idx < n_gpus )) || die "GPUS=$GPUS names GPU $idx but this machine has $n_gpus GPU(s) (indices 0..$((n_gpus - 1))); unset GPUS to use what is there."
    done
    export CUDA_VISIBLE_DEVICES="$GPUS"
    n_gpus="$(tr ',' '\n' <<<"$GPUS" | wc -l)"
  elif [[ -n "${CUDA_VISIBLE_DEVICES:-}" && "$n_gpus" -gt 0 ]]; then
    n_gpus="$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | wc -l)"
  fi
  local nproc="${NUM_PROCESSES:-$(( n_gpus > 0 ? n_gpus : 1 ))}"
  [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "NUM_PROCESSES='$nproc' must be a positive integer."
  if (( nproc == 1 )); then  # one process needs no launcher (and keeps the script's own exit code)
    echo "running $module: 1 process, GPUs: ${CUDA_VISIBLE_DEVICES:-none set}" >&2
    exec "$PYTHON" -m "$module" "$@"
  fi
  # Check flags and files once, in one process, so that a mistake is one line rather than one per rank under
  # torch's ChildFailedError report; the trainers stop after their pre-load checks when REFL_DDPO_PREFLIGHT is set.
  WORLD_SIZE="$nproc" REFL_DDPO_PREFLIGHT=1 "$PYTHON" -m "$module" "$@" || exit $?
  local port="${MAIN_PROCESS_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
  # refl_ddpo.launch is accelerate launch whose processes die with it (no orphans after a kill -9) and which prints a
  # process' user error as its one line, not under torch's ChildFailedError report.
  # --quiet: a failing script exits with its own one-line error, not under accelerate's CalledProcessError traceback
  # --mixed_precision no: the trainer sets its own from its flag; --multi_gpu without a GPU runs CPU processes (gloo)
  local args=(--quiet --multi_gpu --num_processes "$nproc" --num_machines 1 --main_process_port "$port"
              --dynamo_backend no --mixed_precision no)
  echo "launching $module: $nproc process(es), GPUs: ${CUDA_VISIBLE_DEVICES:-none set}, port $port" >&2
  exec "$PYTHON" -m refl_ddpo.launch "${args[@]}" -m "$module" "$@"
}
