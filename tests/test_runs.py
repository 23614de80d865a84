"""Output folders, resume inputs and process lifetime (refl_ddpo.run.runs, refl_ddpo.run.launch): every bad folder, checkpoint
or LoRA is one line naming what to fix, exit != 0, before any model is loaded and with no weight file written or
changed; checkpoint rotation keeps other runs' checkpoints; the processes of launch.sh die with their launcher, a
process' user error is one line and a finished process of several skips the interpreter's teardown. One tiny finished
ReFL run (in this process) serves every resume case (checked in preflight mode)."""

import hashlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import script_env, trainer_flags

from refl_ddpo.apps.inference import run_inference
from refl_ddpo.core.lora import LORA_WEIGHTS_NAME
from refl_ddpo.run import runs
from refl_ddpo.run.flags import parse_config
from refl_ddpo.run.launch import PREFLIGHT_ENV
from refl_ddpo.toy_world import DATA_DIR as TOY_WORLD_DIR
from refl_ddpo.trainers import ddpo, refl
from refl_ddpo.trainers.refl import ReFLConfig

REPO = Path(__file__).resolve().parent.parent
TOY_SD = TOY_WORLD_DIR / "toy-sd"


def _env(**extra) -> dict:
    return script_env("WORLD_SIZE", "RANK", **extra)


def _refl_flags(tiny_models, out: Path) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        num_inference_steps=4,
        k_lo=2,
        k_hi=3,
        device="cpu",
        report_to="none",
        max_train_steps=2,
    )


@pytest.fixture(scope="module")
def run_dir(tiny_models, tmp_path_factory) -> Path:
    """A finished 2-step ReFL run with checkpoint-1 and checkpoint-2 (never changed by the tests), run in this
    process."""
    out = tmp_path_factory.mktemp("runs") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WORLD_SIZE", "RANK"):  # one process (as `_env` gives a subprocess)
            mp.delenv(name, raising=False)
        refl.main([*_refl_flags(tiny_models, out), "--checkpointing_steps", "1"])
    return out


def _weights(*folders: Path) -> dict[str, str]:
    """sha256 of every weight / state file under the folders (to show that nothing was written or changed)."""
    found = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")) if folder.exists() else []:
            if p.is_file() and p.suffix in (".safetensors", ".bin", ".pkl", ".json"):
                found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def _edit_marker(checkpoint: Path, **changes) -> None:
    record = json.loads((checkpoint / runs.MARKER).read_text())
    (checkpoint / runs.MARKER).write_text(json.dumps({**record, **changes}))


def _spoil(path: Path, same_size: bool) -> None:
    data = bytearray(path.read_bytes())
    if same_size:
        middle = len(data) // 2
        data[middle : middle + 64] = b"x" * 64
    else:
        data = bytearray(b"not what was written")
    path.write_bytes(bytes(data))


# ---- bad folders and resume inputs: one line each, before any model is loaded ----

