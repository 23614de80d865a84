"""Model families: chosen from model_index.json's `_class_name`; see `base.ModelFamily` for what one provides."""

from __future__ import annotations

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families.base import TEXT_ENCODER_NAMES, Cond, ModelFamily, cond_cat, cond_expand

__all__ = [
    "Cond",
    "ModelFamily",
    "cond_cat",
    "cond_expand",
    "family_class",
    "load_family",
    "resolve_guidance",
    "resolve_lora_targets",
]

# model_index.json _class_name -> (module, class); a static table, so choosing a family imports nothing heavy.
FAMILIES = {
    "StableDiffusionPipeline": ("refl_ddpo.core.families.sd", "StableDiffusion"),
    "StableDiffusion3Pipeline": ("refl_ddpo.core.families.sd3", "StableDiffusion3"),
    "StableDiffusionXLPipeline": ("refl_ddpo.core.families.sdxl", "StableDiffusionXL"),
    "FluxPipeline": ("refl_ddpo.core.families.flux", "Flux"),
    "FluxKontextPipeline": ("refl_ddpo.core.families.flux_kontext", "FluxKontext"),
    "QwenImagePipeline": ("refl_ddpo.core.families.qwen_image", "QwenImage"),
    "QwenImageEditPlusPipeline": ("refl_ddpo.core.families.qwen_image_edit", "QwenImageEditPlus"),
    "ZImagePipeline": ("refl_ddpo.core.families.z_image", "ZImage"),
    "Flux2Pipeline": ("refl_ddpo.core.families.flux2", "Flux2"),
    "Flux2KleinPipeline": ("refl_ddpo.core.families.flux2", "Flux2Klein"),
    "WanPipeline": ("refl_ddpo.core.families.wan", "Wan"),
    "WanImageToVideoPipeline": ("refl_ddpo.core.families.wan_i2v", "WanI2V"),
}


def family_class(pipeline_class: str) -> type[ModelFamily]:
    import importlib

    if pipeline_class not in FAMILIES:
        known = ", ".join(FAMILIES)
        raise UserError(
            f"model_index.json names {pipeline_class or 'no pipeline class'}; this kit trains {known} "
            "folders."
        )
    module, name = FAMILIES[pipeline_class]
    return getattr(importlib.import_module(module), name)


# families whose prompt is read by a decoder LLM, not a T5: --drop_t5 is refused for them
NO_T5 = {
    "QwenImagePipeline": ("a Qwen-Image", "Qwen2.5-VL"),
    "QwenImageEditPlusPipeline": ("a Qwen-Image-Edit-Plus", "Qwen2.5-VL"),
    "ZImagePipeline": ("a Z-Image", "Qwen3"),
    "Flux2Pipeline": ("a FLUX.2", "Mistral Small 3.1"),
    "Flux2KleinPipeline": ("a FLUX.2", "Qwen3"),
}


def load_family(
    name: str,
    dtype=None,
    device="cpu",
    drop_t5: bool = False,
    network_on_host: bool = False,
    offload_text_encoders: bool = False,
    shard_text_encoders: bool = False,
    expert: str | None = None,
    pair_experts: bool = True,
) -> ModelFamily:
    """Load the model at `name` (local folder or hub id), frozen, as its family's adapter (`drop_t5`: SD3 without
    its T5 text encoder; refused for FLUX.1, which needs its T5). `network_on_host`: the denoising network stays on
    the CPU (--fsdp: `prepare` puts only its shards on `device`); the other parts go to `device`.
    `offload_text_encoders`: the text encoders stay on the CPU and visit `device` only while they encode
    (`ModelFamily.text_encoders_on_device`); composes with `network_on_host`. `shard_text_encoders`
    (--fsdp_shard_text_encoders; torch.distributed must run): they are loaded on the host, then sharded per block over
    the processes (`refl_ddpo.core.sharding.shard_frozen`), each process' shard on `device`. `expert`: the network a Wan model trains (`Wan.train_expert`, with `pair_experts`)."""
    from refl_ddpo.core.models import load_pipeline, pipeline_class_name

    pipeline_class = pipeline_class_name(name)
    cls = family_class(pipeline_class).variant(name)
    if drop_t5 and pipeline_class in ("FluxPipeline", "FluxKontextPipeline"):
        raise UserError(
            f"--drop_t5: {name} is a FLUX.1 model, whose prompt is read by its T5 (CLIP gives only a pooled vector), "
            "so it cannot run without it; leave --drop_t5 off."
        )
    if drop_t5 and pipeline_class in NO_T5:
        what, reader = NO_T5[pipeline_class]
        raise UserError(f"--drop_t5: {name} is {what} model, which has no T5 ({reader} reads its prompt).")
    wan_expert = hasattr(cls, "train_expert") and expert in ("transformer", "transformer_2")
    trained = (
        expert if wan_expert else cls.network_name
    )  # the network --fsdp shards (Wan: the expert it trains)
    on_host = ((trained,) if network_on_host else ()) + (
        TEXT_ENCODER_NAMES if offload_text_encoders or shard_text_encoders else ()
    )
    family = cls(load_pipeline(name, dtype, device, pipeline_class, drop_t5=drop_t5, on_host=on_host))
    if shard_text_encoders:
        from refl_ddpo.core.sharding import shard_frozen

        for module in family.text_encoders():
            shard_frozen(module)
    if offload_text_encoders:
        family.text_encoder_device = device
    if expert is not None and hasattr(family, "train_expert"):  # Wan: the expert the trainers adapt
        family.train_expert(expert, pair_experts)
    return family


