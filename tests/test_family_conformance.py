"""What every model family owes the kit, checked on the tiny random folder of each (SD 1.x, SDXL, SD3, FLUX.1,
FLUX.1 Kontext, Qwen-Image, Z-Image, FLUX.2 [dev] and [klein]) from one small spec per family: the family picked from model_index.json, the loop equal to the
stock diffusers pipeline, the reward gradient reaching every LoRA tensor and no base weight (and the LoRA saved, loaded
by the stock `load_lora_weights` and restored for a resume), DDPO's first update on policy, ReFL training a LoRA that
loads in the stock pipeline with validation and a card that name the family, and every trainer for two steps (DRaFT-K,
AlignProp, DRaFT-LV, DDPO, GRPO, DiffusionNFT, AWM) moving its LoRA and no base weight.

What only one family has (SDXL's added conditions, SD3's T5 handling, FLUX.1's packing, position ids and guidance
embedding, Qwen-Image's true-CFG rescale, ...) is tested in that family's own file."""

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers import (
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    ZImagePipeline,
)
from helpers import (
    DRAFT_CASES,
    assert_lora_changes_stock_images,
    assert_lora_moves_the_scores,
    ddpo_first_update,
    kit_frames,
    trainer_flags,
    watch_training,
)

from refl_ddpo.core.families import family_class, load_family
from refl_ddpo.core.lora import add_lora, load_lora_into_unet, save_lora
from refl_ddpo.core.sampling import denoise

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a photo of a cat", "a red bird"]
RES = 32
SEEDS = [3, 7]  # one CPU generator per image, as the inference scripts draw


@dataclass(frozen=True)
class Loop:
    """One comparison with the stock pipeline: the sampler (a diffusers class name), the guidance, the steps, the
    resolution, the folder (default: the family's)."""

    sampler: str
    guidance_scale: float
    steps: int = 4
    resolution: int = RES
    model: str | None = None


@dataclass(frozen=True)
class Spec:
    """A family as the conformance tests see it."""

    name: str  # ModelFamily.name, and what the run, the validation files and the card name it by
    model: str  # its tiny folder in `tiny_models`
    pipeline: type  # the stock diffusers pipeline
    part: str  # the network's name in the pipeline, the LoRA file's key prefix: "unet" or "transformer"
    native_resolution: int
    loops: tuple[Loop, ...]
    tolerance: float = 1 / 255  # of the loop against the stock pipeline, in [0, 1] pixel values
    true_cfg: bool = (
        False  # CFG is the pipeline's true_cfg_scale against negative_prompt="" (not guidance_scale)
    )
    embedded_guidance: bool = False  # guidance goes into the network (no negative prompt)
    # the stock call's guidance arguments for the kit's guidance scale, where its own scale means another thing
    stock_guidance: object = None  # float -> dict
    stock_kwargs: dict = field(default_factory=dict)  # from_pretrained's
    # the reward-gradient test: its sampler and guidance; LoRA modules that must be among the defaults; the LoRA
    # tensors (by name prefix, given the network) that get no gradient because their output reaches nothing
    grad_sampler: str = "FlowMatchEulerDiscreteScheduler"
    grad_guidance: float = 1.0
    lora_parts: tuple[str, ...] = ()
    dead_lora: object = None  # network -> name prefixes
    # DDPO's first update: its guidance and eta, and the shapes (or their leading sizes) of sample buffers
    ddpo_guidance: float = 5.0
    ddpo_eta: float = 0.7
    buffers: dict = field(default_factory=dict)
    # the trainers' flags on this family (beside the common ones below); ReFL's rollout sampler as the run prints it
    refl_flags: dict = field(default_factory=dict)
    policy_flags: dict = field(default_factory=dict)
    refl_sampler: str = "FlowMatchEulerDiscreteScheduler"
    card: tuple[str, str] = ("", "")  # in the model card: the family's line, its tag line


class FluxKontextPipeline(diffusers.FluxKontextPipeline):
    """The stock Kontext pipeline drawing at the height and width it is given: the stock one rescales them to
    `max_area` (1024 x 1024 px by default), here height x width unless given."""

    def __call__(self, *args, height=None, width=None, **kwargs):
        if height and width:
            kwargs.setdefault("max_area", height * width)
        return super().__call__(*args, height=height, width=width, **kwargs)


