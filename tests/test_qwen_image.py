"""What only the Qwen-Image family has, on the tiny random Qwen-Image folder: prompt encoding (the template, the
mask) vs the stock QwenImagePipeline's, noise and packing, the schedule's shift_terminal, true CFG with its norm
rescale, the loop in bfloat16, conditionings of unequal text lengths side by side, the Flow-GRPO preset, the VAE's
missing gradient checkpointing refused. The checks every family passes (the loop vs the stock pipeline, the reward
gradient, the LoRA in the stock pipeline, DDPO on policy, ReFL's card, every trainer for two steps) are in
tests/test_family_conformance.py and test_family_trainers.py."""

from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from helpers import (
    assert_lora_changes_stock_images,
    train_preset_small,
    trainer_flags,
)

from refl_ddpo.core.families import cond_cat, load_family
from refl_ddpo.core.families.qwen_image import QwenImage
from refl_ddpo.core.sampling import denoise

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32
SEEDS = [3, 7]  # one CPU generator per image, as the inference scripts draw
MODEL = "tiny-qwen-image"


def _stock(path) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def stock(tiny_models):
    return _stock(tiny_models / MODEL)


def _generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def test_qwen_image_loads_at_the_pipelines_default_size_and_refuses_drop_t5(tiny_models):
    """Beside what every family is checked for on loading (tests/test_family_conformance.py)."""
    from refl_ddpo.core.errors import UserError

    family = load_family(str(tiny_models / MODEL))
    assert family.native_resolution == 128 * family.vae_scale_factor  # the pipeline's default height
    with pytest.raises(UserError, match="has no T5"):
        load_family(str(tiny_models / MODEL), drop_t5=True)


def test_encode_prompts_equal_the_stock_encode_prompt(stock):
    family = QwenImage(stock)
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    with torch.no_grad():
        embeds, mask = stock.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
        empty, empty_mask = stock.encode_prompt([""] * 2, device="cpu", max_sequence_length=512)
    assert torch.equal(cond["prompt_embeds"], embeds) and torch.equal(cond["prompt_embeds_mask"], mask)
    assert mask[1].sum() < mask[0].sum() == mask.shape[1]  # the shorter prompt is padded and masked
    assert torch.equal(uncond["prompt_embeds"], empty)
    assert empty_mask is None and bool(uncond["prompt_embeds_mask"].all())  # the kit keeps a mask of ones
    assert family.encode_prompts(PROMPTS, with_negative=False)[1] is None


def test_a_prompt_is_said_truncated_past_the_512_tokens_the_template_leaves(stock, capsys):
    family = QwenImage(stock)
    tokenizer, limit = family.prompt_reader()
    kept = len(tokenizer(stock.prompt_template_encode.format("")).input_ids) - 34  # the template's tail
    assert limit == 512 - kept
    family.encode_prompts(["a" * limit], with_negative=False)  # one token per byte: exactly fits
    assert "truncated" not in capsys.readouterr().err
    family.encode_prompts(["a" * (limit + 1)], with_negative=False)
    assert f"the text encoder reads {limit}" in capsys.readouterr().err


def test_noise_and_packing_are_the_pipelines(stock):
    family = QwenImage(stock)
    noise = family.initial_noise(2, RES, _generators(), torch.float32)
    assert noise.shape == (2, 16, 16, 16)
    packed = stock.prepare_latents(2, 16, RES, RES, torch.float32, "cpu", _generators())
    assert torch.equal(family.pack(noise), packed) and packed.shape == (2, 64, 64)
    assert torch.equal(family.unpack(packed, 16, 16), noise)


def _images(family, guidance_scale, steps=4, resolution=RES):
    with torch.no_grad():
        cond, negative = family.encode_prompts(PROMPTS, with_negative=guidance_scale > 1)
        noise = family.initial_noise(len(PROMPTS), resolution, _generators(), cond["prompt_embeds"].dtype)
        scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
        out = denoise(family, scheduler, cond, negative, noise, steps, guidance_scale)
        return family.decode(out.latents), out.timesteps


@pytest.mark.parametrize("guidance_scale, resolution", [(1.0, RES), (4.0, RES), (4.0, 48)])
def test_the_schedule_ends_at_shift_terminal_and_true_cfg_changes_the_image(
    stock, guidance_scale, resolution
):
    """The loop's timesteps and CFG's effect (its images equal the stock pipeline's, no CFG and true CFG 4 against
    the empty prompt at 32 and 48 px: tests/test_family_conformance.py)."""
    family = QwenImage(stock)
    ours, timesteps = _images(family, guidance_scale, resolution=resolution)
    assert timesteps[-1].item() == pytest.approx(20.0)  # Qwen-Image's shift_terminal 0.02
    if guidance_scale > 1:  # CFG changes the image
        assert (ours - _images(family, 1.0, resolution=resolution)[0]).abs().max() > 1e-3