# case -> (extra flags, what to do to the copy of the run first, trainer main, env, words the one line must hold)
CK = "{copy}/checkpoint-2"
RESUME_CASES = {
    "folder_holds_a_run": ([], None, "refl", {}, ["already holds a run", "--overwrite_output_dir"]),
    "latest_on_finished_run_without_checkpoints": (
        ["--resume_from_checkpoint", "latest"],
        lambda c: [shutil.rmtree(p) for p in c.glob("checkpoint-*")],
        "refl",
        {},
        ["finished run", "no complete checkpoint-N"],
    ),
    "overwrite_and_latest": (
        ["--overwrite_output_dir", "--resume_from_checkpoint", "latest"],
        None,
        "refl",
        {},
        ["--overwrite_output_dir would delete", "drop one"],
    ),
    "checkpoint_of_another_run": (
        ["--resume_from_checkpoint", CK],
        lambda c: _edit_marker(c / "checkpoint-2", run_id="someoneelse"),
        "refl",
        {},
        ["holds another run", "someoneelse"],
    ),
    "ddpo_checkpoint_in_refl": (
        ["--resume_from_checkpoint", CK],
        lambda c: _edit_marker(c / "checkpoint-2", trainer="ddpo"),
        "refl",
        {},
        ["ddpo trainer", "refl_ddpo.trainers.ddpo"],
    ),
    "refl_checkpoint_in_ddpo": (["--resume_from_checkpoint", CK], None, "ddpo", {}, ["refl trainer"]),
    "ddpo_1_process_checkpoint_with_2": (
        ["--resume_from_checkpoint", CK],
        lambda c: _edit_marker(c / "checkpoint-2", trainer="ddpo"),
        "ddpo",
        {"WORLD_SIZE": "2"},
        ["1 process(es)", "NUM_PROCESSES=1"],
    ),
    "refl_1_process_checkpoint_with_2": (
        ["--resume_from_checkpoint", CK],
        None,
        "refl",
        {"WORLD_SIZE": "2"},
        ["NUM_PROCESSES=1"],
    ),
    "lora_rank": (["--resume_from_checkpoint", CK, "--lora_rank", "8"], None, "refl", {}, ["--lora_rank 4"]),
    "lora_targets": (
        ["--resume_from_checkpoint", CK, "--lora_target_modules", "to_q"],
        None,
        "refl",
        {},
        ["--lora_target_modules to_k to_out.0 to_q to_v", "--lora_target_modules to_q"],
    ),
    "full_finetune_on_lora": (
        ["--resume_from_checkpoint", CK, "--no-use_lora"],
        None,
        "refl",
        {},
        ["--use_lora", "--no-use_lora"],
    ),
    "resolution": (
        ["--resume_from_checkpoint", CK, "--resolution", "64"],
        None,
        "refl",
        {},
        ["--resolution 32"],
    ),
    "seed": (["--resume_from_checkpoint", CK, "--seed", "1"], None, "refl", {}, ["--seed 42", "--seed 1"]),
    "model": (
        ["--resume_from_checkpoint", CK, "--pretrained_model", str(TOY_SD)],
        None,
        "refl",
        {},
        ["--pretrained_model", "toy-sd"],
    ),
    "step_past_max_train_steps": (
        ["--resume_from_checkpoint", CK, "--max_train_steps", "1"],
        None,
        "refl",
        {},
        ["past --max_train_steps 1"],
    ),
    "train_state_json_garbage": (
        ["--resume_from_checkpoint", CK],
        lambda c: _spoil(c / "checkpoint-2" / "train_state.json", same_size=False),
        "refl",
        {},
        ["train_state.json"],
    ),
    "train_state_json_garbage_same_size": (
        ["--resume_from_checkpoint", CK],
        lambda c: (c / "checkpoint-2" / "train_state.json").write_text(
            "x" * (c / "checkpoint-2" / "train_state.json").stat().st_size
        ),
        "refl",
        {},
        ["train_state.json", "damaged"],
    ),
    "optimizer_corrupt": (
        ["--resume_from_checkpoint", CK],
        lambda c: _spoil(c / "checkpoint-2" / "optimizer.bin", same_size=True),
        "refl",
        {},
        ["optimizer.bin", "damaged"],
    ),
    "lora_safetensors_corrupt": (
        ["--resume_from_checkpoint", CK],
        lambda c: (c / "checkpoint-2" / LORA_WEIGHTS_NAME).write_bytes(
            b"y" * 16 + (c / "checkpoint-2" / LORA_WEIGHTS_NAME).read_bytes()[16:]
        ),
        "refl",
        {},
        [LORA_WEIGHTS_NAME, "damaged"],
    ),
    "checkpoint_without_marker": (
        ["--resume_from_checkpoint", CK],
        lambda c: (c / "checkpoint-2" / runs.MARKER).unlink(),
        "refl",
        {},
        ["incomplete", runs.MARKER],
    ),
    "checkpoint_file_missing": (
        ["--resume_from_checkpoint", CK],
        lambda c: (c / "checkpoint-2" / "random_states_0.pkl").unlink(),
        "refl",
        {},
        ["random_states_0.pkl is missing"],
    ),
    "no_such_checkpoint": (
        ["--resume_from_checkpoint", "{copy}/checkpoint-9"],
        None,
        "refl",
        {},
        ["no such folder"],
    ),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_bad_folder_or_checkpoint_is_one_line_before_loading(
    case, run_dir, tiny_models, tmp_path, capsys, monkeypatch
):
    extra, spoil, trainer, env, words = RESUME_CASES[case]
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    if spoil is not None:
        spoil(copy)
    extra = [a.replace("{copy}", str(copy)) for a in extra]
    out = (
        copy
        if case
        in ("folder_holds_a_run", "latest_on_finished_run_without_checkpoints", "overwrite_and_latest")
        else tmp_path / "new"
    )
    if case == "checkpoint_of_another_run":
        out = run_dir  # holds run A; the checkpoint claims to be of another run
    flags = _refl_flags(tiny_models, out)
    if trainer == "ddpo":  # the flags both trainers share
        flags = flags[: flags.index("--num_inference_steps")] + ["--device", "cpu", "--report_to", "none"]
    before = _weights(run_dir, copy, tmp_path / "new")
    monkeypatch.setenv(
        PREFLIGHT_ENV, "1"
    )  # a check that failed to fire stops here too, without loading a model
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    main = refl.main if trainer == "refl" else ddpo.main
    with pytest.raises(SystemExit) as exc:
        main(flags + extra)
    assert exc.value.code != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(w in lines[0] for w in words), (words, lines[0])
    assert _weights(run_dir, copy, tmp_path / "new") == before, "no weight or state file written or changed"


@pytest.mark.parametrize("model", ["stable-diffusion", "tiny-sd3"])
def test_a_preflight_imports_no_model_library(model, tiny_models, tmp_path):
    """The launcher runs the trainer's checks once, before it starts several processes (`launch.preflight`): they
    import torch, not diffusers, transformers, peft or timm, which load with the models (diffusers, through
    torch._dynamo, was 2.6 s of a preflight's 4.6 s of CPU), and leave the launcher's argv and environment as they
    were."""
    code = (
        "import os, sys\nfrom refl_ddpo.run.launch import preflight, PREFLIGHT_ENV\nargv = list(sys.argv)\n"
        "preflight('refl_ddpo.trainers.refl', sys.argv[1:], 2)\n"
        "assert sys.argv == argv and PREFLIGHT_ENV not in os.environ and 'WORLD_SIZE' not in os.environ\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'transformers', 'peft', 'timm', 'torch'}))"
    )
    flags = _refl_flags(tiny_models, tmp_path / "out")
    flags[flags.index("--pretrained_model") + 1] = str(tiny_models / model)
    r = subprocess.run(
        [sys.executable, "-c", code, *flags], env=script_env(), capture_output=True, text=True, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "['torch']", r.stdout
    assert not any((tmp_path / "out").iterdir()), "the checks write nothing"


def test_latest_skips_an_incomplete_newest_checkpoint(run_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoint-2" / "optimizer.bin").unlink()  # e.g. a partial copy
    path, record = runs.find_resume("latest", copy)
    assert path == copy / "checkpoint-1" and record["step"] == 1
    assert "skipping incomplete" in capsys.readouterr().out
    (copy / "checkpoint-1" / runs.MARKER).unlink()
    assert runs.find_resume("latest", copy) == (None, None)


def test_rotation_deletes_only_the_writing_runs_checkpoints(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    mine = json.loads((copy / "run.json").read_text())["run_id"]
    shutil.copytree(copy / "checkpoint-1", copy / "checkpoint-0")
    _edit_marker(copy / "checkpoint-0", run_id="anotherrun")  # an older run's checkpoint left in the folder
    runs.rotate_checkpoints(copy, mine, keep=1)
    assert sorted(p.name for p in copy.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-2"]


def test_overwrite_clears_the_old_run_and_claims_the_folder(
    run_dir, tiny_models, tmp_path, monkeypatch, capsys
):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "notes.txt").write_text("the user's own file")
    for k in (PREFLIGHT_ENV, "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    cfg = parse_config(ReFLConfig, _refl_flags(tiny_models, copy) + ["--overwrite_output_dir"])
    info = runs.start_run(cfg, "refl", "max_train_steps")
    assert info.resume is None
    assert sorted(p.name for p in copy.iterdir()) == ["notes.txt", "run.json"]
    assert json.loads((copy / "run.json").read_text())["run_id"] == info.run_id
    assert "deleted checkpoint-1, checkpoint-2" in capsys.readouterr().out
    runs.release_run(cfg.output_dir)  # a user error before anything was written gives the folder back
    assert sorted(p.name for p in copy.iterdir()) == ["notes.txt"]


# ---- inference folders and LoRA inputs ----


def _inference(script: str, args: list[str], capsys) -> str:
    main = runpy.run_path(str(REPO / "inference" / script))["main"]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_bad_lora_dir_or_inference_folder_is_one_line(run_dir, tiny_models, tmp_path, capsys, monkeypatch):
    import refl_ddpo.core.models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(refl_ddpo.core.models, "load_pipeline", refuse)
    common = ["--device", "cpu", "--num_images_per_prompt", "1"]
    before = _weights(run_dir)
    line = _inference(
        "inference.py",
        [*common, "--pretrained_model", str(tiny_models / "stable-diffusion"), "--output_dir", str(run_dir)],
        capsys,
    )
    assert "holds files that no inference run wrote" in line and "checkpoint-1" in line
    for name, spoil in {
        "header": lambda p: p.write_bytes(b"y" * 16 + p.read_bytes()[16:]),
        "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    }.items():
        lora = tmp_path / name
        lora.mkdir()
        shutil.copy(run_dir / "config.json", lora)
        shutil.copy(run_dir / LORA_WEIGHTS_NAME, lora)
        spoil(lora / LORA_WEIGHTS_NAME)
        line = _inference(
            "inference_lora.py",
            [*common, "--lora_dir", str(lora), "--output_dir", str(tmp_path / "o")],
            capsys,
        )
        assert f"{lora / LORA_WEIGHTS_NAME} is not a readable safetensors file" in line, line
    only_checkpoints = tmp_path / "killed_run"
    shutil.copytree(run_dir / "checkpoint-1", only_checkpoints / "checkpoint-1")
    line = _inference(
        "inference_lora.py",
        [*common, "--lora_dir", str(only_checkpoints), "--output_dir", str(tmp_path / "o")],
        capsys,
    )
    assert "checkpoint-1" in line and "point it at one of them" in line
    assert _weights(run_dir) == before and not list((tmp_path / "o").glob("*.png"))


def test_inference_replaces_an_earlier_runs_images(tiny_models, tmp_path):
    from refl_ddpo.apps.inference_config import InferenceConfig

    out = tmp_path / "out"
    for prompts in (["a cat", "a dog"], ["a cat"]):
        (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
        argv = [
            "--pretrained_model",
            str(tiny_models / "stable-diffusion"),
            "--prompts_file",
            str(tmp_path / "p.txt"),
        ]
        argv += ["--reward_model_dir", str(tiny_models), "--resolution", "32", "--num_inference_steps", "2"]
        argv += ["--num_images_per_prompt", "1", "--device", "cpu", "--output_dir", str(out)]
        run_inference(parse_config(InferenceConfig, argv))
    assert sorted(p.name for p in out.iterdir()) == ["0000_00_seed42.png", "grid.png", "scores.json"]


# ---- process lifetime under launch.sh (a stand-in trainer: no model, seconds) ----

END_WORKER = """
import atexit
from refl_ddpo.run.launch import end_worker

class Teardown:
    def __del__(self):
        print("torn down", flush=True)

atexit.register(lambda: print("exit handlers ran"))
kept = Teardown()  # collected only by the interpreter's teardown
print("buffered,", end=" ")
end_worker()
print("one process:", end=" ")
"""


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_a_finished_process_of_several_skips_only_the_interpreters_teardown(world_size):
    """launch.end_worker: one of several processes runs the exit handlers, flushes and leaves with os._exit(0), so no
    thread of torch.distributed can die asking for the GIL in the teardown (SIGABRT after a run had written
    everything); a single process goes on and ends as usual."""
    env = {**_env(), "WORLD_SIZE": world_size, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-c", END_WORKER], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr
    expected = (
        "buffered, exit handlers ran\n"
        if world_size == "2"
        else "buffered, one process: exit handlers ran\ntorn down\n"
    )
    assert r.stdout == expected


FAKE_TRAINER = """
import os, sys, time
from pathlib import Path
from refl_ddpo.core.errors import UserError, cli_main
from refl_ddpo.run.training import run_or_preflight

def train(mode):
    Path(os.environ["OUT"], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    if mode == "fail" and os.environ["RANK"] == "1":
        raise UserError("--some_flag 3 does not fit this model (found on rank 1 after loading); use 2.")
    time.sleep(120)  # rank 0 waits, as in a collective, until its launcher stops it

@cli_main
def main():
    run_or_preflight(train, sys.argv[1], lambda mode: None)

main()
"""


def _launch(tmp_path: Path, mode: str) -> subprocess.Popen:
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    (tmp_path / "tmp").mkdir()
    cmd = f"source {REPO / 'train_scripts' / 'launch.sh'}; launch fake_trainer -- {mode}"
    env = _env(
        NUM_PROCESSES="2", OUT=str(tmp_path), PYTHONPATH=f"{tmp_path}:{REPO}", TMPDIR=str(tmp_path / "tmp")
    )
    return subprocess.Popen(
        ["bash", "-c", cmd],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z" if Path(f"/proc/{pid}").exists() else True


def test_a_user_error_on_one_of_two_processes_is_one_line(tmp_path):
    proc = _launch(tmp_path, "fail")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("launching ")]
    assert lines == [
        "error: --some_flag 3 does not fit this model (found on rank 1 after loading); use 2."
    ], err
    assert not any((tmp_path / "tmp").iterdir()), "the launch left folders in the temporary folder"


def test_help_on_two_processes_is_printed_once_and_starts_none():
    """--help under the launcher: the launcher's checks print it and stop the launch (they used to print it, then
    start the processes, which printed it again, each)."""
    r = subprocess.run(
        ["bash", str(REPO / "train_scripts" / "train_refl_lora.sh"), "--help"],
        cwd=REPO,
        env=_env(NUM_PROCESSES="2"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0 and r.stdout.count("usage:") == 1, (r.stdout[-500:], r.stderr[-2000:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_processes_die_with_their_launcher_after_kill_9(tmp_path):
    proc = _launch(tmp_path, "sleep")
    pid_files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    deadline = time.time() + 120
    while not all(p.is_file() and p.read_text() for p in pid_files) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    workers = [int(p.read_text()) for p in pid_files]
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: it can clean nothing up
        proc.wait()
        deadline = time.time() + 10
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "orphaned processes outlived their launcher"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