def _sd3_dead(network) -> tuple[str, ...]:
    # the last block drops its text stream (context_pre_only), so its text queries reach nothing
    return (f"transformer_blocks.{len(network.transformer_blocks) - 1}.attn.add_q_proj.",)


def _qwen_dead(network) -> tuple[str, ...]:
    # the last block's text-stream output is discarded (only the image tokens reach proj_out): its text queries,
    # text output projection and text MLP get no gradient
    last = f"transformer_blocks.{len(network.transformer_blocks) - 1}."
    return (f"{last}attn.add_q_proj", f"{last}attn.to_add_out", f"{last}txt_mlp")


FAMILIES = {
    "sd": Spec(
        name="sd",
        model="stable-diffusion",
        pipeline=StableDiffusionPipeline,
        part="unet",
        native_resolution=32,
        loops=tuple(Loop(s, g, steps=6) for s in ("DDIMScheduler", "DDPMScheduler") for g in (1.0, 5.0)),
        tolerance=1e-5,
        grad_sampler="DDIMScheduler",
        grad_guidance=5.0,
        ddpo_eta=1.0,
        refl_sampler="DDPMScheduler",
        card=("| model family | Stable Diffusion 1.x", "- stable-diffusion\n"),
    ),
    "sdxl": Spec(
        name="sdxl",
        model="tiny-sdxl",
        pipeline=StableDiffusionXLPipeline,
        part="unet",
        native_resolution=32,
        loops=tuple(
            Loop(s, g, steps=6) for s in ("EulerDiscreteScheduler", "DDIMScheduler") for g in (1.0, 5.0)
        ),
        stock_kwargs={"add_watermarker": False},
        refl_flags={"scheduler": "ddim"},  # the deterministic rollout (SD 1.x's runs take DDPM, the default)
        grad_sampler="DDIMScheduler",
        grad_guidance=5.0,
        ddpo_eta=1.0,
        buffers={"prompt_embeds": (4, 77, 64), "pooled_prompt_embeds": (4, 32)},
        refl_sampler="DDIMScheduler",
        card=("| model family | Stable Diffusion XL", "stable-diffusion-xl"),
    ),
    "sd3": Spec(
        name="sd3",
        model="tiny-sd3",
        pipeline=StableDiffusion3Pipeline,
        part="transformer",
        native_resolution=32,
        loops=tuple(Loop("FlowMatchEulerDiscreteScheduler", g, steps=6) for g in (1.0, 5.0)),
        lora_parts=("add_q_proj", "to_add_out"),
        dead_lora=_sd3_dead,
        ddpo_guidance=4.5,
        card=("| model family | Stable Diffusion 3", "- stable-diffusion-3\n"),
    ),
    "flux": Spec(
        name="flux",
        model="tiny-flux",
        pipeline=FluxPipeline,
        part="transformer",
        native_resolution=256,  # 128 latent pixels x the VAE's 2 (the pipeline's default height)
        loops=(
            Loop("FlowMatchEulerDiscreteScheduler", 3.5),
            Loop("FlowMatchEulerDiscreteScheduler", 1.0),
            Loop("FlowMatchEulerDiscreteScheduler", 0.0, model="tiny-flux-schnell"),
        ),
        embedded_guidance=True,
        grad_guidance=3.5,
        lora_parts=(
            "single_transformer_blocks.0.proj_mlp",
            "single_transformer_blocks.0.attn.to_q",
            "to_add_out",
        ),
        ddpo_guidance=3.5,
        buffers={
            "prompt_embeds": (4, 512, 64),
            "pooled_prompt_embeds": (4, 32),
            "next_latents": (4, 3, 16, 16, 16),  # (N, S, C, h, w): unpacked, as SD3's
        },
        refl_flags={"guidance_scale": 3.5, "validation_guidance_scale": 3.5},
        policy_flags={"sample_guidance_scale": 3.5},
        card=("| model family | FLUX.1", "- flux\n"),
    ),
    # FLUX.1 Kontext without a source image (drawn from the prompt, as its pipeline without `image`); its edits are
    # tested in tests/test_flux_kontext.py
    "flux_kontext": Spec(
        name="flux_kontext",
        model="tiny-flux-kontext",
        pipeline=FluxKontextPipeline,
        part="transformer",
        native_resolution=256,
        loops=(Loop("FlowMatchEulerDiscreteScheduler", 3.5),),
        embedded_guidance=True,
        grad_guidance=3.5,
        lora_parts=("single_transformer_blocks.0.proj_mlp", "to_add_out"),
        ddpo_guidance=3.5,
        buffers={"prompt_embeds": (4, 512, 64), "next_latents": (4, 3, 16, 16, 16)},
        refl_flags={"guidance_scale": 3.5, "validation_guidance_scale": 3.5},
        policy_flags={"sample_guidance_scale": 3.5},
        card=("| model family | FLUX.1 Kontext", "- flux-kontext\n"),
    ),
    "qwen_image": Spec(
        name="qwen_image",
        model="tiny-qwen-image",
        pipeline=QwenImagePipeline,
        part="transformer",
        native_resolution=256,
        # no CFG, and true CFG 4 at 32 px and at 48 px (another image token count: another shift mu)
        loops=(
            Loop("FlowMatchEulerDiscreteScheduler", 1.0),
            Loop("FlowMatchEulerDiscreteScheduler", 4.0),
            Loop("FlowMatchEulerDiscreteScheduler", 4.0, resolution=48),
        ),
        true_cfg=True,
        grad_guidance=4.0,
        lora_parts=("img_mlp.net.0.proj", "txt_mlp.net.2", "attn.add_q_proj", "attn.to_out.0"),
        dead_lora=_qwen_dead,
        ddpo_guidance=4.0,
        buffers={"prompt_embeds": (4,), "prompt_embeds_mask": (4,), "next_latents": (4, 3, 16, 16, 16)},
        refl_flags={"guidance_scale": 4.0, "validation_guidance_scale": 4.0},
        policy_flags={"sample_guidance_scale": 4.0},
        card=("| model family | Qwen-Image", "- qwen-image\n"),
    ),
    "z_image": Spec(
        name="z_image",
        model="tiny-z-image",
        pipeline=ZImagePipeline,
        part="transformer",
        native_resolution=1024,  # the pipeline's default height
        # no CFG and CFG 5 (the pipeline's 4) at 32 and 48 px on the base; the Turbo without CFG (its own shift)
        loops=(
            Loop("FlowMatchEulerDiscreteScheduler", 1.0),
            Loop("FlowMatchEulerDiscreteScheduler", 5.0),
            Loop("FlowMatchEulerDiscreteScheduler", 5.0, resolution=48),
            Loop("FlowMatchEulerDiscreteScheduler", 1.0, model="tiny-z-image-turbo"),
        ),
        tolerance=1e-5,
        stock_guidance=lambda s: {"guidance_scale": s - 1.0},  # text + g (text - uncond), CFG off at g = 0
        grad_guidance=5.0,
        lora_parts=(
            "noise_refiner.0.attention.to_q",
            "context_refiner.0.feed_forward.w2",
            "layers.1.attention.to_out.0",
        ),
        ddpo_guidance=5.0,
        buffers={"prompt_embeds": (4,), "prompt_embeds_mask": (4,), "next_latents": (4, 3, 16, 16, 16)},
        refl_flags={"guidance_scale": 5.0, "validation_guidance_scale": 5.0},
        policy_flags={"sample_guidance_scale": 5.0},
        card=("| model family | Z-Image", "- z-image\n"),
    ),
    "flux2": Spec(
        name="flux2",
        model="tiny-flux2",
        pipeline=Flux2Pipeline,
        part="transformer",
        native_resolution=256,
        # the embedded guidance at the pipeline's default and off, at 32 px and at 48 px (another shift mu)
        loops=(
            Loop("FlowMatchEulerDiscreteScheduler", 4.0),
            Loop("FlowMatchEulerDiscreteScheduler", 1.0, resolution=48),
        ),
        embedded_guidance=True,
        grad_guidance=4.0,
        lora_parts=("ff_context.linear_in", "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "to_add_out"),
        ddpo_guidance=4.0,
        buffers={"prompt_embeds": (4, 512, 48), "next_latents": (4, 3, 32, 8, 8)},  # patchified latents
        refl_flags={"guidance_scale": 4.0, "validation_guidance_scale": 4.0},
        policy_flags={"sample_guidance_scale": 4.0},
        card=("| model family | FLUX.2 [dev]", "- flux2\n"),
    ),
    "flux2_klein": Spec(
        name="flux2_klein",
        model="tiny-flux2-klein-base",
        pipeline=Flux2KleinPipeline,
        part="transformer",
        native_resolution=256,
        # the base without and with CFG; the step-distilled model, whose pipeline ignores the guidance scale
        loops=(
            Loop("FlowMatchEulerDiscreteScheduler", 1.0),
            Loop("FlowMatchEulerDiscreteScheduler", 4.0, resolution=48),
            Loop("FlowMatchEulerDiscreteScheduler", 4.0, model="tiny-flux2-klein"),
        ),
        grad_guidance=4.0,
        lora_parts=("ff.linear_out", "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "add_v_proj"),
        ddpo_guidance=4.0,
        buffers={"prompt_embeds": (4, 512, 48), "next_latents": (4, 3, 32, 8, 8)},
        refl_flags={"guidance_scale": 4.0, "validation_guidance_scale": 4.0},
        policy_flags={"sample_guidance_scale": 4.0},
        card=("| model family | FLUX.2 [klein]", "- flux2-klein\n"),
    ),
}
NAMES = list(FAMILIES)


def _generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def _stock(spec: Spec, path: Path):
    pipe = spec.pipeline.from_pretrained(path, **spec.stock_kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def stock(tiny_models):
    """name -> its stock pipeline (loaded once, on first use)."""
    pipes = {}

    def get(spec: Spec, model: str | None = None):
        model = model or spec.model
        if model not in pipes:
            pipes[model] = _stock(spec, tiny_models / model)
        return pipes[model]

    return get


# ---- loading ----


@pytest.mark.parametrize("name", NAMES)
def test_load_family_picks_the_family_from_model_index(name, tiny_models):
    spec = FAMILIES[name]
    family = load_family(str(tiny_models / spec.model))
    cls = family_class(spec.pipeline.__name__)
    assert type(family) is cls and family.name == spec.name
    assert family.native_resolution == spec.native_resolution
    assert not any(p.requires_grad for p in family.network.parameters())


# ---- the loop against the stock pipeline ----


def _cfg(spec: Spec, guidance_scale: float) -> tuple[bool, dict]:
    """(whether our loop encodes a negative prompt, the stock call's guidance arguments)."""
    if spec.embedded_guidance:
        return False, {"guidance_scale": guidance_scale}
    if spec.stock_guidance is not None:
        return guidance_scale > 1, spec.stock_guidance(guidance_scale)
    if spec.true_cfg:
        cfg = {"negative_prompt": "", "true_cfg_scale": guidance_scale} if guidance_scale > 1 else {}
        return guidance_scale > 1, cfg
    return guidance_scale > 1, {"guidance_scale": guidance_scale}


@pytest.mark.parametrize(
    "name, loop", [(name, loop) for name in NAMES for loop in FAMILIES[name].loops], ids=str
)
def test_loop_reproduces_stock_pipeline(name, loop, stock, record_property):
    spec = FAMILIES[name]
    pipe = stock(spec, loop.model)
    family = family_class(spec.pipeline.__name__)(pipe)
    negative, cfg = _cfg(spec, loop.guidance_scale)
    original = pipe.scheduler
    try:
        pipe.scheduler = family.scheduler(loop.sampler)
        ref = pipe(
            prompt=list(PROMPTS),  # by name (FLUX.2's pipelines take an image first), a copy (ZImagePipeline
            # writes its chat template into the list it is given)
            num_inference_steps=loop.steps,
            height=loop.resolution,
            width=loop.resolution,
            generator=_generators(),
            output_type="pt",
            **cfg,
        ).images
    finally:
        pipe.scheduler = original
    generators = _generators()  # as the pipeline: the noise, then a stochastic sampler's steps (DDPM) draw
    with torch.no_grad():
        cond, uncond = family.encode_prompts(PROMPTS, with_negative=negative)
        noise = family.initial_noise(2, loop.resolution, generators, cond["prompt_embeds"].dtype)
        scheduler = family.scheduler(loop.sampler)
        out = denoise(
            family, scheduler, cond, uncond, noise, loop.steps, loop.guidance_scale, generator=generators
        )
        ours = family.decode(out.latents)
    assert ours.shape == ref.shape == (2, 3, loop.resolution, loop.resolution)
    diff = (ours - ref).abs().max().item()
    record_property("max_grey_levels", diff * 255)
    assert diff <= spec.tolerance


# ---- the kit's frames between a loop and the network ----


@pytest.mark.parametrize("name", NAMES)
def test_denoise_reaches_the_network_in_two_kit_frames(name, tiny_models):
    """A trainer's loop reaches the network in at most 3 of the kit's frames; the core's share is 2: `denoise` calls
    `family.predict`, which calls the network itself. So without CFG, with CFG (one call on the doubled batch, or
    two calls for true CFG: FLUX.1's turned on here) and with a grad step under `checkpoint` (torch's frames, not
    counted); every step feeds the network 2 images, 4 with CFG. The counter itself: `predict` called directly is
    1 frame, and a loop name that is not on the stack fails."""
    spec = FAMILIES[name]
    family = load_family(str(tiny_models / spec.model))
    if spec.embedded_guidance:
        family.true_cfg_scale = 2.0  # FLUX.1's true CFG against the empty prompt (off by default)
    network, here = family.network, inspect.currentframe().f_code.co_name
    fed = []  # images per network call
    handle = network.register_forward_pre_hook(
        # the batch: a tensor's first dim, or the length of Z-Image's list of latents
        lambda _, args, kwargs: fed.append(len(args[0] if args else kwargs["hidden_states"])),
        with_kwargs=True,
    )
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    noise = family.initial_noise(2, RES, _generators(), cond["prompt_embeds"].dtype)
    scheduler = family.policy_scheduler()
    modes = {"no CFG": (None, 1.0, {}), "CFG": (uncond, 4.0, {})}
    modes["CFG, checkpointed grad step"] = (uncond, 4.0, {"grad_steps": {1}, "checkpoint_grad_steps": True})
    try:
        for mode, (negative, guidance, kw) in modes.items():
            fed.clear()
            run = functools.partial(denoise, family, scheduler, cond, negative, noise, 2, guidance, **kw)
            assert kit_frames(network, run, here) == 2, mode
            assert sum(fed) == 2 * (2 if negative is None else 4), (mode, fed)
        t = scheduler.timesteps[0]
        with torch.no_grad():
            direct = functools.partial(family.predict, noise, t, scheduler, cond, uncond, 4.0)
            assert kit_frames(network, direct, here) == 1
            with pytest.raises(AssertionError, match="no frame named 'no_such_loop'"):
                kit_frames(network, direct, "no_such_loop")
    finally:
        handle.remove()


# ---- the LoRA core: the reward gradient, the saved LoRA in the stock pipeline, a resume ----


@pytest.mark.parametrize("name", NAMES)
def test_reward_gradient_reaches_every_lora_tensor_and_no_base_weight_and_the_lora_loads(
    name, tiny_models, stock, tmp_path
):
    """ReFL's path (no grad to step k, one step with grad, predicted x0, VAE decode) on the family's default LoRA
    targets: every LoRA tensor gets gradient (but those whose output reaches nothing), the base weights (network,
    VAE, text encoders) get none and stay bit-identical after an AdamW step that moves every LoRA tensor. The LoRA
    saved in diffusers' format loads into the stock pipeline, each matrix into its layer with its value and alpha,
    and changes its images; a fresh adapter restored from the file (a resume) equals it."""
    from helpers import base_weights

    spec = FAMILIES[name]
    family = load_family(str(tiny_models / spec.model))
    network = family.network
    params = add_lora(network, 4, 8, family.lora_target_modules, init="random")  # B != 0: A gets gradient too
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    names = [n for n, _ in network.named_parameters() if "lora_A" in n]
    for part in spec.lora_parts:
        assert any(part in n for n in names), part
    frozen = base_weights(family)
    before = {n: p.detach().clone() for n, p in frozen.items()}
    lora_before = {n: p.detach().clone() for n, p in network.named_parameters() if "lora_" in n}
    cond, uncond = family.encode_prompts(
        PROMPTS, with_negative=spec.grad_guidance > 1 and not spec.embedded_guidance
    )
    noise = family.initial_noise(2, RES, _generators(), torch.float32)
    scheduler = family.scheduler(spec.grad_sampler)
    out = denoise(family, scheduler, cond, uncond, noise, 4, spec.grad_guidance, grad_steps={2}, stop_at=2)
    family.decode(out.pred_original_sample).mean().backward()
    dead = spec.dead_lora(network) if spec.dead_lora else ()
    reached = set()
    for n, p in network.named_parameters():
        if "lora_" in n:
            if p.grad is not None and p.grad.abs().sum() > 0:
                reached.add(n)
            assert (n in reached) != any(n.startswith(d) for d in dead), n
    assert not any(p.requires_grad for p in frozen.values()) and all(p.grad is None for p in frozen.values())
    torch.optim.AdamW(params, lr=1e-2).step()
    still = [n for n, p in network.named_parameters() if n in reached and torch.equal(lora_before[n], p)]
    assert not still, f"LoRA tensors with gradient that did not move: {still[:3]}"
    changed = [n for n, p in frozen.items() if not torch.equal(before[n], p)]
    assert not changed, f"base weights changed: {changed[:3]}"

    save_lora(network, tmp_path / "lora", config={"lora_rank": 4})
    pipe = assert_lora_changes_stock_images(
        _stock(spec, tiny_models / spec.model), tmp_path / "lora", RES, 4, spec.part
    )
    net = getattr(pipe, spec.part)
    adapter = net.active_adapters()[0]
    loaded = {n.replace(f".{adapter}.", ".default."): p for n, p in net.named_parameters() if "lora_" in n}
    ours = {n: p for n, p in network.named_parameters() if "lora_" in n}
    assert loaded.keys() == ours.keys()  # every matrix found its layer (none dropped by the loader)
    for n, p in ours.items():
        torch.testing.assert_close(loaded[n], p)
    assert net.peft_config[adapter].lora_alpha == 8

    fresh = load_family(str(tiny_models / spec.model))
    add_lora(fresh.network, 4, 8, family.lora_target_modules)
    load_lora_into_unet(fresh.network, tmp_path / "lora")
    restored = dict(fresh.network.named_parameters())
    assert all(torch.equal(restored[n], p) for n, p in ours.items())


# ---- DDPO's first update ----


@pytest.mark.parametrize("name", NAMES)
def test_ddpo_first_update_is_on_policy_through_the_sample_buffers(name, tiny_models):
    """DDPO samples with the family's policy sampler (DDIM on the UNets, Flow-GRPO's SDE step on the flow models);
    its sample buffers carry the family's conditioning and latents through stacking, shuffling and slicing; the first
    PPO step recomputes the sampler's log-probs (CFG against empty_cond as in sampling): approx KL 0, nothing
    clipped."""
    spec = FAMILIES[name]
    torch.manual_seed(0)
    family = load_family(str(tiny_models / spec.model))
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    assert type(scheduler).__name__ == (
        "DDIMScheduler" if spec.part == "unet" else "FlowMatchEulerDiscreteScheduler"
    )
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    kw = {"num_steps": 3, "guidance_scale": spec.ddpo_guidance, "eta": spec.ddpo_eta}
    samples, first = ddpo_first_update(family, scheduler, params, family.empty_cond(), PROMPTS * 4, RES, **kw)
    for key, shape in spec.buffers.items():
        assert tuple(samples[key].shape[: len(shape)]) == shape, (key, samples[key].shape)
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


# ---- the trainers, in this process ----


def _refl_flags(spec: Spec, tiny_models, out: Path, *extra: str, **flags) -> list[str]:
    recipe = {"num_inference_steps": 4, "k_lo": 2, "k_hi": 3} | spec.refl_flags
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=spec.model,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        device="cpu",
        report_to="none",
        **(recipe | flags),
    )


def _policy_flags(spec: Spec, tiny_models, out: Path, **flags) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        model=spec.model,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",  # prompts of unequal lengths: an epoch's batches concatenate padded
        sample_num_steps=3,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=2,
        device="cpu",
        report_to="none",
        **(spec.policy_flags | flags),
    )


@pytest.mark.parametrize("name", NAMES)
def test_refl_trains_a_lora_that_loads_in_the_stock_pipeline_and_the_card_names_the_family(
    name, tiny_models, tmp_path, capsys, monkeypatch
):
    """ReFL (ImageReward, the KL term on) for 2 steps with validation: the LoRA moved and no base weight did, it
    changes the stock pipeline's images, the run, the validation files and the model card name the family, and the
    before / after inference with its scores and the scored comparison see it."""
    from refl_ddpo.run.model_card import CARD_NAME
    from refl_ddpo.run.validation import validation_files
    from refl_ddpo.trainers import refl

    spec = FAMILIES[name]
    watch = watch_training(monkeypatch)
    prompts = tmp_path / "validation.txt"
    prompts.write_text("a photo of a cat\n")
    out = tmp_path / "refl"
    flags = {"validation_prompts_file": prompts, "num_validation_images": 1, "validation_num_steps": 3}
    refl.main(_refl_flags(spec, tiny_models, out, max_train_steps=2, kl_weight=1, **flags))
    printed = capsys.readouterr().out
    assert f"model family: {spec.name}" in printed and f"sampler: {spec.refl_sampler}" in printed
    watch.assert_lora_moved_and_base_not(out)
    watch.assert_loop_near_the_network()
    assert_lora_changes_stock_images(_stock(spec, tiny_models / spec.model), out, RES, part=spec.part)
    records = validation_files(out)
    assert [r["count"] for r in records] == [0, 2] and {r["family"] for r in records} == {spec.name}
    card = (out / CARD_NAME).read_text()
    assert spec.card[0] in card and spec.card[1] in card

    guidance = spec.refl_flags.get("guidance_scale")
    extra = ["--resolution", str(RES)] + (["--guidance_scale", str(guidance)] if guidance else [])
    assert_lora_moves_the_scores(tiny_models, tiny_models / spec.model, out, prompts, tmp_path, *extra)


@pytest.mark.parametrize("flags, described", DRAFT_CASES)
@pytest.mark.parametrize("name", NAMES)
def test_draft_k_alignprop_and_draft_lv_run_two_steps(
    name, flags, described, tiny_models, tmp_path, capsys, monkeypatch
):
    from refl_ddpo.trainers import refl

    spec = FAMILIES[name]
    watch = watch_training(monkeypatch)
    out = tmp_path / "draft"
    refl.main(_refl_flags(spec, tiny_models, out, *flags, max_train_steps=2))
    assert described in capsys.readouterr().out
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    watch.assert_lora_moved_and_base_not(out)
    watch.assert_loop_near_the_network()


@pytest.mark.parametrize("trainer", ["ddpo", "grpo", "nft", "awm"])
@pytest.mark.parametrize("name", NAMES)
def test_trainer_runs_two_epochs(name, trainer, tiny_models, tmp_path, capsys, monkeypatch):
    """DDPO, GRPO (KL to the base on), DiffusionNFT and AWM for two epochs: the LoRA moved and no base weight did,
    every network call of the loop was at most 3 kit frames below it; DDPO's, GRPO's and DiffusionNFT's load in the
    stock pipeline and change its images."""
    spec = FAMILIES[name]
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    extra = {"ddpo": {}, "grpo": {"group_size": 2, "beta": "0.04"}}.get(trainer, {"group_size": 2})
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(
        _policy_flags(spec, tiny_models, out, **extra)
    )
    assert "epoch 2/2" in capsys.readouterr().out
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    watch.assert_lora_moved_and_base_not(out)
    watch.assert_loop_near_the_network()
    if trainer in ("ddpo", "grpo", "nft"):
        assert_lora_changes_stock_images(_stock(spec, tiny_models / spec.model), out, RES, part=spec.part)
