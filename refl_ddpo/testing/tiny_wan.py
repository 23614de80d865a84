"""Tiny random Wan text-to-video folders in the real diffusers layout (refl_ddpo.testing.tiny writes them):

    OUT/tiny-wan21/   Wan 2.1-like: one WanTransformer3DModel, a UMT5 encoder with a T5 tokenizer built offline,
                      an AutoencoderKLWan (3-D causal VAE: 4x in time, 8x in space, 16 channels with the real
                      latents_mean / latents_std) and a flow-matching scheduler (shift 3.0, Wan's 480p flow_shift)
    OUT/tiny-wan22/   Wan 2.2-A14B-like: the same and a second expert `transformer_2` for the low-noise steps,
                      `boundary_ratio` 0.875 as Wan2.2-T2V-A14B's model_index.json
    OUT/tiny-wan21-i2v/   Wan 2.1 I2V-like (WanImageToVideoPipeline): the transformer reads 36 channels (16 noisy +
                      4 mask + 16 of the first frame's condition) and CLIP image embeddings (`image_dim`), from a
                      tiny CLIPVisionModel (16 px, 8 px patches: 5 tokens) and its CLIPImageProcessor
    OUT/tiny-wan22-i2v/   Wan 2.2 I2V A14B-like: two 36-channel experts, no image encoder, `boundary_ratio` 0.9 as
                      Wan's own i2v_A14B config (`boundary`)

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
I2V_BOUNDARY_RATIO = 0.9  # Wan 2.2 I2V A14B (Wan's wan/configs/wan_i2v_A14B.py: boundary 0.900)
# the tiny CLIP vision tower's hidden size (ViT-H/14's is 1280), the I2V transformer's image_dim
CLIP_WIDTH = 16


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


def tiny_wan_transformer(seed: int, in_channels: int = 16, **image):
    """A tiny random WanTransformer3DModel (2 blocks, 2 heads of 12) reading the tiny UMT5's width; `in_channels` 36
    for image-to-video, `image` (image_dim, added_kv_proj_dim) for Wan 2.1 I2V's CLIP embeddings."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=16,
        text_dim=TEXT_WIDTH,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        **image,
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


def tiny_clip_vision(seed: int):
    """(a tiny random CLIPVisionModel: 16 px, 8 px patches, 2 layers of width 16; its CLIPImageProcessor at 16 px)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        image_size=16,
        patch_size=8,
        hidden_size=CLIP_WIDTH,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    torch.manual_seed(seed)
    processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return CLIPVisionModel(config), processor


def write_tiny_wan_i2v(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """OUT/tiny-wan21-i2v/ and OUT/tiny-wan22-i2v/ (see the module doc); returns both paths."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    tokenizer, text_encoder = tiny_umt5(seed + 2)
    parts = {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": tiny_wan_vae(seed + 1)}
    image_encoder, image_processor = tiny_clip_vision(seed + 4)
    image = {"image_dim": CLIP_WIDTH, "added_kv_proj_dim": 24}  # 2 heads x 12: the attention's inner width
    wan21 = WanImageToVideoPipeline(
        transformer=tiny_wan_transformer(seed + 5, 36, **image),
        image_encoder=image_encoder,
        image_processor=image_processor,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        **parts,
    )
    wan22 = WanImageToVideoPipeline(
        transformer=tiny_wan_transformer(seed + 6, 36),
        transformer_2=tiny_wan_transformer(seed + 7, 36),
        boundary_ratio=I2V_BOUNDARY_RATIO,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        **parts,
    )
    paths = []
    for dirname, pipe in [("tiny-wan21-i2v", wan21), ("tiny-wan22-i2v", wan22)]:
        path = Path(out) / dirname
        pipe.save_pretrained(path, safe_serialization=True)
        paths.append(path)
    return paths[0], paths[1]
