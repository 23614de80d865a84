#!/usr/bin/env bash
# Shared launcher for the train_*.sh scripts: env knobs -> accelerate launch -> python -m MODULE "$@".
#
#   GPUS=6,7              which GPUs to use (sets CUDA_VISIBLE_DEVICES before Python starts); unset: all visible
#   NUM_PROCESSES=2       processes in all, over every machine (accelerate's --num_processes); default: the number of
#                         GPUs in use here times NUM_MACHINES (1 per machine without a GPU)
#   NUM_MACHINES=2        machines (nodes) of the run, each starting this script once; default 1
#   MACHINE_RANK=0        this machine's index, 0 .. NUM_MACHINES-1 (0 hosts the rendezvous); default 0
#   MAIN_PROCESS_IP=...   address of machine 0, needed with NUM_MACHINES > 1
#   MAIN_PROCESS_PORT=..  rendezvous port on machine 0; needed with NUM_MACHINES > 1, else default: a free port
#                         picked now (no clash with other users' runs)
#   RENDEZVOUS_TIMEOUT=600  seconds the machines wait for each other at the start; default 600 (torch's)
#   PYTHON=python3        the interpreter; default: python
#
# Usage (from the train_*.sh scripts): source this file, then `launch MODULE [script defaults...] -- "$@"`.
# The script's defaults travel in REFL_DDPO_DEFAULTS and are a layer *below* --config and the user's flags (see
# refl_ddpo/run/config.py), so a config file is never overridden by a script default.
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
  local machines="${NUM_MACHINES:-1}" machine_rank="${MACHINE_RANK:-0}"
  [[ "$machines" =~ ^[1-9][0-9]*$ ]] || die "NUM_MACHINES='$machines' must be a positive integer."
  [[ "$machine_rank" =~ ^[0-9]+$ ]] && (( machine_rank < machines )) \
    || die "MACHINE_RANK='$machine_rank' must be 0 .. $((machines - 1)) (NUM_MACHINES=$machines)."
  local nproc="${NUM_PROCESSES:-$(( (n_gpus > 0 ? n_gpus : 1) * machines ))}"
  [[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "NUM_PROCESSES='$nproc' must be a positive integer."
  (( nproc % machines == 0 )) \
    || die "NUM_PROCESSES=$nproc (all machines) does not split over NUM_MACHINES=$machines: make it a multiple."
  if (( machines > 1 )); then
    [[ -n "${MAIN_PROCESS_IP:-}" ]] || die "NUM_MACHINES=$machines needs MAIN_PROCESS_IP, the address of machine 0."
    [[ -n "${MAIN_PROCESS_PORT:-}" ]] || die "NUM_MACHINES=$machines needs MAIN_PROCESS_PORT, the same free port on machine 0 for every machine."
    "$PYTHON" -c 'import socket, sys; socket.getaddrinfo(sys.argv[1], None)' "$MAIN_PROCESS_IP" 2>/dev/null \
      || die "MAIN_PROCESS_IP='$MAIN_PROCESS_IP' does not resolve to an address from this machine."
  fi
  if [[ -n "${MAIN_PROCESS_PORT:-}" ]]; then
    [[ "$MAIN_PROCESS_PORT" =~ ^[1-9][0-9]*$ ]] && (( MAIN_PROCESS_PORT <= 65535 )) \
      || die "MAIN_PROCESS_PORT='$MAIN_PROCESS_PORT' must be a port number, 1 .. 65535."
  fi
  local rdzv_timeout="${RENDEZVOUS_TIMEOUT:-600}"
  [[ "$rdzv_timeout" =~ ^[1-9][0-9]*$ ]] || die "RENDEZVOUS_TIMEOUT='$rdzv_timeout' must be a positive number of seconds."
  if (( nproc == 1 )); then  # one process needs no launcher (and keeps the script's own exit code)
    echo "running $module: 1 process, GPUs: ${CUDA_VISIBLE_DEVICES:-none set}" >&2
    exec "$PYTHON" -m "$module" "$@"
  fi
  local port="${MAIN_PROCESS_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
  # refl_ddpo.run.launch is accelerate launch that first runs the trainer's checks of flags and files once (on machine 0:
  # a mistake is one line before any process starts), whose processes die with it (no orphans after a kill -9), and
  # which prints a process' user error, or a failed rendezvous, as its one line, not under ChildFailedError's report.
  # --quiet: a failing script exits with its own one-line error, not under accelerate's CalledProcessError traceback
  # --mixed_precision no: the trainer sets its own from its flag; --multi_gpu without a GPU runs CPU processes (gloo)
  local args=(--quiet --multi_gpu --num_processes "$nproc" --num_machines "$machines" --machine_rank "$machine_rank"
              --main_process_port "$port" --rdzv_conf "timeout=$rdzv_timeout" --dynamo_backend no --mixed_precision no)
  (( machines > 1 )) && args+=(--main_process_ip "$MAIN_PROCESS_IP")
  echo "launching $module: $nproc process(es) on $machines machine(s), this is machine $machine_rank with" \
       "$((nproc / machines)), GPUs: ${CUDA_VISIBLE_DEVICES:-none set}, rendezvous ${MAIN_PROCESS_IP:-127.0.0.1}:$port" >&2
  exec "$PYTHON" -m refl_ddpo.run.launch "${args[@]}" -m "$module" "$@"
}
