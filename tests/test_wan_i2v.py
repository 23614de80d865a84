"""Wan image-to-video on the tiny Wan 2.1 I2V (CLIP image embeddings) and Wan 2.2 I2V (two experts) folders: the
kit's videos equal the stock WanImageToVideoPipeline's at the same seeds (each sample its own first frame, resized
to the video's size), through generate_batch and through inference.py --edit_data; GRPO's first update on policy
with the image condition in the sample buffers; GRPO and DiffusionNFT for two epochs with the LoRA moving and no base
weight, their LoRA loading in the stock pipeline and changing its video; a missing or misplaced --edit_data refused
in one line before any model loads."""

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from helpers import ddpo_first_update, trainer_flags, watch_training
from PIL import Image

from refl_ddpo.core.edit_data import SOURCE_IMAGES
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.generate import generate_batch
from refl_ddpo.core.lora import add_lora

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

RES, FRAMES, STEPS = 16, 5, 3
SOURCE = 32  # the source images' side: resized to RES, as the stock pipeline resizes them
PROMPTS = ["the cat turns", "a dog  &amp; the sun"]  # the second needs the pipeline's prompt_clean


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (SOURCE, SOURCE, 3), dtype=np.uint8)) for _ in PROMPTS]


def _tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


def _edit_data(folder: Path) -> Path:
    """folder/edits.jsonl: one line per prompt, each with its own image."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (prompt, image) in enumerate(zip(PROMPTS, _images(), strict=True)):
        image.save(folder / f"{i}.png")
        lines.append(json.dumps({"image": f"{i}.png", "instruction": prompt}) + "\n")
    (folder / "edits.jsonl").write_text("".join(lines))
    return folder / "edits.jsonl"


def _stock(path) -> WanImageToVideoPipeline:
    pipe = WanImageToVideoPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stock_video(pipe, i: int, seed: int, steps: int = STEPS, guidance: float = 4.0, **kw) -> torch.Tensor:
    """The stock pipeline's video (1, T, 3, H, W) of prompt i with image i."""
    return pipe(
        image=_images()[i],
        prompt=PROMPTS[i],
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        **kw,
    ).frames


def _family(path):
    family = load_family(str(path))
    family.num_frames, family.video_resolution = FRAMES, RES
    return family


@pytest.mark.parametrize(("model", "guidance_2"), [("tiny-wan21-i2v", None), ("tiny-wan22-i2v", 1.5)])
def test_videos_match_the_stock_pipeline(tiny_models, model, guidance_2):
    """A batch of two prompts, each with its own image: each video equals the stock call with that image and
    seed (float32, to 1e-5: the stock call animates one image at a time); a batch of one, bit for bit."""
    family = _family(tiny_models / model)
    family.guidance_scale_2 = guidance_2
    metadata = [{SOURCE_IMAGES: [_tensor(im)]} for im in _images()]
    videos = generate_batch(family, PROMPTS, [0, 1], RES, STEPS, 4.0, metadata=metadata)
    kw = {"guidance_scale_2": guidance_2} if guidance_2 is not None else {}
    stock = _stock(tiny_models / model)
    ref = torch.cat([_stock_video(stock, i, seed=i, **kw) for i in range(2)])
    assert videos.shape == ref.shape == (2, FRAMES, 3, RES, RES)
    torch.testing.assert_close(videos, ref, rtol=0, atol=1e-5)
    one = generate_batch(family, PROMPTS[:1], [0], RES, STEPS, 4.0, metadata=metadata[:1])
    assert torch.equal(one, ref[:1])  # a batch of one is the stock call itself: bit for bit
    assert ("image_embeds" in family.encode_conditioning(PROMPTS[:1], metadata[:1], False)[0]) == (
        model == "tiny-wan21-i2v"
    )


