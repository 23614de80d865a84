"""`geneval:URL`: GenEval (Ghosh et al. 2023) scored by flow_grpo's reward server (yifan123/reward-server,
app_geneval.py: mmdet's Mask2Former and a CLIP colour classifier, in their own environment). Not differentiable.

The server's protocol, as it defines it (pickle both ways, one POST to the URL itself):

    request   pickle of {"images": [JPEG bytes] * B, "meta_datas": [dict] * B, "only_strict": bool}
              each metadata is the prompt's line of GenEval's metadata JSONL: {"tag", "include", "exclude",
              "prompt"} (--prompt_fn geneval_file gives it)
    answer    200: pickle of {"scores": [float] * B, "rewards": [float] * B, "strict_rewards": [float] * B,
              "group_rewards": {tag: [float] * B}, "group_strict_rewards": {tag: [float] * B}}
              500: the traceback as text

The reward is "scores" (the fraction of the prompt's checks met: counts, colours, positions), as flow_grpo trains on
it; "strict_rewards" (1 when every check holds exactly) is logged as strict_accuracy, and "rewards" (GenEval's own
correctness) as accuracy unless only_strict (the default, as flow_grpo trains: the server then skips it).

The answer is read by an unpickler that admits plain data only (dict, list, tuple, str, bytes, int, float, bool,
None): any class or function it names is refused with one line naming the server, so a hostile or compromised server
cannot run code here. Images go as JPEG (quality 95), batches of at most 64 per request; timeouts, retries on
connection errors, timeouts and 5xx, one-line errors naming the URL.
"""

from __future__ import annotations

import io
import pickle
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from refl_ddpo.core.errors import UserError

TIMEOUT_S = 120.0
RETRIES = 2
BACKOFF_S = 1.0
BATCH = 64  # images per request
JPEG_QUALITY = 95
PLAIN = (dict, list, tuple, str, bytes, int, float, bool, type(None))


class PlainDataUnpickler(pickle.Unpickler):
    """Loads containers and scalars only: a pickle that names any global (a class, a function such as os.system)
    is refused before anything is built or called."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and only plain data is admitted")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, and only plain data is admitted")


def _check_plain(obj, depth: int = 0) -> None:
    if depth > 50 or not isinstance(obj, PLAIN):
        raise pickle.UnpicklingError(f"it holds a {type(obj).__name__}, and only plain data is admitted")
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_plain(key, depth + 1)
            _check_plain(value, depth + 1)
    elif isinstance(obj, list | tuple):
        for item in obj:
            _check_plain(item, depth + 1)


def load_plain(data: bytes, where: str):
    """Unpickle `data` admitting plain data only; anything else is a one-line UserError naming `where`."""
    try:
        obj = PlainDataUnpickler(io.BytesIO(data)).load()
        _check_plain(obj)
    except Exception as e:  # noqa: BLE001 (malformed pickles raise many kinds; each is a refusal)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{where} answered a pickle that was refused ({why}).") from None
    return obj


def jpeg_bytes(images: torch.Tensor) -> list[bytes]:
    """images [B, 3, H, W] in [0, 1] -> JPEG bytes per image (rounded to uint8)."""
    from PIL import Image

    arr = (
        (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    )
    out = []
    for image in arr:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image)).save(buf, format="JPEG", quality=JPEG_QUALITY)
        out.append(buf.getvalue())
    return out


class GenEvalClient:
    """POSTs batches to the GenEval reward server; `score(images, metadata, only_strict) -> dict of lists`."""

    def __init__(
        self, url: str, timeout: float = TIMEOUT_S, retries: int = RETRIES, backoff: float = BACKOFF_S
    ):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def _post(self, body: bytes) -> bytes:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                request = urllib.request.Request(
                    self.url, data=body, headers={"Content-Type": "application/octet-stream"}
                )
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as e:
                text = e.read().decode("utf-8", "replace").strip().splitlines()
                last = f"HTTP {e.code} {e.reason}" + (
                    f": {text[-1][:160]}" if text else ""
                )  # a traceback's last line
                if e.code < 500:
                    break
            except (TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                    reason = f"no answer within {self.timeout:g} s"
                last = (str(reason).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(
            f"geneval server {self.url}: failed after {attempt + 1} attempt(s) ({last}); check that GenEval's reward "
            "server (yifan123/reward-server, app_geneval.py) runs there."
        )

    def score(self, images: torch.Tensor, metadata: list[dict], only_strict: bool) -> dict[str, list[float]]:
        keys = ("scores", "strict_rewards") + (() if only_strict else ("rewards",))
        out: dict[str, list[float]] = {k: [] for k in keys}
        for start in range(0, len(images), BATCH):
            chunk = slice(start, start + BATCH)
            request = {
                "images": jpeg_bytes(images[chunk]),
                "meta_datas": list(metadata[chunk]),
                "only_strict": only_strict,
            }
            answer = load_plain(self._post(pickle.dumps(request)), f"geneval server {self.url}")
            size = len(request["images"])
            for key in keys:
                values = answer.get(key) if isinstance(answer, dict) else None
                if not (
                    isinstance(values, list | tuple)
                    and len(values) == size
                    and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
                ):
                    raise UserError(
                        f"geneval server {self.url}: its answer has no '{key}' of {size} numbers "
                        f"({str(answer)[:100]})."
                    )
                out[key] += [float(v) for v in values]
        return out


def _check_metadata(metadata: list[dict]) -> None:
    for m in metadata:
        if not (isinstance(m, dict) and "tag" in m and "include" in m):
            raise UserError(
                f"geneval: a prompt's metadata {str(m)[:80]} has no GenEval 'tag' and 'include'; give the prompts "
                "with --prompt_fn geneval_file --prompts_file F (GenEval's metadata JSONL)."
            )


def geneval(
    device: torch.device, dtype: torch.dtype, model_dir: str, url: str, only_strict: bool = True, **options
):
    """GenEval's score from its server at `url` (see the module docstring)."""
    client = GenEvalClient(url, **options)

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        _check_metadata(metadata)
        metadata = [{**m, "prompt": m.get("prompt", p)} for m, p in zip(metadata, prompts, strict=True)]
        out = client.score(images, metadata, only_strict)
        info = {"strict_accuracy": torch.tensor(out["strict_rewards"], device=device)}
        if not only_strict:
            info["accuracy"] = torch.tensor(out["rewards"], device=device)
        return torch.tensor(out["scores"], dtype=torch.float32, device=device), info

    return reward_fn
