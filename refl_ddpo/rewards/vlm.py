"""Rewards judged by a vision-language model behind an OpenAI-compatible chat server (vLLM, sglang, ...). Not
differentiable.

    vlm_judge       asks "Does this image show {prompt}? Answer yes or no." (--vlm_question) about each image;
                    the reward is P(yes) / (P(yes) + P(no)) from the answer token's top log-probs when the server
                    returns them, else 1 for an answer starting with yes and 0 for no (anything else is an error).
    vlm_bertscore   ddpo-pytorch's prompt-image alignment (Black et al. 2023, its LLaVA + BERTScore server): the VLM
                    describes the image ("Describe this image in one sentence."), and the reward is the BERTScore
                    recall of the prompt against that description, computed here with a transformers encoder:
                    each prompt token's greatest cosine similarity to a description token, averaged over the prompt's
                    tokens (contextual embeddings of one hidden layer, special tokens left out, no idf weighting,
                    no baseline rescaling; Zhang et al. 2020).

Server: `vlm_judge:URL` / `vlm_bertscore:URL`, else $OPENAI_BASE_URL; the URL is the API base as the openai client
takes it (http://host:8000/v1; a URL with no path gets /v1). $OPENAI_API_KEY, when set, is sent as a bearer token.
The model is --vlm_model, else the first of the server's GET /models. Each image goes as a base64 PNG data URL in one
chat request (POST /chat/completions, temperature 0); a batch's requests run concurrently, which servers batch.

BERTScore model: `<reward_model_dir>/bertscore/` (an AutoModel folder with its tokenizer), else the hub id
roberta-large (bert_score's default for English), read at hidden layer min(17, layers) (17 is bert_score's layer for
roberta-large).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import torch

from refl_ddpo.core.errors import UserError

JUDGE_QUESTION = "Does this image show {prompt}? Answer yes or no."
DESCRIBE_QUESTION = "Describe this image in one sentence."
TIMEOUT_S = 120.0
RETRIES = 2
BACKOFF_S = 0.5
MAX_CONCURRENT = 16
BERTSCORE_DIR = "bertscore"
BERTSCORE_HUB_ID = "roberta-large"
BERTSCORE_LAYER = 17


def _one_line(text) -> str:
    return (str(text).strip().splitlines() or [""])[0][:200]


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
    """POST /chat/completions and GET /models of an OpenAI-compatible server, with timeouts, retries and one-line
    errors naming the URL."""

    def __init__(
        self, base_url: str, timeout: float = TIMEOUT_S, retries: int = RETRIES, backoff: float = BACKOFF_S
    ):
        self.base_url = base_url
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        key = os.environ.get("OPENAI_API_KEY")
        self.headers = {
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {}),
        }

    def request(self, path: str, payload: dict | None = None) -> dict:
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                req = urllib.request.Request(url, data=data, headers=self.headers)
                with urllib.request.urlopen(req, timeout=self.timeout) as response:
                    body = response.read()
            except urllib.error.HTTPError as e:
                detail = _one_line(e.read().decode("utf-8", "replace"))[:150]
                last = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
                if e.code < 500 and e.code != 429:
                    break
                continue
            except (TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                    reason = f"no answer within {self.timeout:g} s"
                last = _one_line(reason) or type(e).__name__
                continue
            try:
                answer = json.loads(body)
            except ValueError:
                raise UserError(
                    f"vlm server {self.base_url}: {path} answered something that is not JSON "
                    f"({_one_line(body.decode('utf-8', 'replace'))[:80]!r}); is it an OpenAI-compatible API base "
                    "(http://HOST:PORT/v1)?"
                ) from None
            if not isinstance(answer, dict):
                raise UserError(f"vlm server {self.base_url}: {path} answered JSON that is not an object.")
            return answer
        raise UserError(
            f"vlm server {self.base_url}: {path} failed after {self.retries + 1} attempt(s) ({last}); check that "
            "the server runs and OPENAI_BASE_URL / the reward's URL is its API base (http://HOST:PORT/v1)."
        )

    def first_model(self) -> str:
        answer = self.request("/models")
        data = answer.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise UserError(
                f"vlm server {self.base_url}: /models lists no model ({json.dumps(answer)[:100]}); pass --vlm_model."
            )
        return str(data[0]["id"])


def _message(answer: dict, base_url: str) -> dict:
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


def yes_probability(choice: dict, base_url: str) -> float:
    """P(yes) / (P(yes) + P(no)) over the first answer token's top log-probs when present and holding either word,
    else 1.0 / 0.0 from the text; an answer that is neither is a UserError."""
    with contextlib.suppress(
        KeyError, IndexError, TypeError, ValueError
    ):  # no usable log-probs: read the text
        top = choice["logprobs"]["content"][0]["top_logprobs"]
        p = {"yes": 0.0, "no": 0.0}
        for item in top:
            word = str(item["token"]).strip().strip(".,!").lower()
            if word in p:
                p[word] += math.exp(float(item["logprob"]))
        if p["yes"] + p["no"] > 0:
            return p["yes"] / (p["yes"] + p["no"])
    text = choice["message"]["content"].strip().lower()
    if text.startswith("yes"):
        return 1.0
    if text.startswith("no"):
        return 0.0
    raise UserError(
        f"vlm server {base_url}: the judge answered {_one_line(choice['message']['content'])[:80]!r}, neither yes "
        "nor no; ask a question it answers with yes or no (--vlm_question)."
    )


class VLM:
    """Asks the server one question per image, concurrently; returns the chosen choices (dicts) in order."""

    def __init__(self, base_url: str | None, model: str | None, **client_options):
        self.client = ChatClient(resolve_base_url(base_url), **client_options)
        self.model = (
            model or self.client.first_model()
        )  # also checks that the server answers, before training

    def ask(self, images: torch.Tensor, questions: list[str], max_tokens: int, logprobs: bool) -> list[dict]:
        def one(i: int) -> dict:
            payload = {
                "model": self.model,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": questions[i]},
                            {"type": "image_url", "image_url": {"url": image_data_url(images[i])}},
                        ],
                    }
                ],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            if logprobs:
                payload.update(logprobs=True, top_logprobs=5)
            return _message(self.client.request("/chat/completions", payload), self.client.base_url)

        with ThreadPoolExecutor(min(len(images), MAX_CONCURRENT) or 1) as pool:
            return list(pool.map(one, range(len(images))))


def _question(template: str, prompt: str) -> str:
    return template.replace("{prompt}", prompt)


def vlm_judge(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    **client_options,
):
    vlm = VLM(url, model, **client_options)
    template = question or JUDGE_QUESTION

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        choices = vlm.ask(images, [_question(template, p) for p in prompts], max_tokens=1, logprobs=True)
        rewards = [yes_probability(c, vlm.client.base_url) for c in choices]
        return torch.tensor(rewards, dtype=torch.float32, device=device), {}

    return reward_fn


# ---- BERTScore recall ----


class BERTScorer:
    """BERTScore recall of references against candidates with a transformers encoder (see the module docstring)."""

    def __init__(self, model_dir: str | os.PathLike, device, layer: int | None = None):
        import transformers
        from transformers import AutoModel, AutoTokenizer

        local = Path(model_dir) / BERTSCORE_DIR
        source = str(local) if (local / "config.json").is_file() else BERTSCORE_HUB_ID
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source)
            self.model = AutoModel.from_pretrained(source).to(device).eval()
        except (OSError, ValueError) as e:
            raise UserError(
                f"vlm_bertscore: BERTScore model not found at {local} and {BERTSCORE_HUB_ID} could not be loaded "
                f"({_one_line(e)}); put an AutoModel folder with its tokenizer there (save_pretrained)."
            ) from None
        finally:
            transformers.logging.set_verbosity(verbosity)
        self.model.requires_grad_(False)
        self.layer = layer if layer is not None else min(BERTSCORE_LAYER, self.model.config.num_hidden_layers)
        self.device = device

    @torch.no_grad()
    def embed(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, D) L2-normalised token embeddings of hidden layer `layer`, and the (B, L) mask of real tokens
        (padding and the special tokens, e.g. [CLS] [SEP], are left out)."""
        tokens = self.tokenizer(
            list(texts), padding=True, truncation=True, return_tensors="pt", return_special_tokens_mask=True
        )
        special = tokens.pop("special_tokens_mask").bool()
        tokens = tokens.to(self.device)
        hidden = self.model(**tokens, output_hidden_states=True).hidden_states[self.layer]
        mask = tokens["attention_mask"].bool() & ~special.to(self.device)
        return torch.nn.functional.normalize(hidden.float(), dim=-1), mask

    def recall(self, candidates: list[str], references: list[str]) -> torch.Tensor:
        """(B,) mean over each reference's tokens of the greatest cosine to a token of its candidate."""
        cand, cand_mask = self.embed(candidates)
        ref, ref_mask = self.embed(references)
        sim = ref @ cand.transpose(1, 2)  # (B, L_ref, L_cand)
        sim = sim.masked_fill(~cand_mask[:, None, :], -2.0)
        best = sim.max(dim=2).values  # (B, L_ref)
        count = ref_mask.sum(1)
        recall = (best * ref_mask).sum(1) / count.clamp(min=1)
        empty = (count == 0) | (cand_mask.sum(1) == 0)  # nothing to compare: no alignment
        return torch.where(empty, torch.zeros_like(recall), recall).cpu()


def vlm_bertscore(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    max_tokens: int = 64,
    **client_options,
):
    scorer = BERTScorer(model_dir, device)  # local first: a missing model fails before the server is asked
    vlm = VLM(url, model, **client_options)
    template = question or DESCRIBE_QUESTION

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        choices = vlm.ask(images, [_question(template, p) for p in prompts], max_tokens, logprobs=False)
        descriptions = [c["message"]["content"].strip() for c in choices]
        rewards = scorer.recall(descriptions, list(prompts))
        return rewards.to(device=device, dtype=torch.float32), {}

    return reward_fn
