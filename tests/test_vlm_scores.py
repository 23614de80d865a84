"""The VLM client's modes against a stand-in OpenAI-compatible server on 127.0.0.1 (http.server in this process):
unifiedreward's "Final Score" forms, vlm_yesno's P(yes), geneval2's Soft-TIFA, the pairwise judge; and the client's
robustness: slow, failing and malformed answers, a bound on the requests in flight (one line, nothing lost)."""

import base64
import io
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import build_reward, is_differentiable, parse_reward_spec
from refl_ddpo.rewards.pairwise import PAIRWISE, build_pairwise
from refl_ddpo.rewards.vlm_scores import final_score, geneval_questions, plural, vlm_pairwise

MODEL = "stand-in-vlm"


def _redness(url: str) -> float:
    png = base64.b64decode(url.split(",", 1)[1])
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(float).mean((0, 1)) / 255
    return float(rgb[0])


def _top(pairs):
    return {
        "content": [
            {
                "token": pairs[0][0],
                "logprob": 0.0,
                "top_logprobs": [{"token": t, "logprob": math.log(p)} for t, p in pairs],
            }
        ]
    }


class StandIn(BaseHTTPRequestHandler):
    """Answers by the red channel of the images: `answer(handler, request, reds)` -> (HTTP code, body or choice)."""

    answer = None
    requests: list
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send(self, code: int, obj) -> None:
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with cls.lock:
                cls.requests.append(request)
            content = request["messages"][0]["content"]
            reds = [_redness(p["image_url"]["url"]) for p in content if p["type"] == "image_url"]
            text = " ".join(p["text"] for p in content if p["type"] == "text")
            code, out = cls.answer(self, request, reds, text)
            if code == 200 and isinstance(out, dict) and "message" in out:
                out = {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [out]}
            self._send(code, out)
        finally:
            self.leave()

    def leave(self):
        """No longer in flight (once): a request the client gave up on leaves when the client's timeout passes."""
        cls = type(self)
        with cls.lock:
            if not getattr(self, "left", False):
                cls.in_flight -= 1
                self.left = True


def _choice(text, logprobs=None):
    choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return choice


class Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that gave up on a slow answer closed its end (BrokenPipeError)


