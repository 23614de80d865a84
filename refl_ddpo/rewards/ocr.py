"""`ocr` / `ocr:URL`: how well an image renders the text its prompt asks for (flow_grpo's text-rendering reward).
Not differentiable.

The target is the prompt's quoted text (flow_grpo's OCR prompts: 'A neon sign that reads "Open 24 Hours" ...'; the
first pair of double quotes), or the metadata's "ocr_text" when the prompt source gives one (--prompt_fn ocr_file
does). The text read from the image and the target are compared with spaces removed and in lower case:

    reward = 1 - min(d, n) / n      d = Levenshtein distance(read, target), 0 when the target appears in what was
                                    read; n = the target's length (so the reward is in [0, 1])

The reader: PaddleOCR for `ocr` (an optional extra, not in requirements.txt: `pip install paddleocr paddlepaddle`;
English, no angle classifier, the texts of one image joined), or, for `ocr:URL`, a VLM behind an OpenAI-compatible
server asked to transcribe the text (the one client: refl_ddpo.rewards.vlm_client).
"""

from __future__ import annotations

import numpy as np
import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.prompts import quoted_text
from refl_ddpo.rewards.vlm_client import VLM, answer_text

READ_QUESTION = (
    "Transcribe all the text written in this image, exactly as written. Answer with the text only, or with "
    "nothing if the image has no text."
)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions that turn a into b."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def ocr_score(read: str, target: str) -> float:
    """1 - min(d, n) / n (the module docstring), spaces removed and in lower case."""
    read, target = _normalise(read), _normalise(target)
    distance = 0 if target in read else min(edit_distance(read, target), len(target))
    return 1 - distance / len(target)


def target_of(prompt: str, metadata: dict) -> str:
    target = metadata.get("ocr_text") or quoted_text(prompt)
    if not target or not _normalise(target):
        raise UserError(
            f"ocr: the prompt {prompt[:60]!r} has no text in double quotes to render (flow_grpo's OCR prompts: "
            '... a sign that reads "Open" ...); use such prompts (--prompt_fn ocr_file --prompts_file F).'
        )
    return target


def paddle_text(result) -> str:
    """The text of one image from PaddleOCR's answer: 2.x's [[box, (text, confidence)], ...] (per image, in a
    list) or 3.x's results holding "rec_texts"; texts of confidence 0 are left out (flow_grpo's reading)."""
    texts = []
    for page in result or []:
        if isinstance(page, dict) or hasattr(page, "keys"):
            texts += [str(t) for t in page.get("rec_texts", [])]
            continue
        for line in page or []:
            text, confidence = line[1][0], line[1][1]
            if confidence > 0:
                texts.append(str(text))
    return "".join(texts)


class PaddleReader:
    """PaddleOCR (English, no angle classifier), imported when first built."""

    def __init__(self):
        try:
            from paddleocr import PaddleOCR
        except ImportError:
            raise UserError(
                "--reward ocr reads with PaddleOCR, which is not installed: `pip install paddleocr paddlepaddle` "
                "(an optional extra), or let a VLM read the text: --reward ocr:http://HOST:PORT/v1."
            ) from None
        try:
            self.ocr, self.v3 = PaddleOCR(use_angle_cls=False, lang="en", show_log=False), False
        except (TypeError, ValueError):  # 3.x dropped show_log / use_angle_cls
            self.ocr, self.v3 = PaddleOCR(use_textline_orientation=False, lang="en"), True

    def __call__(self, images: list[np.ndarray]) -> list[str]:
        if self.v3:
            return [paddle_text(self.ocr.predict(image)) for image in images]
        return [paddle_text(self.ocr.ocr(image, cls=False)) for image in images]


def vlm_reader(url: str, model: str | None, **client_options):
    """A reader that asks the VLM at `url` to transcribe each image's text, concurrently."""
    vlm = VLM(url, model, **client_options)

    def read(images: list[np.ndarray]) -> list[str]:
        tensors = [torch.from_numpy(image).permute(2, 0, 1).float() / 255 for image in images]
        return [answer_text(c) for c in vlm.chat([[t, READ_QUESTION] for t in tensors], max_tokens=64)]

    return read


def ocr(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    reader=None,
    **client_options,
):
    """The OCR reward; `reader` (images as uint8 [H, W, 3] arrays -> texts) replaces PaddleOCR / the VLM."""
    read = reader or (vlm_reader(url, model, **client_options) if url else PaddleReader())

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        targets = [target_of(p, m) for p, m in zip(prompts, metadata, strict=True)]
        arrays = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
        texts = read([np.ascontiguousarray(a) for a in arrays.cpu().numpy()])
        rewards = [ocr_score(text, target) for text, target in zip(texts, targets, strict=True)]
        return torch.tensor(rewards, dtype=torch.float32, device=device), {}

    return reward_fn
