"""ReFL trainer: the gradient path, the KL term, the shell script end to end, bit-exact resume, two processes in step,
and one-line errors for bad input. CPU, tiny random models (refl_ddpo.testing.tiny). The trainer runs in this process
(`refl.main`, under train_refl_lora.sh's recipe) except where the script or the process boundary is the point: the
script end to end, its one-line errors and env knobs seen from a shell, and two processes."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionPipeline
from helpers import run_in_process, script_env, trainer_flags, watch_training
from safetensors.torch import load_file

from refl_ddpo.core.families import load_family, resolve_guidance
from refl_ddpo.core.families.sd import StableDiffusion
from refl_ddpo.core.lora import CONFIG_NAME, LORA_WEIGHTS_NAME, add_lora
from refl_ddpo.core.prompts import DATA_DIR, PromptDraw, load_prompts
from refl_ddpo.core.sampling import denoise
from refl_ddpo.rewards import build_reward
from refl_ddpo.run.flags import parse_config
from refl_ddpo.trainers import refl
from refl_ddpo.trainers.backprop import Rollout, kl_to_base, refl_step
from refl_ddpo.trainers.refl import ReFLConfig, build_refl_reward

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "train_scripts" / "train_refl_lora.sh"
RES, T, K_LO, K_HI = 32, 8, 4, 7
PROMPTS = ["a photo of a cat", "a red bird"]


pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


def _cfg(tiny_models, **kw) -> ReFLConfig:
    return ReFLConfig(
        pretrained_model=str(tiny_models / "stable-diffusion"),
        reward_model_dir=str(tiny_models),
        resolution=RES,
        num_inference_steps=T,
        k_lo=K_LO,
        k_hi=K_HI,
        device="cpu",
        **kw,
    )


def _refl_inputs(tiny_models, lora_init: str):
    family = load_family(str(tiny_models / "stable-diffusion"))
    params = add_lora(family.network, 4, 4, ["to_q", "to_k", "to_v", "to_out.0"], init=lora_init)
    scheduler = DDPMScheduler.from_config(family.pipe.scheduler.config)
    cond, _ = family.encode_prompts(PROMPTS, with_negative=False)
    noise = family.initial_noise(len(PROMPTS), RES, torch.Generator().manual_seed(0), torch.float32)
    return family, params, scheduler, cond, noise


# ---- units: the gradient path and the KL term ----


def test_imagereward_gradient_reaches_every_lora_param_and_nothing_else_moves(tiny_models):
    # 'random' init: with peft's default zero B the gradient of every A would be exactly zero at step 0
    family, params, scheduler, cond, noise = _refl_inputs(tiny_models, "random")
    pipe = family.pipe
    reward = build_refl_reward(_cfg(tiny_models), torch.device("cpu"), torch.float32)
    frozen = {f"unet.{n}": p for n, p in pipe.unet.named_parameters() if "lora_" not in n}
    frozen.update({f"vae.{n}": p for n, p in pipe.vae.named_parameters()})
    frozen.update({f"text_encoder.{n}": p for n, p in pipe.text_encoder.named_parameters()})
    before = {n: p.detach().clone() for n, p in frozen.items()}
    lora_before = [p.detach().clone() for p in params]

    rollout = Rollout(
        family, scheduler, cond, None, PROMPTS, [{}, {}], noise, T, generator=torch.Generator().manual_seed(1)
    )
    out = refl_step(rollout, reward, 6, margin=2.0, grad_scale=1.0)
    assert out.images.shape == (2, 3, RES, RES) and out.rewards.shape == (2,)
    assert out.rewards.requires_grad and out.images.requires_grad
    torch.testing.assert_close(out.loss, torch.relu(2.0 - out.rewards).mean())
    out.loss.backward()
    missing = [i for i, p in enumerate(params) if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"{len(missing)} of {len(params)} LoRA tensors got no gradient from ImageReward"
    assert all(p.grad is None for p in frozen.values())

    torch.optim.AdamW(params, lr=1e-3).step()
    assert all(not torch.equal(a, p) for a, p in zip(lora_before, params, strict=True)), (
        "every LoRA tensor moves"
    )
    changed = [n for n, p in frozen.items() if not torch.equal(before[n], p)]
    assert not changed, f"base weights changed: {changed[:3]}"


def test_kl_term_is_the_noise_prediction_mse_to_the_base_model(tiny_models):
    family, params, scheduler, cond, noise = _refl_inputs(tiny_models, "random")
    pipe = family.pipe
    reward = build_reward("imagereward", "cpu", torch.float32, str(tiny_models))
    k = 5
    rollout = Rollout(
        family, scheduler, cond, None, PROMPTS, [{}, {}], noise, T, generator=torch.Generator().manual_seed(1)
    )
    out = refl_step(rollout, reward, k, keep_trajectory=True)
    kl = kl_to_base(rollout, out.denoised, k)
    assert all(p.requires_grad for p in params), "enable_adapters must make the LoRA trainable again"
    x_t, t = out.denoised.all_latents[k], out.denoised.timesteps[k]
    with torch.no_grad():
        eps_lora = family.predict(x_t, t, scheduler, cond, None, 1.0)
        pipe.unet.disable_adapters()
        eps_base = family.predict(x_t, t, scheduler, cond, None, 1.0)
        pipe.unet.enable_adapters()
    expected = (eps_lora - eps_base).square().mean()
    assert expected > 0
    torch.testing.assert_close(kl, expected, rtol=1e-3, atol=1e-7)
    kl.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_later_flags_override_earlier_ones_and_defaults():
    cfg = parse_config(ReFLConfig, ["--grad_scale", "0.01", "--learning_rate", "1e-4", "--grad_scale", "0.5"])
    assert cfg.grad_scale == 0.5 and cfg.learning_rate == 1e-4
    assert (cfg.k_lo, cfg.k_hi, cfg.num_inference_steps, cfg.margin) == (30, 39, 40, 2.0)
    assert cfg.output_dir == "checkpoint/refl_lora" and cfg.scheduler == "ddpm"
    assert cfg.guidance_scale is None and resolve_guidance(cfg, StableDiffusion).guidance_scale == 1.0
    assert len(load_prompts(DATA_DIR / "refl_prompts.txt")) >= 30
    train = {p for p, _ in load_prompts(DATA_DIR / "refl_prompts.txt")}
    held_out = [p for p, _ in load_prompts(DATA_DIR / "eval_prompts.txt")]
    assert len(held_out) >= 8 and not train & set(held_out)


# ---- end to end through the shell script ----


def _script(args: list[str], cwd: Path = REPO, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", os.path.relpath(SCRIPT, cwd), *args],
        check=False,
        cwd=cwd,
        env=script_env(**env),
        capture_output=True,
        text=True,
        timeout=240,
    )


def _train_flags(tiny_models, out: Path, steps: int) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        resolution=RES,
        num_inference_steps=T,
        k_lo=K_LO,
        k_hi=K_HI,
        device="cpu",
        train_batch_size=2,
        learning_rate="3e-2",
        max_train_steps=steps,
        image_log_steps=10,
    )


def test_script_trains_on_the_users_reward_and_prompt_fn_and_resumes_bit_exactly(
    tiny_models, tmp_path, capsys, monkeypatch
):
    """--reward pkg.module:function (marked differentiable) and --prompt_fn pkg.module:function (tests/user_functions.py,
    on this process' path as on the script's PYTHONPATH) through ReFL: the prompts are seeded from the process' stream,
    so a run resumed from its checkpoint gives the uninterrupted run's LoRA. A reward not marked differentiable and a
    prompt_fn that does not import are one line each, before any model."""
    watch = watch_training(monkeypatch)
    flags = ["--reward", "user_functions:redness", "--prompt_fn", "user_functions:colour_prompt"]
    flags += ["--checkpointing_steps", "2"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_in_process(monkeypatch, SCRIPT.name, _train_flags(tiny_models, whole, 4) + flags)
    assert "prompt_fn user_functions:colour_prompt" in capsys.readouterr().out
    watch.assert_lora_moved_and_base_not(whole)
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    run_in_process(
        monkeypatch,
        SCRIPT.name,
        _train_flags(tiny_models, resumed, 4) + flags + ["--resume_from_checkpoint", "latest"],
    )
    a, b = load_file(whole / LORA_WEIGHTS_NAME), load_file(resumed / LORA_WEIGHTS_NAME)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for bad, words in (
        (["--reward", "user_functions:brightness_list"], "differentiable = True"),
        (["--prompt_fn", "user_functions:nope"], "has no nope"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            run_in_process(monkeypatch, SCRIPT.name, _train_flags(tiny_models, tmp_path / "bad", 1) + bad)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err.strip().splitlines()[-1], err[-2000:]


def test_prompt_draw_takes_the_list_or_the_source_from_one_generator():
    """A list: uniform draws as torch.randint gives them; a source: seeded from the generator, so the same state
    draws the same prompts (and metadata), and the next state others."""
    listed = [("a", {"i": 0}), ("b", {"i": 1}), ("c", {"i": 2})]
    idx = torch.randint(3, (5,), generator=torch.Generator().manual_seed(7)).tolist()
    assert PromptDraw(listed)(5, torch.Generator().manual_seed(7)) == (
        [listed[i][0] for i in idx],
        [listed[i][1] for i in idx],
    )
    draw, g = PromptDraw(source="user_functions:colour_prompt"), torch.Generator().manual_seed(0)
    first, second = draw(8, g), draw(8, g)
    assert first == draw(8, torch.Generator().manual_seed(0)) and first != second
    assert all(m == {"colour": p.split()[1]} for p, m in zip(*first, strict=True))


E2E_STEPS, RESUME_AT = 30, 15


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory) -> Path:
    """train_refl_lora.sh end to end (its one script-level run; the other runs here are in this process)."""
    out = tmp_path_factory.mktemp("refl") / "run"
    r = _script(_train_flags(tiny_models, out, E2E_STEPS) + ["--checkpointing_steps", str(RESUME_AT)])
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@torch.no_grad()
def _held_out_reward(pipe, reward) -> float:
    """Mean ImageReward of fixed-seed images (2 per prompt) on the held-out prompts, with the training sampler."""
    prompts = [p for p, _ in load_prompts(DATA_DIR / "eval_prompts.txt")]
    family = StableDiffusion(pipe)
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    cond, _ = family.encode_prompts(prompts, with_negative=False)
    scores = []
    for seed in (0, 1):
        generator = torch.Generator().manual_seed(seed)
        noise = family.initial_noise(len(prompts), RES, generator, torch.float32)
        latents = denoise(family, scheduler, cond, None, noise, T, 1.0, generator=generator).latents
        scores.append(reward(family.decode(latents), prompts, [{}] * len(prompts))[0])
    return torch.cat(scores).mean().item()


def test_script_trains_lora_that_raises_held_out_reward_and_loads_in_stock_pipeline(trained, tiny_models):
    assert (trained / LORA_WEIGHTS_NAME).is_file()
    saved = json.loads((trained / CONFIG_NAME).read_text())
    assert (
        saved["learning_rate"] == 3e-2
        and saved["grad_scale"] == 0.01
        and saved["max_train_steps"] == E2E_STEPS
    )
    assert {p.name for p in trained.glob("checkpoint-*")} == {
        f"checkpoint-{RESUME_AT}",
        f"checkpoint-{E2E_STEPS}",
    }
    assert list((trained / "logs").rglob("events.out.tfevents.*")), "tensorboard scalars and image grids"

    reward = build_reward("imagereward", "cpu", torch.float32, str(tiny_models))
    pipe = StableDiffusionPipeline.from_pretrained(tiny_models / "stable-diffusion")
    pipe.set_progress_bar_config(disable=True)
    before = _held_out_reward(pipe, reward)
    pipe.load_lora_weights(str(trained))  # a stock pipeline, stock loader
    after = _held_out_reward(pipe, reward)
    print(f"held-out ImageReward before {before:.4f} after {after:.4f} ({E2E_STEPS} steps)")
    assert after > before + 0.05, (before, after)


def test_resume_gives_bit_identical_lora(trained, tiny_models, tmp_path, capsys, monkeypatch):
    """The script's run resumed from its checkpoint in this process ends on the script's LoRA."""
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(trained / f"checkpoint-{RESUME_AT}", out / f"checkpoint-{RESUME_AT}")
    run_in_process(
        monkeypatch,
        SCRIPT.name,
        _train_flags(tiny_models, out, E2E_STEPS)
        + ["--checkpointing_steps", str(RESUME_AT), "--resume_from_checkpoint", "latest"],
    )
    assert f"resumed from {out / f'checkpoint-{RESUME_AT}'} at step {RESUME_AT}" in capsys.readouterr().out
    resumed, uninterrupted = load_file(out / LORA_WEIGHTS_NAME), load_file(trained / LORA_WEIGHTS_NAME)
    midway = load_file(trained / f"checkpoint-{RESUME_AT}" / LORA_WEIGHTS_NAME)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert any(not torch.equal(midway[k], uninterrupted[k]) for k in midway), "the resumed half did train"


def test_two_processes_hold_identical_lora_after_every_step(tiny_models, tmp_path):
    from PIL import Image

    # an image-caption folder, so that the pretraining loss (a second UNet forward with grad) runs under DDP too
    data = tmp_path / "captions"
    data.mkdir()
    gen = torch.Generator().manual_seed(0)
    lines = []
    for i in range(3):
        pixels = torch.randint(0, 256, (40, 48, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(data / f"{i}.png")
        lines.append(json.dumps({"file_name": f"{i}.png", "text": f"a photo of a cat number {i}"}))
    (data / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    out, steps = tmp_path / "ddp", 3
    flags = _train_flags(tiny_models, out, steps) + [
        "--gradient_accumulation_steps",
        "2",
        "--debug_lora_checksums",
        "--kl_weight",
        "1.0",
        "--pretrain_loss_weight",
        "0.5",
        "--pretrain_data_dir",
        str(data),
        "--lora_init",
        "random",
        "--gradient_checkpointing",
        "--vae_gradient_checkpointing",
        "--reward_gradient_checkpointing",
        "--checkpointing_steps",
        str(steps),
        "--report_to",
        "none",
        # validated by the main process alone under DDP; the other one waits in the next all-reduce
        "--validation_prompts_file",
        str(DATA_DIR / "toy_world_heldout.txt"),
        "--validation_steps",
        "2",
        "--num_validation_images",
        "1",
        "--validation_num_steps",
        "2",
    ]
    r = _script(flags, NUM_PROCESSES="2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("validation after step") == 3  # steps 0, 2, 3
    # a run without --deepspeed_zero does not import DeepSpeed (refl_ddpo.run.zero.unwrap), whose import logs this
    assert "Setting accelerator to CPU" not in r.stdout + r.stderr
    ranks = [
        [
            json.loads(line)
            for line in (out / "debug" / f"lora_checksums_rank{i}.jsonl").read_text().split("\n")
            if line
        ]
        for i in (0, 1)
    ]
    assert [x["step"] for x in ranks[0]] == [x["step"] for x in ranks[1]] == list(range(1, steps + 1))
    assert [x["sha256"] for x in ranks[0]] == [x["sha256"] for x in ranks[1]], (
        "ranks diverged: gradients not synced"
    )
    assert len({x["sha256"] for x in ranks[0]}) == steps, "the weights change every step"
    # the ranks saw different prompts and noise, so only the all-reduce can have kept them equal
    assert [x["refl_loss"] for x in ranks[0]] != [x["refl_loss"] for x in ranks[1]]
    state = load_file(out / f"checkpoint-{steps}" / "train_state.safetensors")
    assert {"k_generator", "generator/rank0", "generator/rank1"} <= state.keys()
    assert not torch.equal(state["generator/rank0"], state["generator/rank1"])


def test_full_finetune_with_ema_resumes_bit_exactly(tiny_models, tmp_path):
    def run(out: Path, *extra: str) -> None:
        args = _train_flags(tiny_models, out, 2) + [
            "--no-use_lora",
            "--use_ema",
            "--ema_decay",
            "0.5",
            "--learning_rate",
            "1e-3",
            "--checkpointing_steps",
            "1",
            "--report_to",
            "none",
            *extra,
        ]
        refl.main(args)

    # validation (of the EMA weights) after every step in run a only: it must leave the training bit-exact
    run(
        tmp_path / "a",
        "--validation_prompts_file",
        str(DATA_DIR / "toy_world_heldout.txt"),
        "--validation_steps",
        "1",
        "--num_validation_images",
        "1",
        "--validation_num_steps",
        "2",
    )
    assert len(list((tmp_path / "a" / "validation").glob("step-*.json"))) == 3
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-1", tmp_path / "b" / "checkpoint-1")
    run(tmp_path / "b", "--resume_from_checkpoint", str(tmp_path / "b" / "checkpoint-1"))
    a, b = (load_file(next((tmp_path / d / "unet").glob("*.safetensors"))) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(next((tiny_models / "stable-diffusion" / "unet").glob("*.safetensors")))
    assert any(not torch.equal(a[k], base[k]) for k in a), "the EMA weights moved"
    assert "ema/0" in load_file(tmp_path / "a" / "checkpoint-1" / "train_state.safetensors")


# ---- bad input: one line, exit != 0, no weights written ----


def _bad_inputs(tiny_models, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# only a comment\n")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    return {
        "pretrained_model": ["--pretrained_model", str(tmp_path / "no-such-model")],
        "reward_model_dir": ["--reward_model_dir", str(tmp_path)],
        "prompts_file": ["--prompts_file", str(empty)],
        "k_lo": ["--k_lo", "6", "--k_hi", "5"],
        "k_hi": ["--k_hi", str(T)],
        "reward": ["--reward", "jpeg_compressibility"],
        "output_dir": ["--output_dir", str(not_a_dir / "out")],
    }


@pytest.mark.parametrize(
    "field", ["pretrained_model", "reward_model_dir", "prompts_file", "k_lo", "k_hi", "reward", "output_dir"]
)
def test_bad_input_is_one_line_error_naming_the_field(field, tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    args = [
        "--pretrained_model",
        str(tiny_models / "stable-diffusion"),
        "--reward_model_dir",
        str(tiny_models),
        "--output_dir",
        str(out),
        "--resolution",
        str(RES),
        "--num_inference_steps",
        str(T),
        "--k_lo",
        str(K_LO),
        "--k_hi",
        str(K_HI),
        "--device",
        "cpu",
        "--max_train_steps",
        "1",
    ]
    with pytest.raises(SystemExit) as exc:
        refl.main(args + _bad_inputs(tiny_models, tmp_path)[field])
    assert exc.value.code != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"--{field}" in lines[0], lines
    assert not out.exists() or not any(out.iterdir()), "nothing written for a bad input"


def test_script_reports_bad_input_in_one_line(tiny_models, tmp_path):
    out = tmp_path / "out"
    r = _script(
        _train_flags(tiny_models, out, 1) + ["--k_hi", str(T)], cwd=SCRIPT.parent
    )  # from train_scripts/
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "--k_hi" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    r = _script(_train_flags(tiny_models, out, 1), GPUS="99")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [r.stderr.strip()] and "GPUS" in r.stderr
    assert not out.exists()


def test_script_trains_with_the_config_files_values_over_its_own_defaults(tiny_models, tmp_path, monkeypatch):
    """train_refl_lora.sh's recipe (lr 1e-4, grad_scale 0.01, read from the script) is a layer below --config: the
    file's lr is used."""
    (tmp_path / "f.yaml").write_text("learning_rate: 0.02\nmax_train_steps: 1\n")
    flags = [
        f for f in _train_flags(tiny_models, tmp_path / "out", 1) if f not in ("--learning_rate", "3e-2")
    ]
    flags = [
        f
        for i, f in enumerate(flags)
        if not (f == "--max_train_steps" or flags[i - 1] == "--max_train_steps")
    ]
    run_in_process(monkeypatch, SCRIPT.name, [*flags, "--config", str(tmp_path / "f.yaml")])
    saved = json.loads((tmp_path / "out" / CONFIG_NAME).read_text())
    assert (saved["learning_rate"], saved["grad_scale"], saved["max_train_steps"]) == (0.02, 0.01, 1)
