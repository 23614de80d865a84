"""A reward server: any reward of the registry over HTTP with JSON, for a trainer on another process or machine.

    python -m refl_ddpo.rewards.serve --reward SPEC [--host 127.0.0.1] [--port 8000] [--device cuda]
        [--reward_model_dir checkpoint] [--dtype float32] [--max_batch_size N]

then train or score with `--reward remote:http://HOST:PORT`. GET /health answers {"status": "ok", ...}; POST /score
takes a batch (format: refl_ddpo.rewards.remote) and scores it in one call of the reward (or in chunks of
--max_batch_size), one batch at a time. JSON only: nothing sent is unpickled or executed. It listens on 127.0.0.1
unless --host says otherwise; it has no authentication, so expose it only on a network you trust.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from refl_ddpo.core.errors import UserError, cli_main

MAX_BODY_BYTES = 1 << 30  # 1 GiB: a batch of 64 float32 images at 1024 px is 800 MB


def parse_request(body: bytes):
    """A POST /score body -> (images [B, 3, H, W], prompts, metadata); ValueError (a 400) if it is malformed."""
    from refl_ddpo.rewards.remote import decode_images

    request = json.loads(body)
    if not isinstance(request, dict):
        raise ValueError("the body must be a JSON object")  # noqa: TRY004 (a 400)
    images = decode_images(request.get("images"))
    prompts = request.get("prompts")
    metadata = request.get("metadata") or [{} for _ in range(len(images))]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if len(prompts) != len(images) or not isinstance(metadata, list) or len(metadata) != len(images):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts / {len(metadata)} metadata")
    return images, prompts, metadata


def score_batches(
    reward, images, prompts: list[str], metadata: list[dict], device, max_batch_size: int | None
):
    """The reward of every image, `max_batch_size` at a time: (rewards (B,) float32 on the CPU, info as JSON,
    per-image lists joined across the batches)."""
    import torch

    from refl_ddpo.rewards.remote import jsonable_info

    step = max_batch_size or len(images)
    rewards, infos = [], []
    with torch.no_grad():
        for i in range(0, len(images), step):
            r, info = reward(images[i : i + step].to(device), prompts[i : i + step], metadata[i : i + step])
            rewards.append(r.detach().float().cpu())
            infos.append(jsonable_info(info, len(r)))
    info = {}
    for key in infos[0]:
        parts = [part.get(key) for part in infos]
        if all(isinstance(p, list) for p in parts):
            info[key] = [v for p in parts for v in p]
        elif len(parts) == 1:
            info[key] = parts[0]
    return torch.cat(rewards), info


def make_handler(reward, spec: str, differentiable: bool, device, max_batch_size: int | None):
    lock = threading.Lock()  # one batch at a time on the model

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
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "reward": spec, "differentiable": differentiable})
            else:
                self._send(404, {"error": f"no {self.path}: GET /health or POST /score"})

        def do_POST(self):
            if self.path.rstrip("/") != "/score":
                self._send(404, {"error": f"no {self.path}: GET /health or POST /score"})
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
            try:
                with lock:
                    rewards, info = score_batches(reward, images, prompts, metadata, device, max_batch_size)
            except UserError as e:  # e.g. a prompt the reward cannot read: the client's to fix
                self._send(400, {"error": str(e)})
                return
            except Exception as e:  # noqa: BLE001 (the server answers 500 and keeps serving)
                traceback.print_exc()
                first = (str(e).strip().splitlines() or [""])[0][:300]
                self._send(500, {"error": f"the reward failed: {type(e).__name__}: {first}"})
                return
            self._send(200, {"rewards": [float(r) for r in rewards], "info": info})

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--reward", required=True, help="Reward spec, as --reward of the trainers (a:1.0,b:0.5)."
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."
    )
    parser.add_argument("--port", type=int, default=8000, help="Port (0: a free one, printed at start).")
    parser.add_argument(
        "--device",
        default=None,
        help="Where the reward runs (cpu, cuda, cuda:1); default cuda if any, else cpu.",
    )
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--reward_model_dir", default="checkpoint", help="Folder with the rewards' files.")
    parser.add_argument(
        "--max_batch_size",
        type=int,
        default=None,
        help="Score a request in chunks of at most this many images.",
    )
    return parser.parse_args(argv)


@cli_main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from refl_ddpo.rewards import check_reward_files, is_differentiable

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: give 0..65535 (0 picks a free port).")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise UserError(f"--max_batch_size {args.max_batch_size}: give a positive number of images.")
    differentiable = is_differentiable(args.reward)  # unknown names fail here, before any model loads
    check_reward_files(args.reward, args.reward_model_dir)
    import torch

    from refl_ddpo.rewards import build_reward

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA GPU is visible here; use --device cpu.")
    try:  # bind before loading the model: a busy port fails at once
        server = ThreadingHTTPServer((args.host, args.port), None)
    except OSError as e:
        raise UserError(
            f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pick another --port."
        ) from None
    try:
        reward = build_reward(args.reward, device, getattr(torch, args.dtype), args.reward_model_dir)
        server.RequestHandlerClass = make_handler(
            reward, args.reward, differentiable, device, args.max_batch_size
        )
        host, port = server.server_address[:2]
        print(f"serving reward {args.reward} on http://{host}:{port} (GET /health, POST /score)", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main(sys.argv[1:])
