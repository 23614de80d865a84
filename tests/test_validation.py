"""Validation during training, trackers, the model card and the hub (issue 16, items 1-3): the validator's images are
the stock pipeline's for fixed seeds and leave the training's random streams alone; the flags and presets; the card's
content; --overwrite_output_dir and the card; and one ReFL run end to end that validates, logs to tensorboard and to
wandb (offline), writes the card, pushes to a local stand-in of the hub's HTTP API, and is loaded back by its id by
inference_lora.py and --resume_from_checkpoint. CPU, tiny models."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import trainer_flags
from hub_standin import HubStandIn

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import resolve_guidance
from refl_ddpo.core.families.sd import StableDiffusion
from refl_ddpo.core.families.sd3 import StableDiffusion3
from refl_ddpo.core.lora import CONFIG_NAME, LORA_WEIGHTS_NAME
from refl_ddpo.run.flags import parse_config
from refl_ddpo.run.session import validation_spec
from refl_ddpo.run.validation import VALIDATION_DIR, ValidationSpec, Validator, validation_files
from refl_ddpo.trainers.ddpo_config import DDPOConfig
from refl_ddpo.trainers.grpo_config import GRPOConfig
from refl_ddpo.trainers.refl_config import ReFLConfig

REPO = Path(__file__).resolve().parent.parent
RES = 32
PROMPTS = ["a red bird", "a photo of a cat"]


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "val_prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def _validation_spec(prompts_file: Path, **kw) -> ValidationSpec:
    values = {
        "prompts_file": str(prompts_file),
        "num_images": 2,
        "num_steps": 3,
        "guidance_scale": 7.5,
        "batch_size": 3,  # not a multiple of the images per prompt: the batches cut across prompts
        "resolution": RES,
        "seed": 5,
    }
    return ValidationSpec(**{**values, **kw})


# ---- the validator ----


def _accelerator():
    """A CPU accelerator without mixed precision; accelerate's per-process state is reset first, since a test before
    this one in the same worker may have made an accelerator with another mixed precision (whose autocast the
    validator would then run under)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(cpu=True, mixed_precision="no")


def test_validator_draws_the_stock_pipelines_images_for_fixed_seeds_and_leaves_rng_alone(
    tiny_sd, tmp_path, prompts_file
):
    from diffusers import DDIMScheduler

    from refl_ddpo.core.families import load_family
    from refl_ddpo.core.lora import add_lora
    from refl_ddpo.rewards import build_reward

    family = load_family(str(tiny_sd))
    params = add_lora(family.network, 4, 4, ["to_q", "to_k", "to_v", "to_out.0"], init="random")
    family.network.train()
    spec = "jpeg_compressibility:1.0,jpeg_incompressibility:0.5"
    reward = build_reward(spec, "cpu")
    validation = _validation_spec(prompts_file)
    validator = Validator(
        _accelerator(), family, reward, spec, validation, tmp_path, every=2, unit="step", last=5
    )

    rng = torch.random.get_rng_state()
    first = validator(0, 0)
    again = validator(1, 1)
    assert torch.equal(torch.random.get_rng_state(), rng), "the global random stream did not move"
    assert family.network.training, "train mode is restored"
    assert torch.equal(first.images, again.images) and first.records == again.records, (
        "same weights, same images"
    )
    assert [(r["prompt"], r["seed"]) for r in first.records] == [
        ("a red bird", 5),
        ("a red bird", 6),
        ("a photo of a cat", 7),
        ("a photo of a cat", 8),
    ], "image j of prompt i is seeded seed + i x n + j, as inference.py"

    # the stock pipeline (with the same LoRA in its UNet), DDIM eta 0, one generator per image
    pipe = family.pipe
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    stock = pipe(
        [r["prompt"] for r in first.records],
        num_inference_steps=3,
        guidance_scale=7.5,
        eta=0.0,
        height=RES,
        width=RES,
        generator=[torch.Generator().manual_seed(r["seed"]) for r in first.records],
        output_type="pt",
    ).images
    assert (stock - first.images).abs().max() < 1e-5

    # scored by the training reward: the weighted total and each part
    total, info = reward(first.images, [r["prompt"] for r in first.records], [{}] * 4)
    assert set(first.metrics) == {
        f"validation/{n}/{s}"
        for n in ("total", "jpeg_compressibility", "jpeg_incompressibility")
        for s in ("mean", "std")
    }
    assert first.metrics["validation/total/mean"] == pytest.approx(total.double().mean().item(), rel=1e-6)
    assert first.metrics["validation/jpeg_compressibility/mean"] == pytest.approx(
        info["jpeg_compressibility"].double().mean().item(), rel=1e-6
    )

    with torch.no_grad():
        for p in params:
            p.add_(0.05)
    moved = validator(2, 2)
    assert not torch.equal(moved.images, first.images), "only the weights change the images"
    saved = validation_files(tmp_path)
    assert [r["count"] for r in saved] == [0, 1, 2] and all(
        (tmp_path / VALIDATION_DIR / r["grid"]).is_file() for r in saved
    )
    assert saved[-1]["records"][0]["reward"] == pytest.approx(float(moved.records[0]["reward"]))
    validator.forget_after(1)  # a run resumed from step 1 redoes step 2
    assert [r["count"] for r in validation_files(tmp_path)] == [0, 1]
    assert not (tmp_path / VALIDATION_DIR / "step-2.png").exists()


