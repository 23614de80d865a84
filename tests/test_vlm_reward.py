"""vlm_judge and vlm_bertscore against a local stand-in OpenAI-compatible server (http.server in this process):
the request carries the image and the question, the scoring follows the answer, BERTScore recall equals a
direct computation, and train_ddpo.sh --preset prompt_image_alignment runs end to end against the stand-in."""

import base64
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from helpers import run_in_process, watch_training
from PIL import Image

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.lora import CONFIG_NAME, LORA_WEIGHTS_NAME
from refl_ddpo.rewards import build_reward, is_differentiable

MODEL = "stand-in-vlm"


class StandIn(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat server that judges by colour: 'yes' when the attached image is mostly red.
    Records every request; `mode` picks the answer's form."""

    mode = "text"  # text | logprobs | describe | maybe | broken
    requests: list

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
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(request)
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": "not found"}})
            return
        if self.mode == "broken":
            self._send(200, {"choices": []})
            return
        content = request["messages"][0]["content"]
        url = next(part["image_url"]["url"] for part in content if part["type"] == "image_url")
        png = base64.b64decode(url.removeprefix("data:image/png;base64,"))
        rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(float).mean((0, 1))
        red = rgb[0] > 128 and rgb[1] < 128
        p_yes = 0.8 if red else 0.3
        choice = {"index": 0, "message": {"role": "assistant", "content": "Yes" if red else "No"}}
        if self.mode == "logprobs":
            choice["logprobs"] = {
                "content": [
                    {
                        "token": choice["message"]["content"],
                        "logprob": math.log(max(p_yes, 1 - p_yes)),
                        "top_logprobs": [
                            {"token": "Yes", "logprob": math.log(p_yes * 0.9)},
                            {"token": " no", "logprob": math.log((1 - p_yes) * 0.9)},
                            {"token": "Maybe", "logprob": math.log(0.1)},
                        ],
                    }
                ]
            }
        elif self.mode == "describe":
            choice["message"]["content"] = "a red cat sitting on a mat" if red else "a blue sky"
        elif self.mode == "maybe":
            choice["message"]["content"] = "Perhaps."
        self._send(200, {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [choice]})


@pytest.fixture
def stand_in():
    """Start a stand-in server on a free port; yields (base URL with /v1, handler class to set `mode` on)."""
    handler = type("H", (StandIn,), {"requests": [], "mode": "text"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", handler
    server.shutdown()
    server.server_close()


def _red_and_blue():
    images = torch.zeros(2, 3, 16, 16)
    images[0, 0] = 0.9  # red
    images[1, 2] = 0.9  # blue
    return images


def test_judge_request_and_yes_no_scores(stand_in, monkeypatch):
    url, handler = stand_in
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    reward = build_reward("vlm_judge", "cpu")  # URL from the environment, model from /v1/models
    assert not is_differentiable("vlm_judge")
    rewards, _ = reward(_red_and_blue(), ["a red square", "a red circle"], [{}, {}])
    assert rewards.tolist() == [1.0, 0.0]
    assert len(handler.requests) == 2
    for request in handler.requests:
        assert request["model"] == MODEL
        text = next(p["text"] for p in request["messages"][0]["content"] if p["type"] == "text")
        image = next(p for p in request["messages"][0]["content"] if p["type"] == "image_url")
        assert image["image_url"]["url"].startswith("data:image/png;base64,")
        assert text.startswith("Does this image show a red ") and "Answer yes or no" in text
    asked = sorted(
        next(p["text"] for p in r["messages"][0]["content"] if p["type"] == "text") for r in handler.requests
    )
    assert asked == sorted(
        f"Does this image show {p}? Answer yes or no." for p in ("a red square", "a red circle")
    )


def test_judge_reads_p_yes_from_logprobs(stand_in):
    url, handler = stand_in
    handler.mode = "logprobs"
    reward = build_reward(f"vlm_judge:{url}", "cpu", options={"vlm_judge": {"model": "given-model"}})
    rewards, _ = reward(_red_and_blue(), ["a", "b"], [{}, {}])
    # P(yes) / (P(yes) + P(no)) over the top log-probs: 0.8 and 0.3, "Maybe" left out
    assert torch.allclose(rewards, torch.tensor([0.8, 0.3]), atol=1e-6)
    assert all(r["model"] == "given-model" and r["logprobs"] for r in handler.requests)


def test_malformed_answers_dead_and_wrong_urls_are_one_line(stand_in, monkeypatch):
    url, handler = stand_in
    fast = {"vlm_judge": {"retries": 0, "timeout": 5.0}}
    for mode, expected in (("maybe", "neither yes nor no"), ("broken", "no choices[0].message.content")):
        handler.mode = mode
        reward = build_reward(f"vlm_judge:{url}", "cpu", options=fast)
        with pytest.raises(UserError) as e:
            reward(_red_and_blue(), ["a", "b"], [{}, {}])
        assert "\n" not in str(e.value) and expected in str(e.value)
    with pytest.raises(UserError) as e:  # the API base given without /v1's right path
        build_reward(f"vlm_judge:{url}/wrong", "cpu", options=fast)
    assert "\n" not in str(e.value) and "HTTP 404" in str(e.value)
    from tests.test_remote_reward import free_port

    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(UserError) as e:
        build_reward(f"vlm_judge:{dead}", "cpu", options=fast)
    assert "\n" not in str(e.value) and dead in str(e.value)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(UserError) as e:
        build_reward("vlm_judge", "cpu")
    assert "OPENAI_BASE_URL" in str(e.value)


def _recall_by_hand(scorer, candidate: str, reference: str) -> float:
    """BERTScore recall written out: per reference token (special tokens dropped), max cosine over candidate tokens."""

    def embed(text):
        tokens = scorer.tokenizer(text, return_tensors="pt")
        hidden = scorer.model(**tokens, output_hidden_states=True).hidden_states[scorer.layer][0]
        return hidden[1:-1]  # [CLS] ... [SEP]

    ref, cand = embed(reference), embed(candidate)
    best = [max(float(torch.cosine_similarity(r, c, dim=0)) for c in cand) for r in ref]
    return sum(best) / len(best)


def test_bertscore_recall_equals_the_direct_computation(tiny_models):
    from refl_ddpo.rewards.vlm import BERTScorer

    scorer = BERTScorer(tiny_models, "cpu")
    assert scorer.layer == 2  # the tiny BERT's last layer (min(17, layers))
    candidates = ["a red cat sitting on a mat", "a blue sky", "cat"]
    references = ["a cat", "a red cat on a mat with a long tail", "a cat"]
    with torch.no_grad():
        ours = scorer.recall(candidates, references)
        expected = [_recall_by_hand(scorer, c, r) for c, r in zip(candidates, references, strict=True)]
    assert torch.allclose(ours, torch.tensor(expected), atol=1e-5), (ours, expected)
    same = scorer.recall(["a red cat"], ["a red cat"])
    assert abs(float(same[0]) - 1) < 1e-5  # a prompt recalls itself fully


def test_vlm_bertscore_describes_then_scores(stand_in, tiny_models):
    url, handler = stand_in
    handler.mode = "describe"
    reward = build_reward(f"vlm_bertscore:{url}", "cpu", model_dir=str(tiny_models))
    prompts = ["a red cat", "a red cat"]
    rewards, _ = reward(_red_and_blue(), prompts, [{}, {}])
    from refl_ddpo.rewards.vlm import BERTScorer

    expected = BERTScorer(tiny_models, "cpu").recall(["a red cat sitting on a mat", "a blue sky"], prompts)
    assert torch.allclose(rewards, expected) and rewards[0] > rewards[1]
    assert all(
        any(p.get("text") == "Describe this image in one sentence." for p in r["messages"][0]["content"])
        for r in handler.requests
    )


def test_prompt_image_alignment_preset_trains_end_to_end(stand_in, tiny_models, tmp_path, monkeypatch):
    """train_ddpo.sh's trainer (in this process, under the script's recipe) with --preset prompt_image_alignment and
    OPENAI_BASE_URL on the stand-in server: it trains (its LoRA moved, no base weight did), each image is described
    once, the config names the preset."""
    watch = watch_training(monkeypatch)
    url, handler = stand_in
    handler.mode = "describe"
    out = tmp_path / "pia"
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    args = [
        "--preset",
        "prompt_image_alignment",
        "--pretrained_model",
        str(tiny_models / "stable-diffusion"),
        "--reward_model_dir",
        str(tiny_models),
        "--output_dir",
        str(out),
        "--resolution",
        "32",
        "--sample_num_steps",
        "2",
        "--sample_batch_size",
        "2",
        "--sample_num_batches_per_epoch",
        "1",
        "--train_batch_size",
        "2",
        "--train_gradient_accumulation_steps",
        "1",
        "--num_epochs",
        "1",
        "--device",
        "cpu",
        "--report_to",
        "none",
        "--async_reward_computation",
    ]
    run_in_process(monkeypatch, "train_ddpo.sh", args)
    assert (out / LORA_WEIGHTS_NAME).is_file()
    watch.assert_lora_moved_and_base_not(out)
    assert len(handler.requests) == 2  # one epoch of 2 images, each described once
    assert all(r["model"] == MODEL for r in handler.requests)
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["reward"] == "vlm_bertscore" and config["preset"] == "prompt_image_alignment"


def test_preset_without_a_server_is_refused_before_loading(tmp_path, monkeypatch):
    from refl_ddpo.trainers.ddpo_config import parse_ddpo_config

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(UserError) as e:
        parse_ddpo_config(
            ["--preset", "prompt_image_alignment", "--pretrained_model", str(tmp_path / "none")]
        )
    assert "OPENAI_BASE_URL" in str(e.value) and "--preset prompt_image_alignment" in str(e.value)
