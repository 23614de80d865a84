"""Tiny random Z-Image folders in the real diffusers layout (refl_ddpo.testing.tiny writes them):

    OUT/tiny-z-image/        Z-Image-like: a ZImageTransformer2DModel (single-stream DiT: noise and caption
                             refiners, then joint layers), a Qwen3 text encoder and a Qwen2 tokenizer with Qwen3's
                             chat template built offline, FLUX.1's 16-channel VAE settings, and Z-Image's scheduler
                             (shift 6.0, no dynamic shifting)
    OUT/tiny-z-image-turbo/  Z-Image-Turbo-like: the same weights and Turbo's scheduler (shift 3.0), which is how the
                             kit tells the distilled Turbo from the base (refl_ddpo.core.families.z_image)

The tokenizer is tiny_qwen's (one token per byte, no merges); the template wraps the prompt in
"<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n" as Qwen3's does with thinking enabled (the pipeline's
call). At 32 px: 16 x 16 latents, 64 image tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refl_ddpo.testing.tiny_parts import tiny_vae
from refl_ddpo.testing.tiny_qwen import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

# Tongyi-MAI/Z-Image's and Tongyi-MAI/Z-Image-Turbo's scheduler/scheduler_config.json
BASE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 6.0, "use_dynamic_shifting": False}
TURBO_SCHEDULER = {**BASE_SCHEDULER, "shift": 3.0}
TEXT_WIDTH = 32  # the tiny text encoder's hidden size (Qwen3-4B's is 2560), the transformer's cap_feat_dim


def tiny_qwen3(tokenizer, seed: int):
    """A tiny random Qwen3Model (2 layers of width 32, grouped-query attention) on `tokenizer`'s vocabulary; the
    pipeline reads its second-to-last hidden state."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3Model(config)


def write_tiny_z_image(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """OUT/tiny-z-image/ and OUT/tiny-z-image-turbo/ (see the module doc); returns both paths."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    text_encoder = tiny_qwen3(tokenizer, seed + 2)
    vae = tiny_vae(
        seed + 1,
        16,
        scaling_factor=0.3611,  # Z-Image's VAE is FLUX.1's
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=TEXT_WIDTH,
        axes_dims=[4, 6, 6],  # sums to the head dim 16
        axes_lens=[1024, 64, 64],
    )
    paths = []
    for dirname, scheduler in [("tiny-z-image", BASE_SCHEDULER), ("tiny-z-image-turbo", TURBO_SCHEDULER)]:
        pipe = ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=transformer,
        )
        path = Path(out) / dirname
        pipe.save_pretrained(path, safe_serialization=True)
        paths.append(path)
    return paths[0], paths[1]