def test_inference_with_edit_data_matches_the_stock_pipeline(tiny_models, tmp_path):
    """inference.py --edit_data on tiny Wan 2.1 I2V: each record's frames within 1 grey level of the stock video of
    its image, instruction and seed."""
    from refl_ddpo.apps import inference
    from refl_ddpo.run.flags import parse_config

    model = tiny_models / "tiny-wan21-i2v"
    argv = [
        "--pretrained_model",
        str(model),
        "--edit_data",
        str(_edit_data(tmp_path / "d")),
        "--device",
        "cpu",
    ]
    argv += ["--output_dir", str(tmp_path / "out"), "--num_images_per_prompt", "1", "--seed", "3"]
    argv += ["--num_inference_steps", str(STEPS), "--resolution", str(RES), "--num_frames", str(FRAMES)]
    argv += ["--guidance_scale", "4", "--rewards", "jpeg_compressibility"]
    records = inference.run_inference(parse_config(inference.InferenceConfig, argv))["records"]
    stock = _stock(model)
    for i, record in enumerate(records):
        frames = np.stack(
            [np.array(Image.open(tmp_path / "out" / f).convert("RGB")) for f in record["frames"]]
        )
        ref = _stock_video(stock, i, seed=record["seed"])[0].permute(0, 2, 3, 1).numpy()
        assert record["prompt"] == PROMPTS[i]
        assert np.abs(frames.astype(float) - np.round(ref * 255)).max() <= 1


def test_grpo_first_update_is_on_policy_with_the_first_frame(tiny_models):
    torch.manual_seed(0)
    family = _family(tiny_models / "tiny-wan21-i2v")
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    kw = {"num_steps": 3, "guidance_scale": 4.0, "eta": 1.0}
    metadata = {SOURCE_IMAGES: [_tensor(_images()[0])]}
    samples, first = ddpo_first_update(
        family, scheduler, params, family.empty_cond(), ["a cat"] * 4, RES, metadata=metadata, **kw
    )
    assert tuple(samples["latents"].shape) == (4, 3, 16, 2, 2, 2)  # (B, steps, C, T, h, w)
    assert tuple(samples["image_condition"].shape) == (
        4,
        20,
        2,
        2,
        2,
    )  # mask + first frame's latents, per sample
    assert tuple(samples["image_embeds"].shape) == (
        4,
        5,
        16,
    )  # the CLIP's penultimate state: 1 + 2 x 2 patches
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


@pytest.mark.parametrize(
    ("trainer", "model", "expert"),
    [("grpo", "tiny-wan22-i2v", "transformer_2"), ("nft", "tiny-wan21-i2v", "transformer")],
)
def test_trainer_runs_two_epochs_on_first_frames(trainer, model, expert, tiny_models, tmp_path, monkeypatch):
    """Two epochs on --edit_data: the LoRA moved and no base weight did; the stock pipeline loads it (into the
    expert it trained) and its video changes."""
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    flags = trainer_flags(
        tiny_models,
        out,
        model=model,
        resolution=RES,
        num_frames=FRAMES,
        edit_data=_edit_data(tmp_path / "d"),
        reward="jpeg_compressibility",
        sample_num_steps=STEPS,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        group_size=2,
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=2,
        wan_expert=expert,
        device="cpu",
        report_to="none",
        seed=5,
    )
    if trainer == "nft":  # validated on held-out first frames: edit records
        flags += [
            "--validation_prompts_file",
            str(tmp_path / "d" / "edits.jsonl"),
            "--num_validation_images",
            "1",
        ]
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(flags)
    watch.assert_lora_moved_and_base_not(out)
    if trainer == "nft":
        records = json.loads((out / "validation" / "epoch-2.json").read_text())["records"]
        assert [len(r["source_image"]) for r in records] == [1] * len(records) and len(records) >= 1
    pipe = _stock(tiny_models / model)
    before = _stock_video(pipe, 0, seed=0)
    pipe.load_lora_weights(str(out), load_into_transformer_2=expert == "transformer_2")
    assert any("lora_" in n for n, _ in getattr(pipe, expert).named_parameters())
    after = _stock_video(pipe, 0, seed=0)
    assert (after - before).abs().max() > 1e-4
    if (
        trainer == "nft"
    ):  # the kit's LoRA inference, as the stock call (Wan 2.1 I2V's loader adds zero matrices)
        assert (_lora_inference_frames(out, tmp_path) - after[0]).abs().max() * 255 <= 1


def _lora_inference_frames(lora_dir: Path, tmp_path: Path) -> torch.Tensor:
    """inference_lora.py --edit_data's frames (T, 3, H, W) in [0, 1] of the first edit at seed 0 (the base, size and
    frames read from the LoRA's config.json), as `_stock_video(pipe, 0, seed=0)` calls it."""
    from refl_ddpo.apps import inference
    from refl_ddpo.run.flags import parse_config

    argv = [
        "--lora_dir",
        str(lora_dir),
        "--edit_data",
        str(tmp_path / "d" / "edits.jsonl"),
        "--device",
        "cpu",
    ]
    argv += ["--output_dir", str(tmp_path / "lora_out"), "--num_images_per_prompt", "1", "--seed", "0"]
    argv += [
        "--num_inference_steps",
        str(STEPS),
        "--guidance_scale",
        "4",
        "--rewards",
        "jpeg_compressibility",
    ]
    record = inference.run_inference(parse_config(inference.LoraInferenceConfig, argv))["records"][0]
    frames = [np.array(Image.open(tmp_path / "lora_out" / f).convert("RGB")) for f in record["frames"]]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255


