"""The reward server's workers: each reward in its own process (refl_ddpo.rewards.serve_worker), fed by one thread
that batches the requests to it, with a state for /health and a death reported to its requests, not to the server.

A request waits while its worker loads. With a batch window, the requests that arrive within it (images of one
size, at most max_batch_size images in all) are scored in one call and their answers split again; without one,
each request is one call. A worker that exits (a crash, the OOM killer, a kill) fails the batch it held with a 503
naming the reward; it is started again up to max_restarts times, after which its requests are answered 503 at once
while the other rewards keep serving.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards.serve_worker import read_frame, write_frame

POLL_S = 0.5  # how often an idle worker's process is checked
STOP_S = 5.0  # how long a stopping worker has to exit before it is killed


@dataclass
class WorkerSettings:
    """How every worker runs: the worker's own flags, and the batching and restart policy."""

    device: str | None = None
    dtype: str = "float32"
    model_dir: str = "checkpoint"
    max_batch_size: int | None = None
    window_s: float = 0.0
    max_restarts: int = 0


@dataclass
class Pending:
    """One request: images float32 [B, 3, H, W] (or videos [B, T, 3, H, W]), its prompts and metadata, and its
    answer once scored."""

    images: np.ndarray
    prompts: list[str]
    metadata: list[dict]
    done: threading.Event = field(default_factory=threading.Event)
    code: int = 0
    answer: dict = field(default_factory=dict)

    def resolve(self, code: int, answer: dict) -> None:
        self.code, self.answer = code, answer
        self.done.set()


def resolve_python(path: str) -> str:
    """--python's PATH -> a python executable: a virtual environment's folder (its bin/python) or the executable."""
    p = Path(path).expanduser()
    for candidate in (p / "bin" / "python", p / "Scripts" / "python.exe", p):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise UserError(
        f"--python {path}: neither a virtual environment (with bin/python) nor a python executable."
    )


def kit_only_path() -> str:
    """A temporary folder holding only a link to this kit's package, for PYTHONPATH of a worker under another
    environment's python: it imports the kit, and nothing else of this environment."""
    folder = tempfile.mkdtemp(prefix="refl_ddpo_kit_")
    os.symlink(Path(__file__).resolve().parent.parent, Path(folder) / "refl_ddpo")
    return folder


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def split_info(info: dict, counts: list[int]) -> list[dict]:
    """The info of a merged batch -> one per request: per-image lists cut at the requests' bounds; a scalar only
    when the batch was one request (else it described other clients' images too)."""
    out: list[dict] = [{} for _ in counts]
    bounds = np.cumsum([0, *counts]).tolist()
    for key, value in info.items():
        if isinstance(value, list) and len(value) == bounds[-1]:
            for i in range(len(counts)):
                out[i][key] = value[bounds[i] : bounds[i + 1]]
        elif len(counts) == 1:
            out[0][key] = value
    return out