@pytest.fixture
def server():
    """A stand-in on a free port; yields (base URL with /v1, the handler class to set `answer` on)."""
    handler = type(
        "H", (StandIn,), {"requests": [], "in_flight": 0, "most_in_flight": 0, "lock": threading.Lock()}
    )
    httpd = Quiet(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler
    httpd.shutdown()
    httpd.server_close()


def _images(reds):
    images = torch.zeros(len(reds), 3, 8, 8)
    for i, r in enumerate(reds):
        images[i, 0] = r
    return images


FAST = {"retries": 0, "timeout": 5.0}


def test_unifiedreward_reads_the_final_score_forms(server):
    url, handler = server
    forms = [
        "Final Score: {s}",
        "The image is fine.\nFinal Score (1-5): {s}",
        "**Final Score:** {s}",
        "Alignment 2. Final Score: 1\nOn reflection, Final Score: {s}",
    ]

    def answer(h, request, reds, text):
        score = round(1 + 4 * reds[0], 1)
        return 200, _choice(forms[len(h.requests) % len(forms)].format(s=score))

    handler.answer = answer
    reward = build_reward(f"unifiedreward:{url}", "cpu")
    assert not is_differentiable(f"unifiedreward:{url}")
    reds = [0.0, 0.25, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    rewards, _ = reward(_images(reds), ["a red cat"] * 8, [{}] * 8)
    expected = [round(1 + 4 * round(r * 255) / 255, 1) / 5 for r in reds]
    assert torch.allclose(rewards, torch.tensor(expected)), (rewards, expected)
    request = handler.requests[0]
    assert request["model"] == MODEL and request["temperature"] == 0.0
    kinds = [p["type"] for p in request["messages"][0]["content"]]
    assert (
        kinds == ["image_url", "text"]
        and "Text Caption: [a red cat]" in request["messages"][0]["content"][1]["text"]
    )
    assert final_score("final score: 3", 5.0, url) == 0.6


def test_unifiedreward_without_a_score_is_one_line(server):
    url, handler = server
    handler.answer = lambda h, r, reds, t: (200, _choice("A lovely picture.\nNo number here."))
    reward = build_reward(f"unifiedreward:{url}", "cpu", options={"unifiedreward": FAST})
    with pytest.raises(UserError) as e:
        reward(_images([0.5]), ["a"], [{}])
    assert "\n" not in str(e.value) and "Final Score" in str(e.value) and url in str(e.value)
    handler.answer = lambda h, r, reds, t: (200, _choice("Final Score: 9"))  # out of [0, 5]
    with pytest.raises(UserError, match="Final Score"):
        reward(_images([0.5]), ["a"], [{}])


def test_vlm_yesno_is_p_yes_from_logprobs(server):
    url, handler = server

    def answer(h, request, reds, text):
        p = 0.1 + 0.8 * reds[0]
        top = [("Yes", p * 0.6), (" yes", p * 0.4), ("No", (1 - p) * 0.9)]
        return 200, _choice("Yes", _top(top))

    handler.answer = answer
    reward = build_reward(f"vlm_yesno:{url}", "cpu", options={"vlm_yesno": {"model": "m2"}})
    reds = [0.0, 1.0, 0.5]
    rewards, _ = reward(_images(reds), ["a", "b", "c"], [{}] * 3)
    expected = [0.1 + 0.8 * round(r * 255) / 255 for r in reds]  # Yes + yes, not normalised against No
    assert torch.allclose(rewards, torch.tensor(expected), atol=1e-6)
    assert all(r["max_tokens"] == 1 and r["logprobs"] and r["top_logprobs"] == 20 for r in handler.requests)
    assert all(r["model"] == "m2" for r in handler.requests)
    texts = sorted(r["messages"][0]["content"][1]["text"] for r in handler.requests)
    assert texts == [f'Does this image show "{p}"? Answer with Yes or No.' for p in "abc"]
    handler.answer = lambda h, r, reds, t: (200, _choice("Yes"))  # no log-probs: no probability to read
    with pytest.raises(UserError) as e:
        reward(_images([0.5]), ["a"], [{}])
    assert "\n" not in str(e.value) and "log-probs" in str(e.value)


def test_geneval2_soft_tifa_on_vqa_list_and_on_geneval_metadata(server):
    url, handler = server
    probs = {
        "How many cats are in the image? Answer in one word.": [("two", 0.5), ("2", 0.2), ("three", 0.3)],
        "Are the cats red? Answer in one word.": [("Yes", 0.9), ("No", 0.1)],
        "Are there any cats in the image? Answer in one word.": [("yes", 0.6), (" Yes", 0.3)],
    }

    def answer(h, request, reds, text):
        return 200, _choice("x", _top(probs.get(text, [("No", 0.99), ("yes", 0.01)])))

    handler.answer = answer
    reward = build_reward(f"geneval2:{url}", "cpu")
    vqa = [
        ["How many cats are in the image?", "two"],
        ["Are the cats red?", "Yes"],
        ["Are there any cats in the image?", "Yes"],
    ]
    metadata = [
        {"vqa_list": vqa},
        {
            "tag": "counting",
            "include": [{"class": "cat", "count": 2, "color": "red"}],
            "exclude": [{"class": "dog", "count": 1}],
        },
    ]
    rewards, info = reward(_images([0.5, 0.5]), ["two red cats", "two red cats"], metadata)
    scores = [0.7, 0.9, 0.9]  # "two" + "2"; Yes; yes + " Yes"
    am, gm = sum(scores) / 3, math.prod(scores) ** (1 / 3)
    # the GenEval lines ask the same three, then "Are there any dogs" (answer no: 0.99)
    am2, gm2 = (sum(scores) + 0.99) / 4, math.prod([*scores, 0.99]) ** (1 / 4)
    assert torch.allclose(rewards, torch.tensor([am, am2]), atol=1e-6)
    assert torch.allclose(info["soft_tifa_gm"], torch.tensor([gm, gm2]), atol=1e-6)
    assert len(handler.requests) == 7
    gm_reward = build_reward(f"geneval2:{url}", "cpu", options={"geneval2": {"aggregate": "gm"}})
    assert torch.allclose(gm_reward(_images([0.5]), ["x"], metadata[:1])[0], torch.tensor([gm]), atol=1e-6)
    with pytest.raises(UserError) as e:
        reward(_images([0.5]), ["a cat"], [{}])
    assert "\n" not in str(e.value) and "geneval_file" in str(e.value)


def test_geneval_questions_from_the_include_lists():
    assert (
        plural("wine glass") == "wine glasses" and plural("person") == "people" and plural("bus") == "buses"
    )
    assert plural("teddy bear") == "teddy bears" and plural("toothbrush") == "toothbrushes"
    metadata = {
        "tag": "position",
        "include": [
            {"class": "laptop", "count": 1},
            {"class": "cow", "count": 1, "position": ["right of", 0]},
        ],
    }
    assert geneval_questions(metadata) == [
        ("Are there any laptops in the image?", "yes"),
        ("How many laptops are in the image?", "one"),
        ("Are there any cows in the image?", "yes"),
        ("How many cows are in the image?", "one"),
        ("Is the cow to the right of the laptop?", "yes"),
    ]


def test_pairwise_judge_prefers_the_redder_image_in_both_orders(server):
    url, handler = server

    def answer(h, request, reds, text):
        p1 = 0.2 + 0.6 * (reds[0] > reds[1]) + 0.1  # a position bias of +0.1 towards Image 1
        return 200, _choice("1", _top([("1", p1), ("2", 1 - p1)]))

    handler.answer = answer
    assert PAIRWISE["vlm_pairwise"] == ("refl_ddpo.rewards.vlm_scores", "vlm_pairwise")
    vlm_judge = vlm_pairwise(url=url)

    def judge(prompt, a, b):  # one pair through the batched contract of --pairwise_reward
        return vlm_judge([prompt], a[None], b[None], [{}])[0]

    red, blue = _images([0.9, 0.1])
    p = judge("a red square", red, blue)
    assert abs(p - (0.9 + 1 - 0.3) / 2) < 1e-6  # (P(1 | a, b) + 1 - P(1 | b, a)) / 2: the bias cancels
    assert abs(judge("a red square", blue, red) - (1 - p)) < 1e-6
    assert len(handler.requests) == 4
    kinds = [part["type"] for part in handler.requests[0]["messages"][0]["content"]]
    assert kinds == ["text", "image_url", "text", "image_url", "text"]
    handler.answer = lambda h, r, reds, t: (
        200,
        _choice("Image 2 is better." if reds[0] < reds[1] else "Image 1 is better."),
    )
    assert vlm_pairwise(url=url, both_orders=False)(["x"], red[None], blue[None])[0] == 1.0
    a, b = torch.stack([red, blue] * 3), torch.stack([blue, red] * 3)  # six pairs in one call
    assert vlm_judge(["x"] * 6, a, b, [{}] * 6) == [1.0, 0.0] * 3
    p = build_pairwise(f"vlm_pairwise:{url}", "cpu")(["x"] * 2, a[:2], b[:2], [{}] * 2)  # by name, checked
    assert p.tolist() == [1.0, 0.0]
    handler.answer = lambda h, r, reds, t: (200, _choice("Both are nice."))
    with pytest.raises(UserError) as e:
        judge("x", red, blue)
    assert "\n" not in str(e.value) and "neither 1 nor 2" in str(e.value)


def test_slow_failing_and_bounded_nothing_lost(server):
    """One slow answer per image (past the timeout) and a 500 per image: retried; every image keeps its own score,
    in order; at most max_concurrent requests in flight."""
    url, handler = server
    seen: dict = {}

    def answer(h, request, reds, text):
        key = round(reds[0], 3)
        with h.lock:
            seen[key] = seen.get(key, 0) + 1
            n = seen[key]
        if n == 1:
            time.sleep(0.45)
            h.leave()  # the client's 0.5 s timeout: it gives up and asks again
            time.sleep(0.6)
        if n == 2:
            return 503, {"error": {"message": "busy"}}
        time.sleep(0.05)
        return 200, _choice(f"Final Score: {1 + 4 * reds[0]:.4f}")

    handler.answer = answer
    options = {"unifiedreward": {"timeout": 0.5, "retries": 2, "backoff": 0.01, "max_concurrent": 3}}
    reward = build_reward(f"unifiedreward:{url}", "cpu", options=options)
    reds = [i / 10 for i in range(10)]
    rewards, _ = reward(_images(reds), ["p"] * 10, [{}] * 10)
    expected = torch.tensor([(1 + 4 * round(r * 255) / 255) / 5 for r in reds])
    assert torch.allclose(rewards, expected, atol=1e-4)
    assert all(n == 3 for n in seen.values()) and len(seen) == 10
    assert handler.most_in_flight <= 3


def test_failing_and_malformed_answers_are_one_line(server):
    url, handler = server
    handler.answer = lambda h, r, reds, t: (500, {"error": {"message": "CUDA out of memory\nTraceback ..."}})
    reward = build_reward(f"vlm_yesno:{url}", "cpu", options={"vlm_yesno": {"retries": 1, "backoff": 0.01}})
    with pytest.raises(UserError) as e:
        reward(_images([0.5, 0.5]), ["a", "b"], [{}, {}])
    message = str(e.value)
    assert "\n" not in message and url in message and "2 attempt(s)" in message and "HTTP 500" in message
    for body in (b"<html>not json</html>", {"choices": [{"message": {"content": None}}]}, [1, 2]):
        handler.answer = lambda h, r, reds, t, body=body: (200, body)
        with pytest.raises(UserError) as e:
            reward(_images([0.5]), ["a"], [{}])
        assert "\n" not in str(e.value) and url in str(e.value)


def test_specs_and_the_server_check():
    assert parse_reward_spec("unifiedreward:http://h:8000/v1@0.5,vlm_yesno,geneval2") == [
        ("unifiedreward:http://h:8000/v1", 0.5),
        ("vlm_yesno", 1.0),
        ("geneval2", 1.0),
    ]
    import os

    from refl_ddpo.trainers.ddpo_config import parse_ddpo_config

    if os.environ.get("OPENAI_BASE_URL"):
        pytest.skip("OPENAI_BASE_URL is set here")
    with pytest.raises(UserError, match="OPENAI_BASE_URL"):
        parse_ddpo_config(["--reward", "geneval2", "--pretrained_model", "none"])
