"""The models the benchmark runs: built from config files with random weights (speed and memory do not depend on
the values), at the real SD v1.5 / ImageReward size or at refl_ddpo.testing.tiny's, and set up as the trainers set them
up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.harness import Bench

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
REAL_CONFIG_FILES = {
    "unet": "sd15_unet.json",
    "vae": "sd15_vae.json",
    "text_encoder": "sd15_text_encoder.json",
    "reward": "imagereward_med_config.json",
}


# SD3.5 Medium (stabilityai/stable-diffusion-3.5-medium): MMDiT-X transformer, 16-channel VAE, CLIP-L and CLIP-G
# text encoders with projection, T5-XXL encoder (optional: the kit's drop_t5).
SD3_CONFIG_FILES = {
    "sd3_transformer": "sd35m_transformer.json",
    "sd3_vae": "sd35m_vae.json",
    "sd3_clip_l": "sd35m_text_encoder.json",
    "sd3_clip_g": "sd35m_text_encoder_2.json",
    "sd3_t5": "sd35m_text_encoder_3.json",
}
SD3_TINY_FOLDERS = {
    "sd3_transformer": "transformer",
    "sd3_vae": "vae",
    "sd3_clip_l": "text_encoder",
    "sd3_clip_g": "text_encoder_2",
    "sd3_t5": "text_encoder_3",
}

# SDXL base 1.0 (stabilityai/stable-diffusion-xl-base-1.0): UNet with the pooled text and time ids (2.57 B
# parameters), VAE (4 channels, scaling 0.13025), CLIP-L and CLIP-G with projection.
SDXL_CONFIG_FILES = {
    "sdxl_unet": "sdxl_unet.json",
    "sdxl_vae": "sdxl_vae.json",
    "sdxl_clip_l": "sdxl_text_encoder.json",
    "sdxl_clip_g": "sdxl_text_encoder_2.json",
}
SDXL_TINY_FOLDERS = {
    "sdxl_unet": "unet",
    "sdxl_vae": "vae",
    "sdxl_clip_l": "text_encoder",
    "sdxl_clip_g": "text_encoder_2",
}

# FLUX.1-dev (black-forest-labs/FLUX.1-dev): FluxTransformer2DModel with the guidance embedding (11.9 B parameters;
# the published transformer/config.json, which are also diffusers' defaults but for guidance_embeds), the 16-channel
# VAE (scaling 0.3611, shift 0.1159), CLIP-L (openai/clip-vit-large-patch14's text tower, SD v1.5's) and the T5-XXL
# encoder (google/t5-v1_1-xxl, SD3.5's text_encoder_3). The scheduler is the tiny FLUX.1-dev's (its published one).
FLUX_CONFIG_FILES = {
    "flux_transformer": "flux1dev_transformer.json",
    "flux_vae": "flux1dev_vae.json",
    "flux_clip_l": "flux1dev_text_encoder.json",
    "flux_t5": "flux1dev_text_encoder_2.json",
}
FLUX_TINY_FOLDERS = {
    "flux_transformer": "transformer",
    "flux_vae": "vae",
    "flux_clip_l": "text_encoder",
    "flux_t5": "text_encoder_2",
}


# case-name prefix -> (the real architecture, the `Bench` attribute holding its configs); the rest: SD v1.5's
FAMILY_OF_CASE = {
    "sd35m_": ("SD3.5 Medium", "sd3_configs"),
    "sdxl_": ("SDXL base 1.0", "sdxl_configs"),
    "flux_": ("FLUX.1-dev", "flux_configs"),
}


def _family_of(case: str) -> tuple[str, str]:
    return next(
        (v for prefix, v in FAMILY_OF_CASE.items() if case.startswith(prefix)), ("SD v1.5", "configs")
    )


def architectures(cases: list[str]) -> str:
    """The real architectures these cases count, e.g. "SDXL base 1.0 architecture"."""
    return " + ".join(sorted({_family_of(c)[0] for c in cases})) + " architecture"


def _read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def real_configs() -> dict[str, dict]:
    """{'unet', 'vae', 'text_encoder', 'reward'} -> the SD v1.5 / ImageReward configs kept in benchmarks/configs."""
    return {name: _read_json(CONFIG_DIR / f) for name, f in REAL_CONFIG_FILES.items()}


def model_configs(tiny: bool, workdir: Path) -> dict[str, dict]:
    """The real configs, or refl_ddpo.testing.tiny's. Writes the tiny models into `workdir` either way (a few MB, seconds):
    their tokenizers serve both sizes."""
    from refl_ddpo.rewards import imagereward
    from refl_ddpo.testing.tiny import write_tiny_stable_diffusion
    from refl_ddpo.testing.tiny_rewards import write_imagereward

    sd = write_tiny_stable_diffusion(workdir)
    write_imagereward(workdir)
    if not tiny:
        return real_configs()
    return {
        "unet": _read_json(sd / "unet" / "config.json"),
        "vae": _read_json(sd / "vae" / "config.json"),
        "text_encoder": _read_json(sd / "text_encoder" / "config.json"),
        "reward": _read_json(workdir / imagereward.MED_CONFIG_FILE),
    }


def sd3_configs(tiny: bool, workdir: Path) -> dict[str, dict]:
    """SD3.5 Medium's configs kept in benchmarks/configs, or those of refl_ddpo.testing.tiny's tiny SD3 (written into
    `workdir`)."""
    if not tiny:
        return {name: _read_json(CONFIG_DIR / f) for name, f in SD3_CONFIG_FILES.items()}
    from refl_ddpo.testing.tiny import write_tiny_stable_diffusion_3

    folder = write_tiny_stable_diffusion_3(workdir)
    return {name: _read_json(folder / sub / "config.json") for name, sub in SD3_TINY_FOLDERS.items()}


def sdxl_configs(tiny: bool, workdir: Path) -> dict[str, dict]:
    """SDXL base 1.0's configs kept in benchmarks/configs, or those of refl_ddpo.testing.tiny's tiny SDXL."""
    if not tiny:
        return {name: _read_json(CONFIG_DIR / f) for name, f in SDXL_CONFIG_FILES.items()}
    from refl_ddpo.testing.tiny import write_tiny_stable_diffusion_xl

    folder = write_tiny_stable_diffusion_xl(workdir)
    return {name: _read_json(folder / sub / "config.json") for name, sub in SDXL_TINY_FOLDERS.items()}


def flux_configs(tiny: bool, workdir: Path) -> dict[str, dict]:
    """FLUX.1-dev's configs kept in benchmarks/configs, or those of refl_ddpo.testing.tiny's tiny FLUX.1-dev."""
    if not tiny:
        return {name: _read_json(CONFIG_DIR / f) for name, f in FLUX_CONFIG_FILES.items()}
    from refl_ddpo.testing.tiny_flux import write_tiny_flux

    folder, _ = write_tiny_flux(workdir)
    return {name: _read_json(folder / sub / "config.json") for name, sub in FLUX_TINY_FOLDERS.items()}


def construct(name: str, config: dict, attention: str = "sdpa", tokenizer=None):
    """One model with freshly initialised random weights, on the current default device (a `torch.device` context:
    meta for counting parameters, the GPU to skip a slow CPU init). `tokenizer`: ImageReward's BERT tokenizer."""
    if name in ("unet", "sdxl_unet"):
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel.from_config(config)
    if name in ("vae", "sdxl_vae"):
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_config(config)
    if name in ("text_encoder", "sdxl_clip_l", "flux_clip_l"):
        from transformers import CLIPTextConfig, CLIPTextModel

        return CLIPTextModel(CLIPTextConfig(**config, attn_implementation=attention))
    if name == "sd3_transformer":
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel.from_config(config)
    if name == "flux_transformer":
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel.from_config(config)
    if name in ("sd3_vae", "flux_vae"):
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_config(config)
    if name in ("sd3_clip_l", "sd3_clip_g", "sdxl_clip_g"):
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        return CLIPTextModelWithProjection(CLIPTextConfig(**config, attn_implementation=attention))
    if name in ("sd3_t5", "flux_t5"):
        from transformers import T5Config, T5EncoderModel

        return T5EncoderModel(T5Config(**config, attn_implementation=attention))
    if name == "reward":
        from refl_ddpo.rewards.imagereward import ImageRewardModel

        model = ImageRewardModel(config, tokenizer)  # the tokenizer only serves `tokenize`
        # The model skips timm's init (a checkpoint replaces it), which leaves cls_token / pos_embed as torch.empty
        # garbage (NaN seen): draw timm's own init instead.
        model.blip.visual_encoder.init_weights()
        return model
    raise ValueError(name)


def run_configs(b: Bench, cases: list[str]) -> dict[str, dict]:
    """The configs of the models these cases build: SD v1.5's for its cases, the family's for the others, and
    ImageReward's wherever a ReFL case scores with it."""
    configs = {}
    for case in cases:
        configs.update(getattr(b, _family_of(case)[1]))
        if case.endswith("refl"):
            configs["reward"] = b.configs["reward"]
    return configs


def parameter_counts(configs: dict[str, dict]) -> dict[str, int]:
    """Parameters of each model, built on the meta device (no memory, no init)."""
    counts = {}
    with torch.device("meta"):
        for name, config in configs.items():
            model = construct(name, config)
            counts[name] = sum(p.numel() for p in model.parameters())
            if name == "reward":
                counts["reward.vision"] = sum(p.numel() for p in model.blip.visual_encoder.parameters())
                counts["reward.text"] = sum(p.numel() for p in model.blip.text_encoder.parameters())
    return counts
