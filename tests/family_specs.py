"""The model families as tests/test_family_conformance.py and test_family_trainers.py see them: one small spec per
family (SD 1.x, SDXL, SD3, FLUX.1, FLUX.1 Kontext, Qwen-Image, Z-Image, FLUX.2 [dev] and [klein]) on its tiny random
folder, the prompts, seeds and resolution the checks draw with, and the stock pipeline of a spec."""

from dataclasses import dataclass, field
from pathlib import Path

import diffusers
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


def seeded_generators():
    return [torch.Generator().manual_seed(s) for s in SEEDS]


def stock_pipeline(spec: Spec, path: Path):
    pipe = spec.pipeline.from_pretrained(path, **spec.stock_kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe
