"""The one client of the VLM rewards: an OpenAI-compatible chat server (vLLM, sglang, ...) asked about images.

Server: the reward's URL (`vlm_judge:URL`, `unifiedreward:URL`, ...), else $OPENAI_BASE_URL; the URL is the API base
as the openai client takes it (http://host:8000/v1; a URL with no path gets /v1). $OPENAI_API_KEY, when set, is sent
as a bearer token. The model is the reward's `model` option (--vlm_model), else the first of the server's GET /models.

Each question is one chat request (POST /chat/completions, temperature 0) whose user message holds its parts in order:
text parts and images (base64 PNG data URLs). A batch's requests run concurrently, at most `max_concurrent` at once
per client (a semaphore, so several threads scoring at once share the bound); each has a timeout and a few retries
with backoff on connection errors, timeouts, HTTP 429 and 5xx; every failure is one line naming the server.

Answers are read by the functions below: `answer_text`, `token_probability` (the probability the server gives a set
of answer words as the first token, from its top log-probs) and `yes_probability` (vlm_judge's normalised form).
`fill_prompt` and `judged_reward` are the rewards' common glue: a question template's prompt, and a reward function
of the rewards' contract around a judge that gives one float per image.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import numpy as np
import torch

from refl_ddpo.core.errors import UserError

TIMEOUT_S = 120.0  # one request (a long answer from a busy server can take a while)
RETRIES = 2  # extra attempts after the first, on connection errors, timeouts, 429 and 5xx
BACKOFF_S = 0.5  # waits 0.5, 1, ... s between attempts
MAX_CONCURRENT = 16  # requests in flight at once, per client

Part = str | torch.Tensor  # a text part, or an image [3, H, W] in [0, 1]
Judge = Callable[
    [torch.Tensor, list[str]], list[float]
]  # (images [B, 3, H, W], prompts) -> one reward per image


def one_line(text) -> str:
    return (str(text).strip().splitlines() or [""])[0][:200]


def fill_prompt(template: str, prompt: str) -> str:
    """A question template with its `{prompt}` replaced by the prompt (other braces kept as they are)."""
    return template.replace("{prompt}", prompt)


def judged_reward(device: torch.device, judge: Judge):
    """The reward function (images, prompts, metadata) -> (rewards [B] float32 on `device`, {}) of `judge`."""

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        return torch.tensor(judge(images, prompts), dtype=torch.float32, device=device), {}

    return reward_fn


def image_data_url(image: torch.Tensor) -> str:
    """image [3, H, W] in [0, 1] -> 'data:image/png;base64,...' (rounded to uint8)."""
    from PIL import Image

    arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def resolve_base_url(url: str | None) -> str:
    url = url or os.environ.get("OPENAI_BASE_URL")
    if not url:
        raise UserError(
            "vlm rewards need an OpenAI-compatible server: set OPENAI_BASE_URL=http://HOST:PORT/v1 or write "
            "--reward vlm_judge:http://HOST:PORT/v1."
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(
            f"vlm server URL '{url}' is not an http(s) URL with a host (e.g. http://127.0.0.1:8000/v1)."
        )
    url = url.rstrip("/")
    return url + "/v1" if parts.path in ("", "/") else url


class ChatClient:
    """POST /chat/completions and GET /models of an OpenAI-compatible server, with timeouts, retries, a bound on the
    requests in flight, and one-line errors naming the URL."""

    def __init__(
        self,
        base_url: str,
        timeout: float = TIMEOUT_S,
        retries: int = RETRIES,
        backoff: float = BACKOFF_S,
        max_concurrent: int = MAX_CONCURRENT,
    ):
        if max_concurrent < 1:
            raise UserError(f"vlm server {base_url}: max_concurrent must be >= 1 (got {max_concurrent}).")
        self.base_url = base_url
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.max_concurrent = max_concurrent
        self.slots = threading.BoundedSemaphore(max_concurrent)
        key = os.environ.get("OPENAI_API_KEY")
        self.headers = {
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        }

    def _attempt(self, url: str, data: bytes | None) -> tuple[bytes | None, str, bool]:
        """One request: (body, '', _) on success, else (None, what went wrong, whether asking again may help)."""
        try:
            req = urllib.request.Request(url, data=data, headers=self.headers)
            with self.slots, urllib.request.urlopen(req, timeout=self.timeout) as response:
                return response.read(), "", False
        except urllib.error.HTTPError as e:
            detail = one_line(e.read().decode("utf-8", "replace"))[:150]
            return (
                None,
                f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else ""),
                e.code >= 500 or e.code == 429,
            )
        except (TimeoutError, OSError) as e:  # URLError is an OSError; so are refused connections
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                reason = f"no answer within {self.timeout:g} s"
            return None, one_line(reason) or type(e).__name__, True

    def request(self, path: str, payload: dict | None = None) -> dict:
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            body, last, again = self._attempt(url, data)
            if body is not None:
                return self._decode(path, body)
            if not again:
                break
        raise UserError(
            f"vlm server {self.base_url}: {path} failed after {attempt + 1} attempt(s) ({last}); check that "
            "the server runs and OPENAI_BASE_URL / the reward's URL is its API base (http://HOST:PORT/v1)."
        )

    def _decode(self, path: str, body: bytes) -> dict:
        try:
            answer = json.loads(body)
        except ValueError:
            raise UserError(
                f"vlm server {self.base_url}: {path} answered something that is not JSON "
                f"({one_line(body.decode('utf-8', 'replace'))[:80]!r}); is it an OpenAI-compatible API base "
                "(http://HOST:PORT/v1)?"
            ) from None
        if not isinstance(answer, dict):
            raise UserError(f"vlm server {self.base_url}: {path} answered JSON that is not an object.")
        return answer

    def first_model(self) -> str:
        answer = self.request("/models")
        data = answer.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise UserError(
                f"vlm server {self.base_url}: /models lists no model ({json.dumps(answer)[:100]}); pass --vlm_model."
            )
        return str(data[0]["id"])


def first_choice(answer: dict, base_url: str) -> dict:
    """choices[0] of a chat answer, checked to carry a text message; else one line naming the server."""
    try:
        choice = answer["choices"][0]
        content = choice["message"]["content"]
        if not isinstance(content, str):
            raise TypeError
    except (KeyError, IndexError, TypeError):
        raise UserError(
            f"vlm server {base_url}: /chat/completions answered {json.dumps(answer)[:120]}, with no "
            "choices[0].message.content text."
        ) from None
    return choice


def answer_text(choice: dict) -> str:
    return choice["message"]["content"].strip()


def _word(token) -> str:
    return str(token).strip().strip(".,!:;\"'").lower()


def top_logprobs(choice: dict) -> list[dict] | None:
    """The first answer token's top log-probs [{token, logprob}], or None when the server sent none."""
    with contextlib.suppress(KeyError, IndexError, TypeError):
        top = choice["logprobs"]["content"][0]["top_logprobs"]
        if isinstance(top, list) and top:
            return top
    return None


