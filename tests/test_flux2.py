"""What only the FLUX.2 families have, on the tiny random FLUX.2 [dev] and [klein] (distilled and base) folders:
prompt encoding (the chat template, the hidden-state stack, the text position ids) vs the stock pipelines'
`encode_prompt`, noise and packing of the patchified latents, the guidance of each (the embedded guidance of [dev],
CFG on the [klein] base, none on the distilled [klein], whatever the flags say), the loop in bfloat16, the unset
guidance flags resolved per family, inference.py against the stock pipeline's call, DDPO on policy on the distilled
[klein] with no CFG call, the presets, the memory benchmark's configs. The checks every family passes (the loop vs the stock pipeline, the reward gradient, the LoRA
in the stock pipeline, DDPO on policy, ReFL's card, every trainer for two steps) are in
tests/test_family_conformance.py and test_family_trainers.py."""

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from helpers import (
    assert_lora_changes_stock_images,
    ddpo_first_update,
    one_image_inference,
    train_preset_small,
)

from refl_ddpo.core.families import load_family
from refl_ddpo.core.families.flux2 import Flux2, Flux2Klein
from refl_ddpo.core.lora import add_lora

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32
SEEDS = [3, 7]  # one CPU generator per image, as the inference scripts draw
DEV, KLEIN, BASE = "tiny-flux2", "tiny-flux2-klein", "tiny-flux2-klein-base"
FOLDERS = {
    DEV: (Flux2Pipeline, Flux2),
    KLEIN: (Flux2KleinPipeline, Flux2Klein),
    BASE: (Flux2KleinPipeline, Flux2Klein),
}


@pytest.fixture(scope="module")
def stock(tiny_models):
    """folder -> its stock pipeline (loaded once, on first use)."""
    pipes = {}

    def get(folder: str):
        if folder not in pipes:
            pipes[folder] = FOLDERS[folder][0].from_pretrained(tiny_models / folder)
            pipes[folder].set_progress_bar_config(disable=True)
        return pipes[folder]

    return get


def _family(stock, folder: str):
    return FOLDERS[folder][1](stock(folder))


def _generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


@pytest.mark.parametrize(
    "folder, embedded, distilled", [(DEV, True, None), (KLEIN, False, True), (BASE, False, False)]
)
def test_flux2_loads_with_its_guidance_settings_and_refuses_drop_t5(folder, embedded, distilled, tiny_models):
    """Beside what every family is checked for on loading (tests/test_family_conformance.py)."""
    from refl_ddpo.core.errors import UserError

    family = load_family(str(tiny_models / folder))
    assert family.native_resolution == 128 * family.vae_scale_factor  # the pipeline's default height
    assert family.network.config.guidance_embeds is embedded
    assert family.pipe.config.get("is_distilled") is distilled
    assert family.uses_cfg() is (distilled is False)
    with pytest.raises(UserError, match="FLUX.2 model, which has no T5"):
        load_family(str(tiny_models / folder), drop_t5=True)


@pytest.mark.parametrize("folder", [DEV, KLEIN, BASE])
def test_encode_prompts_and_text_ids_equal_the_stock_encode_prompt(folder, stock):
    """The stacked hidden states of the templated prompt, padded to 512 tokens (no mask: the pipelines pass none),
    and the text position ids; the empty prompt is encoded only where CFG can be on (the [klein] base)."""
    family = _family(stock, folder)
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    with torch.no_grad():
        embeds, text_ids = stock(folder).encode_prompt(PROMPTS, device="cpu")
        empty, _ = stock(folder).encode_prompt([""] * 2, device="cpu")
    assert list(cond) == ["prompt_embeds"] and torch.equal(cond["prompt_embeds"], embeds)
    assert embeds.shape == (2, 512, 48)  # 3 stacked layers of the width-16 text encoder
    assert torch.equal(family._text_kwargs(cond)["txt_ids"], text_ids)
    if folder == BASE:
        assert torch.equal(uncond["prompt_embeds"], empty)
    else:
        assert uncond is None
    assert family.encode_prompts(PROMPTS, with_negative=False)[1] is None