def test_validator_on_sd3_is_the_stock_pipelines_flow_ode(tiny_models, tmp_path, prompts_file):
    from refl_ddpo.core.families import load_family
    from refl_ddpo.core.lora import add_lora
    from refl_ddpo.rewards import build_reward

    family = load_family(str(tiny_models / "tiny-sd3"))
    add_lora(family.network, 4, 4, list(family.lora_target_modules), init="random")
    res = family.native_resolution
    validation = _validation_spec(prompts_file, num_images=1, resolution=res)
    reward = build_reward("jpeg_compressibility", "cpu")
    result = Validator(
        _accelerator(),
        family,
        reward,
        "jpeg_compressibility",
        validation,
        tmp_path,
        every=0,
        unit="epoch",
        last=1,
    )(0, 0)
    assert result.grid.name == "epoch-0.png" and set(result.metrics) == {
        "validation/jpeg_compressibility/mean",
        "validation/jpeg_compressibility/std",
    }
    family.pipe.set_progress_bar_config(disable=True)
    stock = family.pipe(
        PROMPTS,
        num_inference_steps=3,
        guidance_scale=7.5,
        height=res,
        width=res,
        generator=[torch.Generator().manual_seed(r["seed"]) for r in result.records],
        output_type="pt",
    ).images
    assert (stock - result.images).abs().max() < 1e-5


def test_validation_is_due_at_the_baseline_every_n_and_after_the_last():
    v = Validator.__new__(Validator)
    v.every, v.last = 4, 10
    assert [c for c in range(11) if v.due(c)] == [0, 4, 8, 10]
    v.every = 0
    assert [c for c in range(11) if v.due(c)] == [0, 10]


# ---- flags and presets ----


def test_flags_presets_and_the_token_never_saved():
    cfg = parse_config(ReFLConfig, ["--preset", "toy_world", "--report_to", "all"])
    assert cfg.validation_prompts_file == "toy_world_heldout" and cfg.validation_steps == 80
    for cls in (DDPOConfig, GRPOConfig):
        toy = parse_config(cls, ["--preset", "toy_world"])
        assert toy.validation_prompts_file == "toy_world_heldout" and toy.validation_epochs == 8
        assert parse_config(cls, ["--validation_steps", "3"]).validation_epochs == 3, (
            "the alias sets the epochs"
        )
    with pytest.raises(SystemExit):
        parse_config(ReFLConfig, ["--report_to", "comet"])
    with pytest.raises(UserError, match="--hub_model_id names the repo of --push_to_hub"):
        parse_config(ReFLConfig, ["--hub_model_id", "me/x"])
    cfg = parse_config(ReFLConfig, ["--push_to_hub", "--hub_token", "hf_secret123"])
    assert cfg.hub_token == "hf_secret123", "the run itself has it"
    assert cfg.to_dict()["hub_token"] is None and "hf_secret123" not in cfg.pretty()


