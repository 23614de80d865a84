"""What several test files share beside conftest.py's fixtures: a trainer's command line on the tiny models, and the
environment of a trainer's shell script run in a subprocess."""

import os
import sys
from pathlib import Path


def trainer_flags(
    tiny_models: Path,
    out: Path,
    *extra: str,
    model: str = "stable-diffusion",
    resolution: int = 32,
    **flags,
) -> list[str]:
    """--pretrained_model TINY_MODELS/model --reward_model_dir TINY_MODELS --output_dir OUT --resolution N, then
    `flags` in their order (name=value gives --name value, name=True a bare --name), then `extra` as they are."""
    argv = [
        *("--pretrained_model", str(tiny_models / model), "--reward_model_dir", str(tiny_models)),
        *("--output_dir", str(out), "--resolution", str(resolution)),
    ]
    for name, value in flags.items():
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return [*argv, *extra]


def script_env(*drop: str, **extra: str) -> dict:
    """This process's environment for a trainer's shell script: without GPUS, NUM_PROCESSES and `drop`, with this
    Python, no hub and one OpenMP thread, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "NUM_PROCESSES", *drop)}
    return {**env, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}