def test_wrong_inputs_are_refused_in_one_line_before_loading(tiny_models, tmp_path, capsys):
    """An I2V model without --edit_data (a trainer, inference), a text-to-video one with it: one line each, before
    any model loads (nothing written); --num_frames is checked for the I2V pipeline as for WanPipeline."""
    from refl_ddpo.apps import inference
    from refl_ddpo.core.video import check_video_flags
    from refl_ddpo.trainers import grpo

    edits, out = _edit_data(tmp_path / "d"), tmp_path / "out"
    cases = [
        (
            "tiny-wan21-i2v",
            {},
            "image-to-video model (WanImageToVideoPipeline): give each prompt its first frame",
        ),
        ("tiny-wan21", {"edit_data": edits}, "WanPipeline folder, which draws from the prompt alone"),
        (  # an image-to-video run validates on edit records: a prompts file is refused as one
            "tiny-wan22-i2v",
            {"edit_data": edits, "validation_prompts_file": "toy_world_heldout"},
            "--validation_prompts_file",
        ),
    ]
    for model, extra, needle in cases:
        with pytest.raises(SystemExit) as e:
            grpo.main(trainer_flags(tiny_models, out, model=model, device="cpu", report_to="none", **extra))
        err = capsys.readouterr().err.strip()
        assert e.value.code != 0 and not out.exists() and err.count("\n") == 0 and needle in err, err
    (tmp_path / "p.txt").write_text("a cat\n")
    argv = [
        "--pretrained_model",
        str(tiny_models / "tiny-wan22-i2v"),
        "--prompts_file",
        str(tmp_path / "p.txt"),
    ]
    with pytest.raises(SystemExit):
        inference.main_base([*argv, "--output_dir", str(out), "--device", "cpu"])
    assert "--edit_data FILE" in capsys.readouterr().err and not out.exists()
    check_video_flags(str(tiny_models / "tiny-wan22-i2v"), 9)
    with pytest.raises(UserError, match="--num_frames 8"):
        check_video_flags(str(tiny_models / "tiny-wan22-i2v"), 8)


def test_flow_factory_wan21_i2v_preset_trains_on_first_frames(tiny_models, tmp_path, capsys, monkeypatch):
    """Flow-Factory's Wan 2.1 I2V example as data (one GPU's share), and a run of it scaled down to the tiny Wan 2.1
    I2V with --edit_data: one group of 2, JPEG size as reward, one epoch, CPU precision."""
    from helpers import train_preset_small

    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers import grpo
    from refl_ddpo.trainers.grpo_config import GRPOConfig
    from refl_ddpo.trainers.wan_presets import WAN_GRPO_PRESETS

    edits = _edit_data(tmp_path / "d")
    assert (
        WAN_GRPO_PRESETS["flow_factory_wan21_i2v"]["pretrained_model"]
        == "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
    )
    model = ["--pretrained_model", str(tiny_models / "tiny-wan21-i2v"), "--edit_data", str(edits)]
    cfg = parse_config(GRPOConfig, ["--preset", "flow_factory_wan21_i2v", *model])
    assert (cfg.reward, cfg.resolution, cfg.num_frames) == ("pickscore", 240, 5)
    assert (cfg.sample_num_steps, cfg.sample_eta, cfg.sample_guidance_scale, cfg.sde_window) == (
        10,
        0.9,
        5.0,
        1,
    )
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.learning_rate, cfg.group_size) == (64, 128, 1e-4, 16)
    small = {"sample_num_steps": STEPS, "train_skip_last_steps": 1, "lora_rank": 4, "lora_alpha": 8}
    train_preset_small(
        monkeypatch,
        capsys,
        grpo.main,
        tiny_models,
        tmp_path / "out",
        "flow_factory_wan21_i2v",
        model="tiny-wan21-i2v",
        resolution=RES,
        edit_data=edits,
        **small,
    )
