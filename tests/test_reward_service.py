"""The reward server as a service: several rewards, each in its own worker process (one under a virtual
environment's python given by path), batched requests, per-reward health, a worker killed mid-run answered with a
503 naming its reward while the other keeps serving, a bounded restart; and the client's retries and one-line stop."""

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from user_functions import redness

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import build_reward
from refl_ddpo.rewards.jpeg import jpeg_size_kb
from refl_ddpo.rewards.remote import encode_images
from refl_ddpo.rewards.serve import check_args, parse_args, parse_rewards, route
from refl_ddpo.rewards.serve_workers import RewardWorker, WorkerSettings, resolve_python, split_info

REPO = Path(__file__).resolve().parent.parent
FAST = {"remote": {"retries": 1, "backoff": 0.05, "timeout": 10.0}}


def _env() -> dict:
    path = os.pathsep.join([str(REPO), str(REPO / "tests")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def venv_by_path(folder: Path) -> str:
    """This environment as a virtual environment's folder of its own (its pyvenv.cfg, bin/python and lib/ linked),
    as a user's separate venv is given to --python; this python itself where it is no venv."""
    if not (Path(sys.prefix) / "pyvenv.cfg").is_file():
        return sys.executable
    (folder / "bin").mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
    (folder / "bin" / "python").symlink_to(sys.executable)
    (folder / "lib").symlink_to(Path(sys.prefix) / "lib")
    return str(folder)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, images: torch.Tensor, prompts: list[str]) -> tuple[int, dict]:
    body = json.dumps({"images": encode_images(images), "prompts": prompts}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(condition, timeout: float = 120.0, what: str = "the server"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not yet reaped, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class Service:
    """`python -m refl_ddpo.rewards.serve` on 127.0.0.1, port 0; `close` ends it and every worker it started."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "refl_ddpo.rewards.serve", "--port", "0", "--device", "cpu", *flags],
            env=_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pids: set[int] = set()
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if " on http://127.0.0.1:" not in line:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(line or "the server printed no address")
        self.url = line.split(" on ")[1].split()[0]

    def health(self, name: str | None = None) -> tuple[int, dict]:
        code, answer = get(f"{self.url}/{name}/health" if name else f"{self.url}/health")
        states = answer.get("rewards", {name: answer} if name else {})
        self.pids |= {s["pid"] for s in states.values() if s.get("pid")}
        return code, answer

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        leaked = [pid for pid in self.pids if not wait_for_end(pid)]
        for pid in leaked:
            os.kill(pid, signal.SIGKILL)
        assert not leaked, f"workers {leaked} outlived the server"


def wait_for_end(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    venv = venv_by_path(tmp_path_factory.mktemp("venv") / "jpeg-env")
    s = Service(
        "--reward", "jpeg=jpeg_compressibility", "--reward", "red=user_functions:slow_redness",
        "--reward", "tc=temporal_consistency",
        "--python", f"jpeg={venv}", "--batch_window_ms", "300", "--max_batch_size", "16", "--max_restarts", "1",
    )  # fmt: skip
    s.venv = venv
    try:
        wait_for(lambda: s.health()[0] == 200)
        yield s
    finally:
        s.close()


# ---- the client's retries, against a stand-in ----


class _Flaky(BaseHTTPRequestHandler):
    """/health well; /score a 503 for its first `failures` calls, then rewards."""

    failures, calls = 2, 0

    def log_message(self, *args):
        pass

    def _send(self, code: int, obj: dict):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"status": "ok", "reward": "toy", "differentiable": False, "name": "toy"})

    def do_POST(self):
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
        type(self).calls += 1
        if type(self).calls <= self.failures:
            self._send(503, {"error": "reward 'toy': still loading"})
        else:
            self._send(200, {"rewards": [0.5] * n, "info": {}})


@pytest.mark.parametrize(("retries", "ok"), [(2, True), (1, False)])
def test_client_retries_within_its_bound_then_stops_in_one_line(retries, ok):
    handler = type("H", (_Flaky,), {"calls": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/toy"
        options = {"remote": {"retries": retries, "backoff": 0.01, "timeout": 5.0}}
        reward = build_reward(f"remote:{url}", "cpu", options=options)
        if ok:
            assert reward(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])[0].tolist() == [0.5, 0.5]
        else:
            with pytest.raises(UserError) as e:
                reward(torch.rand(2, 3, 8, 8), ["a", "b"], [{}, {}])
            assert "\n" not in str(e.value)
            assert str(e.value).startswith(
                f"reward server {url} (reward toy): /score failed after 2 attempt(s)"
            )
            assert "HTTP 503" in str(e.value) and "still loading" in str(e.value)
        assert handler.calls == 3 if ok else handler.calls == 2
    finally:
        server.shutdown()
        server.server_close()


# ---- the pieces, without processes ----


def test_reward_flags_and_routes():
    assert parse_rewards(["pickscore"]) == {"pickscore": "pickscore"}
    assert parse_rewards(["pickscore,jpeg_compressibility:0.01"]) == {
        "reward": "pickscore,jpeg_compressibility:0.01"
    }
    assert parse_rewards(["a=pickscore", "jpeg_compressibility"]) == {
        "a": "pickscore",
        "jpeg_compressibility": "jpeg_compressibility",
    }
    assert parse_rewards(["remote:http://h:1/x?a=b"]) == {"reward": "remote:http://h:1/x?a=b"}
    for flags, expected in [
        (["--reward", "a=jpeg_compressibility", "--reward", "a=pickscore"], "given twice"),
        (["--reward", "user_functions:redness", "--reward", "jpeg_compressibility"], "name it"),
        (["--reward", "a=nope"], "unknown reward 'nope'"),
        (["--reward", "a=jpeg_compressibility", "--python", "b=/usr"], "NAME one of the rewards (a)"),
        (
            ["--reward", "a=jpeg_compressibility", "--python", "a=/nonexistent"],
            "neither a virtual environment",
        ),
        (["--reward", "a=jpeg_compressibility", "--max_restarts", "-1"], "--max_restarts"),
    ]:
        with pytest.raises(UserError) as e:
            check_args(parse_args(flags))
        assert expected in str(e.value) and "\n" not in str(e.value)
    assert resolve_python(sys.executable) == sys.executable
    workers = {"a": "A", "b": "B"}
    assert route("/a/score", workers) == ("A", "score", "")
    assert route("/b/health/", workers) == ("B", "health", "")
    assert route("/health", workers) == (None, "health", "")
    assert "several rewards (a, b)" in route("/score", workers)[2]
    assert route("/score", {"a": "A"}) == ("A", "score", "")


def test_a_reward_that_does_not_load_is_down_in_one_line():
    """A spec the server could not check (its worker runs under another python) fails in the worker: the reward
    is down with the worker's one line, its requests answered 503 at once; stop removes the kit's temporary path."""
    worker = RewardWorker("broken", "nope", WorkerSettings(device="cpu"), python=sys.executable)
    kit_path = Path(worker._kit_path)
    assert (kit_path / "refl_ddpo" / "rewards" / "serve_worker.py").is_file()
    worker.start()
    try:
        wait_for(lambda: worker.status == "down", timeout=60, what="the broken worker")
        health = worker.health()
        assert health["error"].startswith("reward 'broken': did not load: --reward: unknown reward 'nope'")
        assert "\n" not in health["error"] and health["pid"] is None
        code, answer = worker.score(np.zeros((1, 3, 8, 8), np.float32), ["a"], [{}])
        assert code == 503 and answer["error"].startswith("reward 'broken' is down: did not load")
    finally:
        worker.stop()
    assert not kit_path.exists()


def test_a_merged_batchs_info_is_split():
    info = {"per_image": [1.0, 2.0, 3.0], "scalar": 7.0}
    assert split_info(info, [1, 2]) == [{"per_image": [1.0]}, {"per_image": [2.0, 3.0]}]
    assert split_info(info, [3]) == [info]


# ---- the service (one server for the file; the kill comes last) ----


def test_two_rewards_each_in_its_worker(service):
    code, health = service.health()
    assert code == 200 and health["status"] == "ok" and set(health["rewards"]) == {"jpeg", "red", "tc"}
    jpeg, red = health["rewards"]["jpeg"], health["rewards"]["red"]
    assert jpeg["python"] == resolve_python(service.venv) and red["python"] == sys.executable
    assert jpeg["pid"] != red["pid"] and os.getpid() not in (jpeg["pid"], red["pid"])
    assert (jpeg["differentiable"], red["differentiable"]) == (False, True)
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 16, 24, generator=g)
    prompts, metadata = ["a", "b", "c"], [{}] * 3
    got, info = build_reward(f"remote:{service.url}/red", "cpu")(images, prompts, metadata)
    assert torch.equal(got, redness(images, prompts, metadata)[0]) and "red" in info
    got, _ = build_reward(f"remote:{service.url}/jpeg", "cpu")(images, prompts, metadata)
    assert torch.equal(got, -jpeg_size_kb(images))
    with pytest.raises(UserError) as e:  # two rewards: the client must name one
        build_reward(f"remote:{service.url}", "cpu", options=FAST)
    assert "\n" not in str(e.value) and "serves several rewards (jpeg, red, tc)" in str(e.value)
    assert f"remote:{service.url}/jpeg" in str(e.value)
    code, answer = post(service.url + "/score", images, prompts)
    assert code == 404 and "POST /NAME/score" in answer["error"]
    code, answer = get(service.url + "/nope/health")
    assert code == 404 and "no reward 'nope' here" in answer["error"] and "jpeg, red, tc" in answer["error"]


def test_requests_within_the_window_are_one_call(service):
    """Four requests at once, within --batch_window_ms: fewer calls of the worker than requests, each request's
    answer its own images' rewards."""
    before = service.health("red")[1]
    g = torch.Generator().manual_seed(1)
    batches = [torch.rand(n, 3, 8, 8, generator=g) for n in (1, 2, 3, 1)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda x: post(service.url + "/red/score", x, ["p"] * len(x)), batches))
    after = service.health("red")[1]
    assert after["requests"] - before["requests"] == 4
    assert after["batches"] - before["batches"] < 4, (before, after)
    for x, (code, answer) in zip(batches, answers, strict=True):
        assert code == 200
        assert answer["rewards"] == pytest.approx(redness(x, [], [])[0].tolist(), abs=1e-6)


def test_videos_go_whole_to_a_video_reward_and_as_frames_to_an_image_reward(service, monkeypatch):
    """A served reward of videos (temporal_consistency) gets them whole and equals itself in process, also when
    the client splits the batch into one request per video; a served image reward scores the frames that the
    client's --video_reduction picks, as frames_reward in process; a 5-D POST to an image reward is a 400."""
    from refl_ddpo.rewards import remote

    videos = torch.rand(2, 5, 3, 8, 8, generator=torch.Generator().manual_seed(2))  # (B, T, 3, H, W)
    prompts, metadata = ["a", "b"], [{}, {}]
    assert service.health("tc")[1]["video"] is True and service.health("jpeg")[1]["video"] is False
    tc = build_reward(f"remote:{service.url}/tc", "cpu")
    expected = build_reward("temporal_consistency", "cpu")(videos, prompts, metadata)[0]
    assert tc.video and (tc(videos, prompts, metadata)[0] - expected).abs().max() <= 1e-6
    before = service.health("tc")[1]["requests"]
    monkeypatch.setattr(remote, "REQUEST_BYTES", videos[0].numel() * 4)  # one video per request
    assert (tc(videos, prompts, metadata)[0] - expected).abs().max() <= 1e-6
    assert service.health("tc")[1]["requests"] - before == 2
    jpeg = build_reward(f"remote:{service.url}/jpeg", "cpu", video_reduction="min:2")
    expected = build_reward("jpeg_compressibility", "cpu", video_reduction="min:2")(
        videos, prompts, metadata
    )[0]
    assert not jpeg.video and (jpeg(videos, prompts, metadata)[0] - expected).abs().max() <= 1e-6
    code, answer = post(service.url + "/jpeg/score", videos, prompts)
    assert code == 400 and "\n" not in answer["error"], answer
    assert answer["error"].startswith(
        "reward 'jpeg': jpeg_compressibility scores images [B, 3, H, W], not videos"
    )


def test_a_killed_worker_answers_its_reward_only(service):
    """The done-when: two rewards in workers; red's worker killed while it scores -> that request gets a 503
    naming red, jpeg keeps serving; red is started again once (--max_restarts 1); killed again, it stays down,
    its requests get the error at once, and the trainer's client stops with one line naming the URL and red. (Last
    in this file: it takes red down for good.)"""
    s = service
    client = build_reward(f"remote:{s.url}/red", "cpu", options=FAST)
    x = torch.rand(2, 3, 8, 8)
    first = s.health("red")[1]["pid"]
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, s.url + "/red/score", x, ["slow", "b"])
        time.sleep(2.0)  # the worker is inside the reward's 5 s (after the 0.3 s window)
        os.kill(first, signal.SIGKILL)
        code, answer = slow.result(timeout=30)
    assert code == 503 and "\n" not in answer["error"], answer
    assert answer["error"].startswith("reward 'red': its worker exited (killed by SIGKILL) while scoring")
    assert post(s.url + "/jpeg/score", x, ["a", "b"])[0] == 200  # the other reward is untouched

    restarted = wait_for(lambda: (h := s.health("red")[1])["status"] == "ok" and h, what="red's restart")
    assert restarted["pid"] != first and restarted["restarts"] == 1
    assert torch.equal(client(x, ["a", "b"], [{}, {}])[0], redness(x, [], [])[0])

    os.kill(restarted["pid"], signal.SIGKILL)  # idle, and no restart left
    wait_for(lambda: s.health("red")[1]["status"] == "down", timeout=10, what="red down")
    code, answer = post(s.url + "/red/score", x, ["a", "b"])
    assert code == 503 and answer["error"].startswith(
        "reward 'red' is down: its worker exited (killed by SIGKILL)"
    )
    assert post(s.url + "/jpeg/score", x, ["a", "b"])[0] == 200
    code, health = s.health()
    assert code == 503 and health["status"] == "degraded" and health["rewards"]["jpeg"]["status"] == "ok"
    assert "reward 'red'" in health["error"]
    with pytest.raises(UserError) as e:
        client(x, ["a", "b"], [{}, {}])
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        f"reward server {s.url}/red (reward red): /score failed after 2"
    )
    assert "HTTP 503" in line and "reward 'red' is down" in line
