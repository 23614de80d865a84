"""Non-finite numbers and broken inputs at run time (issue #19): a NaN / inf reward or gradient stops a run in one
line before anything is saved (the last good checkpoint stays the newest), DDPO can drop non-finite rewards, no
weight with NaN is written or loaded, broken model folders and scores.json records are named. CPU, tiny models.

The cases that need no model (config values, --config files, prompt files) are in test_config.py."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import ddpo_first_update, trainer_flags

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import REWARDS

RES = 32
STATE = {"modes": ["ok"], "calls": 0}


def broken_reward(device, dtype, model_dir, **options):
    """The images' mean, broken at call k (0-based) as STATE['modes'][k] says (the last mode repeats)."""

    def reward_fn(images, prompts, metadata):
        mode = STATE["modes"][min(STATE["calls"], len(STATE["modes"]) - 1)]
        STATE["calls"] += 1
        rewards = images.float().mean(dim=(1, 2, 3))  # (B,), differentiable
        if mode == "nan":
            rewards = rewards * float("nan")
        elif mode == "one_nan":  # the first sample of the batch
            rewards = torch.cat([rewards[:1] * float("nan"), rewards[1:]])
        elif mode == "nan_grad":  # finite rewards, NaN gradient (d sqrt(x) / dx at 0, times 0)
            rewards = rewards + (images.float().sum() * 0).sqrt()
        return rewards, {}

    return reward_fn


@pytest.fixture
def broken(monkeypatch):
    """--reward broken (differentiable, so that both trainers take it); returns a function that sets its modes."""
    monkeypatch.setitem(REWARDS, "broken", (__name__, "broken_reward", True))

    def set_modes(*modes: str) -> None:
        STATE.update(modes=list(modes), calls=0)

    return set_modes


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def _weight_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors"))


# ---- ReFL: a NaN reward, a NaN gradient ----


def _refl_argv(tiny_models, out: Path) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        resolution=RES,
        reward="broken",
        device="cpu",
        report_to="none",
        num_inference_steps=3,
        k_lo=1,
        k_hi=2,
        train_batch_size=2,
        checkpointing_steps=1,
        image_log_steps=0,
    )


@pytest.mark.parametrize(
    "mode, message", [("nan", "--reward broken gave 2 non-finite"), ("nan_grad", "gradient norm")]
)
def test_refl_stops_before_the_update_and_the_good_checkpoint_stays_newest(
    mode, message, broken, tiny_models, tmp_path, capsys
):
    from refl_ddpo.trainers import refl

    broken("ok", mode)  # step 1 is good and saved; step 2 breaks
    out = tmp_path / "out"
    argv = [*_refl_argv(tiny_models, out), "--max_train_steps", "3"]
    with pytest.raises(SystemExit) as e:
        refl.main(argv)
    line = _one_error_line(capsys)
    assert (
        e.value.code != 0
        and message in line
        and "at step 2" in line
        and "checkpoint-1 stays the newest" in line
    )
    assert _weight_files(out) == [
        "checkpoint-1/pytorch_lora_weights.safetensors",
        "checkpoint-1/train_state.safetensors",
    ]


# ---- DDPO: non-finite rewards stop the run, or are dropped with --nonfinite_rewards drop ----


def _ddpo_argv(tiny_models, out: Path, *extra: str) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        "--no-per_prompt_stat_tracking",
        *extra,
        resolution=RES,
        reward="broken",
        device="cpu",
        sample_num_steps=2,
        sample_batch_size=4,
        sample_num_batches_per_epoch=1,
        train_batch_size=4,
        num_epochs=2,
        save_freq=1,
        report_to="none",
    )


def test_ddpo_drops_non_finite_rewards_when_asked_and_stops_when_all_are(
    broken, tiny_models, tmp_path, capsys
):
    from safetensors.torch import load_file

    from refl_ddpo.trainers import ddpo

    broken("one_nan", "nan")  # epoch 1: one of 4 rewards NaN, dropped; epoch 2: all NaN, the run stops
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        ddpo.main(_ddpo_argv(tiny_models, out, "--nonfinite_rewards", "drop"))
    captured = capsys.readouterr()
    assert "(1 non-finite, dropped)" in captured.out, captured.out[-2000:]
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert e.value.code != 0 and len(lines) == 1 and "Traceback" not in captured.err
    assert "gave 4 non-finite reward(s) (NaN or inf) of 4 samples in epoch 2" in lines[0], lines
    assert "checkpoint-1 stays the newest" in lines[0]
    assert _weight_files(out) == [
        "checkpoint-1/pytorch_lora_weights.safetensors",
        "checkpoint-1/train_state.safetensors",
    ]
    assert all(
        torch.isfinite(v).all()
        for v in load_file(out / "checkpoint-1" / "pytorch_lora_weights.safetensors").values()
    )