class RewardWorker:
    """One reward's worker process and the thread that feeds it. `score` is called from the HTTP threads."""

    def __init__(
        self, name: str, spec: str, settings: WorkerSettings, python: str | None = None, differentiable=None
    ):
        self.name, self.spec, self.settings = name, spec, settings
        self.python = python or sys.executable
        self.differentiable = differentiable
        self.video = None  # whether it takes whole videos, once loaded
        self.status, self.error = "starting", ""
        self.restarts = self.requests = self.batches = 0
        self._proc: subprocess.Popen | None = None
        self._pending: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._kit_path = kit_only_path() if python else None
        self._thread = threading.Thread(target=self._run, name=f"reward-{name}", daemon=True)

    # ---- the HTTP side ----

    def start(self) -> None:
        self._thread.start()

    def health(self, detail: bool = True) -> dict:
        with self._cond:
            out = {"status": self.status, "reward": self.spec, "differentiable": self.differentiable}
            out["video"] = self.video
            if self.error or self.status != "ok":
                out["error"] = f"reward '{self.name}': {self.error or 'still loading'}"
            if detail:
                pid = self._proc.pid if self._proc and self.status == "ok" else None
                out |= {"name": self.name, "python": self.python, "pid": pid, "restarts": self.restarts}
                out |= {"requests": self.requests, "batches": self.batches}
            return out

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> tuple[int, dict]:
        """(HTTP code, answer) for one request: its rewards and info, or {"error": one line naming the reward}."""
        pending = Pending(images, prompts, metadata)
        with self._cond:
            if self.status == "down" or self._stopping:
                return 503, {"error": self._down_line()}
            self.requests += 1
            self._pending.append(pending)
            self._cond.notify_all()
        pending.done.wait()
        return pending.code, pending.answer

    def stop(self) -> None:
        """Fails what waits, ends the process (stdin closed, then terminate, then kill) and removes the temp path."""
        with self._cond:
            self._stopping = True
            self._fail_pending("the server is stopping")
            self._cond.notify_all()
            proc = self._proc  # one started after this is ended by _launch itself
        if proc is not None:
            _end_process(proc)
        self._thread.join(timeout=STOP_S)
        if self._kit_path:
            shutil.rmtree(self._kit_path, ignore_errors=True)

    # ---- the worker's thread ----

    def _down_line(self) -> str:
        return f"reward '{self.name}' is down: {self.error}; the server's other rewards still serve"

    def _fail_pending(self, why: str) -> None:
        """Under the lock: answers every waiting request with a 503 naming the reward."""
        while self._pending:
            self._pending.popleft().resolve(503, {"error": f"reward '{self.name}': {why}"})

    def _command(self) -> list[str]:
        s = self.settings
        command = [self.python, "-m", "refl_ddpo.rewards.serve_worker", "--reward", self.spec]
        command += ["--dtype", s.dtype, "--reward_model_dir", s.model_dir]
        command += ["--device", s.device] if s.device else []
        return command + (["--max_batch_size", str(s.max_batch_size)] if s.max_batch_size else [])

    def _launch(self) -> None:
        """Starts the process and waits for its first frame: ready (status ok) or a load error (status down); a
        process that dies while loading is started again within max_restarts."""
        env = dict(os.environ)
        if self._kit_path:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self._kit_path, env.get("PYTHONPATH")]))
        while True:
            proc = subprocess.Popen(self._command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            with self._cond:
                self._proc = proc
                stopping = self._stopping
            if stopping:
                _end_process(proc)
                return
            try:
                ready, _ = read_frame(proc.stdout)
                break
            except (EOFError, ValueError):
                if not self._died("while loading (its traceback is on the server's stderr)"):
                    return
        with self._cond:
            if ready.get("ready"):
                self.status, self.error = "ok", ""
                self.differentiable = bool(ready.get("differentiable"))
                self.video = bool(ready.get("video"))
                print(f"reward {self.name} ready (pid {proc.pid})", file=sys.stderr, flush=True)
            else:
                self.status, self.error = "down", f"did not load: {ready.get('error', '?')}"
                self._fail_pending(self._down_line())

    def _died(self, when: str) -> bool:
        """The process has exited: records why; True if it may be started again (the caller does so)."""
        code = self._proc.wait()
        with self._cond:
            self.error = f"its worker exited ({describe_exit(code)}) {when}"
            if self._stopping or self.restarts >= self.settings.max_restarts:
                self.status = "down"
                self._fail_pending(self._down_line())
                return False
            self.restarts += 1
            self.status = "starting"
            return True

    def _run(self) -> None:
        self._launch()
        while True:
            with self._cond:
                if self._stopping:
                    return
            batch = self._next_batch()
            if self.status == "ok" and self._proc.poll() is not None and self._died("while idle"):
                self._launch()
            if batch:
                self._score(batch)

    def _next_batch(self) -> list[Pending]:
        """The next request, and with a window the ones that join it; [] when none came within POLL_S."""
        with self._cond:
            if not self._pending:
                self._cond.wait(POLL_S)
            if not self._pending or self.status != "ok":
                return []
            batch = [self._pending.popleft()]
            deadline = time.monotonic() + self.settings.window_s
            size, limit = len(batch[0].images), self.settings.max_batch_size or float("inf")
            while self.settings.window_s > 0 and size < limit:
                while self._pending and self._joins(batch[0], self._pending[0], size, limit):
                    batch.append(self._pending.popleft())
                    size += len(batch[-1].images)
                left = deadline - time.monotonic()
                if self._pending or size >= limit or left <= 0:  # the next one does not fit: it waits
                    break
                self._cond.wait(left)
            return batch

    @staticmethod
    def _joins(first: Pending, other: Pending, size: int, limit: float) -> bool:
        return other.images.shape[1:] == first.images.shape[1:] and size + len(other.images) <= limit

    def _score(self, batch: list[Pending]) -> None:
        """One call of the worker for the batch; every request answered, whatever happens."""
        counts = [len(p.images) for p in batch]
        images = batch[0].images if len(batch) == 1 else np.concatenate([p.images for p in batch])
        request = {
            "shape": list(images.shape),
            "prompts": [t for p in batch for t in p.prompts],
            "metadata": [m for p in batch for m in p.metadata],
        }
        try:
            write_frame(self._proc.stdin, request, np.ascontiguousarray(images, dtype="<f4").tobytes())
            answer, _ = read_frame(self._proc.stdout)
        except (EOFError, OSError, ValueError):  # a closed pipe: the worker died
            restart = self._died("while scoring")
            for p in batch:
                p.resolve(503, {"error": f"reward '{self.name}': {self.error}; its batch was lost"})
            if restart:
                self._launch()
            return
        with self._cond:
            self.batches += 1
        if "error" in answer:
            code = 400 if answer.get("kind") == "user" else 500
            for p in batch:
                p.resolve(code, {"error": f"reward '{self.name}': {answer['error']}"})
            return
        bounds = np.cumsum([0, *counts]).tolist()
        for i, (p, info) in enumerate(zip(batch, split_info(answer["info"], counts), strict=True)):
            p.resolve(200, {"rewards": answer["rewards"][bounds[i] : bounds[i + 1]], "info": info})


def _end_process(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()  # the worker exits at the end of its input
    except OSError:
        pass
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()