@pytest.mark.parametrize("folder", [DEV, KLEIN])
def test_a_prompt_is_said_truncated_past_the_tokens_the_chat_template_leaves(folder, stock, capsys):
    family = _family(stock, folder)
    tokenizer, limit = family.prompt_reader()
    assert 0 < limit < 512 - 20  # the template takes its share (the system message on [dev])
    chat = family._chat("a" * limit)  # the text encode_prompt tokenizes: exactly the 512 tokens it reads
    assert len(tokenizer(chat, add_special_tokens=False).input_ids) == 512
    family.encode_prompts(["a" * limit], with_negative=False)  # one token per byte: exactly fits
    assert "truncated" not in capsys.readouterr().err
    family.encode_prompts(["a" * (limit + 1)], with_negative=False)
    assert f"the text encoder reads {limit}" in capsys.readouterr().err


def test_noise_packing_and_position_ids_are_the_pipelines(stock):
    """The kit's latents are the pipeline's patchified ones (B, 32, h, w); the transformer sees the pipeline's packed
    tokens and image position ids, and its output goes back to the same layout."""
    family = _family(stock, DEV)
    pipe = stock(DEV)
    noise = family.initial_noise(2, RES, _generators(), torch.float32)
    assert noise.shape == (2, 32, 8, 8)
    packed, latent_ids = pipe.prepare_latents(2, 8, RES, RES, torch.float32, "cpu", _generators())
    assert torch.equal(pipe._pack_latents(noise), packed) and packed.shape == (2, 64, 32)
    assert torch.equal(pipe._unpack_latents_with_ids(packed, latent_ids), noise)
    seen = {}

    def record(_, args, kwargs):
        seen.update(kwargs)

    handle = family.network.register_forward_pre_hook(record, with_kwargs=True)
    try:
        cond, _ = family.encode_prompts(PROMPTS, with_negative=False)
        t = torch.tensor(500.0)
        with torch.no_grad():
            v = family.predict(noise, t, None, cond, None, 4.0)
    finally:
        handle.remove()
    assert torch.equal(seen["hidden_states"], packed) and torch.equal(seen["img_ids"], latent_ids)
    with torch.no_grad():
        out = family.network(
            hidden_states=packed,
            encoder_hidden_states=cond["prompt_embeds"],
            timestep=t.expand(2) / 1000,
            guidance=torch.full([2], 4.0),
            txt_ids=seen["txt_ids"],
            img_ids=latent_ids,
            return_dict=False,
        )[0]
    assert torch.equal(v, pipe._unpack_latents_with_ids(out, latent_ids))


def _velocity(family, guidance_scale: float, with_uncond: bool, prompts=PROMPTS) -> tuple[torch.Tensor, int]:
    """(the velocity `predict` gives `prompts` at one state, how many images the network was fed)."""
    fed = []
    handle = family.network.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        cond, _ = family.encode_prompts(prompts, with_negative=False)
        uncond = family.encode_prompts(["", ""], with_negative=False)[0] if with_uncond else None
        noise = family.initial_noise(2, RES, _generators(), torch.float32)
        with torch.no_grad():
            v = family.predict(noise, torch.tensor(700.0), None, cond, uncond, guidance_scale)
    finally:
        handle.remove()
    return v, sum(fed)


def test_each_flux2_guides_as_its_pipeline(stock):
    """[dev]: the guidance scale goes into the network, one call, no CFG even with an uncond at hand. The [klein]
    base: CFG against the empty prompt above 1 (two calls, uncond + s (text - uncond)). The distilled [klein]: every
    guidance scale ignored, one call, as the pipeline (whose images the distilled loop equals at guidance 4:
    tests/test_family_conformance.py)."""
    dev = _family(stock, DEV)
    embedded, fed = _velocity(dev, 4.0, with_uncond=True)
    assert fed == 2 and (embedded - _velocity(dev, 1.0, with_uncond=False)[0]).abs().max() > 1e-4
    base = _family(stock, BASE)
    guided, fed = _velocity(base, 4.0, with_uncond=True)
    text = _velocity(base, 1.0, with_uncond=False)[0]
    empty = _velocity(base, 1.0, with_uncond=False, prompts=["", ""])[0]
    assert fed == 4 and torch.equal(guided, empty + 4.0 * (text - empty))
    klein = _family(stock, KLEIN)
    distilled, fed = _velocity(klein, 4.0, with_uncond=True)
    assert fed == 2 and torch.equal(distilled, _velocity(klein, 1.0, with_uncond=False)[0])


