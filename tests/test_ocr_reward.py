"""The OCR reward equals its closed form, 1 - min(d, n) / n, on text images PIL draws, read by a stand-in reader (in
process, and as a VLM behind a stand-in OpenAI-compatible server: ocr:URL); PaddleOCR's answers parsed; a missing
PaddleOCR and a prompt without quoted text are one line."""

import base64
import hashlib
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import build_reward, is_differentiable
from refl_ddpo.rewards.ocr import edit_distance, ocr_score, paddle_text, quoted_text

# (prompt, the text drawn, the closed form by hand: targets and readings with spaces dropped, lower case)
CASES = [
    ('A neon sign that reads "Open 24 Hours" at night', "OPEN 24 HOURS", 1.0),
    ('A chalkboard with "Hello World" on it', "Hel1o World", 1 - 1 / 10),  # one substitution in 10
    ('A mug printed with "Coffee"', "The Coffee Shop", 1.0),  # the target appears in what was read
    ('A banner saying "Open"', "abc", 1 - 4 / 4),  # 4 edits, the most counted is n
    ('A poster with "Spring Sale"', "Sprng Sal", 1 - 2 / 10),  # two deletions
    ('A label "Tea"', "", 0.0),  # nothing read
]


def _draw(text: str) -> np.ndarray:
    image = Image.new("RGB", (160, 32), "white")
    ImageDraw.Draw(image).text((4, 10), text, fill="black")
    return np.asarray(image)


def _key(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def drawn():
    """The images [B, 3, H, W] in [0, 1], and what a perfect reader reads from each (by its pixels)."""
    arrays = [_draw(text) for _, text, _ in CASES]
    images = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255
    return images, {_key(a): text for a, (_, text, _) in zip(arrays, CASES, strict=True)}


def test_closed_form_on_drawn_text(drawn):
    images, texts = drawn
    calls = []

    def reader(arrays):
        calls.append(len(arrays))
        return [texts[_key(a)] for a in arrays]

    reward = build_reward("ocr", "cpu", options={"ocr": {"reader": reader}})
    assert not is_differentiable("ocr")
    rewards, _ = reward(images, [p for p, _, _ in CASES], [{}] * len(CASES))
    assert torch.allclose(rewards, torch.tensor([r for _, _, r in CASES]), atol=1e-6), rewards
    assert calls == [len(CASES)]
    # the metadata's ocr_text (--prompt_fn ocr_file) is the target when given
    rewards, _ = reward(images[:1], ["no quotes here"], [{"ocr_text": "open 24"}])
    assert rewards.tolist() == [1.0]


def test_edit_distance_and_quotes():
    assert (
        edit_distance("kitten", "sitting") == 3
        and edit_distance("", "abc") == 3
        and edit_distance("ab", "ab") == 0
    )
    assert ocr_score("HelloWorld", "Hello World") == 1.0
    assert quoted_text('a sign "Open" and "Closed"') == "Open" and quoted_text("a sign “Café” here") == "Café"
    assert quoted_text("no quotes") is None


class StandInVLM(BaseHTTPRequestHandler):
    texts: dict
    questions: list

    def log_message(self, *args):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"data": [{"id": "reader"}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = request["messages"][0]["content"]
        url = next(p["image_url"]["url"] for p in content if p["type"] == "image_url")
        array = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
        type(self).questions.append(next(p["text"] for p in content if p["type"] == "text"))
        self._send({"choices": [{"message": {"content": self.texts[_key(array)]}}]})


def test_a_vlm_reads_the_text(drawn):
    images, texts = drawn
    handler = type("H", (StandInVLM,), {"texts": texts, "questions": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
        reward = build_reward(f"ocr:{url}", "cpu")
        rewards, _ = reward(images, [p for p, _, _ in CASES], [{}] * len(CASES))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert torch.allclose(rewards, torch.tensor([r for _, _, r in CASES]), atol=1e-6)
    assert len(handler.questions) == len(CASES) and all("Transcribe" in q for q in handler.questions)


def test_paddle_answers_parsed_and_its_absence_is_one_line(monkeypatch):
    v2 = [[[[0, 0]] * 4, ("OPEN", 0.98)], [[[0, 0]] * 4, ("24", 0.0)], [[[0, 0]] * 4, ("HOURS", 0.9)]]
    assert paddle_text([v2]) == "OPENHOURS" and paddle_text([None]) == ""
    assert paddle_text([{"rec_texts": ["OPEN", "24"], "rec_scores": [0.9, 0.8]}]) == "OPEN24"
    import sys

    monkeypatch.setitem(sys.modules, "paddleocr", None)  # not installed
    with pytest.raises(UserError) as e:
        build_reward("ocr", "cpu")
    assert "\n" not in str(e.value) and "pip install paddleocr" in str(e.value) and "ocr:http" in str(e.value)
    from refl_ddpo.trainers.ddpo_config import parse_ddpo_config

    with pytest.raises(UserError, match="pip install paddleocr"):  # before any model loads
        parse_ddpo_config(["--reward", "ocr", "--pretrained_model", "none"])


def test_a_prompt_without_quoted_text_is_one_line(drawn):
    images, _ = drawn
    reward = build_reward("ocr", "cpu", options={"ocr": {"reader": lambda arrays: ["x"] * len(arrays)}})
    with pytest.raises(UserError) as e:
        reward(images[:1], ["a cat"], [{}])
    assert "\n" not in str(e.value) and "double quotes" in str(e.value)
