"""FSDP2 (--fsdp) on CPU processes over gloo: GRPO LoRA on tiny SD3 (two processes with --fsdp train the weights
of the same two without it to 1e-5; killed with -9 and resumed, the uninterrupted run's bit for bit), two launchers
on one machine as machines 0 and 1 training one run, and the machine and FSDP settings that cannot work, each refused
in one line before anything loads (see tests/test_fsdp.py for ReFL)."""

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from helpers import (
    REPO,
    assert_close,
    free_port,
    grpo_flags,
    kill_after,
    refused,
    run_script,
    run_two,
    saved_lora,
    script_env,
    trainer_flags,
)

from refl_ddpo.core.lora import LORA_WEIGHTS_NAME

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


def test_grpo_lora_under_fsdp_equals_the_unsharded_run(two_process_runs):
    (ddp, _), (fsdp, r) = two_process_runs("grpo-ddp"), two_process_runs("grpo-fsdp")
    assert "weights sharded over 2 process(es) (FSDP2): one copy" in r.stdout
    assert_close(saved_lora(fsdp), saved_lora(ddp))
    assert_close(saved_lora(fsdp / "checkpoint-1"), saved_lora(ddp / "checkpoint-1"))
    assert any(not torch.equal(v, saved_lora(fsdp / "checkpoint-1")[k]) for k, v in saved_lora(fsdp).items())
    # the optimizer state is kept gathered, as safetensors, not pickled
    assert (fsdp / "checkpoint-1" / "optimizer_fsdp.safetensors").is_file()
    assert not list((fsdp / "checkpoint-1").glob("*.bin"))


def test_killed_fsdp_run_resumes_to_the_uninterrupted_weights(two_process_runs, tiny_models, tmp_path):
    """GRPO under FSDP, killed (-9, the launcher's whole group) after checkpoint-1, resumed with latest: the LoRA
    equals the uninterrupted FSDP run's bit for bit, and the counters too. (The other engines' and checkpoint forms'
    resume tests start from a finished run's checkpoint: helpers.resume_two.)"""
    reference, _ = two_process_runs("grpo-fsdp")
    out = tmp_path / "killed"
    flags = grpo_flags(tiny_models, out, "--fsdp")
    kill_after(out / "checkpoint-1", "train_grpo.sh", flags)
    assert not (out / LORA_WEIGHTS_NAME).exists(), "killed before the end"
    r = run_two("train_grpo.sh", [*flags, "--resume_from_checkpoint", "latest"])
    assert "resumed from" in r.stdout and "1 epoch(s) done" in r.stdout
    resumed, uninterrupted = saved_lora(out), saved_lora(reference)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert json.loads((out / "checkpoint-2" / "train_state.json").read_text()) == json.loads(
        (reference / "checkpoint-2" / "train_state.json").read_text()
    )