def test_ddpo_non_finite_rewards_are_an_error_by_default():
    from refl_ddpo.trainers.ddpo_config import DDPOConfig
    from refl_ddpo.trainers.epochs import check_rewards

    rewards = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    cfg = DDPOConfig(output_dir="unused-never-created")
    with pytest.raises(
        UserError,
        match=r"gave 2 non-finite reward\(s\) \(NaN or inf\) of 4 samples in epoch 3.*--nonfinite_rewards drop",
    ):
        check_rewards(cfg, rewards, epoch=2)
    cfg = dataclasses.replace(cfg, nonfinite_rewards="drop")
    assert check_rewards(cfg, rewards, epoch=2).tolist() == [True, False, False, True]
    assert check_rewards(cfg, torch.ones(3), epoch=0).all()
    with pytest.raises(UserError, match="4 non-finite reward"):
        check_rewards(cfg, torch.full((4,), float("nan")), epoch=0)


# ---- DDPO / GRPO: a non-finite gradient names the non-finite value and where (issue #72) ----


@pytest.mark.parametrize(
    "broken_part, named",
    [("stored", "the sampling pass's log-probability is nan"), ("lora", "the network's output is nan")],
)
def test_a_non_finite_ppo_gradient_names_the_value_its_timestep_and_a_fix_that_fits(
    broken_part, named, tiny_models, tmp_path
):
    """A NaN in the sampling pass's log-probs (at sampler step 2) or in the LoRA (so the network's output) stops the
    first PPO step with that value and its timestep named; before any update the advice is not a learning rate."""
    from refl_ddpo.core.families import load_family
    from refl_ddpo.core.lora import add_lora
    from refl_ddpo.trainers.ppo import NonFiniteGradient

    family = load_family(str(tiny_models / "stable-diffusion"))
    scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")

    def edit(samples):
        if broken_part == "stored":
            samples["log_probs"][:, 1] = float("nan")
        else:
            with torch.no_grad():
                params[0].fill_(float("nan"))

    kw = {"num_steps": 2, "guidance_scale": 5.0, "eta": 1.0}
    with pytest.raises(NonFiniteGradient) as e:
        ddpo_first_update(family, scheduler, params, family.empty_cond(), ["a cat"] * 4, RES, edit, **kw)
    schedule = scheduler.timesteps.tolist()
    step = 1 if broken_part == "stored" else int(str(e.value).split("(sampler step ")[1][0]) - 1
    assert f"{named} at timestep {schedule[step]} (sampler step {step + 1} of 2)" in str(e.value), e.value
    first = str(e.value.error(str(tmp_path), 1, updated_before=False))
    later = str(e.value.error(str(tmp_path), 3, updated_before=True))
    assert (
        "the first optimizer step: the weights were never updated" in first and "learning_rate" not in first
    )
    assert "(epoch 3, an optimizer step)" in later and "lower --learning_rate" in later
    fix = {"stored": "check the scheduler config", "lora": "check the model's weights"}[broken_part]
    assert first.rsplit("): ", 1)[1].startswith(fix) and "no checkpoint was written" in first


def test_a_non_finite_gradient_of_finite_values_blames_the_backward():
    from refl_ddpo.trainers.ppo import TRACED, nonfinite_gradient

    values = torch.zeros(2, len(TRACED))  # every traced value finite
    e = nonfinite_gradient(
        float("inf"), torch.tensor(0.5), [values], [torch.tensor([1, 1])], torch.tensor([1]), 0
    )
    assert e.cause is None and "the gradient norm is inf (PPO loss 0.5)" in str(e)
    assert "finite, so the backward pass made it" in str(e)
    assert str(e.error("unused-never-created", 1, False)).endswith(
        "try --mixed_precision no, or check the model (the learning rate is not the cause)."
    )


# ---- no NaN weight is written, resumed or loaded for inference ----


