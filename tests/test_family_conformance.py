"""What every model family owes the kit, checked on the tiny random folder of each (tests/family_specs.py: SD 1.x,
SDXL, SD3, FLUX.1, FLUX.1 Kontext, Qwen-Image, Z-Image, FLUX.2 [dev] and [klein]): the family picked from
model_index.json, the loop equal to the stock diffusers pipeline, the kit's frames between a loop and the network, the
reward gradient reaching every LoRA tensor and no base weight (and the LoRA saved, loaded by the stock
`load_lora_weights` and restored for a resume), DDPO's first update on policy. The trainers on every family:
tests/test_family_trainers.py.

What only one family has (SDXL's added conditions, SD3's T5 handling, FLUX.1's packing, position ids and guidance
embedding, Qwen-Image's true-CFG rescale, ...) is tested in that family's own file."""

import functools
import inspect

import pytest
import torch
from family_specs import FAMILIES, NAMES, PROMPTS, RES, Spec, seeded_generators, stock_pipeline
from helpers import assert_lora_changes_stock_images, ddpo_first_update, kit_frames

from refl_ddpo.core.families import family_class, load_family
from refl_ddpo.core.lora import add_lora, load_lora_into_unet, save_lora
from refl_ddpo.core.sampling import denoise

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


@pytest.fixture(scope="module")
def stock(tiny_models):
    """name -> its stock pipeline (loaded once, on first use)."""
    pipes = {}

    def get(spec: Spec, model: str | None = None):
        model = model or spec.model
        if model not in pipes:
            pipes[model] = stock_pipeline(spec, tiny_models / model)
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
            generator=seeded_generators(),
            output_type="pt",
            **cfg,
        ).images
    finally:
        pipe.scheduler = original
    generators = (
        seeded_generators()
    )  # as the pipeline: the noise, then a stochastic sampler's steps (DDPM) draw
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
    noise = family.initial_noise(2, RES, seeded_generators(), cond["prompt_embeds"].dtype)
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
    noise = family.initial_noise(2, RES, seeded_generators(), torch.float32)
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
        stock_pipeline(spec, tiny_models / spec.model), tmp_path / "lora", RES, 4, spec.part
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
