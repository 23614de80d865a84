"""The trainers on video (tiny Wan 2.1 and Wan 2.2, 5 frames of 16 x 16 px, the JPEG size per frame as reward): GRPO
and DiffusionNFT for two epochs with the LoRA moving and no base weight (both experts' included), their LoRA loaded
by the stock WanPipeline's `load_lora_weights` changing its video (a LoRA of Wan 2.2's `transformer_2` with
`load_into_transformer_2=True`); AWM and DDPO for two epochs; the first PPO update on policy through the 5-D sample
buffers, on both models (Wan 2.2's steps cross its boundary, so both experts sample)."""

import importlib
import math
import re

import pytest
import torch
from diffusers import WanPipeline
from helpers import ddpo_first_update, trainer_flags, watch_training

from refl_ddpo.core.families import load_family
from refl_ddpo.core.lora import add_lora, lora_parts

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

RES, FRAMES = 16, 5


def _flags(tiny_models, out, model, **flags):
    return trainer_flags(
        tiny_models,
        out,
        model=model,
        resolution=RES,
        num_frames=FRAMES,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_num_steps=3,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=2,
        device="cpu",
        report_to="none",
        **flags,
    )


def _stock_video(pipe) -> torch.Tensor:
    kw = {"height": RES, "width": RES, "num_frames": FRAMES, "num_inference_steps": 3, "output_type": "pt"}
    return pipe("a cat", generator=torch.Generator().manual_seed(0), **kw).frames


def assert_lora_changes_stock_video(model_dir, lora_dir, expert: str):
    """The stock pipeline's video of "a cat" changes once the LoRA is loaded into `expert`, and every saved matrix
    lands in one of that expert's layers. Returns the video with the LoRA."""
    from safetensors.torch import load_file

    pipe = WanPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    before = _stock_video(pipe)
    pipe.load_lora_weights(str(lora_dir), load_into_transformer_2=expert == "transformer_2")
    after = _stock_video(pipe)
    assert (before - after).abs().max() > 1e-4
    saved = load_file(lora_dir / "pytorch_lora_weights.safetensors")
    loaded = [n for n, _ in getattr(pipe, expert).named_parameters() if "lora_" in n]
    assert saved and all(k.startswith("transformer.") for k in saved) and len(loaded) == len(saved)
    return after


def lora_inference_video(lora_dir, tmp_path) -> torch.Tensor:
    """inference_lora.py's frames (T, 3, H, W) in [0, 1] of "a cat", seed 0, 3 steps (the base, the resolution, the
    frames and the expert read from the LoRA's config.json), as the stock call of `_stock_video`."""
    import numpy as np
    from PIL import Image

    from refl_ddpo.apps import inference
    from refl_ddpo.run.flags import parse_config

    (tmp_path / "p.txt").write_text("a cat\n")
    argv = ["--lora_dir", str(lora_dir), "--prompts_file", str(tmp_path / "p.txt"), "--device", "cpu"]
    argv += ["--output_dir", str(tmp_path / "lora_out"), "--num_images_per_prompt", "1", "--seed", "0"]
    argv += ["--num_inference_steps", "3", "--guidance_scale", "5"]  # num_frames from config.json
    argv += ["--rewards", "jpeg_compressibility"]
    record = inference.run_inference(parse_config(inference.LoraInferenceConfig, argv))["records"][0]
    frames = [np.array(Image.open(tmp_path / "lora_out" / f).convert("RGB")) for f in record["frames"]]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255


@pytest.mark.parametrize(
    ("trainer", "model", "expert"),
    [
        ("grpo", "tiny-wan22", "transformer_2"),
        ("nft", "tiny-wan22", "transformer"),
        ("awm", "tiny-wan21", "transformer"),
        ("ddpo", "tiny-wan21", "transformer"),
    ],
)
def test_trainer_runs_two_epochs_on_video(trainer, model, expert, tiny_models, tmp_path, capsys, monkeypatch):
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    extra = {} if trainer == "ddpo" else {"group_size": 2}
    extra |= {"beta": "0.04"} if trainer == "grpo" else {}
    if trainer == "ddpo":  # validation on videos: scored whole, shown by their first frames
        (tmp_path / "validation.txt").write_text("a cat\n")
        extra |= {"validation_prompts_file": tmp_path / "validation.txt", "num_validation_images": 1}
        extra |= {"validation_num_steps": 2}
    flags = _flags(tiny_models, out, model, wan_expert=expert, **extra)
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(flags)
    printed = capsys.readouterr().out
    assert "epoch 2/2" in printed and re.search(r"num_frames +=? *5\b", printed)
    family = watch.runs[-1][
        "family"
    ]  # the trained expert (Wan 2.2: the pair's one LoRA part), at the folder's top
    assert lora_parts(family.network) == [
        (expert if model == "tiny-wan22" else "", getattr(family.pipe, expert), "")
    ]
    watch.assert_lora_moved_and_base_not(out)
    if trainer == "ddpo":
        assert printed.count("validation after epoch") == 2 and (out / "validation" / "epoch-2.png").is_file()
    if trainer in ("grpo", "nft"):
        stock = assert_lora_changes_stock_video(tiny_models / model, out, expert)[0]
    if trainer == "grpo":  # the kit's LoRA inference loads it into the expert it trained, as the stock call
        assert (lora_inference_video(out, tmp_path) - stock).abs().max() * 255 <= 1


