"""geneval:URL against a stand-in of flow_grpo's GenEval reward server on 127.0.0.1 (pickle both ways): the request
as that server reads it, the scores back in order over several batches, and a hostile answer refused before anything
in it runs; failures are one line naming the server."""

import io
import os
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import build_reward, is_differentiable
from refl_ddpo.rewards.geneval import load_plain

METADATA = {
    "tag": "color_attr",
    "include": [{"class": "giraffe", "count": 1, "color": "red"}],
    "prompt": "a photo of a red giraffe",
}


class StandIn(BaseHTTPRequestHandler):
    """GenEval's server in miniature: POST / with a pickle; the score is the images' mean red, strict when > 0.5."""

    requests: list
    reply = None  # bytes to answer instead (a hostile pickle), or None

    def log_message(self, *args):
        pass

    def do_POST(self):
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))  # the test's own: trusted
        type(self).requests.append(data)
        if self.reply is not None:
            code, body = self.reply
        else:
            reds = [
                np.asarray(Image.open(io.BytesIO(b), formats=["jpeg"]))[..., 0].mean() / 255
                for b in data["images"]
            ]
            scores = [round(float(r), 2) for r in reds]
            strict = [1.0 if s > 0.5 else 0.0 for s in scores]
            answer = {
                "scores": scores,
                "rewards": strict,
                "strict_rewards": strict,
                "group_rewards": {"color_attr": strict},
                "group_strict_rewards": {"color_attr": strict},
            }
            code, body = 200, pickle.dumps(answer)
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    handler = type("H", (StandIn,), {"requests": [], "reply": None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()
    httpd.server_close()


def _images(reds):
    images = torch.zeros(len(reds), 3, 16, 16)
    for i, r in enumerate(reds):
        images[i, 0] = r
    return images


def test_geneval_scores_in_order_over_batches(server, monkeypatch):
    url, handler = server
    monkeypatch.setattr("refl_ddpo.rewards.geneval.BATCH", 2)
    reward = build_reward(f"geneval:{url}", "cpu")
    assert not is_differentiable(f"geneval:{url}")
    reds = [0.1, 0.9, 0.3, 0.7, 0.5]
    metadata = [{k: v for k, v in METADATA.items() if k != "prompt"} for _ in reds]
    rewards, info = reward(_images(reds), ["a photo of a red giraffe"] * 5, metadata)
    assert torch.allclose(rewards, torch.tensor(reds), atol=0.011), rewards  # JPEG and rounding
    assert info["strict_accuracy"].tolist() == [0.0, 1.0, 0.0, 1.0, float(rewards[4] > 0.5)]
    assert [len(r["images"]) for r in handler.requests] == [2, 2, 1]
    first = handler.requests[0]
    assert set(first) == {"images", "meta_datas", "only_strict"} and first["only_strict"] is True
    assert first["meta_datas"][0] == METADATA  # the line as GenEval's server reads it, with its prompt
    assert all(isinstance(b, bytes) and b[:2] == b"\xff\xd8" for b in first["images"])  # JPEG
    both = build_reward(f"geneval:{url}", "cpu", options={"geneval": {"only_strict": False}})
    assert "accuracy" in both(_images([0.9]), ["p"], metadata[:1])[1]


class Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_answer_is_refused_and_nothing_runs(server, tmp_path):
    url, handler = server
    marker = tmp_path / "ran"
    reward = build_reward(f"geneval:{url}", "cpu")
    answers = [
        {"scores": [Hostile(marker)], "strict_rewards": [1.0]},  # os.system inside a plain dict
        Hostile(marker),
        {"scores": [np.float64(0.5)], "strict_rewards": [1.0]},  # numpy scalars are not plain data either
    ]
    for answer in answers:
        handler.reply = (200, pickle.dumps(answer))
        with pytest.raises(UserError) as e:
            reward(_images([0.5]), ["p"], [METADATA])
        message = str(e.value)
        assert "\n" not in message and url in message and "refused" in message
    assert not marker.exists()  # nothing ran
    with pytest.raises(UserError, match="only plain data"):
        load_plain(pickle.dumps({"a": {1, 2}}), "here")  # a set is built without a global, refused after
    assert load_plain(pickle.dumps({"a": [1, 2.5, "x", b"y", None, True, (1,)]}), "here")["a"][2] == "x"


def test_server_errors_and_bad_answers_are_one_line(server):
    url, handler = server
    reward = build_reward(f"geneval:{url}", "cpu", options={"geneval": {"retries": 1, "backoff": 0.01}})
    handler.reply = (500, b"Traceback (most recent call last):\n  File x\nKeyError: 'tag'\n")
    with pytest.raises(UserError) as e:
        reward(_images([0.5]), ["p"], [METADATA])
    assert "\n" not in str(e.value) and "KeyError: 'tag'" in str(e.value) and "2 attempt(s)" in str(e.value)
    assert len(handler.requests) == 2  # a 5xx is asked again
    handler.reply = (200, pickle.dumps({"scores": [0.5, 0.5], "strict_rewards": [1.0]}))
    with pytest.raises(UserError, match="no 'scores' of 1 numbers"):
        reward(_images([0.5]), ["p"], [METADATA])
    handler.reply = (200, b"not a pickle")
    with pytest.raises(UserError, match="refused"):
        reward(_images([0.5]), ["p"], [METADATA])
    with pytest.raises(UserError, match="geneval_file"):
        reward(_images([0.5]), ["p"], [{}])
    with pytest.raises(UserError, match="needs the server's URL"):
        build_reward("geneval", "cpu")