def test_bad_validation_file_and_push_offline_fail_before_loading(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from refl_ddpo.trainers import refl

    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    base = ["--preset", "toy_world", "--output_dir", str(tmp_path / "out"), "--device", "cpu"]
    with pytest.raises(UserError, match="^--validation_prompts_file .*holds no prompts"):
        refl.preflight(parse_config(ReFLConfig, [*base, "--validation_prompts_file", str(empty)]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        refl.preflight(parse_config(ReFLConfig, [*base, "--push_to_hub", "--hub_token", "x"]))
    with pytest.raises(UserError, match="not a valid hub repo id"):
        refl.preflight(parse_config(ReFLConfig, [*base, "--push_to_hub", "--hub_model_id", "a/b/c"]))


def test_hub_ids_and_local_paths():
    from refl_ddpo.run.hub import is_hub_id

    assert is_hub_id("user/my-lora") and is_hub_id("org/name.v2")
    assert not is_hub_id("checkpoint/refl_lora"), (
        "its first part is a local folder: a missing folder, no hub lookup"
    )
    assert (
        not is_hub_id("./a/b")
        and not is_hub_id("/abs/path")
        and not is_hub_id("a/b/c")
        and not is_hub_id("name")
    )


# ---- the model card ----


def _fake_validation(out: Path) -> None:
    folder = out / VALIDATION_DIR
    folder.mkdir(parents=True)
    for count, mean in ((0, 0.25), (10, 0.5)):
        (folder / f"step-{count}.json").write_text(
            json.dumps(
                {
                    "count": count,
                    "unit": "step",
                    "metrics": {"validation/toy_classifier/mean": mean, "validation/toy_classifier/std": 0.1},
                    "grid": f"step-{count}.png",
                    "sampler": {
                        "scheduler": "DDIMScheduler",
                        "num_inference_steps": 20,
                        "guidance_scale": 7.5,
                    },
                    "records": [{"prompt": "a red square", "seed": 42, "reward": mean}],
                }
            )
        )


def _sd_refl_card(out: Path, cfg, progress: dict, repo_id: str | None = None):
    """The model card of a ReFL LoRA on SD 1.x's UNet trained with `cfg` (its validation spec)."""
    from refl_ddpo.run.model_card import model_card

    cfg = resolve_guidance(cfg, StableDiffusion)  # as the trainer resolves the unset guidance flags on SD
    spec = validation_spec(cfg)
    return model_card(
        out, cfg.to_dict(), spec, "refl", "sd", "UNet2DConditionModel", "unet", progress, repo_id
    )


def test_model_card_says_what_was_trained_how_it_validated_and_how_to_load_it(tmp_path):
    from huggingface_hub import ModelCard

    from refl_ddpo.run.model_card import CARD_NAME, model_card

    _fake_validation(tmp_path)
    cfg = parse_config(
        ReFLConfig, ["--preset", "toy_world", "--max_train_steps", "10", "--lora_target_modules", "to_q"]
    )
    _sd_refl_card(tmp_path, cfg, {"optimizer steps": 10}, "me/toy").save(tmp_path / CARD_NAME)
    card = ModelCard.load(tmp_path / CARD_NAME)
    assert card.data.library_name == "diffusers" and {"refl_ddpo", "refl", "lora"} <= set(card.data.tags)
    assert card.data.base_model is None, "a local base model is no hub id: left out of the metadata"
    text = card.text
    for line in (
        "| model family | Stable Diffusion 1.x / 2.x (UNet) |",
        "| optimizer steps | 10 |",
        "| grad_scale | `1` |",
        "| lora_target_modules | `to_q` |",
        "| 0 | 0.25 |",
        "| 10 | 0.5 |",
        "![validation grid](validation/step-10.png)",
        'pipe.load_lora_weights("me/toy")',
        "--num_images_per_prompt 2 --num_inference_steps 20",
    ):
        assert line in text, line

    full = parse_config(
        GRPOConfig,
        ["--pretrained_model", "org/sd3-model", "--no-use_lora", "--output_dir", str(tmp_path / "g")],
    )
    full = resolve_guidance(full, StableDiffusion3)  # as the trainer resolves it (no hub here)
    card = model_card(
        tmp_path / "g",
        full.to_dict(),
        validation_spec(full),
        "grpo",
        "sd3",
        "SD3Transformer2DModel",
        "transformer",
        {"epochs": 3},
    )
    assert card.data.base_model == "org/sd3-model"
    assert "transformer = SD3Transformer2DModel.from_pretrained(" in card.text and "group_size" in card.text
    assert "No validation ran" in card.text

    draft = parse_config(ReFLConfig, ["--preset", "toy_world", "--backprop_steps", "3"])
    text = _sd_refl_card(tmp_path, draft, {}).text
    assert "DRaFT-K / AlignProp" in text and "| backprop_steps | `3` |" in text


def test_overwrite_deletes_our_card_and_validation_but_not_a_users_readme(tmp_path):
    from refl_ddpo.run.model_card import CARD_NAME
    from refl_ddpo.run.runs import clear_run

    cfg = parse_config(ReFLConfig, ["--preset", "toy_world", "--output_dir", str(tmp_path)])
    _fake_validation(tmp_path)
    _sd_refl_card(tmp_path, cfg, {"optimizer steps": 1}).save(tmp_path / CARD_NAME)
    assert set(clear_run(tmp_path, cfg.logging_dir)) == {VALIDATION_DIR, CARD_NAME}
    (tmp_path / CARD_NAME).write_text("# my notes\n")
    assert clear_run(tmp_path, cfg.logging_dir) == [] and (tmp_path / CARD_NAME).is_file()


# ---- end to end: validation, tensorboard + wandb, card, push, load back by id ----


def _env(hub: HubStandIn, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "NUM_PROCESSES", "HF_TOKEN")}
    return {
        **env,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf_home"),  # its own cache and no saved token
        "WANDB_MODE": "offline",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
    }


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def _refl_flags(tiny_models: Path, out: Path, steps: int) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        resolution=RES,
        num_inference_steps=4,
        k_lo=2,
        k_hi=3,
        train_batch_size=2,
        learning_rate="3e-2",
        max_train_steps=steps,
        device="cpu",
    )


def test_refl_validates_logs_everywhere_writes_the_card_pushes_and_loads_back_by_id(
    tiny_models, tmp_path, prompts_file
):
    from huggingface_hub import ModelCard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, repo = tmp_path / "run", "tester/refl-tiny"
    validation = [
        "--validation_prompts_file",
        str(prompts_file),
        "--validation_steps",
        "1",
        "--num_validation_images",
        "1",
        "--validation_num_steps",
        "3",
    ]
    hub_flags = ["--push_to_hub", "--hub_model_id", repo, "--hub_token", "hf_secret_token"]
    with HubStandIn() as hub:
        env = _env(hub, tmp_path)
        train = [sys.executable, "-m", "refl_ddpo.trainers.refl"]
        r = _run(
            [*train, *_refl_flags(tiny_models, out, 2), *validation, *hub_flags, "--report_to", "all"], env
        )

        # ---- validation in the files and in both trackers ----
        assert [x["count"] for x in validation_files(out)] == [0, 1, 2]
        scalars, images = {}, set()
        for f in (out / "logs").rglob("events.out.tfevents.*"):
            acc = EventAccumulator(str(f))
            acc.Reload()
            scalars.update({t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]})
            images |= set(acc.Tags()["images"])
        assert [s for s, _ in scalars["validation/imagereward/mean"]] == [
            0,
            1,
            2,
        ] and "validation/images" in images
        runs = list((out / "logs" / "wandb").glob("offline-run-*"))
        assert len(runs) == 1 and list(runs[0].glob("run-*.wandb")), "wandb's offline run file"
        assert len(list((runs[0] / "files" / "media" / "images").rglob("*.png"))) == 3, (
            "one grid per validation"
        )

        # ---- the card, the saved config, the push ----
        card = ModelCard.load(out / "README.md")
        assert "refl_ddpo" in card.data.tags and f'pipe.load_lora_weights("{repo}")' in card.text
        assert "| 2 |" in card.text and "![validation grid](validation/step-2.png)" in card.text
        assert json.loads((out / CONFIG_NAME).read_text())["hub_token"] is None
        pushed = hub.repos[repo]
        assert {LORA_WEIGHTS_NAME, CONFIG_NAME, "README.md", "validation/step-2.png"} <= pushed.keys()
        assert {p.split("/")[0] for p in pushed} == {
            LORA_WEIGHTS_NAME,
            CONFIG_NAME,
            "README.md",
            "validation",
            "checkpoint-2",
        }
        assert pushed[LORA_WEIGHTS_NAME] == (out / LORA_WEIGHTS_NAME).read_bytes()
        assert not any(b"hf_secret_token" in content for content in pushed.values()), (
            "the token is never uploaded"
        )
        assert "hf_secret_token" not in r.stdout + r.stderr
        assert hub.tokens == {"Bearer hf_secret_token"}
        assert "refl_ddpo" in hub.validated[-1]["tags"], "the card's metadata passed the hub's YAML check"

        # ---- loaded back by id: inference, then a resumed run ----
        r = _run(
            [
                sys.executable,
                "inference/inference_lora.py",
                "--lora_dir",
                repo,
                "--prompts_file",
                str(prompts_file),
                "--num_images_per_prompt",
                "1",
                "--num_inference_steps",
                "3",
                "--reward_model_dir",
                str(tiny_models),
                "--output_dir",
                str(tmp_path / "inference"),
            ],
            env,
        )
        scores = json.loads((tmp_path / "inference" / "scores.json").read_text())
        assert scores["count"] == 2 and str(tmp_path / "hf_home") in scores["config"]["lora_dir"]
        resumed = tmp_path / "resumed"
        r = _run(
            [
                *train,
                *_refl_flags(tiny_models, resumed, 3),
                "--resume_from_checkpoint",
                repo,
                "--report_to",
                "none",
            ],
            env,
        )
        assert "at step 2" in r.stdout and (resumed / LORA_WEIGHTS_NAME).is_file()
        assert hub.unhandled == [], hub.unhandled