@pytest.mark.parametrize("model", ["tiny-wan21", "tiny-wan22"])
def test_grpo_first_update_is_on_policy(model, tiny_models):
    torch.manual_seed(0)
    family = load_family(str(tiny_models / model))
    family.num_frames = FRAMES
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    kw = {"num_steps": 3, "guidance_scale": 4.0, "eta": 1.0}
    samples, first = ddpo_first_update(
        family, scheduler, params, family.empty_cond(), ["a cat", "a bird"] * 4, RES, **kw
    )
    assert tuple(samples["latents"].shape) == (4, 3, 16, 2, 2, 2)  # (B, steps, C, T, h, w)
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


def test_refl_on_two_of_five_frames_and_the_temporal_term(tiny_models, tmp_path, monkeypatch):
    """ReFL with a differentiable reward of videos: the aesthetic score of 2 of the 5 decoded frames (mean:2, the
    gradient through those frames only) plus the temporal-consistency term; two steps, the LoRA moved and no base
    weight, and it loads in the stock pipeline and changes its video."""
    from refl_ddpo.trainers import refl

    watch = watch_training(monkeypatch)
    out = tmp_path / "refl"
    flags = trainer_flags(
        tiny_models,
        out,
        model="tiny-wan21",
        resolution=RES,
        num_frames=FRAMES,
        reward="aesthetic:1.0,temporal_consistency:0.5",
        video_reduction="mean:2",
        num_inference_steps=4,
        k_lo=2,
        k_hi=3,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        device="cpu",
        report_to="none",
        max_train_steps=2,
    )
    refl.main(flags)
    watch.assert_lora_moved_and_base_not(out)
    assert_lora_changes_stock_video(tiny_models / "tiny-wan21", out, "transformer")


def test_flow_factory_wan22_preset_trains_on_the_tiny_wan22(tiny_models, tmp_path, capsys, monkeypatch):
    """The Wan preset (Flow-Factory's LoRA example, a LoRA on each expert) scaled down to the tiny Wan 2.2: one group
    of 2, JPEG size as reward, one epoch, CPU precision; its 5 frames, 10 steps, CFG 5 and a 1-step SDE window."""
    from helpers import train_preset_small

    from refl_ddpo.trainers import grpo

    out = tmp_path / "preset"
    train_preset_small(
        monkeypatch,
        capsys,
        grpo.main,
        tiny_models,
        out,
        "flow_factory_wan22",
        model="tiny-wan22",
        resolution=RES,
    )
    assert_lora_changes_stock_video(tiny_models / "tiny-wan22", out, "transformer")


# ---- DRaFT-K and AlignProp on video; validation videos in tensorboard and wandb ----


def _event_scalars_and_videos(out) -> tuple[dict, dict]:
    """The tensorboard events under `out`/logs: {tag: [values]} of the scalars, {tag: [(step, frames)]} of the
    animated images (an image summary whose encoded bytes hold several frames)."""
    import io

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars, videos = {}, {}
    for f in out.glob("logs/**/events.out.tfevents.*"):
        acc = EventAccumulator(str(f), size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
        for tag in acc.Tags()["images"]:
            for e in acc.Images(tag):
                with Image.open(io.BytesIO(e.encoded_image_string)) as im:
                    if getattr(im, "n_frames", 1) > 1:
                        videos.setdefault(tag, []).append((e.step, im.n_frames, im.format))
    return scalars, videos


@pytest.mark.parametrize(
    ("backprop_steps", "says"), [("2", "DRaFT-2"), ("random:1-3", "AlignProp (K in 1..3)")]
)
def test_draft_and_alignprop_on_two_of_five_frames(
    backprop_steps, says, tiny_models, tmp_path, capsys, monkeypatch
):
    """DRaFT-K and AlignProp on video: two steps on the tiny Wan 2.1, the aesthetic score's gradient through 2 of
    the 5 decoded frames (mean:2); the LoRA moved and no base weight, the loss finite. DRaFT's run also validates
    with tensorboard and wandb (offline): each validation is an animated GIF of the 5 frames in tensorboard, and a
    video among wandb's media."""
    from refl_ddpo.trainers import refl

    watch = watch_training(monkeypatch)
    out = tmp_path / "out"
    extra = {"report_to": "tensorboard"}
    if backprop_steps == "2":
        (tmp_path / "validation.txt").write_text("a cat\n")
        extra = {"report_to": "all", "validation_prompts_file": tmp_path / "validation.txt"}
        extra |= {"num_validation_images": 1, "validation_num_steps": 2}
        for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            monkeypatch.setenv(key, str(tmp_path / key.lower()))
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.setenv("WANDB_SILENT", "true")
    flags = trainer_flags(
        tiny_models,
        out,
        model="tiny-wan21",
        resolution=RES,
        num_frames=FRAMES,
        reward="aesthetic",
        video_reduction="mean:2",
        num_inference_steps=4,
        backprop_steps=backprop_steps,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        device="cpu",
        max_train_steps=2,
        **extra,
    )
    refl.main(flags)
    assert says in capsys.readouterr().out
    watch.assert_lora_moved_and_base_not(out)
    scalars, videos = _event_scalars_and_videos(out)
    assert len(scalars["refl/loss"]) == 2 and all(math.isfinite(v) for v in scalars["refl/loss"])
    if backprop_steps == "2":
        assert videos["validation/videos"] == [(0, FRAMES, "GIF"), (2, FRAMES, "GIF")], videos
        (run,) = (out / "logs" / "wandb").glob("offline-run-*")
        assert len(list((run / "files" / "media" / "videos").rglob("*.gif"))) == 2