def token_probability(top: list[dict], words: set[str]) -> float:
    """Sum of the probabilities of the top first tokens that read as one of `words` (lower case, stripped of spaces
    and punctuation: 'Yes', ' yes' and 'yes.' are all 'yes'). A word outside the top log-probs counts 0."""
    return sum(math.exp(float(item["logprob"])) for item in top if _word(item.get("token")) in words)


def yes_probability(choice: dict, base_url: str) -> float:
    """P(yes) / (P(yes) + P(no)) over the first answer token's top log-probs when present and holding either word,
    else 1.0 / 0.0 from the text; an answer that is neither is a UserError."""
    with contextlib.suppress(KeyError, TypeError, ValueError):  # no usable log-probs: read the text
        top = top_logprobs(choice)
        if top is not None:
            p_yes, p_no = token_probability(top, {"yes"}), token_probability(top, {"no"})
            if p_yes + p_no > 0:
                return p_yes / (p_yes + p_no)
    text = answer_text(choice).lower()
    if text.startswith("yes"):
        return 1.0
    if text.startswith("no"):
        return 0.0
    raise UserError(
        f"vlm server {base_url}: the judge answered {one_line(choice['message']['content'])[:80]!r}, neither yes "
        "nor no; ask a question it answers with yes or no (--vlm_question)."
    )


class VLM:
    """Asks the server questions about images, concurrently; returns the chosen choices (dicts) in order."""

    def __init__(self, base_url: str | None, model: str | None, **client_options):
        self.client = ChatClient(resolve_base_url(base_url), **client_options)
        self.model = (
            model or self.client.first_model()
        )  # also checks that the server answers, before training

    @property
    def base_url(self) -> str:
        return self.client.base_url

    def payload(self, parts: list[Part], max_tokens: int, logprobs: int) -> dict:
        content = [
            {"type": "text", "text": p}
            if isinstance(p, str)
            else {"type": "image_url", "image_url": {"url": image_data_url(p)}}
            for p in parts
        ]
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if logprobs:
            payload.update(logprobs=True, top_logprobs=logprobs)
        return payload

    def chat(self, messages: list[list[Part]], max_tokens: int, logprobs: int = 0) -> list[dict]:
        """One request per message (a list of text and image parts); `logprobs` > 0 asks for that many top
        log-probs per token. The choices in the messages' order."""

        def one(parts: list[Part]) -> dict:
            answer = self.client.request("/chat/completions", self.payload(parts, max_tokens, logprobs))
            return first_choice(answer, self.base_url)

        if not messages:
            return []
        with ThreadPoolExecutor(min(len(messages), self.client.max_concurrent)) as pool:
            return list(pool.map(one, messages))

    def ask(self, images: torch.Tensor, questions: list[str], max_tokens: int, logprobs: bool) -> list[dict]:
        """One question per image (the text first, then the image)."""
        messages = [[q, images[i]] for i, q in enumerate(questions)]
        return self.chat(messages, max_tokens, 5 if logprobs else 0)

    def ask_each(
        self, images: torch.Tensor, template: str, prompts: list[str], max_tokens: int, logprobs: int = 0
    ) -> list[dict]:
        """The template's question about each image and its prompt (the image first, then the text)."""
        messages = [[images[i], fill_prompt(template, p)] for i, p in enumerate(prompts)]
        return self.chat(messages, max_tokens, logprobs)