@pytest.mark.parametrize("folder, guidance_scale", [(DEV, 4.0), (BASE, 4.0)])
def test_loop_reproduces_stock_pipeline_in_bfloat16(folder, guidance_scale, tiny_models, record_property):
    """[dev] with its embedded guidance and the [klein] base with CFG, in bfloat16: within 1 grey level (the stock
    postprocess rounds in bfloat16, ours decodes to float32)."""
    from refl_ddpo.core.sampling import denoise

    path = tiny_models / folder
    family = load_family(str(path), dtype=torch.bfloat16)
    pipe = FOLDERS[folder][0].from_pretrained(path, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    kw = {"height": RES, "width": RES, "output_type": "pt", "guidance_scale": guidance_scale}
    ref = pipe(prompt=PROMPTS, num_inference_steps=4, generator=_generators(), **kw).images.float()
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
        noise = family.initial_noise(2, RES, _generators(), cond["prompt_embeds"].dtype)
        scheduler = family.scheduler("FlowMatchEulerDiscreteScheduler")
        out = denoise(family, scheduler, cond, uncond, noise, 4, guidance_scale)
        ours = family.decode(out.latents).float()
    diff = (ours - ref).abs().max().item()
    record_property("max_grey_levels", diff * 255)
    assert diff <= 1 / 255


def test_unset_guidance_flags_take_the_embedded_default_on_dev_and_the_cfg_defaults_on_klein(tiny_models):
    """Every trainer's guidance flags left unset: 4.0 (Flux2Pipeline's default) on [dev]; on the [klein] base the
    flags keep their CFG defaults; on the distilled [klein], which ignores them, 1 (what runs is what is saved)."""
    from refl_ddpo.core.families import resolve_guidance
    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers.grpo_config import GRPOConfig

    def resolved(folder):
        cfg = parse_config(GRPOConfig, ["--pretrained_model", str(tiny_models / folder)])
        assert cfg.sample_guidance_scale is None  # unset until resolved
        cfg = resolve_guidance(cfg)
        return cfg.sample_guidance_scale, cfg.validation_guidance_scale

    assert resolved(DEV) == (4.0, 4.0)
    defaults = resolved("stable-diffusion")
    assert resolved(BASE) == defaults and defaults != (1.0, 1.0)
    assert resolved(KLEIN) == (1.0, 1.0)


@pytest.mark.parametrize("folder, flags", [(DEV, ()), (BASE, ("--guidance_scale", "4.0")), (KLEIN, ())])
def test_inference_equals_the_stock_pipelines_call(folder, flags, tiny_models, stock, tmp_path):
    """inference.py within 1 grey level of the stock pipeline's call at the same seed: [dev] without
    --guidance_scale (the pipeline's default embedded 4.0), the [klein] base with CFG 4, the distilled [klein] with
    the kit's unset CFG default, which it ignores as the pipeline does its default 4."""
    import numpy as np
    from PIL import Image

    result = one_image_inference(tmp_path, tiny_models / folder, PROMPTS[0], 3, RES, SEEDS[0], *flags)
    if folder == DEV:
        assert result["config"]["guidance_scale"] == 4.0
    ref = stock(folder)(
        prompt=PROMPTS[0],
        height=RES,
        width=RES,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(SEEDS[0]),
        output_type="np",
    ).images[0]
    ours = np.asarray(Image.open(tmp_path / "out" / result["records"][0]["file"])).astype(np.float32) / 255
    assert np.abs(ours - ref).max() <= 1 / 255


def test_ddpo_on_the_distilled_klein_is_on_policy_without_a_cfg_call(tiny_models):
    """DDPO's sampler asks for guidance 5 (a CFG default) on the step-distilled [klein]: the network is fed the
    batch alone at every step (no CFG, no empty prompt), and the first PPO step is on policy."""
    torch.manual_seed(0)
    family = load_family(str(tiny_models / KLEIN))
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    fed = []
    handle = family.network.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        kw = {"num_steps": 3, "guidance_scale": 5.0, "eta": 0.7}
        _, first = ddpo_first_update(family, scheduler, params, family.empty_cond(), PROMPTS * 2, RES, **kw)
    finally:
        handle.remove()
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first
    assert fed and max(fed) == 2  # batches of 2, never doubled


# preset -> (trainer, tiny folder, (model, reward, resolution, steps, eta or None, guidance), SDE window's possible
# starts or None)
PRESETS = {
    "flow_factory_flux2": ("grpo", DEV, ("FLUX.2-dev", "clip_score:1,pickscore:0.5", 512, 8, 1.0, 4.0), 4),
    "flow_factory_flux2_klein": ("grpo", KLEIN, ("FLUX.2-klein-9B", "pickscore", 384, 4, 0.5, 1.0), 3),
    "flow_factory_flux2_klein_base": (
        "grpo",
        BASE,
        ("FLUX.2-klein-base-9B", "pickscore", 384, 8, 0.7, 4.0),
        4,
    ),
    "nft_flux2_klein_base": ("nft", BASE, ("FLUX.2-klein-base-4B", "pickscore", 384, 8, None, 1.0), None),
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_flow_factory_presets_keep_their_sources_numbers_and_train_on_the_tiny_model(
    preset, tiny_models, tmp_path, capsys, monkeypatch
):
    """Each preset as data (Flow-Factory's FLUX.2 examples, one GPU's share): its numbers, the family's default
    LoRA targets at r 64 / alpha 128, and a run of it on its tiny folder (smaller batches, one epoch, CPU
    precision) that trains a LoRA the stock pipeline loads."""
    import importlib

    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers.forward_config import NFTConfig
    from refl_ddpo.trainers.grpo_config import GRPOConfig

    trainer, folder, numbers, starts = PRESETS[preset]
    module = importlib.import_module(f"refl_ddpo.trainers.{trainer}")
    cfg = parse_config({"grpo": GRPOConfig, "nft": NFTConfig}[trainer], ["--preset", preset])
    eta = cfg.sample_eta if trainer == "grpo" else None
    assert (
        cfg.pretrained_model.split("/")[-1],
        cfg.reward,
        cfg.resolution,
        cfg.sample_num_steps,
        eta,
        cfg.sample_guidance_scale,
    ) == numbers
    assert (cfg.group_size, cfg.sample_batch_size * cfg.sample_num_batches_per_epoch) == (16, 16)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules) == (64, 128, None)  # the family's default
    assert cfg.mixed_precision == "bf16" and cfg.kl_weight == 0.0 and not cfg.global_std
    if starts is not None:  # one SDE step, its start drawn among the first `starts` steps
        assert (cfg.sde_window, cfg.sample_num_steps - cfg.train_skip_last_steps) == (1, starts)

    out = tmp_path / "preset"
    small = {"model": folder, "resolution": RES, "validation_num_steps": 2}
    train_preset_small(monkeypatch, capsys, module.main, tiny_models, out, preset, **small)
    pipe = FOLDERS[folder][0].from_pretrained(tiny_models / folder)
    pipe.set_progress_bar_config(disable=True)
    assert_lora_changes_stock_images(pipe, out, RES, part="transformer")


def test_memory_benchmark_configs_are_flux2s_published_sizes():
    """benchmarks/configs/flux2*.json (diffusers' conversion script's configs) build the published sizes on meta: the
    32 B [dev] transformer, the 4 B and 9 B [klein] ones, the 84 M VAE; and the text encoders as the pipelines'
    classes build them: Mistral-Small-3.1-24B (Mistral3ForConditionalGeneration, its vision tower included, the LM
    head tied to the embeddings as this transformers ties it), Qwen3-4B (tied head) and Qwen3-8B (own head)."""
    from benchmarks.flux2_memory import parameter_counts

    assert parameter_counts() == {
        "flux2_dev": 32_223_281_152,
        "flux2_dev_text_encoder": 23_340_272_640,
        "flux2_klein_4b": 3_875_544_576,
        "flux2_klein_4b_text_encoder": 4_022_468_096,
        "flux2_klein_9b": 9_078_581_248,
        "flux2_klein_9b_text_encoder": 8_190_735_360,
        "vae": 84_046_115,
    }


def test_memory_benchmark_text_encoders_fit_their_transformers():
    """Each text encoder's three stacked hidden states are its transformer's text width (joint_attention_dim)."""
    from benchmarks.family_memory import load_config
    from benchmarks.flux2_memory import FLUX2_MODELS

    for transformer, _, _, encoder in FLUX2_MODELS.values():
        text = load_config(encoder)
        width = text.get("text_config", text)["hidden_size"]
        assert load_config(transformer)["joint_attention_dim"] == 3 * width