def test_non_finite_weights_are_never_saved():
    from refl_ddpo.run.checkpoints import check_finite_weights

    layer = torch.nn.Linear(2, 2)
    check_finite_weights(layer, "x")
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    with pytest.raises(
        UserError, match=r"not saving checkpoint-3: 1 trained tensor\(s\) hold NaN or inf \(e.g. weight\)"
    ):
        check_finite_weights(layer, "not saving checkpoint-3")
    layer.weight.requires_grad_(False)  # frozen weights are the base model's business
    check_finite_weights(layer, "x")


def test_resume_refuses_a_checkpoint_with_nan(broken, tiny_models, tmp_path, capsys):
    """A checkpoint written before these checks (or edited) with NaN weights is not trained on."""
    from safetensors.torch import load_file, save_file

    from refl_ddpo.trainers import refl

    broken("ok")
    out = tmp_path / "out"
    refl.main([*_refl_argv(tiny_models, out), "--max_train_steps", "1"])
    lora = out / "checkpoint-1" / "pytorch_lora_weights.safetensors"
    state = load_file(lora)
    state[next(iter(state))].fill_(float("nan"))
    save_file(state, lora, metadata={"format": "pt"})
    marker = out / "checkpoint-1" / "checkpoint.json"  # a complete checkpoint, as if written with the NaN
    record = json.loads(marker.read_text())
    record["files"][lora.name] = lora.stat().st_size
    marker.write_text(json.dumps(record))
    before = _weight_files(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        refl.main(
            [*_refl_argv(tiny_models, out), "--max_train_steps", "2", "--resume_from_checkpoint", "latest"]
        )
    line = _one_error_line(capsys)
    assert (
        e.value.code != 0 and "not resuming from" in line and "checkpoint-1" in line and "NaN or inf" in line
    ), line
    assert _weight_files(out) == before and not (out / "checkpoint-2").exists()


def test_a_non_finite_imagereward_score_stops_inference():
    from refl_ddpo.apps.inference import RewardScorer

    def reward(images, prompts, metadata):  # ImageReward as the registry builds it, without loading it
        return torch.tensor([0.5, float("nan")][: len(images)]), {}

    scorer = object.__new__(RewardScorer)
    scorer.spec, scorer.device, scorer.reward, scorer.error = "imagereward", torch.device("cpu"), reward, None
    pixels = torch.zeros(2, 8, 8, 3, dtype=torch.uint8)  # (B, H, W, 3), as saved
    assert scorer(["a cat"], pixels[:1]) == [0.5]
    with pytest.raises(
        UserError, match=r"ImageReward gave 1 non-finite score\(s\) \(NaN or inf\) of 2 images"
    ):
        scorer(["a cat", "a cat"], pixels)


def test_inference_refuses_a_lora_with_nan(tiny_sd, tmp_path, capsys):
    from refl_ddpo.apps.inference import main_lora
    from refl_ddpo.core.lora import add_lora, save_lora
    from refl_ddpo.core.models import load_pipeline

    unet = load_pipeline(str(tiny_sd)).unet
    params = add_lora(unet, 2, 2, ["to_q", "to_v"], init="random")
    with torch.no_grad():
        params[0].fill_(float("nan"))
    save_lora(unet, tmp_path / "lora", config={"pretrained_model": str(tiny_sd), "resolution": RES})
    (tmp_path / "p.txt").write_text("a cat\n")
    out = tmp_path / "out"
    argv = [
        "--lora_dir",
        str(tmp_path / "lora"),
        "--prompts_file",
        str(tmp_path / "p.txt"),
        "--device",
        "cpu",
    ]
    with pytest.raises(SystemExit) as e:
        main_lora(
            [*argv, "--output_dir", str(out), "--num_images_per_prompt", "1", "--num_inference_steps", "2"]
        )
    line = _one_error_line(capsys)
    assert e.value.code != 0 and "--lora_dir" in line and "NaN or inf" in line, line
    assert not list(out.glob("*.png")) and not (out / "scores.json").exists()


# ---- broken model folders and scores.json records ----


def test_a_model_folder_missing_a_component_names_it(tmp_path):
    from refl_ddpo.core.models import check_pretrained_model

    index = {
        "_class_name": "StableDiffusionPipeline",
        "safety_checker": [None, None],
        "feature_extractor": [
            "transformers",
            "CLIPImageProcessor",
        ],  # loaded as None: its folder may be absent
        **{part: ["x", "Y"] for part in ("scheduler", "text_encoder", "tokenizer", "unet", "vae")},
    }
    model = tmp_path / "sd"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps(index))
    for part in ("scheduler", "text_encoder", "unet"):
        (model / part).mkdir()
    with pytest.raises(
        UserError, match=r"--pretrained_model .*sd lacks tokenizer/, vae/ \(model_index.json lists them\)"
    ):
        check_pretrained_model(str(model))
    (model / "tokenizer").mkdir()
    (model / "vae").mkdir()
    check_pretrained_model(str(model))


