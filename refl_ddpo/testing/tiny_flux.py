"""Tiny random FLUX.1 folders in the real diffusers layout (refl_ddpo.testing.tiny writes them):

    OUT/tiny-flux/          FLUX.1-dev-like: a FluxTransformer2DModel with the guidance embedding, the scheduler of
                            FLUX.1-dev (shift 3.0, dynamic shifting between 256 and 4096 image tokens)
    OUT/tiny-flux-schnell/  FLUX.1-schnell-like: the same parts, a transformer without the guidance embedding and
                            schnell's scheduler (shift 1.0, no dynamic shifting)
    OUT/tiny-flux-kontext/  FLUX.1-Kontext-dev-like: tiny-flux's parts as a FluxKontextPipeline

Both have a 16-channel VAE with FLUX.1's scaling and shift factors (no quant convs), a CLIP text encoder (its pooled
output) and a T5 encoder with their tokenizers, built offline. At 32 px: 16 x 16 latents, 64 image tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refl_ddpo.testing.tiny_parts import clip_tokenizer, tiny_clip_config, tiny_t5, tiny_vae

# The scheduler_config.json settings of FLUX.1-dev and FLUX.1-schnell.
DEV_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
SCHNELL_SCHEDULER = {**DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}


def _parts(seed: int) -> dict:
    """VAE, CLIP, T5 and tokenizers, the same for both folders."""
    from transformers import CLIPTextModel

    tokenizer = clip_tokenizer()
    vae = tiny_vae(
        seed + 1,
        16,
        scaling_factor=0.3611,  # FLUX.1's
        shift_factor=0.1159,  # FLUX.1's
        use_quant_conv=False,  # FLUX.1's VAE has none
        use_post_quant_conv=False,
    )
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(tiny_clip_config(tokenizer))
    t5_tok, t5 = tiny_t5(seed + 3)
    return {
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "text_encoder_2": t5,
        "tokenizer_2": t5_tok,
    }


def _transformer(seed: int, guidance_embeds: bool):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels x the 2 x 2 packing
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,  # T5's width
        pooled_projection_dim=32,  # CLIP's pooled output
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )


def write_tiny_flux(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """OUT/tiny-flux/ and OUT/tiny-flux-schnell/ (see the module doc); returns both paths."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    parts = _parts(seed)
    paths = []
    for dirname, guidance_embeds, scheduler in [
        ("tiny-flux", True, DEV_SCHEDULER),
        ("tiny-flux-schnell", False, SCHNELL_SCHEDULER),
    ]:
        pipe = FluxPipeline(
            transformer=_transformer(seed, guidance_embeds),
            scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
            **parts,
        )
        path = Path(out) / dirname
        pipe.save_pretrained(path, safe_serialization=True)
        paths.append(path)
    return paths[0], paths[1]


def write_tiny_flux_kontext(out: Path, seed: int = 0) -> Path:
    """OUT/tiny-flux-kontext/: tiny-flux's transformer, VAE, CLIP, T5 and scheduler as a FluxKontextPipeline (FLUX.1
    Kontext [dev] has FLUX.1-dev's architecture and scheduler; it learnt to read the appended source tokens)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    pipe = FluxKontextPipeline(
        transformer=_transformer(seed, True),
        scheduler=FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER),
        **_parts(seed),
    )
    path = Path(out) / "tiny-flux-kontext"
    pipe.save_pretrained(path, safe_serialization=True)
    return path
