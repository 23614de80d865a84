"""FLUX.2's reference images (the pipelines' `image`): the kit's loop equal to the stock `Flux2Pipeline` and
`Flux2KleinPipeline` with two references per prompt (the embedded guidance, and CFG whose two calls both see them);
the reference tokens' time coordinates; GRPO's first update on policy with CFG; ReFL, GRPO, DiffusionNFT and AWM
for two steps on --edit_data with their LoRA moving and no base weight, the LoRA loading in the stock pipeline."""

import importlib
import json

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from helpers import ddpo_first_update, trainer_flags, watch_training
from PIL import Image

from refl_ddpo.core.edit_data import SOURCE_IMAGES
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.generate import generate_batch

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

BASE = "tiny-flux2-klein-base"
RES = 32
PROMPTS = ["make it blue", "add a hat"]
SEEDS = [3, 4]


def _references(h: int = 96, w: int = 64) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(2)]


def _metadata(images) -> dict:
    return {
        SOURCE_IMAGES: [
            torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255 for im in images
        ]
    }


@pytest.mark.parametrize("model, pipeline", [("tiny-flux2", Flux2Pipeline), (BASE, Flux2KleinPipeline)])
def test_loop_reproduces_stock_flux2_with_two_references(tiny_models, model, pipeline):
    images = _references()
    pipe = pipeline.from_pretrained(tiny_models / model)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(
        prompt=list(PROMPTS),
        image=images,
        height=RES,
        width=RES,
        num_inference_steps=3,
        guidance_scale=4.0,
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        output_type="pt",
    ).images
    family = load_family(str(tiny_models / model))
    ours = generate_batch(family, PROMPTS, SEEDS, RES, 3, 4.0, metadata=[_metadata(images)] * 2)
    assert ours.shape == ref.shape == (2, 3, RES, RES)
    assert (ours - ref).abs().max().item() <= 1 / 255
    plain = generate_batch(family, PROMPTS, SEEDS, RES, 3, 4.0)
    assert (plain - ours).abs().max() > 1e-3  # the references change the image


def test_reference_tokens_and_ids(tiny_models):
    family = load_family(str(tiny_models / BASE))
    cond, _ = family.encode_conditioning(PROMPTS, [_metadata(_references())] * 2, with_negative=False)
    # a 96 x 64 reference: 48 x 32 latents, patchified 24 x 16 = 384 tokens; two of them
    assert tuple(cond["image_latents"].shape) == (2, 768, 32) and tuple(cond["image_latent_ids"].shape) == (
        2,
        768,
        4,
    )
    times = cond["image_latent_ids"][0, :, 0]
    assert times[:384].eq(10).all() and times[384:].eq(20).all()  # 10 + 10 i
    with pytest.raises(UserError, match="at least 64") as e:
        family.encode_conditioning(PROMPTS, [_metadata(_references(32, 32))] * 2, with_negative=False)
    assert "\n" not in str(e.value)


def test_grpo_first_update_is_on_policy_with_cfg_and_references(tiny_models):
    from refl_ddpo.core.lora import add_lora

    torch.manual_seed(0)
    family = load_family(str(tiny_models / BASE))
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    kw = {"num_steps": 3, "guidance_scale": 4.0, "eta": 0.7}
    metadata = _metadata(_references(64, 64)[:1])
    samples, first = ddpo_first_update(
        family, scheduler, params, family.empty_cond(), PROMPTS * 2, RES, metadata=metadata, **kw
    )
    assert tuple(samples["image_latents"].shape) == (4, 256, 32)
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


def _edits(folder):
    folder.mkdir(parents=True)
    for i, name in enumerate(("a.png", "b.png")):
        rng = np.random.default_rng(i)
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / name)
    lines = [{"image": "a.png", "instruction": PROMPTS[0]}, {"image": "b.png", "instruction": PROMPTS[1]}]
    (folder / "edits.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder / "edits.jsonl"


@pytest.mark.parametrize("trainer", ["refl", "grpo", "nft", "awm"])
def test_trainer_runs_two_steps_on_edits(trainer, tiny_models, tmp_path, monkeypatch):
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    common = {"model": BASE, "edit_data": _edits(tmp_path / "d"), "learning_rate": "3e-2"}
    common |= {"lora_init": "random", "device": "cpu", "report_to": "none"}
    if trainer == "refl":
        flags = {"num_inference_steps": 4, "k_lo": 2, "k_hi": 3, "train_batch_size": 2, "max_train_steps": 2}
        flags |= {"guidance_scale": 4.0}
    else:
        flags = {"reward": "jpeg_compressibility", "sample_num_steps": 3, "sample_batch_size": 2}
        flags |= {"sample_num_batches_per_epoch": 1, "train_batch_size": 2, "num_epochs": 2, "group_size": 2}
        flags |= {"sample_guidance_scale": 4.0}
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(
        trainer_flags(tiny_models, out, **(common | flags))
    )
    watch.assert_lora_moved_and_base_not(out)
    if trainer in ("refl", "grpo"):
        pipe = Flux2KleinPipeline.from_pretrained(tiny_models / BASE)
        pipe.set_progress_bar_config(disable=True)
        kw = {"prompt": "make it blue", "image": _references(64, 64)[:1], "height": RES, "width": RES}
        kw |= {"num_inference_steps": 3, "guidance_scale": 4.0, "output_type": "pt"}
        before = pipe(generator=torch.Generator().manual_seed(0), **kw).images
        pipe.load_lora_weights(str(out))
        after = pipe(generator=torch.Generator().manual_seed(0), **kw).images
        assert (before - after).abs().max() > 1e-4
