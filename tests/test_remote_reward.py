"""The reward server (`python -m refl_ddpo.rewards.serve`) and the `remote:URL` client reward: same scores as in
process, one-line errors for a dead, slow, wrong or malformed server."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import build_reward, is_differentiable, parse_reward_spec

REPO = Path(__file__).resolve().parent.parent
FAST = {"remote": {"retries": 1, "backoff": 0.05, "timeout": 5.0}}  # keeps the failure tests short


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def start_reward_server(
    spec: str, model_dir: Path | str, timeout: float = 120
) -> tuple[subprocess.Popen, str]:
    """The server in a subprocess on a free port; returns it and its URL once /health answers."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "refl_ddpo.rewards.serve", "--reward", spec, "--port", str(port)]
        + ["--device", "cpu", "--reward_model_dir", str(model_dir)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                pass
            build_reward(f"remote:{url}", "cpu", options=FAST)  # /health answers
            return proc, url
        except (OSError, UserError):
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not start")


@pytest.fixture(scope="module")
def served(tiny_models):
    spec = "pickscore,jpeg_compressibility:0.01"
    proc, url = start_reward_server(spec, tiny_models)
    yield spec, url
    proc.terminate()
    proc.wait(timeout=30)


def test_remote_equals_in_process(served, tiny_models):
    spec, url = served
    local = build_reward(spec, "cpu", model_dir=str(tiny_models))
    remote = build_reward(f"remote:{url}", "cpu")
    assert not is_differentiable(f"remote:{url}")
    g = torch.Generator().manual_seed(0)
    images = torch.rand(5, 3, 40, 48, generator=g)
    prompts = ["a cat", "a dog", "", "a very long prompt " * 20, "ünïcödé ✓"]
    metadata = [{"i": i} for i in range(5)]
    with torch.no_grad():
        expected, expected_info = local(images, prompts, metadata)
    got, info = remote(images, prompts, metadata)
    assert got.shape == (5,) and got.dtype == torch.float32
    assert (got - expected).abs().max() <= 1e-4, (got, expected)
    for key in ("pickscore", "jpeg_compressibility"):  # the weighted sum's parts come back as info
        assert (info[key] - expected_info[key]).abs().max() <= 1e-4


def test_health_and_wire_format(served):
    import urllib.request

    spec, url = served
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health == {"status": "ok", "reward": spec, "differentiable": False, "video": False}
    # a client of its own (curl, another language) may send PNGs
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="PNG")
    body = json.dumps(
        {
            "images": {"encoding": "png", "data": [base64.b64encode(buf.getvalue()).decode()]},
            "prompts": ["red"],
        }
    ).encode()
    req = urllib.request.Request(url + "/score", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        answer = json.loads(r.read())
    assert len(answer["rewards"]) == 1 and set(answer["info"]) >= {"pickscore", "jpeg_compressibility"}


def test_bad_request_is_a_400_with_one_line(served):
    import urllib.error
    import urllib.request

    _, url = served
    req = urllib.request.Request(url + "/score", data=b'{"images": {"shape": [1]}}')
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert "\n" not in json.loads(e.value.read())["error"]


def test_spec_parsing_of_urls():
    assert parse_reward_spec("remote:http://127.0.0.1:8000") == [("remote:http://127.0.0.1:8000", 1.0)]
    assert parse_reward_spec("remote:https://h.example/rw@0.5,jpeg_compressibility:2") == [
        ("remote:https://h.example/rw", 0.5),
        ("jpeg_compressibility", 2.0),
    ]
    for bad in ("remote", "remote:localhost:8000", "remote:http://", "remote:http://h:port"):
        with pytest.raises(UserError) as e:
            parse_reward_spec(bad)
        assert "\n" not in str(e.value) and "remote" in str(e.value)


def test_refl_refuses_a_remote_reward():
    from refl_ddpo.trainers.refl_config import ReFLConfig

    with pytest.raises(UserError) as e:
        ReFLConfig(reward="remote:http://127.0.0.1:1").check()
    assert "cannot carry gradient" in str(e.value)


def test_dead_server_and_wrong_url_are_one_line(served):
    _, url = served
    dead = f"http://127.0.0.1:{free_port()}"
    t = time.time()
    with pytest.raises(UserError) as e:
        build_reward(f"remote:{dead}", "cpu", options=FAST)
    assert "\n" not in str(e.value) and dead in str(e.value) and "2 attempt(s)" in str(e.value)
    assert time.time() - t < 10
    with pytest.raises(UserError) as e:  # a server that is there, at a path that is not
        build_reward(f"remote:{url}/nothing", "cpu", options=FAST)
    assert "\n" not in str(e.value) and "HTTP 404" in str(e.value)


class _StandIn(BaseHTTPRequestHandler):
    """Answers /health well and /score as the test says: not JSON, the wrong count, or too late."""

    mode = "not_json"

    def log_message(self, *args):
        pass

    def _send(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (the slow case)
            pass

    def do_GET(self):
        self._send(b'{"status": "ok"}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.mode == "slow":
            time.sleep(3)
        self._send(
            {"not_json": b"<html>proxy error</html>", "wrong_count": b'{"rewards": [1.0]}', "slow": b"{}"}[
                self.mode
            ]
        )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("not_json", "not JSON"), ("wrong_count", "not 2 rewards"), ("slow", "no answer within 1 s")],
)
def test_malformed_or_slow_answers_are_one_line(mode, expected):
    handler = type("H", (_StandIn,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reward = build_reward(f"remote:{url}", "cpu", options={"remote": {**FAST["remote"], "timeout": 1.0}})
        with pytest.raises(UserError) as e:
            reward(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
        assert "\n" not in str(e.value) and expected in str(e.value) and url in str(e.value)
    finally:
        server.shutdown()
        server.server_close()


def test_serve_refuses_bad_flags_before_loading(tmp_path):
    for args, expected in [
        (["--reward", "nope"], "unknown reward 'nope'"),
        (["--reward", "imagereward", "--reward_model_dir", str(tmp_path)], "lacks ImageReward.pt"),
        (["--reward", "jpeg_compressibility", "--port", "70000"], "--port 70000"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "refl_ddpo.rewards.serve", *args],
            check=False,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], r.stderr


@pytest.mark.parametrize("where", ["in_process", "remote"])
def test_async_scoring_equals_sync(served, tiny_models, where):
    """The DDPO / GRPO sampler with a thread pool scores the same images to the same rewards as without (the
    trajectories, drawn from the same generator, are identical too), for a reward in process and over HTTP."""
    from concurrent.futures import ThreadPoolExecutor

    from diffusers import DDIMScheduler

    from refl_ddpo.core.families import load_family
    from refl_ddpo.trainers.epochs import EpochPlan
    from refl_ddpo.trainers.rollouts import Policy, SampleSettings, collect_rewards, sample_epoch

    spec, url = served
    reward = build_reward(
        spec if where == "in_process" else f"remote:{url}", "cpu", model_dir=str(tiny_models)
    )
    family = load_family(str(tiny_models / "stable-diffusion"))
    family.pipe.scheduler = DDIMScheduler.from_config(family.pipe.scheduler.config)
    negative, _ = family.encode_prompts([""], with_negative=False)

    def run(executor):
        prompts = iter(["a cat", "a dog", "a red bird"] * 4)
        batches = sample_epoch(
            Policy(family, family.pipe.scheduler, negative),
            SampleSettings(
                batch_size=2, num_batches=3, num_steps=3, guidance_scale=5.0, eta=1.0, resolution=32
            ),
            EpochPlan(lambda: (next(prompts), {})),
            reward,
            torch.Generator().manual_seed(0),
            executor,
        )
        collect_rewards(batches)
        return batches

    sync = run(None)
    with ThreadPoolExecutor(2) as pool:
        overlapped = run(pool)
    for a, b in zip(sync, overlapped, strict=True):
        assert torch.equal(a.next_latents, b.next_latents) and torch.equal(a.log_probs, b.log_probs)
        assert torch.equal(a.rewards[0], b.rewards[0]), (a.rewards[0], b.rewards[0])
        assert a.rewards[1].keys() == b.rewards[1].keys()


def test_inference_scores_with_a_remote_reward(served, tiny_models, tmp_path):
    """`inference.py --rewards remote:URL,...`: one field per reward, the remote one equal to scoring in process."""
    import numpy as np
    from PIL import Image
    from test_outputs import _cfg

    from refl_ddpo.apps import inference

    spec, url = served
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    out = tmp_path / "out"
    names = [f"remote:{url}", "jpeg_compressibility"]
    cfg = _cfg(tiny_models / "stable-diffusion", prompts, out, "--rewards", ",".join(names))
    inference.run_inference(cfg)
    scores = json.loads((out / "scores.json").read_text())
    assert scores["rewards"] == names
    local = build_reward(spec, "cpu", model_dir=str(tiny_models))
    for r in scores["records"]:
        with Image.open(out / r["file"]) as im:
            x = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)[None].float() / 255
        with torch.no_grad():
            expected = float(local(x, [r["prompt"]], [{}])[0][0])
        assert r[names[0]] == pytest.approx(expected, abs=1e-4)
        assert isinstance(r["jpeg_compressibility"], float)


def _post_pngs(url: str, files: list[Path], prompts: list[str]) -> list[float]:
    """What a client of its own gets for the saved PNG files, sent as they are (`encoding: png`)."""
    import base64
    import urllib.request

    body = {
        "images": {"encoding": "png", "data": [base64.b64encode(f.read_bytes()).decode() for f in files]},
        "prompts": prompts,
    }
    req = urllib.request.Request(
        url + "/score", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["rewards"]


def test_inference_imagereward_is_the_registry_and_remote_reward_on_the_saved_images(tiny_models, tmp_path):
    """One ImageReward path: the `imagereward` field of scores.json equals, on the PNGs as saved, the registry's
    reward in process, a `remote:` server running it (the client's float32 batch) and that server sent the PNG files,
    to 1e-6."""
    import numpy as np
    from PIL import Image
    from test_outputs import _cfg

    from refl_ddpo.apps import inference

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na red apple on a wooden table\n")
    out = tmp_path / "out"
    cfg = _cfg(tiny_models / "stable-diffusion", prompts, out, "--reward_model_dir", str(tiny_models))
    inference.run_inference(cfg)  # --rewards: imagereward, the default
    records = json.loads((out / "scores.json").read_text())["records"]
    files = [out / r["file"] for r in records]
    texts = [r["prompt"] for r in records]
    recorded = torch.tensor([r["imagereward"] for r in records], dtype=torch.float64)
    pixels = []
    for f in files:
        with Image.open(f) as im:
            pixels.append(torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1))
    images = torch.stack(pixels).float() / 255  # (N, 3, H, W): the 8-bit images as saved
    local = build_reward("imagereward", "cpu", model_dir=str(tiny_models))
    with torch.no_grad():
        in_process = local(images, texts, [{}] * len(texts))[0].double()
    proc, url = start_reward_server("imagereward", tiny_models)
    try:
        remote = build_reward(f"remote:{url}", "cpu")(images, texts, [{}] * len(texts))[0].double()
        from_pngs = torch.tensor(_post_pngs(url, files, texts), dtype=torch.float64)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    gaps = {
        name: float((recorded - other).abs().max())
        for name, other in (("registry", in_process), ("remote", remote), ("remote, PNGs", from_pngs))
    }
    print("max |inference - reward|:", gaps)
    assert max(gaps.values()) <= 1e-6, (gaps, recorded, in_process)


def test_a_sample_over_the_servers_request_limit_stops_before_it_is_sent(monkeypatch):
    """A video too big for one request (here: the limit made tiny) is one line naming its shape and the fix, and no
    request is made (nothing listens at the URL)."""
    from refl_ddpo.rewards import remote

    monkeypatch.setattr(remote, "MAX_BODY_BYTES", 1000)
    client = remote.RemoteReward(f"http://127.0.0.1:{free_port()}", retries=0)
    with pytest.raises(UserError) as e:
        client(torch.rand(2, 5, 3, 8, 8), ["a", "b"], [{}, {}])
    assert "\n" not in str(e.value) and "one sample of shape (5, 3, 8, 8) is over" in str(e.value)
    assert "--video_reduction mean:K" in str(e.value)
