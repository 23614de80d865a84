"""Tiny random Wan text-to-video folders in the real diffusers layout (refl_ddpo.testing.tiny writes them):

    OUT/tiny-wan21/   Wan 2.1-like: one WanTransformer3DModel, a UMT5 encoder with a T5 tokenizer built offline,
                      an AutoencoderKLWan (3-D causal VAE: 4x in time, 8x in space, 16 channels with the real
                      latents_mean / latents_std) and a flow-matching scheduler (shift 3.0, Wan's 480p flow_shift)
    OUT/tiny-wan22/   Wan 2.2-A14B-like: the same and a second expert `transformer_2` for the low-noise steps,
                      `boundary_ratio` 0.875 as Wan2.2-T2V-A14B's model_index.json

The real folders carry a `UniPCMultistepScheduler` with `flow_shift`; the tiny ones a `FlowMatchEulerDiscreteScheduler`
with the same shift, which is what the kit samples with on either (refl_ddpo.core.families.wan). The tokenizer is
tiny_parts' unigram T5 tokenizer (umt5-xxl's is a sentencepiece unigram model too). 16 x 16 px, 5 frames: latents
(B, 16, 2, 2, 2), 2 patches of 2 x 2, 2 latent frames: 4 video tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refl_ddpo.testing.tiny_parts import t5_tokenizer

SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
TEXT_WIDTH = 32  # the tiny UMT5's d_model (umt5-xxl's is 4096), the transformer's text_dim
BOUNDARY_RATIO = 0.875  # Wan-AI/Wan2.2-T2V-A14B-Diffusers model_index.json


def tiny_umt5(seed: int):
    """(the offline T5 tokenizer, a tiny random one-layer UMT5 encoder of width 32 drawn from `seed`)."""
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer()
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=TEXT_WIDTH,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return tokenizer, UMT5EncoderModel(config)


def tiny_wan_vae(seed: int):
    """A tiny random AutoencoderKLWan: 3 base channels, Wan 2.1's strides (4x in time, 8x in space) and its
    per-channel latents_mean / latents_std (the class defaults, the real config's)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


def tiny_wan_transformer(seed: int):
    """A tiny random WanTransformer3DModel (2 blocks, 2 heads of 12) reading the tiny UMT5's width."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=TEXT_WIDTH,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def write_tiny_wan(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """OUT/tiny-wan21/ and OUT/tiny-wan22/ (see the module doc); returns both paths."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    tokenizer, text_encoder = tiny_umt5(seed + 2)
    vae = tiny_wan_vae(seed + 1)
    parts = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae}
    wan21 = WanPipeline(
        transformer=tiny_wan_transformer(seed),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        **parts,
    )
    wan22 = WanPipeline(
        transformer=tiny_wan_transformer(seed),
        transformer_2=tiny_wan_transformer(seed + 3),
        boundary_ratio=BOUNDARY_RATIO,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        **parts,
    )
    paths = []
    for dirname, pipe in [("tiny-wan21", wan21), ("tiny-wan22", wan22)]:
        path = Path(out) / dirname
        pipe.save_pretrained(path, safe_serialization=True)
        paths.append(path)
    return paths[0], paths[1]
