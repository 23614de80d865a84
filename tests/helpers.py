"""What several test files share beside conftest.py's fixtures: a trainer's command line on the tiny models, and the
environment of a trainer's shell script run in a subprocess."""

import importlib
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# docs/gen_flags.py (a script, not a package module): the flag reference's reader of the configs and shell scripts
_spec = importlib.util.spec_from_file_location("gen_flags", REPO / "docs" / "gen_flags.py")
gen_flags = sys.modules.setdefault("gen_flags", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(gen_flags)

# ReFL's --backprop_steps variants and what its log calls them (parametrize "flags, described")
DRAFT_CASES = [
    (["--backprop_steps", "2"], "DRaFT-2"),
    (["--backprop_steps", "random:1-2"], "AlignProp"),
    (["--backprop_steps", "1", "--draft_lv", "2"], "DRaFT-LV"),
]


def trainer_flags(
    tiny_models: Path,
    out: Path,
    *extra: str,
    model: str = "stable-diffusion",
    resolution: int = 32,
    **flags,
) -> list[str]:
    """--pretrained_model TINY_MODELS/model --reward_model_dir TINY_MODELS --output_dir OUT --resolution N, then
    `flags` in their order (name=value gives --name value, name=True a bare --name), then `extra` as they are."""
    argv = [
        *("--pretrained_model", str(tiny_models / model), "--reward_model_dir", str(tiny_models)),
        *("--output_dir", str(out), "--resolution", str(resolution)),
    ]
    for name, value in flags.items():
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return [*argv, *extra]


def script_env(*drop: str, **extra: str) -> dict:
    """This process's environment for a trainer's shell script: without GPUS, NUM_PROCESSES and `drop`, with this
    Python, no hub and one OpenMP thread, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "NUM_PROCESSES", *drop)}
    return {**env, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}


def assert_lora_changes_stock_images(
    pipe, lora_dir, resolution: int, steps: int = 3, part: str | None = None
):
    """The stock `pipe` draws other images of "a cat" (seed 0, `steps` steps) once `load_lora_weights(lora_dir)` ran;
    with `part` ("unet", "transformer"), every saved matrix is that part's and loads into one of its layers. Returns
    the pipe, the LoRA loaded."""
    import torch

    kw = {"num_inference_steps": steps, "height": resolution, "width": resolution, "output_type": "pt"}
    before = pipe(prompt="a cat", generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(lora_dir))
    after = pipe(prompt="a cat", generator=torch.Generator().manual_seed(0), **kw).images
    assert (before - after).abs().max() > 1e-4
    if part is not None:
        from safetensors.torch import load_file

        from refl_ddpo.core.lora import LORA_WEIGHTS_NAME

        saved = load_file(Path(lora_dir) / LORA_WEIGHTS_NAME)
        loaded = [n for n, _ in getattr(pipe, part).named_parameters() if "lora_" in n]
        assert saved and all(k.startswith(f"{part}.") for k in saved) and len(loaded) == len(saved)
    return pipe


def base_weights(family) -> dict:
    """Every weight of the family's pipeline that is not a LoRA tensor (the network's, the VAE's, the text
    encoders'), by component and name."""
    import torch

    return {
        f"{part}.{name}": p
        for part, module in family.pipe.components.items()
        if isinstance(module, torch.nn.Module)
        for name, p in module.named_parameters()
        if "lora_" not in name
    }


KIT_FRAMES = (
    3  # issue 63: at most 3 of the kit's own frames from a trainer's loop to the network's forward call
)
LOOP_MODULES = ("reward_backprop.py", "policy_gradient.py", "forward_process.py")


def kit_frames_up_to(frame, is_loop) -> list[str] | None:
    """The kit's frames (files inside the refl_ddpo package, as 'module.function') from `frame` up to the nearest
    frame whose code `is_loop(code)` says is the loop, innermost last; None when no such frame is above it."""
    import refl_ddpo

    package = Path(refl_ddpo.__file__).resolve().parent
    names = []
    while frame is not None:
        code = frame.f_code
        if is_loop(code):
            return names[::-1]
        if Path(code.co_filename).resolve().is_relative_to(package):
            names.append(f"{Path(code.co_filename).stem}.{code.co_name}")
        frame = frame.f_back
    return None


def kit_frames_below_loop(frame) -> list[str] | None:
    """`kit_frames_up_to` a trainer's loop (its family module's `train`); None when no loop is above `frame` or
    validation's code is (refl_ddpo/run/validation.py: not the training loop's path)."""
    names = kit_frames_up_to(frame, lambda c: c.co_name == "train" and c.co_filename.endswith(LOOP_MODULES))
    return None if names is None or any(n.startswith("validation.") for n in names) else names


class TrainingWatch:
    """What `watch_training` saw of the trainer runs in this process, one record per run (per load of a trainable
    family): the family, its LoRA's tensors at the start (peft's names, as `read_lora_state` reads a saved LoRA), a
    copy of every base weight at the start, and the names of the LoRA tensors that got a non-zero gradient."""

    def __init__(self):
        self.runs: list[dict] = []

    def assert_lora_moved_and_base_not(self, out: Path, run: int = -1) -> None:
        """Run `run` (default: the last) trained its LoRA and nothing else: some LoRA tensor got a non-zero gradient,
        the LoRA saved in `out` has the start's tensors and differs from the start, so does the LoRA in memory, and
        every base weight of the pipeline is bit-identical to the start."""
        import torch
        from peft.utils import get_peft_model_state_dict

        from refl_ddpo.core.lora import read_lora_state

        seen = self.runs[run]
        network, start = seen["family"].network, seen["lora"]
        assert seen["graded"], "no LoRA tensor got a non-zero gradient"
        saved = read_lora_state(network, out)
        assert saved.keys() == start.keys(), sorted(saved.keys() ^ start.keys())[:3]
        assert any(not torch.equal(saved[k], start[k]) for k in start), (
            f"the LoRA saved in {out} is its start"
        )
        now = get_peft_model_state_dict(network)
        assert any(not torch.equal(now[k].float(), start[k]) for k in start), (
            "the LoRA in memory is its start"
        )
        moved = [n for n, p in base_weights(seen["family"]).items() if not torch.equal(p, seen["base"][n])]
        assert seen["base"] and not moved, f"base weights moved: {moved[:3]}"

    def assert_loop_near_the_network(self, run: int = -1, most: int = KIT_FRAMES) -> None:
        """Every network call of run `run`'s training loop was at most `most` of the kit's own frames below the
        loop (its family module's `train`); validation's calls (refl_ddpo/run/validation.py) aside."""
        counts = self.runs[run]["frames"]
        assert counts, "no network call was seen below a trainer's loop"
        deepest = max(counts, key=lambda c: len(c))
        assert len(deepest) <= most, (
            f"{len(deepest)} kit frames from the loop to the network: {' -> '.join(deepest)}"
        )


def watch_training(monkeypatch) -> TrainingWatch:
    """Watch every trainer run in this process (`refl_ddpo.trainers.NAME.main(flags)`): right after its family is
    loaded (run.training.load_trainable_family, which the trainers look up when they run), keep its LoRA's and its
    base weights' starting values and hook the LoRA's tensors to note which get a non-zero gradient. Then
    `watch.assert_lora_moved_and_base_not(output_dir)`."""
    from peft.utils import get_peft_model_state_dict

    from refl_ddpo.run import training

    watch = TrainingWatch()
    load = training.load_trainable_family

    def watched(*args, **kwargs):
        family, params, dtype = load(*args, **kwargs)
        network = family.network
        assert getattr(network, "peft_config", None), "watch_training checks a LoRA run (not --no-use_lora)"
        seen = {"family": family, "graded": set()}
        seen["lora"] = {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(network).items()}
        seen["base"] = {n: p.detach().clone() for n, p in base_weights(family).items()}
        for name, p in network.named_parameters():
            if p.requires_grad:
                p.register_hook(lambda g, name=name: seen["graded"].add(name) if g.abs().sum() > 0 else None)
        seen["frames"] = []

        def count_frames(module, args, frames=seen["frames"]):
            names = kit_frames_below_loop(sys._getframe(1))
            if names is not None and names not in frames:
                frames.append(names)

        network.register_forward_pre_hook(count_frames)
        watch.runs.append(seen)
        return family, params, dtype

    monkeypatch.setattr(training, "load_trainable_family", watched)
    return watch


def ddpo_first_update(
    family, scheduler, params, uncond, prompts, resolution: int, edit=None, metadata=None, **kw
) -> tuple[dict, dict]:
    """DDPO on `family`: two sampled batches of 2 (jpeg_compressibility, `kw`: num_steps, guidance_scale, eta)
    stacked with their advantages, `edit(samples)` (if given) run on them, then one PPO pass (clip range 1e-4, AdamW
    1e-3, no mixed precision); `metadata`: every prompt's (an edit's source images). Returns (the stacked samples, the
    first PPO step's stats)."""
    import torch

    from refl_ddpo.algorithms.policy import batch_advantages
    from refl_ddpo.rewards import build_reward
    from refl_ddpo.trainers.epochs import EpochPlan
    from refl_ddpo.trainers.ppo import PPOSettings, train_on_samples
    from refl_ddpo.trainers.rollouts import Policy, SampleSettings, sample_epoch, stack_samples

    prompts = iter(prompts)
    batches = sample_epoch(
        Policy(family, scheduler, uncond),
        SampleSettings(batch_size=2, num_batches=2, resolution=resolution, **kw),
        EpochPlan(lambda: (next(prompts), dict(metadata or {}))),
        build_reward("jpeg_compressibility", "cpu"),
        torch.Generator().manual_seed(0),
    )
    samples = stack_samples(batches, batch_advantages(torch.cat([b.rewards[0] for b in batches])).float())
    if edit is not None:
        edit(samples)
    accelerator = cpu_accelerator(gradient_accumulation_steps=kw["num_steps"])
    optimizer = accelerator.prepare_optimizer(torch.optim.AdamW(params, lr=1e-3))
    steps = train_on_samples(
        Policy(family, scheduler, uncond, family.network),
        PPOSettings(batch_size=2, num_train_steps=kw["num_steps"], clip_range=1e-4, **kw),
        samples,
        accelerator,
        optimizer,
        params,
        torch.Generator().manual_seed(1),
    )
    return samples, steps[0]


def run_script(name: str, args: list[str], env: dict | None = None, timeout: int = 300):
    """bash train_scripts/NAME ARGS from the repo root with `env` (default: script_env()), output captured. Past
    `timeout` seconds (a hang) its whole process group is killed, the launcher's workers with it, and
    TimeoutExpired raised."""
    with subprocess.Popen(
        ["bash", str(REPO / "train_scripts" / name), *args],
        cwd=REPO,
        env=script_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the workers are killed with it
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def script_recipe(name: str) -> tuple[str, str]:
    """train_scripts/NAME's trainer module and its recipe: the defaults it hands to `launch` before the "--"
    (docs/gen_flags.py's reading of the scripts), as the REFL_DDPO_DEFAULTS string launch.sh exports."""
    module, defaults = gen_flags.script_launches(REPO / "train_scripts")[name]
    return module, shlex.join(defaults)


def run_in_process(monkeypatch, name: str, args: list[str]) -> None:
    """What `run_script(NAME, ARGS)` runs on one process, in this one: the script's trainer module's main(ARGS) under
    the script's recipe and program name. A user error raises SystemExit (its code is the script's exit code, its
    one line is on stderr). Tests of the script itself (the launcher, env knobs, exit codes seen by a shell, several
    processes) run it with `run_script`."""
    module, defaults = script_recipe(name)
    monkeypatch.setenv("REFL_DDPO_DEFAULTS", defaults)
    monkeypatch.setenv("REFL_DDPO_PROG", f"bash train_scripts/{name}")
    importlib.import_module(module).main(args)


def refused(monkeypatch, capsys, name: str, args: list[str], through_script: bool, env: dict | None = None):
    """A run of train_scripts/NAME ARGS on one process that must stop at a check before loading: through the script
    (`run_script`, `env`) or in this process (`run_in_process`: the same trainer main, whose checks these are, without
    an interpreter's start). Returns (exit code, stderr). A parametrized test of refusals runs one case per script
    through it and the others in this process."""
    import pytest

    if through_script:
        r = run_script(name, args, env)
        return r.returncode, r.stderr
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        run_in_process(monkeypatch, name, args)
    return stopped.value.code, capsys.readouterr().err


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_after(folder: Path, name: str, args: list[str]) -> None:
    """Start train_scripts/NAME ARGS on two processes and kill its whole process group with -9 once `folder` (a
    checkpoint) is there. The launcher's temporary folders, which a kill leaves, go beside the run's folder."""
    tmp = folder.parent.with_name(folder.parent.name + ".tmp")
    tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        ["bash", str(REPO / "train_scripts" / name), *args],
        cwd=REPO,
        env=script_env(NUM_PROCESSES="2", TMPDIR=str(tmp)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 180
    while not folder.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert folder.is_dir(), f"no {folder.name} before the kill"


def assert_lora_moves_the_scores(
    tiny_models: Path, base: Path, lora_dir: Path, prompts: Path, tmp: Path, *extra
):
    """Before (`base`) / after (the LoRA in `lora_dir`) inference with its scores, 2 images of each prompt in 3 steps
    (then `extra` flags), and the scored comparison: 2 pairs, a mean difference that is not 0."""
    import json

    from refl_ddpo.apps import compare, inference

    common = ["--prompts_file", str(prompts), "--reward_model_dir", str(tiny_models), "--device", "cpu"]
    common += ["--num_inference_steps", "3", "--num_images_per_prompt", "2", *extra]
    before, after = tmp / "before", tmp / "after"
    inference.main_base(["--pretrained_model", str(base), "--output_dir", str(before), *common])
    inference.main_lora(["--lora_dir", str(lora_dir), "--output_dir", str(after), *common])
    compare.run_compare(str(before), str(after), str(tmp / "cmp"))
    result = json.loads((tmp / "cmp" / "compare.json").read_text())
    assert result["count"] == 2 and result["mean_difference"] != 0


# ---- two-process runs under FSDP and ZeRO-2 (tests/test_fsdp*.py, test_deepspeed.py; conftest.py's
# `two_process_runs` runs each named one once a pytest run) ----

FSDP_TOL = 1e-5
# validation: every process draws (a sharded network needs all of them in each forward), the main one writes
FSDP_VALIDATION = (
    "--gradient_checkpointing",
    *("--validation_prompts_file", "toy_world_heldout", "--validation_steps", "2"),
    *("--num_validation_images", "1", "--validation_num_steps", "2"),
)
FSDP_FULL = ("--no-use_lora", "--learning_rate", "1e-3")
FSDP_FULL_SHARDS = ("--fsdp", *FSDP_FULL, "--fsdp_checkpoint", "sharded")
# ReFL under FSDP with validation, sharded checkpoints (--fsdp_checkpoint sharded: checkpoint-1, -2 and -3, the last
# two kept) and the text encoders sharded too (--fsdp_shard_text_encoders)
FSDP_SHARDS = (
    *("--fsdp", *FSDP_VALIDATION, "--fsdp_checkpoint", "sharded", "--fsdp_shard_text_encoders"),
    *("--checkpointing_steps", "1", "--checkpoints_total_limit", "2"),
)


ZERO2 = ("--deepspeed_zero", "2")


def grpo_flags(tiny_models: Path, out: Path, *extra: str) -> list[str]:
    """GRPO on tiny SD3, 2 processes x 2 samples in groups of 2, an SDE window of 2, beta; 2 epochs, a checkpoint
    after each; gradients clipped at 1e-3, so that every engine's clipping acts (on the second step)."""
    return trainer_flags(
        tiny_models,
        out,
        "--global_std",
        *("--max_grad_norm", "1e-3"),
        *extra,
        model="tiny-sd3",
        sample_num_steps=4,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        group_size=2,
        sde_window=2,
        beta="0.04",
        learning_rate="3e-2",
        num_epochs=2,
        save_freq=1,
        device="cpu",
        report_to="none",
        lora_init="random",
    )


def refl_flags(tiny_models: Path, out: Path, *extra: str, model: str = "tiny-sd3") -> list[str]:
    """ReFL, 3 steps of 2 micro-batches of 2 per process, checkpoint-2."""
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=model,
        num_inference_steps=4,
        k_lo=2,
        k_hi=3,
        train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate="3e-2",
        max_train_steps=3,
        checkpointing_steps=2,
        device="cpu",
        report_to="none",
        lora_init="random",
    )


# the runs `two_process_runs` knows: name -> (script, its flags for (tiny_models, out))
TWO_PROCESS_RUNS = {
    "grpo-ddp": ("train_grpo.sh", lambda m, out: grpo_flags(m, out)),
    "grpo-fsdp": ("train_grpo.sh", lambda m, out: grpo_flags(m, out, "--fsdp")),
    "refl-ddp": ("train_refl_lora.sh", lambda m, out: refl_flags(m, out, *FSDP_VALIDATION)),
    "refl-fsdp": ("train_refl_lora.sh", lambda m, out: refl_flags(m, out, *FSDP_SHARDS)),
    "full-ddp": ("train_refl_lora.sh", lambda m, out: refl_flags(m, out, *FSDP_FULL)),
    "full-fsdp": ("train_refl_lora.sh", lambda m, out: refl_flags(m, out, *FSDP_FULL_SHARDS)),
    "grpo-zero2": ("train_grpo.sh", lambda m, out: grpo_flags(m, out, *ZERO2)),
}


def run_two(script: str, args: list[str], **env) -> subprocess.CompletedProcess:
    """train_scripts/SCRIPT ARGS on two processes (`env` added), which must succeed."""
    r = run_script(script, args, script_env(NUM_PROCESSES="2", **env), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def resume_two(checkpoint: Path, script: str, args: list[str]) -> subprocess.CompletedProcess:
    """Copy a finished run's `checkpoint` into the fresh --output_dir of `args` (the folder a run killed right after
    writing it leaves) and resume it with latest on two processes: one two-process run, not a killed and a resumed
    one. Runs killed with -9 on two processes and resumed: tests/test_nft.py, test_fsdp_grpo.py (GRPO, under
    FSDP); and test_runs.py: the workers die with their launcher."""
    import shutil

    out = Path(args[args.index("--output_dir") + 1])
    out.mkdir(parents=True)
    shutil.copytree(checkpoint, out / checkpoint.name)
    return run_two(script, [*args, "--resume_from_checkpoint", "latest"])


def dcp_model(checkpoint: Path) -> dict:
    """A sharded checkpoint's network (--fsdp_checkpoint sharded), read whole in this one process (DCP reshards),
    by the trained module's parameter names."""
    import torch
    import torch.distributed.checkpoint as dcp

    from refl_ddpo.core.sharding import SHARDS_DIR

    saved = dcp.FileSystemReader(checkpoint / SHARDS_DIR).read_metadata().state_dict_metadata
    whole = {k: torch.empty(v.size) for k, v in saved.items() if k.startswith("model.")}
    dcp.load(whole, checkpoint_id=checkpoint / SHARDS_DIR, no_dist=True)
    return {k.removeprefix("model."): v for k, v in whole.items()}


def assert_close(a: dict, b: dict, tol: float = FSDP_TOL) -> float:
    """The same non-empty set of tensors, each within `tol` (max abs); returns the worst difference."""
    assert a.keys() == b.keys() and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, worst
    return worst


def saved_lora(folder: Path) -> dict:
    """The LoRA tensors a run or checkpoint folder holds."""
    from safetensors.torch import load_file

    from refl_ddpo.core.lora import LORA_WEIGHTS_NAME

    return load_file(folder / LORA_WEIGHTS_NAME)


def kit_frames(network, run_fn, loop_name: str) -> int:
    """The most frames of the kit's own code (files inside the refl_ddpo package) between the frame of the function
    named `loop_name` (a trainer's loop; in a test, the test function) and a forward call of `network`, over every
    call that `run_fn()` makes. torch's, diffusers', peft's and accelerate's frames do not count, nor the forward
    pre-hook's own; frames of tests/ do not either. Fails when `run_fn` never calls the network, or when a call has
    no frame named `loop_name` above it."""
    counts: list[int | None] = []

    def hook(module, args):
        names = kit_frames_up_to(sys._getframe(1), lambda c: c.co_name == loop_name)
        counts.append(None if names is None else len(names))

    handle = network.register_forward_pre_hook(hook)
    try:
        run_fn()
    finally:
        handle.remove()
    assert counts, "kit_frames: run_fn never called the network"
    assert None not in counts, f"kit_frames: a network call with no frame named {loop_name!r} above it"
    return max(counts)


# ---- shared by the family test files (test_flux, test_flux2, test_qwen_image, test_z_image) ----

# config class name -> its guidance flags and their CFG defaults (what SD resolves them to, a family without embedded
# guidance too)
GUIDANCE_FIELDS = {
    "ReFLConfig": {"guidance_scale": 1.0, "validation_guidance_scale": 7.5},
    "DDPOConfig": {"sample_guidance_scale": 5.0, "validation_guidance_scale": 7.5},
    "GRPOConfig": {"sample_guidance_scale": 5.0, "validation_guidance_scale": 7.5},
    "NFTConfig": {"sample_guidance_scale": 1.0, "validation_guidance_scale": 7.5},
    "AWMConfig": {"sample_guidance_scale": 1.0, "validation_guidance_scale": 7.5},
}


def config_classes() -> list:
    """Every trainer's config class (each has GUIDANCE_FIELDS' guidance flags)."""
    from refl_ddpo.trainers.ddpo_config import DDPOConfig
    from refl_ddpo.trainers.forward_config import AWMConfig, NFTConfig
    from refl_ddpo.trainers.grpo_config import GRPOConfig
    from refl_ddpo.trainers.refl_config import ReFLConfig

    return [ReFLConfig, DDPOConfig, GRPOConfig, NFTConfig, AWMConfig]


def one_image_inference(
    tmp_path: Path, model: Path, prompt: str, steps: int, resolution: int, seed: int, *flags
):
    """refl_ddpo.apps.inference on one prompt (a prompts file in tmp_path): one image of `model` into tmp_path/out,
    on CPU, scored by the JPEG reward; returns run_inference's result."""
    from refl_ddpo.apps import inference
    from refl_ddpo.run.flags import parse_config

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{prompt}\n")
    argv = ["--pretrained_model", str(model), "--prompts_file", str(prompts), "--device", "cpu"]
    argv += ["--output_dir", str(tmp_path / "out"), "--num_images_per_prompt", "1"]
    argv += ["--num_inference_steps", str(steps)]
    argv += [
        "--resolution",
        str(resolution),
        "--rewards",
        "jpeg_compressibility",
        "--seed",
        str(seed),
        *flags,
    ]
    return inference.run_inference(parse_config(inference.InferenceConfig, argv))


def train_preset_small(monkeypatch, capsys, main, tiny_models: Path, out: Path, preset: str, **flags) -> None:
    """A trainer's `main` run with --preset `preset` scaled down to a tiny model (`flags`: model=..., more flags):
    one group of 2, the JPEG size as reward, one epoch, CPU precision, a random LoRA init; checks that it ran its
    epoch and that the LoRA moved and the base weights did not."""
    small = {"sample_batch_size": 2, "sample_num_batches_per_epoch": 1, "group_size": 2}
    small |= {"train_batch_size": 2, "train_gradient_accumulation_steps": 1, "num_epochs": 1}
    argv = trainer_flags(
        tiny_models,
        out,
        "--preset",
        preset,
        reward="jpeg_compressibility",
        mixed_precision="no",
        lora_init="random",
        device="cpu",
        report_to="none",
        **small,
        **flags,
    )
    watch = watch_training(monkeypatch)
    main(argv)
    assert "epoch 1/1" in capsys.readouterr().out
    watch.assert_lora_moved_and_base_not(out)


def cpu_accelerator(**kwargs):
    """A float32 CPU Accelerator (`kwargs`: its other arguments). accelerate keeps one state per process: an earlier
    test's bf16 (a trainer run in this process, test_lean's) would otherwise leak into this one's autocast."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    return Accelerator(cpu=True, mixed_precision="no", **kwargs)
