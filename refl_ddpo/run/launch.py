"""Start several trainer processes with accelerate (train_scripts/launch.sh), adding three things to `accelerate launch`:

1. The trainer's checks of flags and files run once, in the launcher, before any process starts (`preflight`, on
   machine 0): a mistake is one line, not one per process.
2. The processes die with the launcher. torch's elastic agent (which `accelerate launch` runs) starts every worker in
   a session of its own and stops them only when it can clean up; after a kill -9 of the launcher they ran on as
   orphans, still writing --output_dir. A worker started from here asks the kernel for SIGKILL when its parent dies
   (`die_with_launcher`: Linux's prctl(PR_SET_PDEATHSIG)); elsewhere this is not available and nothing changes.
3. A user error on any process, or a rendezvous that fails (machine 0 unreachable, the port taken, a machine that
   never came within the timeout), reaches the user as its one line. The worker writes it to a file in the launcher's
   REFL_DDPO_ERROR_DIR instead of printing it (`report_user_error`), and the launcher prints the line of the first
   process that failed in place of torch's ChildFailedError report and the agent's log lines about stopping the
   others. Any other failure keeps the report and the log lines.

    python -m refl_ddpo.run.launch [accelerate launch flags] -m MODULE [flags ...]

The worker side (`die_with_launcher`, `report_user_error`, `end_worker`) is called by `training.run_or_preflight`
and imports nothing heavy.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

LAUNCHER_PID_ENV = "REFL_DDPO_LAUNCHER_PID"  # the launcher's pid: a worker whose parent is gone stops at once
ERROR_DIR_ENV = "REFL_DDPO_ERROR_DIR"  # workers write their user error here as rank{RANK}.json
PREFLIGHT_ENV = "REFL_DDPO_PREFLIGHT"  # the launcher's `preflight`: only the checks, then stop
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
AGENT_LOGGER = "torch.distributed.elastic"


# ---- the worker's side ----


def _launched_worker() -> str | None:
    """The launcher's pid if this process is a worker that refl_ddpo.run.launch started, else None."""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    return pid if pid and "LOCAL_RANK" in os.environ else None


def die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this worker when its parent (the launcher) dies; exit now if it already has."""
    pid = _launched_worker()
    if pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != int(pid):  # the launcher died before we asked: nobody would stop us
        os._exit(1)


def report_user_error(message: str, exit_code: int) -> bool:
    """In a worker of refl_ddpo.run.launch: leave the one-line error for the launcher to print; True if it was left."""
    folder, rank = os.environ.get(ERROR_DIR_ENV), os.environ.get("RANK")
    if _launched_worker() is None or not folder or rank is None or not Path(folder).is_dir():
        return False
    path = Path(folder) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"message": message, "exit_code": exit_code}))
    os.replace(tmp, path)
    return True


def end_worker() -> None:
    """End a process of a multi-process run (WORLD_SIZE > 1) that has finished its work as multiprocessing's children
    end: the exit handlers run and the streams are flushed, then os._exit(0) skips the interpreter's teardown.

    In that teardown a thread of torch.distributed that still holds the last reference to a tensor made in Python
    must take the GIL to free it (seen: gloo's worker freeing the run's last all_gather_object, core dump: runLoop ->
    ~AsyncAllgatherWork -> decref_pyobject -> take_gil); Python 3.11 ends a thread that asks for the GIL while
    finalizing with pthread_exit, which libstdc++ turns into std::terminate. The run's files were all written, yet the
    process died of SIGABRT and the launch failed. Nothing is torn down after this point that the OS does not free."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import atexit

    atexit._run_exitfuncs()  # what the interpreter's exit would run: logging's shutdown, trackers', finalizers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the launcher's side ----


class _HeldLogs(logging.Handler):
    """The elastic agent's log records, held until we know whether a user error explains the failure."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger(AGENT_LOGGER)
        self.logger.addHandler(self)
        self.logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def finish(self, replay: bool) -> None:
        self.logger.removeHandler(self)
        self.logger.propagate = True
        if replay:
            for record in self.records:
                self.logger.handle(record)


def _reported(folder: str, rank: int) -> dict | None:
    try:
        report = json.loads((Path(folder) / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and "message" in report else None


CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"


def main(argv: list[str] | None = None) -> None:
    import tempfile

    # torch's C++ log lines (a rendezvous retry prints one with 40 stack frames) are for the workers, not the
    # launcher: it is quiet below FATAL (read once, when torch loads), the workers get the user's setting back
    user_level = os.environ.get(CPP_LOG_ENV)
    os.environ[CPP_LOG_ENV] = "FATAL"
    import torch  # noqa: F401  (loads c10 with the launcher's level)

    if user_level is None:
        del os.environ[CPP_LOG_ENV]
    else:
        os.environ[CPP_LOG_ENV] = user_level
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    if args.machine_rank == 0:  # machine 0 checks for all (the others would race its claim of --output_dir)
        preflight(args.training_script, args.training_script_args, args.num_processes)
    held = _HeldLogs()
    with tempfile.TemporaryDirectory(prefix="refl_ddpo_errors.") as errors:
        os.environ[ERROR_DIR_ENV] = errors  # the workers inherit the launcher's environment
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        # the elastic agent's logs: without a folder it makes one in /tmp per launch (torchelastic_*), never removed
        if args.log_dir is None:
            args.log_dir = errors
        try:
            launch_command(args)
        except ChildFailedError as e:
            rank, _ = e.get_first_failure()
            report = _reported(errors, rank)
            held.finish(replay=report is None)
            if report is None:
                raise
            print(f"error: {report['message']}", file=sys.stderr, flush=True)
            sys.exit(int(report.get("exit_code", 2)))
        except Exception as e:  # the agent's own failure: the rendezvous with the other machines
            held.finish(replay=not _is_rendezvous_error(e))
            if not _is_rendezvous_error(e):
                raise
            print(f"error: {rendezvous_message(e, args)}", file=sys.stderr, flush=True)
            sys.exit(2)
        held.finish(replay=True)


def preflight(module: str, argv: list[str], num_processes: int) -> None:
    """The trainer's checks of flags and files, once, here, before any process starts: `python -m MODULE ARGV` with
    REFL_DDPO_PREFLIGHT set, so that it stops after its pre-load checks. A mistake is its one line and exit code,
    not one per process under torch's ChildFailedError report; and no process of its own pays the imports."""
    import runpy

    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in (PREFLIGHT_ENV, "WORLD_SIZE")}
    os.environ.update({PREFLIGHT_ENV: "1", "WORLD_SIZE": str(num_processes)})
    sys.argv = [module, *argv]
    try:  # a trainer that exits (an error, its line printed; --help) stops the launch with its exit code
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _is_rendezvous_error(e: BaseException) -> bool:
    """Whether the elastic agent failed to meet the other machines (not a worker's failure)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    return isinstance(e, (DistError, RendezvousError, TimeoutError, ConnectionError))


def rendezvous_message(e: BaseException, args) -> str:
    """The one line for a failed rendezvous: where, torch's reason (its first 300 characters), what to check."""
    where = f"{args.main_process_ip or '127.0.0.1'}:{args.main_process_port}"
    reason = " ".join(str(e).split())[:300] or type(e).__name__
    return (
        f"the rendezvous at {where} failed ({type(e).__name__}: {reason}); check that MAIN_PROCESS_IP is machine "
        "0's address as seen from this machine, that MAIN_PROCESS_PORT is free there and open between the "
        "machines, and that every machine starts within RENDEZVOUS_TIMEOUT seconds."
    )


if __name__ == "__main__":
    main()
