"""Time-to-reward on the toy world: CPU seconds until held-out colour accuracy reaches a target, per trainer
configuration, over several seeds, on two tasks.

    python benchmarks/time_to_reward.py [--out DIR] [--configs a,b,...] [--seeds 0,1,2] [--jobs N]

Tasks (TASKS): `twelve`, toy-sd on all 12 training prompts, judged on the 6 held-out colour / shape combinations x 16
seeds; `cyan`, toy-sd3 on the colour word cyan (the one-word task GRPO learns), judged on "a cyan circle" x 64 seeds.
Each run is the trainer's shell script with its task's preset (one thread, `--device cpu`, no validation) plus the
configuration's flags, checkpointing at fixed intervals. While it runs, the CPU seconds of its process tree are read
each time a `checkpoint-N/` appears (the folder is renamed into place once complete). Afterwards each checkpoint's
LoRA is judged as the learning tests judge a final LoRA (`toy_world.evaluate_model`: 20 deterministic steps, CFG
7.5). Results per task: `DIR/TASK/results.json` (every point), `DIR/TASK/results.md` (a table and a reward-vs-time
chart in Mermaid, which GitHub renders), `DIR/TASK/runs/` (the runs). A finished run (its `points.json` present) is
reused, so the work can be split over several calls.

A task's target is the final held-out accuracy (seed mean) of its reference configuration (DDPO's preset on
`twelve`, GRPO's on `cyan`), and a second one the base's accuracy + GAIN; each configuration's time to them is read
off its seed-mean curve (linear between checkpoints).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Task:
    what: str
    preset: str  # every configuration of the task runs with --preset this
    model: str  # a folder under toy_world.DATA_DIR
    prompts: str  # the held-out prompts: a tuple's name in refl_ddpo.toy_world.world
    seeds: str  # the evaluation seeds: a tuple's name in refl_ddpo.toy_world.world
    target: str  # the configuration whose seed-mean final accuracy is the target


@dataclass(frozen=True)
class Config:
    task: str
    script: str
    flags: tuple[str, ...]
    checkpoint: tuple[str, ...]  # the checkpoint flag and its interval
    what: str


TASKS: dict[str, Task] = {
    "twelve": Task(
        "toy-sd on all 12 training prompts; the 6 held-out colour / shape combinations x 16 seeds",
        "toy_world",
        "toy-sd",
        "HELDOUT_PROMPTS",
        "EVAL_SEEDS",
        "ddpo",
    ),
    "cyan": Task(
        'toy-sd3 on the colour word cyan (its 2 training prompts); "a cyan circle" x 64 seeds',
        "toy_world_sd3",
        "toy-sd3",
        "SD3_HELDOUT_PROMPTS",
        "PROOF_EVAL_SEEDS",
        "grpo_sd3",
    ),
}

_TWELVE = ("--prompt_fn", "toy_world_train")
CONFIGS: dict[str, Config] = {
    "ddpo": Config(
        "twelve",
        "train_ddpo.sh",
        ("--num_epochs", "64", *_TWELVE),
        ("--save_freq", "16"),
        (
            "DDPO, the toy_world preset on all 12 training prompts run 4x longer (64 epochs of 64 images, "
            "batch-normalised advantages, the first 4 of 6 steps trained)"
        ),
    ),
    "grpo_window": Config(
        "twelve",
        "train_grpo.sh",
        (
            "--num_epochs",
            "64",
            "--sde_window",
            "2",
            "--sde_window_start",
            "0",
            *_TWELVE,
            "--reward",  # as measured (the preset has added toy_clean since)
            "toy_color_match",
        ),
        ("--save_freq", "16"),
        "GRPO, groups of 8 with one x_T each, only the first 2 steps stochastic and trained (Flow-GRPO-Fast's window)",
    ),
    "refl": Config(
        "twelve",
        "train_refl_lora.sh",
        (),
        ("--checkpointing_steps", "40"),
        "ReFL, the toy_world preset (160 steps of 8, toy_classifier)",
    ),
    "draft3": Config(
        "twelve",
        "train_refl_lora.sh",
        ("--backprop_steps", "3", "--max_train_steps", "80", "--learning_rate", "2e-3"),
        ("--checkpointing_steps", "20"),
        "DRaFT-3 (reward backprop through the last 3 of 10 steps)",
    ),
    "nft": Config(
        "twelve",
        "train_nft.sh",
        ("--num_epochs", "32", *_TWELVE, "--group_size", "4", "--sample_num_batches_per_epoch", "3"),
        ("--save_freq", "16"),
        "DiffusionNFT, the toy_world preset on all 12 training prompts (32 epochs of 12 groups of 4 clean samples)",
    ),
    "awm": Config(
        "twelve",
        "train_awm.sh",
        ("--num_epochs", "32", *_TWELVE, "--group_size", "4", "--sample_num_batches_per_epoch", "3"),
        ("--save_freq", "16"),
        "AWM, the toy_world preset on all 12 training prompts (as `nft`, the samples from the current weights)",
    ),
    "grpo_sd3": Config(
        "cyan",
        "train_grpo.sh",
        (),
        ("--save_freq", "2"),
        "GRPO, the toy_world_sd3 preset (8 epochs of 64 images, the flow SDE step, groups of 8)",
    ),
    "nft_sd3": Config(
        "cyan",
        "train_nft.sh",
        (),
        ("--save_freq", "2"),
        "DiffusionNFT, the toy_world_sd3 preset (8 epochs of 2 groups of 16 clean Euler samples at CFG 7.5)",
    ),
    "awm_sd3": Config(
        "cyan",
        "train_awm.sh",
        (),
        ("--save_freq", "2"),
        "AWM, the toy_world_sd3 preset (as `nft_sd3`, the samples from the current weights)",
    ),
}
GAIN = 0.10  # a second target: the base's accuracy plus this


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid, cpu
    total, frontier = 0.0, [pid]
    while frontier:
        p = frontier.pop()
        total += stats.get(p, (0, 0.0))[1]
        frontier += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


def train(name: str, seed: int, out: Path) -> dict:
    """One run; returns {"checkpoints": [(step, cpu_s)], "cpu_s": total} and writes RUN/points.json."""
    run = run_dir(out, name, seed)
    done = run / "points.json"
    if done.exists():
        return json.loads(done.read_text())
    config = CONFIGS[name]
    cmd = [
        "bash",
        f"train_scripts/{config.script}",
        "--preset",
        TASKS[config.task].preset,
        "--output_dir",
        str(run),
        "--seed",
        str(seed),
        "--device",
        "cpu",
        "--report_to",
        "none",
        "--validation_prompts_file",
        "",
        "--overwrite_output_dir",
        "--checkpoints_total_limit",
        "1000",
        *config.flags,
        *config.checkpoint,
    ]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("NUM_PROCESSES", None)
    env.pop("GPUS", None)
    run.mkdir(parents=True, exist_ok=True)
    seen: dict[int, float] = {}
    with open(run.parent / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        cpu = 0.0
        while proc.poll() is None:
            cpu = max(cpu, tree_cpu_seconds(proc.pid))
            for d in run.glob("checkpoint-*"):
                step = int(d.name.split("-")[1])
                seen.setdefault(step, cpu)
            time.sleep(0.5)
    if proc.returncode != 0:
        sys.exit(
            f"error: {name} seed {seed} failed (exit {proc.returncode}); see {run.parent / run.name}.log"
        )
    for d in run.glob("checkpoint-*"):  # one written in the last half second
        seen.setdefault(int(d.name.split("-")[1]), cpu)
    result = {"checkpoints": sorted(seen.items()), "cpu_s": cpu}
    done.write_text(json.dumps(result))
    return result


def judge(task: Task, lora_dir: Path | None) -> float:
    """Held-out colour accuracy of the task's model plus a LoRA folder (None: the base), as the learning tests
    judge."""
    import torch

    from refl_ddpo.toy_world import world as toy_world

    torch.set_num_threads(1)
    return toy_world.evaluate_model(
        toy_world.DATA_DIR / task.model,
        lora_dir,
        getattr(toy_world, task.prompts),
        getattr(toy_world, task.seeds),
    )["accuracy"]


def judged(task: Task, run: Path, step: int) -> float:
    cache = run / "accuracy.json"
    scores = json.loads(cache.read_text()) if cache.exists() else {}
    if str(step) not in scores:
        scores[str(step)] = judge(task, run / f"checkpoint-{step}")
        cache.write_text(json.dumps(scores))
    return scores[str(step)]


def judge_run(task: Task, run: Path, steps: list[int]) -> list[float]:
    return [judged(task, run, step) for step in steps]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/time_to_reward_cpu", help="results folder")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    a = ap.parse_args(argv)
    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        ap.error(
            f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CONFIGS)}"
        )
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers (got {a.seeds!r})")
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    out = Path(a.out)
    jobs = [(n, s) for n in names for s in seeds]
    with ThreadPoolExecutor(a.jobs) as pool:
        trained = dict(zip(jobs, pool.map(lambda j: train(*j, out), jobs), strict=False))
    for task_name, task in TASKS.items():
        # the task's configurations asked for now, and those whose runs for these seeds an earlier call finished
        members = [
            n
            for n, c in CONFIGS.items()
            if c.task == task_name
            and (n in names or all(run_dir(out, n, s).joinpath("points.json").exists() for s in seeds))
        ]
        if members:
            print(summarise(task_name, task, members, seeds, out, a.jobs, trained))


def run_dir(out: Path, name: str, seed: int) -> Path:
    return out / CONFIGS[name].task / "runs" / f"{name}-seed{seed}"


def summarise(
    task_name: str, task: Task, names: list[str], seeds: list[int], out: Path, jobs: int, trained: dict
) -> str:
    """Judge every checkpoint of the task's runs, write DIR/TASK/results.json and results.md; returns the table."""
    folder = out / task_name
    jobs_ = [(n, s) for n in names for s in seeds]
    trained = {j: trained.get(j) or train(*j, out) for j in jobs_}  # finished runs: read back
    # runs an earlier call recorded in results.json stay in it where their folders are gone (runs/ is not committed)
    earlier = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
    base_cache = folder / "base_accuracy.json"
    if not base_cache.exists():
        base_cache.write_text(json.dumps(earlier.get("base_accuracy") or judge(task, None)))
    results = {
        "task": task.what,
        "base_accuracy": json.loads(base_cache.read_text()),
        "configs": {},
        "runs": {},
    }

    # one run's checkpoints in order (one accuracy.json per run), a process per run at a time: loading models in
    # threads of one process is not safe (meta-device initialisation is process-wide)
    runs = [run_dir(out, *job) for job in jobs_]
    steps = [[step for step, _ in trained[job]["checkpoints"]] for job in jobs_]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        accuracies = dict(zip(jobs_, pool.map(judge_run, [task] * len(runs), runs, steps), strict=True))
    for (name, seed), tr in trained.items():
        results["runs"].setdefault(name, {})[str(seed)] = [
            {"step": step, "cpu_s": round(cpu, 1), "accuracy": acc}
            for (step, cpu), acc in zip(tr["checkpoints"], accuracies[(name, seed)], strict=False)
        ]
    results["configs"] = {
        n: {
            "script": CONFIGS[n].script,
            "preset": task.preset,
            "flags": [*CONFIGS[n].flags, *CONFIGS[n].checkpoint],
            "what": CONFIGS[n].what,
        }
        for n in names
    }
    for name, runs in earlier.get("runs", {}).items():
        if name not in results["runs"] and name in CONFIGS and CONFIGS[name].task == task_name:
            results["runs"][name] = runs
            results["configs"][name] = earlier["configs"][name]
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    from benchmarks.time_to_reward_report import report  # it reads this module's CONFIGS

    return f"## {task_name}: {task.what}\n\n" + report(results, folder, task.target)


if __name__ == "__main__":
    main()
