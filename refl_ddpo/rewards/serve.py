"""A reward server: registered rewards over HTTP with JSON, each in its own worker process, for trainers on other
processes or machines.

    python -m refl_ddpo.rewards.serve --reward [NAME=]SPEC [--reward NAME=SPEC ...] [--python NAME=VENV]
        [--host 127.0.0.1] [--port 8000] [--device cuda] [--reward_model_dir checkpoint] [--dtype float32]
        [--max_batch_size N] [--batch_window_ms MS] [--max_restarts N]

then train or score with `--reward remote:http://HOST:PORT/NAME` (or `remote:http://HOST:PORT` when one reward is
served). Endpoints:

    GET  /health         one reward: {"status", "reward": SPEC, "differentiable", "video"}; several: {"status": "ok" or
                         "degraded", "rewards": {NAME: its state}}; 200 when every reward is ok, else 503
    GET  /NAME/health    that reward's state: status (starting, ok, down), its spec, whether it is
                         differentiable, whether it takes whole videos [B, T, 3, H, W], the worker's python and
                         pid, restarts, requests and batches scored, and the error that took it down
    POST /NAME/score     a batch (format: refl_ddpo.rewards.remote) scored by that reward; POST /score when one
                         reward is served

Each reward runs in a worker process (refl_ddpo.rewards.serve_worker), under --python's environment if given, so a
scorer whose packages clash with the kit's runs apart. Requests to a reward are scored one batch at a time; with
--batch_window_ms, the requests arriving within the window are merged into one call (refl_ddpo.rewards.serve_workers).
A worker that dies answers its requests a 503 naming the reward and is started again up to --max_restarts times;
the other rewards keep serving. JSON only: nothing sent is unpickled or executed. It listens on 127.0.0.1 unless
--host says otherwise; it has no authentication, so expose it only on a network you trust.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from refl_ddpo.core.errors import UserError, cli_main
from refl_ddpo.rewards.remote import MAX_BODY_BYTES
from refl_ddpo.rewards.serve_workers import RewardWorker, WorkerSettings, resolve_python

NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_request(body: bytes):
    """A POST /score body -> (images float32 [B, 3, H, W] or videos [B, T, 3, H, W], prompts, metadata); ValueError
    (a 400) if it is malformed. numpy only: the HTTP process never imports torch."""
    from refl_ddpo.rewards.remote import decode_array

    request = json.loads(body)
    if not isinstance(request, dict):
        raise ValueError("the body must be a JSON object")  # noqa: TRY004 (a 400)
    images = decode_array(request.get("images"))
    prompts = request.get("prompts")
    metadata = request.get("metadata") or [{} for _ in range(len(images))]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if len(prompts) != len(images) or not isinstance(metadata, list) or len(metadata) != len(images):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts / {len(metadata)} metadata")
    return images, prompts, metadata


def health(workers: dict[str, RewardWorker]) -> dict:
    """GET /health: one reward's own state, or every reward's under "rewards"."""
    if len(workers) == 1:
        return next(iter(workers.values())).health(detail=False)
    states = {name: w.health() for name, w in workers.items()}
    if all(s["status"] == "ok" for s in states.values()):
        return {"status": "ok", "rewards": states}
    errors = "; ".join(s["error"] for s in states.values() if "error" in s)
    return {"status": "degraded", "rewards": states, "error": errors}


def route(path: str, workers: dict[str, RewardWorker]) -> tuple[RewardWorker | None, str, str]:
    """A path -> (the reward it names, or None for the server; 'health' or 'score'; an error for a 404 or '')."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    served = ", ".join(workers)
    if len(parts) == 2 and parts[1] in ("health", "score"):
        if parts[0] in workers:
            return workers[parts[0]], parts[1], ""
        return None, "", f"no reward '{parts[0]}' here; this server serves {served}"
    if len(parts) == 1 and parts[0] in ("health", "score"):
        if parts[0] == "score" and len(workers) > 1:
            return (
                None,
                "",
                f"this server serves several rewards ({served}): POST /NAME/score (remote:URL/NAME)",
            )
        return (next(iter(workers.values())) if len(workers) == 1 else None), parts[0], ""
    return None, "", f"no {path}: GET /health, GET /NAME/health or POST /NAME/score (rewards: {served})"