def test_loop_reproduces_stock_pipeline_in_bfloat16(tiny_models, record_property):
    """True CFG 4 in bfloat16: within 1 grey level (the stock postprocess rounds in bfloat16, ours decodes to
    float32)."""
    path = tiny_models / MODEL
    family = load_family(str(path), dtype=torch.bfloat16)
    pipe = QwenImagePipeline.from_pretrained(path, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    ours = _images(family, 4.0)[0].float()
    kw = {"height": RES, "width": RES, "output_type": "pt", "negative_prompt": "", "true_cfg_scale": 4.0}
    ref = pipe(PROMPTS, num_inference_steps=4, generator=_generators(), **kw).images.float()
    diff = (ours - ref).abs().max().item()
    record_property("max_grey_levels", diff * 255)
    assert diff <= 1 / 255


def test_true_cfg_rescales_each_token_to_the_text_predictions_norm(stock):
    family = QwenImage(stock)
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    x = family.initial_noise(2, RES, _generators(), torch.float32)
    scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    t = family.set_timesteps(scheduler, 4, x)[1]
    with torch.no_grad():
        text = family.pack(family.predict(x, t, scheduler, cond, None, 1.0))
        guided = family.pack(family.predict(x, t, scheduler, cond, uncond, 4.0))
    torch.testing.assert_close(guided.norm(dim=-1), text.norm(dim=-1))
    assert (guided - text).abs().max() > 1e-3


def test_conditionings_of_unequal_lengths_concatenate_padded_and_predict_the_same(stock):
    """cond_cat (DDPO / NFT sample buffers) right-pads a batch's shorter text with masked zeros: the prediction
    of each image is unchanged."""
    family = QwenImage(stock)
    short = family.encode_prompts(["a cat"], with_negative=False)[0]
    long = family.encode_prompts(["a red bird on a branch"], with_negative=False)[0]
    both = cond_cat([short, long])
    n = long["prompt_embeds"].shape[1]
    assert both["prompt_embeds"].shape[1] == n > short["prompt_embeds"].shape[1]
    assert both["prompt_embeds_mask"][0].sum() == short["prompt_embeds"].shape[1]
    x = family.initial_noise(2, RES, _generators(), torch.float32)
    scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    t = family.set_timesteps(scheduler, 4, x)[0]
    with torch.no_grad():
        together = family.predict(x, t, scheduler, both, None, 1.0)
        alone = family.predict(x[:1], t, scheduler, short, None, 1.0)
    torch.testing.assert_close(together[:1], alone, atol=1e-5, rtol=1e-5)


# ---- the trainers (every trainer for two steps: tests/test_family_trainers.py) ----


def _refl_flags(tiny_models, out: Path, *extra: str, **flags) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=MODEL,
        num_inference_steps=4,
        k_lo=2,
        k_hi=3,
        guidance_scale=4.0,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        device="cpu",
        report_to="none",
        **flags,
    )


def test_flow_grpo_qwen_image_preset_keeps_its_sources_numbers_and_trains_its_window(
    tiny_models, tmp_path, capsys, monkeypatch
):
    """The preset as data (flow_grpo's pickscore_qwenimage): its numbers, and a run of it on the tiny Qwen-Image
    (smaller batches, one epoch, CPU precision) that trains a 2-step SDE window starting in steps 0-4 into a LoRA the
    stock pipeline loads."""
    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers import grpo
    from refl_ddpo.trainers.grpo_config import GRPOConfig

    cfg = parse_config(GRPOConfig, ["--preset", "flow_grpo_qwen_image"])
    assert (cfg.pretrained_model, cfg.reward, cfg.resolution) == ("Qwen/Qwen-Image", "pickscore", 512)
    assert (cfg.sample_num_steps, cfg.sample_eta, cfg.sample_guidance_scale) == (10, 1.2, 4.0)
    assert (cfg.sde_window, cfg.sample_num_steps - cfg.train_skip_last_steps - cfg.sde_window) == (2, 4)
    assert (cfg.group_size, cfg.sample_batch_size * cfg.sample_num_batches_per_epoch) == (16, 16)
    assert (cfg.learning_rate, cfg.train_clip_range, cfg.kl_weight, cfg.global_std) == (3e-4, 1e-4, 0.0, True)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (64, 128, None)  # the family's default
    assert cfg.gradient_checkpointing and cfg.mixed_precision == "bf16"

    out = tmp_path / "preset"
    train_preset_small(
        monkeypatch, capsys, grpo.main, tiny_models, out, "flow_grpo_qwen_image", model=MODEL, resolution=RES
    )
    assert_lora_changes_stock_images(_stock(tiny_models / MODEL), out, RES, part="transformer")


def test_vae_gradient_checkpointing_is_refused_in_one_line(tiny_models, tmp_path, capsys):
    """diffusers' AutoencoderKLQwenImage has no gradient checkpointing: ReFL says so in one line before training."""
    from refl_ddpo.trainers import refl

    with pytest.raises(SystemExit) as exit_info:
        refl.main(
            _refl_flags(tiny_models, tmp_path / "out", max_train_steps=1, vae_gradient_checkpointing=True)
        )
    assert exit_info.value.code == 2
    assert "AutoencoderKLQwenImage (qwen_image) has no gradient checkpointing" in capsys.readouterr().err


def test_memory_benchmark_configs_are_qwen_images_published_sizes():
    """benchmarks/configs/qwen_image_*.json build the published parameter counts (on meta): the 20B transformer,
    Qwen2.5-VL-7B-Instruct (vision tower included) and the 127M VAE."""
    from benchmarks.qwen_memory import parameter_counts

    assert parameter_counts() == {
        "transformer": 20_430_401_088,
        "vae": 126_892_531,
        "text_encoder": 8_292_166_656,
    }
