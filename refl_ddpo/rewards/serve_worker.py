"""One reward in its own process, for the reward server (refl_ddpo.rewards.serve): the worker's entry point.

    python -m refl_ddpo.rewards.serve_worker --reward SPEC [--device cpu] [--dtype float32]
        [--reward_model_dir checkpoint] [--max_batch_size N]

It needs only this kit importable and the reward's own packages, so a scorer whose dependencies clash with the
server's runs under another virtual environment's python (the server starts it so, with --python NAME=VENV). It
loads the reward, then scores the batches it reads from stdin and answers on stdout, one at a time, until stdin
closes (the server stopped or died). Everything the reward prints goes to stderr: stdout carries only frames.

A frame is a header of two little-endian uint64 (the JSON's length, the payload's length), a JSON object, and a
payload of raw bytes:

    worker -> server, once loaded   {"ready": true, "differentiable": bool, "video": bool}, or
                                    {"error": "one line"} and exit
    server -> worker                {"shape": [B, 3, H, W] or [B, T, 3, H, W] (a reward of videos: "video"),
                                    "prompts": [str] * B, "metadata": [dict] * B}, payload: the images (videos)
                                    as C-order little-endian float32 in [0, 1]
    worker -> server                {"rewards": [float] * B, "info": {key: [float] * B or float}}, or
                                    {"error": "one line", "kind": "user" | "reward"}
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from typing import BinaryIO

HEADER = struct.Struct("<QQ")


def write_frame(stream: BinaryIO, obj: dict, payload: bytes = b"") -> None:
    """Writes one frame (JSON object + raw payload) and flushes."""
    body = json.dumps(obj).encode()
    stream.write(HEADER.pack(len(body), len(payload)) + body + payload)
    stream.flush()


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError(f"the stream closed with {left} of {n} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(stream: BinaryIO) -> tuple[dict, bytes]:
    """One frame -> (JSON object, payload); EOFError when the other side has gone."""
    size, payload_size = HEADER.unpack(_read_exactly(stream, HEADER.size))
    obj = json.loads(_read_exactly(stream, size))
    return obj, _read_exactly(stream, payload_size)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def _load(args: argparse.Namespace):
    """The reward of args.reward and whether it is differentiable (an unknown name or a missing file: UserError)."""
    from refl_ddpo.rewards import build_reward, check_reward_files, is_differentiable

    differentiable = is_differentiable(args.reward)  # a wrong spec fails before torch loads
    check_reward_files(args.reward, args.reward_model_dir)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reward = build_reward(args.reward, device, getattr(torch, args.dtype), args.reward_model_dir)
    return reward, device, differentiable


def score_batches(
    reward, images, prompts: list[str], metadata: list[dict], device, max_batch_size: int | None
):
    """The reward of every image, `max_batch_size` at a time: (rewards (B,) float32 on the CPU, info as JSON,
    per-image lists joined across the batches)."""
    import torch

    from refl_ddpo.rewards.remote import jsonable_info, read_wire_metadata

    step = max_batch_size or len(images)
    metadata = [read_wire_metadata(m) for m in metadata]
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


def _score(reward, device, request: dict, payload: bytes, max_batch_size: int | None) -> dict:
    import numpy as np
    import torch

    shape = request["shape"]
    if len(shape) == 5 and not reward.video:
        from refl_ddpo.core.errors import UserError

        raise UserError(
            f"{reward.name} scores images [B, 3, H, W], not videos {shape}: send their frames "
            "(remote:URL does so, by the trainer's --video_reduction)"
        )
    images = torch.from_numpy(np.frombuffer(payload, dtype="<f4").reshape(shape).copy())
    rewards, info = score_batches(
        reward, images, request["prompts"], request["metadata"], device, max_batch_size
    )
    return {"rewards": [float(r) for r in rewards], "info": info}


def serve(args: argparse.Namespace, inp: BinaryIO, out: BinaryIO) -> None:
    """Load, say ready, then answer every batch until `inp` closes."""
    import traceback

    from refl_ddpo.core.errors import UserError

    try:
        reward, device, differentiable = _load(args)
    except UserError as e:
        write_frame(out, {"error": str(e)})
        return
    except Exception as e:  # noqa: BLE001 (the server reports it as this reward's state)
        traceback.print_exc()
        write_frame(out, {"error": f"the reward did not load: {_first_line(e)}"})
        return
    write_frame(out, {"ready": True, "differentiable": differentiable, "video": reward.video})
    while True:
        try:
            request, payload = read_frame(inp)
        except EOFError:
            return
        try:
            answer = _score(reward, device, request, payload, args.max_batch_size)
        except UserError as e:  # e.g. a prompt the reward cannot read: the client's to fix
            answer = {"error": str(e).splitlines()[0], "kind": "user"}
        except Exception as e:  # noqa: BLE001 (the worker answers and keeps serving)
            traceback.print_exc()
            answer = {"error": f"the reward failed: {_first_line(e)}", "kind": "reward"}
        write_frame(out, answer)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reward", required=True, help="Reward spec, as --reward of the trainers.")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1; default cuda if any, else cpu.")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--reward_model_dir", default="checkpoint", help="Folder with the rewards' files.")
    parser.add_argument(
        "--max_batch_size", type=int, default=None, help="Score in chunks of this many images."
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the frames' channel
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a library's prints go to stderr, never into a frame
    try:
        serve(args, sys.stdin.buffer, out)
    except (BrokenPipeError, KeyboardInterrupt):  # the server has gone
        pass
    sys.stderr.flush()
    os._exit(
        0
    )  # nothing is left to save: skip the seconds an interpreter with a model loaded takes to tear down


if __name__ == "__main__":
    main(sys.argv[1:])