def test_a_missing_folder_under_an_existing_one_is_a_local_path_not_a_hub_id(tmp_path, monkeypatch):
    """checkpoint/stable-diffusion-v1-4 in the repo (checkpoint/ exists) fails at once, without asking the hub."""
    from refl_ddpo.core.models import check_pretrained_model, looks_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoint").mkdir()
    assert looks_local("checkpoint/stable-diffusion-v1-4") and not looks_local(
        "CompVis/stable-diffusion-v1-4"
    )
    with pytest.raises(
        UserError, match="checkpoint/stable-diffusion-v1-4 does not exist: put the diffusers folder"
    ):
        check_pretrained_model("checkpoint/stable-diffusion-v1-4")


def test_a_hub_id_with_the_hub_unreachable_is_one_line_at_once(tmp_path, monkeypatch):
    """A hub id that is not in the local cache, with the hub unreachable (HF_ENDPOINT on a closed port here): one
    line from the inference script, no retries; with HF_HUB_OFFLINE set the probe is skipped (the loader's cache-only
    error says the rest)."""
    import subprocess
    import sys
    import time

    from refl_ddpo.core.models import check_pretrained_model, hub_unreachable

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    assert "127.0.0.1:9" in hub_unreachable()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_pretrained_model("someone/some-model")  # offline: not probed
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(UserError, match="the hub cannot be reached .127.0.0.1:9"):
        check_pretrained_model("someone/some-model")
    script = Path(__file__).resolve().parent.parent / "inference" / "inference.py"
    started = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            "--pretrained_model",
            "someone/some-model",
            "--output_dir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "the hub cannot be reached" in lines[0], r.stderr
    assert time.perf_counter() - started < 30  # the hub client's retries alone take about 30 s
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "record, message",
    [
        ({"seed": 1, "file": "a.png", "imagereward": 0.5}, "no str 'prompt'"),
        ({"prompt": None, "seed": 1, "file": "a.png", "imagereward": 0.5}, "no str 'prompt'"),
        ({"prompt": "a", "seed": "1", "file": "a.png", "imagereward": 0.5}, "no int 'seed'"),
        ({"prompt": "a", "seed": 1, "imagereward": 0.5}, "no str 'file'"),
        ({"prompt": "a", "seed": 1, "file": "a.png", "imagereward": float("nan")}, "imagereward nan"),
        ({"prompt": "a", "seed": 1, "file": "a.png", "imagereward": float("inf")}, "imagereward inf"),
        ({"prompt": "a", "seed": 1, "file": "a.png", "imagereward": "0.5"}, "imagereward '0.5'"),
        ("a record", "record 0 is not an object"),
    ],
)
def test_compare_refuses_broken_records_and_writes_no_nan(record, message, tmp_path, capsys):
    from refl_ddpo.apps.compare import main

    for run in ("base", "lora"):
        (tmp_path / run).mkdir()
        good = {"prompt": "a", "seed": 1, "file": "a.png", "imagereward": 0.25}
        (tmp_path / run / "scores.json").write_text(
            json.dumps({"records": [record if run == "lora" else good]})
        )
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "base"), str(tmp_path / "lora"), "--out", str(tmp_path / "cmp")])
    line = _one_error_line(capsys)
    assert e.value.code != 0 and "lora/scores.json record 0" in line and message in line, line
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("trainer", ["refl", "ddpo"])
@pytest.mark.parametrize("reward", ["toy_classifier", "imagereward"])
def test_missing_reward_files_are_one_line_before_loading(trainer, reward, tiny_models, tmp_path, capsys):
    """Both trainers check the reward's files in --reward_model_dir before any model loads."""
    import importlib

    main = importlib.import_module(f"refl_ddpo.trainers.{trainer}").main
    argv = (_refl_argv if trainer == "refl" else _ddpo_argv)(tiny_models, tmp_path / "out")
    argv += ["--reward", reward, "--reward_model_dir", str(tmp_path / "empty")]
    with pytest.raises(SystemExit) as e:
        main(argv)
    line = _one_error_line(capsys)
    assert e.value.code != 0 and f"--reward {reward}" in line and "lacks" in line, line
    assert not (tmp_path / "out").exists()
