"""CPU threads for torch's intra-op parallelism when the user did not choose them.

torch starts one OpenMP thread per physical core. That is right on an idle machine, and very wrong on a busy one:
the threads wait for each other at every operation, and each waits for a core that another program holds. On a
shared 2-core machine the inference scripts ran a tiny image in 46 s with 2 threads against 1.2 s with one.

The rule, when neither OMP_NUM_THREADS nor REFL_DDPO_CPU_THREADS is set:

    threads = max(1, min(torch's default (physical cores), free cores // local processes))
    free cores = the cores this process may run on (its CPU affinity) minus the 1-minute load average, rounded

so a busy machine gets few threads, an idle one all its cores, and the processes of one multi-process run
(LOCAL_WORLD_SIZE) share the cores rather than each taking all of them. REFL_DDPO_CPU_THREADS=N sets N; OMP_NUM_THREADS
(which torch reads itself) leaves torch's choice alone.
"""

from __future__ import annotations

import math
import os

THREADS_ENV = "REFL_DDPO_CPU_THREADS"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells it, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_cpu_threads(physical: int, cores: int, load: float | None, local_processes: int = 1) -> int:
    """The rule above: min(physical, (cores - round(load)) // local_processes), at least 1. `load` None: unknown."""
    free = cores - (round(load) if load is not None and math.isfinite(load) else 0)
    return max(1, min(physical, free // max(1, local_processes)))


def set_cpu_threads() -> int:
    """Set torch's intra-op threads by REFL_DDPO_CPU_THREADS or the rule, unless OMP_NUM_THREADS is set; returns
    the number of threads torch uses afterwards. A bad REFL_DDPO_CPU_THREADS is a one-line UserError."""
    import torch

    from refl_ddpo.core.errors import UserError

    chosen = os.environ.get(THREADS_ENV)
    if chosen:
        try:
            n = int(chosen)
        except ValueError:
            n = 0
        if n < 1:
            raise UserError(f"{THREADS_ENV}={chosen!r} must be a positive integer (threads per process).")
        torch.set_num_threads(n)
    elif not os.environ.get("OMP_NUM_THREADS"):
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # not on every OS
            load = None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        torch.set_num_threads(default_cpu_threads(torch.get_num_threads(), available_cores(), load, local))
    return torch.get_num_threads()
