"""Qwen-Image-Edit-Plus (editing with Qwen2.5-VL reading the source images): the kit's loop equal to the stock
`QwenImageEditPlusPipeline` with two sources per edit, with and without true CFG (whose negative carries the
pictures); the reference tokens and shapes in the conditioning; GRPO's first update on policy with CFG; ReFL, GRPO,
DiffusionNFT and AWM for two steps on --edit_data with their LoRA moving and no base weight, the LoRA loading in the
stock pipeline. The pipeline's two image sizes (about 384 x 384 px for the VLM, 1024 x 1024 px for the VAE) are
shrunk for the tiny model, in the stock pipeline's module, which the family reads too."""

import importlib

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from helpers import ddpo_first_update, trainer_flags, watch_training
from PIL import Image
from test_flux_kontext import _two_edits

from refl_ddpo.core.edit_data import SOURCE_IMAGES
from refl_ddpo.core.families import load_family
from refl_ddpo.core.generate import generate_batch

pytestmark = pytest.mark.usefixtures("one_thread_module", "small_sizes")  # conftest.py, below

MODEL = "tiny-qwen-image-edit-plus"
RES = 32
PROMPTS = ["make it blue", "put a hat on the cat"]
SEEDS = [3, 4]


@pytest.fixture
def small_sizes(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock

    monkeypatch.setattr(stock, "CONDITION_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(stock, "VAE_IMAGE_SIZE", 32 * 32)


@pytest.fixture(scope="module")
def stock_pipe(tiny_models):
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_models / MODEL)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sources(n: int = 2, h: int = 48, w: int = 32) -> list[list[Image.Image]]:
    rng = np.random.default_rng(0)
    return [
        [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)] for _ in PROMPTS
    ]


def _metadata(sources) -> list[dict]:
    def tensor(image):
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255

    return [{SOURCE_IMAGES: [tensor(im) for im in images]} for images in sources]


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_loop_reproduces_stock_edit_plus_with_two_sources(stock_pipe, tiny_models, guidance):
    """Two sources of 48 x 32 px per edit, prompts of unequal lengths in one batch (the stock pipeline takes one at a
    time): within 1 grey level of it, without CFG and with true CFG against the empty prompt and the pictures."""
    sources = _sources()
    refs = []
    for i, prompt in enumerate(PROMPTS):
        extra = {"negative_prompt": "", "true_cfg_scale": guidance} if guidance > 1 else {}
        out = stock_pipe(
            prompt=prompt,
            image=sources[i],
            height=RES,
            width=RES,
            num_inference_steps=3,
            generator=torch.Generator().manual_seed(SEEDS[i]),
            output_type="pt",
            **extra,
        )
        refs.append(out.images)
    ref = torch.cat(refs)
    family = load_family(str(tiny_models / MODEL))
    assert family.name == "qwen_image_edit_plus"
    ours = generate_batch(family, PROMPTS, SEEDS, RES, 3, guidance, metadata=_metadata(sources))
    assert ours.shape == ref.shape == (2, 3, RES, RES)
    assert (ours - ref).abs().max().item() <= 1 / 255
    if guidance > 1:
        plain = generate_batch(family, PROMPTS, SEEDS, RES, 3, 1.0, metadata=_metadata(sources))
        assert (plain - ours).abs().max() > 1e-3


def test_the_conditioning_carries_the_reference_tokens_shapes_and_negative(tiny_models):
    family = load_family(str(tiny_models / MODEL))
    cond, uncond = family.encode_conditioning(PROMPTS, _metadata(_sources()), with_negative=True)
    # each 48 x 32 source at about 32 x 32 px: 16 x 16 latents, 8 x 8 = 64 tokens; two per edit
    assert tuple(cond["image_latents"].shape) == (2, 128, 64)
    assert cond["image_shapes"].tolist() == [[[8, 8], [8, 8]]] * 2
    assert torch.equal(cond["negative_prompt_embeds"], uncond["prompt_embeds"])
    assert cond["prompt_embeds"].shape[1] > uncond["prompt_embeds"].shape[1]  # the instruction's tokens
    text_only, _ = family.encode_conditioning(PROMPTS, None, with_negative=False)
    assert "image_latents" not in text_only


def test_grpo_first_update_is_on_policy_with_cfg_and_the_sources(tiny_models):
    from refl_ddpo.core.lora import add_lora

    torch.manual_seed(0)
    family = load_family(str(tiny_models / MODEL))
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    metadata = _metadata(_sources(n=1, h=32, w=32))[0]
    kw = {"num_steps": 3, "guidance_scale": 4.0, "eta": 0.7}
    samples, first = ddpo_first_update(
        family, scheduler, params, family.empty_cond(), PROMPTS * 2, RES, metadata=metadata, **kw
    )
    assert tuple(samples["image_latents"].shape) == (4, 64, 64) and "negative_prompt_embeds" in samples
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


@pytest.mark.parametrize("trainer", ["refl", "grpo", "nft", "awm"])
def test_trainer_runs_two_steps_on_edits(trainer, tiny_models, stock_pipe, tmp_path, monkeypatch):
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    common = {"model": MODEL, "edit_data": _two_edits(tmp_path / "d"), "learning_rate": "3e-2"}
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
    assert watch.runs[-1]["family"].name == "qwen_image_edit_plus"
    watch.assert_lora_moved_and_base_not(out)
    if trainer in ("refl", "grpo"):
        kw = {"prompt": "make it blue", "image": _sources(n=1, h=32, w=32)[0], "height": RES, "width": RES}
        kw |= {"num_inference_steps": 3, "output_type": "pt"}
        before = stock_pipe(generator=torch.Generator().manual_seed(0), **kw).images
        stock_pipe.load_lora_weights(str(out))
        try:
            after = stock_pipe(generator=torch.Generator().manual_seed(0), **kw).images
        finally:
            stock_pipe.unload_lora_weights()
        assert (before - after).abs().max() > 1e-4


def test_flow_factory_qwen_edit_preset_keeps_its_numbers_and_trains_on_edits(
    tiny_models, tmp_path, capsys, monkeypatch
):
    from helpers import train_preset_small

    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers import grpo
    from refl_ddpo.trainers.grpo_config import GRPOConfig

    cfg = parse_config(GRPOConfig, ["--preset", "flow_factory_qwen_image_edit_plus"])
    numbers = (cfg.pretrained_model, cfg.reward, cfg.resolution, cfg.sample_num_steps, cfg.sample_eta)
    assert numbers == ("Qwen/Qwen-Image-Edit-2509", "pickscore", 384, 10, 1.0)
    assert (
        cfg.sample_guidance_scale,
        cfg.sde_window,
        cfg.train_skip_last_steps,
        cfg.gradient_checkpointing,
    ) == (
        4.0,
        1,
        6,
        True,
    )
    small = {
        "sample_num_steps": 4,
        "train_skip_last_steps": 2,
        "lora_rank": 4,
        "lora_alpha": 8,
        "save_freq": 1,
    }
    small |= {"validation_num_steps": 2}
    train_preset_small(
        monkeypatch,
        capsys,
        grpo.main,
        tiny_models,
        tmp_path / "out",
        "flow_factory_qwen_image_edit_plus",
        model=MODEL,
        resolution=RES,
        edit_data=_two_edits(tmp_path / "d"),
        **small,
    )