def check_edit_data(name: str, edit_data: str | None) -> None:
    """--edit_data (if given) needs a model that edits (FLUX.1 Kontext, Qwen-Image-Edit-Plus, FLUX.2) or animates
    an image (Wan image-to-video, which needs it), and readable edits: one line naming what is wrong otherwise,
    before any weights load (an editing run's --validation_prompts_file is edit records too: run.validation)."""
    from refl_ddpo.core.edit_data import load_edit_data
    from refl_ddpo.core.models import model_index, pipeline_class_name

    pipeline_class = pipeline_class_name(name)
    cls = family_class(pipeline_class)
    if getattr(cls, "needs_source_images", False):
        if not edit_data:
            raise UserError(
                f"{name} is an image-to-video model ({pipeline_class}): give each prompt its first frame with "
                "--edit_data FILE (JSONL lines of {'image': path, 'instruction': prompt})."
            )
        if model_index(name).get("expand_timesteps"):
            raise UserError(
                f"--edit_data: {name} is Wan 2.2 TI2V-5B-like (expand_timesteps), whose image-to-video is not "
                "supported; use a Wan 2.1 / 2.2 I2V model."
            )
    if not edit_data:
        return
    if not cls.edits_images:
        raise UserError(
            f"--edit_data: {name} is a {pipeline_class} folder, which draws from the prompt alone and would ignore "
            "the source images; edit with a FLUX.1 Kontext, Qwen-Image-Edit-Plus or FLUX.2 model, or animate "
            "with a Wan image-to-video one."
        )
    load_edit_data(edit_data)  # every image opened, its size checked


def resolve_lora_targets(cfg):
    """The config with unset --lora_target_modules resolved to the model family's default LoRA targets (chosen from
    model_index.json, before any weights load): a copy, the config itself stays as it was."""
    if cfg.lora_target_modules is not None:
        return cfg
    import dataclasses

    from refl_ddpo.core.models import pipeline_class_name

    targets = list(family_class(pipeline_class_name(cfg.pretrained_model)).lora_target_modules)
    return dataclasses.replace(cfg, lora_target_modules=targets)


def resolve_guidance(cfg, family: type[ModelFamily] | None = None):
    """The config with every guidance flag left unset (None; a field made by `refl_ddpo.run.config.guidance_field`)
    resolved to the model family's default for it (`ModelFamily.default_guidance_scale`): the flag's CFG default on
    SD 1.x/2.x, SDXL and SD3, the pipeline's embedded guidance (3.5) on FLUX.1, 1 (no CFG) on Z-Image-Turbo. A value
    the user set is kept. The family is chosen from model_index.json (and `ModelFamily.variant`'s configs) before any
    weights load, unless given. A copy; the config stays as it was."""
    import dataclasses

    unset = {
        f.name: f.metadata["cfg_default"]
        for f in dataclasses.fields(cfg)
        if "cfg_default" in f.metadata and getattr(cfg, f.name) is None
    }
    if not unset:
        return cfg
    if family is None:
        from refl_ddpo.core.models import pipeline_class_name

        family = family_class(pipeline_class_name(cfg.pretrained_model)).variant(cfg.pretrained_model)
    return dataclasses.replace(cfg, **{n: family.default_guidance_scale(d) for n, d in unset.items()})
