"""`remote:URL`: a reward scored by a reward server (`python -m refl_ddpo.rewards.serve`) over HTTP. Not
differentiable (JSON carries no gradient): DDPO / GRPO and inference use it, ReFL refuses it.

A server of several rewards serves each at its own path: `remote:http://HOST:PORT/NAME` picks reward NAME (the
URL then reaches GET /NAME/health and POST /NAME/score); `remote:http://HOST:PORT` reaches a server of one reward.

Wire format (JSON only, no pickle), shared with refl_ddpo.rewards.serve:

    GET  /health  -> {"status": "ok", "reward": SPEC, "differentiable": bool, "video": bool} (several rewards:
                     {"status", "rewards": {NAME: state}}); 503 with {"status", "error"} while a reward loads or
                     is down
    POST /score   {"images": IMAGES, "prompts": [str] * B, "metadata": [dict] * B}
                  -> {"rewards": [float] * B, "info": {key: [float] * B or float}}
                  an error -> HTTP 4xx / 5xx with {"error": "one line"}

    IMAGES is {"encoding": "raw", "dtype": "float32" | "uint8", "shape": [B, 3, H, W], "data": base64 of the
    C-order bytes} (float32 in [0, 1], or uint8 0..255), or {"encoding": "png", "data": [base64 PNG] * B}; for
    a reward of whole videos ("video": true) raw IMAGES may hold videos, shape [B, T, 3, H, W] (a reward of images
    answers a 5-D request with a 400).
    An edit's source images (metadata "source_images", refl_ddpo.core.edit_data) travel in its metadata as IMAGES
    of shape [n, 3, H, W], its n references (`decode_images` reads them).

Videos: a served reward whose function takes whole videos (`.video = True`, e.g. temporal_consistency or a
VideoAlign-style scorer) says "video": true in /health; the client then takes videos itself (`reward_fn.video`), and
sends them whole. A served image reward gets frames: `build_reward` wraps the client in `frames_reward`, so the
trainer's --video_reduction picks the K frames and reduces their scores, and only those K frames per video travel
(mean:2 sends 2 of 81), not every frame for the server to reduce by a rule it does not know.

The client sends raw float32, so the server scores exactly the tensor the trainer holds: `remote:` equals the
reward in process (tests/test_remote_reward.py checks it to 1e-4). A batch is one request, or several of at most
REQUEST_BYTES of pixels each (a batch of long videos: two of 81 frames at 832 x 480 are 776 MB), each under the
server's 1 GiB body limit once in base64. Timeouts, a bounded
number of retries with backoff on connection errors, timeouts and 5xx answers (a reward still loading, or its worker
being started again, answers 503), and then a one-line UserError naming the URL and the reward when the server is
down, slow, or answers something that is not the format above.
"""

from __future__ import annotations

import base64
import io
import json
import math
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

import numpy as np

from refl_ddpo.core.errors import UserError

if (
    TYPE_CHECKING
):  # torch is imported where it is used: the reward server's HTTP process decodes with numpy alone
    import torch

TIMEOUT_S = 120.0  # one request (scoring a batch with a big model on a busy GPU can take a while)
RETRIES = 3  # extra attempts after the first, on connection errors, timeouts and 5xx answers
BACKOFF_S = 0.5  # waits 0.5, 1, 2 s between attempts
MAX_ERROR_CHARS = 300
MAX_BODY_BYTES = 1 << 30  # the server's limit on a request, 1 GiB: 64 float32 images at 1024 px are 800 MB
REQUEST_BYTES = 512 << 20  # a batch's float32 pixels per request (683 MiB in base64), at least one sample


# ---- wire format ----