def test_two_machines_on_one_host_train_one_run(two_process_runs, tiny_models, tmp_path):
    """Two launchers, machines 0 and 1 over 127.0.0.1, one process each, --fsdp across them: one result, the same
    weights as the two processes of one machine."""
    reference, _ = two_process_runs("grpo-ddp")
    out = tmp_path / "two-machines"
    flags = grpo_flags(tiny_models, out, "--fsdp")
    common = {"NUM_MACHINES": "2", "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(free_port())}
    logs = [(tmp_path / f"machine{rank}.out", tmp_path / f"machine{rank}.err") for rank in (0, 1)]
    procs = []
    for rank, (stdout, stderr) in enumerate(logs):  # files, not pipes: neither launcher waits on a full pipe
        with stdout.open("w") as out_file, stderr.open("w") as err_file:
            procs.append(
                subprocess.Popen(
                    ["bash", str(REPO / "train_scripts" / "train_grpo.sh"), *flags],
                    cwd=REPO,
                    env=script_env(
                        NUM_PROCESSES="2", MACHINE_RANK=str(rank), RENDEZVOUS_TIMEOUT="120", **common
                    ),
                    stdout=out_file,
                    stderr=err_file,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = [p.poll() is None for p in procs]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    results = [(out.read_text(), err.read_text()) for out, err in logs]
    told = "".join(
        f"\n--- machine {r}{' (hung)' * hung[r]}:\n{o[-1500:]}{e[-1500:]}" for r, (o, e) in enumerate(results)
    )
    assert [p.returncode for p in procs] == [0, 0], told
    assert "this is machine 1 with 1" in results[1][1]
    assert "saved final weights" in results[0][0] and "saved final weights" not in results[1][0]
    assert json.loads((out / "checkpoint-2" / "checkpoint.json").read_text())["num_processes"] == 2
    assert_close(saved_lora(out), saved_lora(reference))


@pytest.mark.parametrize(
    "env, says",
    [
        ({"NUM_MACHINES": "2", "MACHINE_RANK": "0", "MAIN_PROCESS_PORT": "29500"}, "needs MAIN_PROCESS_IP"),
        ({"NUM_MACHINES": "2", "MAIN_PROCESS_IP": "127.0.0.1"}, "needs MAIN_PROCESS_PORT"),
        ({"NUM_MACHINES": "2", "MACHINE_RANK": "2"}, "MACHINE_RANK='2' must be 0 .. 1"),
        ({"NUM_MACHINES": "2", "NUM_PROCESSES": "3"}, "does not split over NUM_MACHINES=2"),
        ({"NUM_MACHINES": "x"}, "NUM_MACHINES='x' must be a positive integer"),
        ({"MAIN_PROCESS_PORT": "70000", "NUM_PROCESSES": "2"}, "must be a port number"),
        ({"RENDEZVOUS_TIMEOUT": "0", "NUM_PROCESSES": "2"}, "RENDEZVOUS_TIMEOUT='0'"),
        (
            {"NUM_MACHINES": "2", "MAIN_PROCESS_IP": "no-such-host.invalid", "MAIN_PROCESS_PORT": "29500"},
            "does not resolve",
        ),
    ],
)
def test_machine_settings_are_checked_in_one_line_before_anything_starts(env, says, tmp_path):
    r = run_script("train_grpo.sh", ["--output_dir", str(tmp_path / "x")], script_env(**env), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip().splitlines()[-1]] and says in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


def test_a_machine_that_never_meets_machine_0_is_one_line(tiny_models, tmp_path):
    """Machine 1 alone: the rendezvous times out (RENDEZVOUS_TIMEOUT) and says so in one line, exit 2."""
    env = {"NUM_MACHINES": "2", "MACHINE_RANK": "1", "MAIN_PROCESS_IP": "127.0.0.1"}
    env |= {"MAIN_PROCESS_PORT": str(free_port()), "RENDEZVOUS_TIMEOUT": "2"}
    r = run_script("train_grpo.sh", grpo_flags(tiny_models, tmp_path / "x"), script_env(**env), timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("launching ")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: the rendezvous at 127.0.0.1:") and "MAIN_PROCESS_IP" in lines[0]


@pytest.mark.parametrize(
    "script, extra, says",
    [
        ("train_grpo.sh", ["--fsdp"], "--fsdp shards the network over several processes but this run has 1"),
        ("train_grpo.sh", ["--fsdp_cpu_offload"], "add --fsdp"),
        (
            "train_grpo.sh",
            ["--fsdp_checkpoint", "sharded"],
            "--fsdp_checkpoint sharded writes FSDP's shards: add",
        ),
        ("train_refl_lora.sh", ["--fsdp", "--no-use_lora", "--use_ema"], "drop --use_ema or --fsdp"),
        ("train_nft.sh", ["--fsdp"], "DiffusionNFT and AWM keep a copy"),
        ("train_refl_lora.sh", ["--fsdp_shard_text_encoders"], "shards them with FSDP: add --fsdp"),
        (
            "train_refl_lora.sh",
            ["--fsdp", "--fsdp_shard_text_encoders", "--offload_text_encoders"],
            "--fsdp_shard_text_encoders and --offload_text_encoders both move",
        ),
    ],
)
def test_fsdp_settings_that_cannot_work_are_one_line_before_loading(
    script, extra, says, tiny_models, tmp_path, capsys, monkeypatch
):
    """The first case of each script through it, the others in this process (helpers.refused)."""
    flags = trainer_flags(
        tiny_models, tmp_path / "x", *extra, model="tiny-sd3", device="cpu", report_to="none"
    )
    first = extra in (["--fsdp"], ["--fsdp", "--no-use_lora", "--use_ema"])
    code, err = refused(monkeypatch, capsys, script, flags, first, script_env())
    assert code == 2 and says in err.strip().splitlines()[-1], err[-3000:]
    assert not (tmp_path / "x" / "run.json").exists(), "the folder is given back"