def make_handler(workers: dict[str, RewardWorker]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # no line per request
            pass

        def do_GET(self):
            worker, what, error = route(self.path, workers)
            if error or what != "health":
                self._send(404, {"error": error or f"GET {self.path}: the score is a POST"})
                return
            answer = worker.health(detail=self.path.strip("/") != "health") if worker else health(workers)
            self._send(200 if answer["status"] == "ok" else 503, answer)

        def do_POST(self):
            worker, what, error = route(self.path, workers)
            if error or what != "score":
                self._send(404, {"error": error or f"POST {self.path}: the health is a GET"})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY_BYTES:
                self._send(400, {"error": f"Content-Length must be 1..{MAX_BODY_BYTES} bytes"})
                return
            try:
                images, prompts, metadata = parse_request(self.rfile.read(length))
            except ValueError as e:  # JSONDecodeError is a ValueError
                self._send(400, {"error": str(e).splitlines()[0][:300]})
                return
            self._send(*worker.score(images, prompts, metadata))

    return Handler


def parse_rewards(values: list[str]) -> dict[str, str]:
    """--reward [NAME=]SPEC, repeated -> {name: spec}. An unnamed spec is named by itself when it is a plain name
    (pickscore), else 'reward' when it is the only one."""
    rewards: dict[str, str] = {}
    for value in values:
        name, sep, spec = value.partition("=")
        if not (sep and NAME.fullmatch(name) and spec):
            name, spec = value, value
            if not NAME.fullmatch(name):
                if len(values) > 1:
                    raise UserError(
                        f"--reward {value}: name it, --reward NAME={value}, when several are served."
                    )
                name = "reward"
        if name in rewards:
            raise UserError(f"--reward {value}: the name '{name}' is given twice; name each reward apart.")
        rewards[name] = spec
    return rewards


def parse_pythons(values: list[str], rewards: dict[str, str]) -> dict[str, str]:
    """--python NAME=VENV, repeated -> {name: python executable}."""
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or name not in rewards:
            raise UserError(
                f"--python {value}: write NAME=VENV with NAME one of the rewards ({', '.join(rewards)})."
            )
        out[name] = resolve_python(path)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--reward",
        action="append",
        required=True,
        help="[NAME=]SPEC, repeatable: a reward to serve as --reward of the trainers (a:1.0,b:0.5), reached at /NAME.",
    )
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        help="NAME=VENV, repeatable: run reward NAME's worker with this virtual environment's python (or this "
        "python executable); the kit is put on its path.",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."
    )
    parser.add_argument("--port", type=int, default=8000, help="Port (0: a free one, printed at start).")
    parser.add_argument(
        "--device",
        default=None,
        help="Where the rewards run (cpu, cuda, cuda:1); default cuda if any, else cpu.",
    )
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--reward_model_dir", default="checkpoint", help="Folder with the rewards' files.")
    parser.add_argument(
        "--max_batch_size",
        type=int,
        default=None,
        help="Score at most this many images (videos) in one call (a bigger request in chunks; merged requests up to it).",
    )
    parser.add_argument(
        "--batch_window_ms",
        type=float,
        default=0.0,
        help="Merge the requests to a reward that arrive within this many ms into one call (0: each request alone).",
    )
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=2,
        help="Start a reward's worker again at most this many times after it dies (0: never).",
    )
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """Every flag checked before a worker starts: -> ({name: spec}, {name: python}); a UserError otherwise."""
    from refl_ddpo.rewards import check_reward_files, is_differentiable

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: give 0..65535 (0 picks a free port).")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise UserError(f"--max_batch_size {args.max_batch_size}: give a positive number of images.")
    if args.batch_window_ms < 0 or args.max_restarts < 0:
        raise UserError("--batch_window_ms and --max_restarts: give 0 or more.")
    rewards = parse_rewards(args.reward)
    pythons = parse_pythons(args.python, rewards)
    for name, spec in rewards.items():
        if name not in pythons:  # one under another python is checked by its worker, where it imports
            is_differentiable(spec)  # unknown names fail here, before any model loads
            check_reward_files(spec, args.reward_model_dir)
    if args.device and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UserError(f"--device {args.device}: no CUDA GPU is visible here; use --device cpu.")
    return rewards, pythons


def _stop_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the workers' stop short
    raise KeyboardInterrupt  # main's finally ends the workers


@cli_main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rewards, pythons = check_args(args)
    from refl_ddpo.rewards import is_differentiable

    try:  # bind before loading the models: a busy port fails at once
        server = ThreadingHTTPServer((args.host, args.port), None)
    except OSError as e:
        raise UserError(
            f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pick another --port."
        ) from None
    settings = WorkerSettings(
        args.device, args.dtype, args.reward_model_dir, args.max_batch_size,
        args.batch_window_ms / 1000, args.max_restarts,
    )  # fmt: skip
    workers = {
        name: RewardWorker(
            name, spec, settings, pythons.get(name), None if name in pythons else is_differentiable(spec)
        )
        for name, spec in rewards.items()
    }
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        for worker in workers.values():
            worker.start()
        server.RequestHandlerClass = make_handler(workers)
        host, port = server.server_address[:2]
        print(
            f"serving rewards {', '.join(workers)} on http://{host}:{port} (GET /health, POST /NAME/score)",
            flush=True,
        )
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        stops = [threading.Thread(target=w.stop) for w in workers.values()]  # each may wait for its process
        for t in stops:
            t.start()
        for t in stops:
            t.join()


if __name__ == "__main__":
    main(sys.argv[1:])