def encode_images(images: torch.Tensor, dtype: str = "float32") -> dict:
    """images [B, 3, H, W] (or videos [B, T, 3, H, W]) in [0, 1] -> the JSON object of the wire format (raw
    bytes, base64)."""
    import torch

    x = images.detach().float().cpu()
    if dtype == "uint8":
        arr = (x.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    else:
        arr = x.numpy().astype("<f4")
    data = base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")
    return {"encoding": "raw", "dtype": dtype, "shape": list(arr.shape), "data": data}


def decode_images(obj) -> torch.Tensor:
    """The wire format's IMAGES -> float32 [B, 3, H, W] (raw: or [B, T, 3, H, W]) in [0, 1]; ValueError with one
    line for anything else."""
    import torch

    return torch.from_numpy(decode_array(obj))


def decode_array(obj) -> np.ndarray:
    """decode_images as a numpy array (float32 [B, 3, H, W] or [B, T, 3, H, W] in [0, 1], C-order)."""
    if not isinstance(obj, dict):
        raise ValueError("'images' must be an object with 'encoding' raw or png")  # noqa: TRY004 (a 400)
    encoding = obj.get("encoding", "raw")
    if encoding == "png":
        from PIL import Image

        data = obj.get("data")
        if not isinstance(data, list) or not data:
            raise ValueError("png images: 'data' must be a non-empty list of base64 PNG strings")
        arrays = []
        for i, item in enumerate(data):
            try:
                with Image.open(io.BytesIO(base64.b64decode(item, validate=True))) as im:
                    arrays.append(np.asarray(im.convert("RGB")))
            except Exception as e:  # noqa: BLE001 (PIL raises many kinds on bad bytes)
                raise ValueError(f"png image {i} could not be read ({type(e).__name__})") from None
        if len({a.shape for a in arrays}) != 1:
            raise ValueError("png images must all have the same size")
        # contiguous [B, 3, H, W], as the raw encoding gives: a reward then scores a PNG as it scores the same pixels
        # sent raw (a channels-last view rounds differently in the resize before a model, by up to about 1e-6)
        return np.ascontiguousarray(np.stack(arrays).transpose(0, 3, 1, 2)).astype(np.float32) / np.float32(
            255
        )
    if encoding != "raw":
        raise ValueError(f"unknown image encoding {encoding!r} (raw or png)")
    dtype, shape = obj.get("dtype"), obj.get("shape")
    if dtype not in ("float32", "uint8"):
        raise ValueError(f"raw images: dtype must be float32 or uint8, got {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) not in (4, 5)
        or shape[-3] != 3
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise ValueError(
            f"raw images: shape must be [B, 3, H, W] (videos: [B, T, 3, H, W]) of positive ints, got {shape!r}"
        )
    try:
        raw = base64.b64decode(obj.get("data", ""), validate=True)
    except (ValueError, TypeError):
        raise ValueError("raw images: 'data' is not base64") from None
    np_dtype = np.dtype("<f4") if dtype == "float32" else np.uint8
    if len(raw) != math.prod(shape) * np_dtype.itemsize:
        raise ValueError(f"raw images: {len(raw)} bytes do not hold {dtype} of shape {shape}")
    arr = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    return arr.astype(np.float32) / np.float32(255) if dtype == "uint8" else arr.copy()


def jsonable_info(info: dict, batch: int) -> dict:
    """The info dict's scalars and (B,) tensors as JSON numbers; other entries are left out."""
    import torch

    out = {}
    for key, value in info.items():
        if torch.is_tensor(value):
            value = value.detach().float().cpu()
            if value.ndim == 0:
                out[key] = float(value)
            elif value.shape == (batch,):
                out[key] = [float(v) for v in value]
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


# ---- client ----


def wire_metadata(metadata: dict) -> dict:
    """A sample's metadata as the request carries it: its source images, if any, as IMAGES [n, 3, H, W]."""
    import torch

    from refl_ddpo.core.edit_data import SOURCE_IMAGES, source_tensors

    if not metadata.get(SOURCE_IMAGES):
        return metadata
    return {**metadata, SOURCE_IMAGES: encode_images(torch.stack(source_tensors(metadata)))}


def read_wire_metadata(metadata: dict) -> dict:
    """wire_metadata undone on the server: the source images back as a list of (3, H, W) tensors."""
    from refl_ddpo.core.edit_data import SOURCE_IMAGES

    if not isinstance(metadata.get(SOURCE_IMAGES), dict):
        return metadata
    return {**metadata, SOURCE_IMAGES: list(decode_images(metadata[SOURCE_IMAGES]))}


def _first_line(text: str) -> str:
    return (str(text).strip().splitlines() or [""])[0][:MAX_ERROR_CHARS]


class RemoteReward:
    """Calls a reward server: `__call__(images, prompts, metadata) -> (rewards (B,), info)` like any reward; a
    batch bigger than REQUEST_BYTES goes in several requests."""

    def __init__(
        self, url: str, timeout: float = TIMEOUT_S, retries: int = RETRIES, backoff: float = BACKOFF_S
    ):
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.reward = ""  # the reward's name or spec, once /health has told it

    def _where(self) -> str:
        return f"reward server {self.url}" + (f" (reward {self.reward})" if self.reward else "")

    def _request(self, path: str, payload: dict | None = None, timeout: float | None = None) -> dict:
        """JSON in, JSON out, with retries; every failure is a one-line UserError naming the URL."""
        url = self.url + path
        data = None if payload is None else json.dumps(payload, default=str).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                    body = response.read()
            except urllib.error.HTTPError as e:
                try:
                    message = json.loads(e.read() or b"{}").get("error", "")
                except (ValueError, AttributeError):
                    message = ""
                last = f"HTTP {e.code} {e.reason}" + (f": {_first_line(message)}" if message else "")
                if e.code < 500:  # our request was wrong (or the URL is): asking again will not help
                    break
                continue
            except (TimeoutError, OSError) as e:  # URLError is an OSError; so are refused connections
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                    reason = f"no answer within {timeout or self.timeout:g} s"
                last = _first_line(str(reason)) or type(e).__name__
                continue
            try:
                answer = json.loads(body)
            except ValueError:
                raise UserError(
                    f"{self._where()}: {path} answered something that is not JSON "
                    f"({_first_line(body.decode('utf-8', 'replace'))[:80]!r}); is {self.url} a refl_ddpo reward "
                    "server (python -m refl_ddpo.rewards.serve)?"
                ) from None
            if not isinstance(answer, dict):
                raise UserError(f"{self._where()}: {path} answered JSON that is not an object.")
            return answer
        raise UserError(
            f"{self._where()}: {path} failed after {self.retries + 1} attempt(s) ({last}); check that "
            "`python -m refl_ddpo.rewards.serve` runs there and the URL is right."
        )

    def health(self, timeout: float = 10.0) -> dict:
        answer = self._request("/health", timeout=timeout)
        if "reward" not in answer and isinstance(answer.get("rewards"), dict):
            names = list(answer["rewards"])
            raise UserError(
                f"reward server {self.url} serves several rewards ({', '.join(names)}): name one, "
                f"remote:{self.url}/{names[0] if names else 'NAME'}."
            )
        if answer.get("status") != "ok":
            raise UserError(f"{self._where()}: /health answered {json.dumps(answer)[:120]}.")
        self.reward = str(answer.get("name") or answer.get("reward") or "")
        return answer

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        import torch

        step = max(1, REQUEST_BYTES // max(1, images[:1].numel() * 4))
        if 4 * math.ceil(images[:1].numel() * 4 / 3) > MAX_BODY_BYTES:  # one image or video, in base64
            raise UserError(
                f"{self._where()}: one sample of shape {tuple(images.shape[1:])} is over the server's "
                f"{MAX_BODY_BYTES >> 20} MiB request in base64; score fewer frames (--video_reduction mean:K for "
                "an image reward) or a smaller --resolution."
            )
        if len(images) <= step:
            return self._score(images, prompts, metadata)
        parts = [
            self._score(images[i : i + step], prompts[i : i + step], metadata[i : i + step])
            for i in range(0, len(images), step)
        ]
        info = {  # per-sample values joined; a scalar described one request only, so it is left out
            key: torch.cat([p[1][key] for p in parts])
            for key in parts[0][1]
            if all(key in p[1] and p[1][key].ndim == 1 for p in parts)
        }
        return torch.cat([p[0] for p in parts]), info

    def _score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        import torch

        batch = len(images)
        answer = self._request(
            "/score",
            {
                "images": encode_images(images),
                "prompts": list(prompts),
                "metadata": [wire_metadata(m) for m in metadata],
            },
        )
        rewards = answer.get("rewards")
        if (
            not isinstance(rewards, list)
            or len(rewards) != batch
            or not all(isinstance(r, int | float) and not isinstance(r, bool) for r in rewards)
        ):
            raise UserError(
                f"{self._where()}: /score answered {json.dumps(answer)[:120]}, not {batch} rewards "
                "as a list of numbers under 'rewards'."
            )
        info = {}
        for key, value in (answer.get("info") or {}).items():
            if isinstance(value, list) and len(value) == batch:
                info[key] = torch.tensor(value, dtype=torch.float32)
            elif isinstance(value, int | float):
                info[key] = torch.tensor(float(value))
        return torch.tensor(rewards, dtype=torch.float32), info


def remote(device: torch.device, dtype: torch.dtype, model_dir: str, url: str, **options):
    """The reward of the server at `url`; checks /health first, so a server that is down fails before training. A
    served reward of whole videos makes this one take videos too (`.video`): they are sent whole."""
    client = RemoteReward(url, **options)
    video = bool(client.health().get("video"))

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        rewards, info = client(images, prompts, metadata)
        return rewards.to(device), {k: v.to(device) for k, v in info.items()}

    reward_fn.video = video
    return reward_fn
