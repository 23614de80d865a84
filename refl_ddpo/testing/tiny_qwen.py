"""A tiny random Qwen-Image folder in the real diffusers layout (refl_ddpo.testing.tiny writes it):

    OUT/tiny-qwen-image/   a QwenImageTransformer2DModel, an AutoencoderKLQwenImage with Qwen-Image's
                           latents_mean / latents_std and one 2x downsampling (the real one has three), a
                           Qwen2.5-VL text encoder (its vision tower is loaded but never run for text) and a Qwen2
                           tokenizer built offline, and Qwen-Image's scheduler config

OUT/tiny-qwen-image-edit-plus/ (`write_tiny_qwen_image_edit_plus`) is the same transformer, VAE and scheduler as a
QwenImageEditPlusPipeline whose Qwen2.5-VL reads the source images with its vision tower.

The tokenizer is byte-level with no merges and the chat tokens <|im_start|> / <|im_end|>, so the pipeline's
template is about 170 tokens here (34 with the real tokenizer) and dropping its first 34 keeps part of the system
text: the same code path, other lengths. At 32 px: 16 x 16 latents, 64 image tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refl_ddpo.testing.tiny_parts import byte_chars

# Qwen/Qwen-Image's scheduler/scheduler_config.json
QWEN_IMAGE_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
# the tiny text encoder's hidden size (Qwen2.5-VL-7B's is 3584), the transformer's joint_attention_dim
TEXT_WIDTH = 32

# Qwen3's chat template reduced to what ZImagePipeline and Flux2KleinPipeline ask of it: user turns, the generation
# prompt, and the empty think block that Qwen3 adds only when thinking is disabled.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def qwen_tokenizer():
    """A Qwen2 tokenizer built offline: one token per byte, no merges, and Qwen's <|endoftext|> (padding) and chat
    tokens <|im_start|> / <|im_end|>."""
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*byte_chars(), *specials])}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tokenizer


def tiny_qwen_vl(tokenizer, seed: int):
    """A tiny random Qwen2.5-VL (2 text layers of width 32 with grouped-query attention and the multimodal rotary
    sections, a one-block vision tower) on `tokenizer`'s vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 2 * TEXT_WIDTH,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},  # sums to head_dim / 2
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": TEXT_WIDTH,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def _image_parts(seed: int) -> dict:
    """The scheduler, VAE and transformer of the tiny Qwen-Image folders."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(seed + 1)
    # latents_mean / latents_std are the class defaults: Qwen-Image's
    vae = AutoencoderKLQwenImage(
        base_dim=16, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]
    )
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels x the 2 x 2 packing
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        "vae": vae,
        "transformer": transformer,
    }


def write_tiny_qwen_image(out: Path, seed: int = 0) -> Path:
    """OUT/tiny-qwen-image/ (see the module doc); returns its path."""
    from diffusers import QwenImagePipeline

    tokenizer = qwen_tokenizer()
    pipe = QwenImagePipeline(
        text_encoder=tiny_qwen_vl(tokenizer, seed + 2), tokenizer=tokenizer, **_image_parts(seed)
    )
    path = Path(out) / "tiny-qwen-image"
    pipe.save_pretrained(path, safe_serialization=True)
    return path


VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


def write_tiny_qwen_image_edit_plus(out: Path, seed: int = 0) -> Path:
    """OUT/tiny-qwen-image-edit-plus/: a QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 / 2511) of tiny-qwen-image's
    transformer, VAE and scheduler, and a Qwen2.5-VL whose vision tower reads the source images: the Qwen2 tokenizer
    with Qwen's vision tokens, the model's image / video / vision-start token ids set to theirs, and a
    Qwen2VLProcessor (Qwen2-VL's image processor: 14 px patches, 2 x 2 merged, 2 frames per temporal patch) built
    offline."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]}
    )
    text_encoder = tiny_qwen_vl(tokenizer, seed + 2)
    names = ("vision_start", "image", "vision_end", "video")
    ids = dict(zip(names, tokenizer.convert_tokens_to_ids(VISION_TOKENS), strict=True))
    for config in (text_encoder.config, text_encoder.config.text_config):
        config.image_token_id, config.video_token_id = ids["image"], ids["video"]
        config.vision_start_token_id, config.vision_end_token_id = ids["vision_start"], ids["vision_end"]
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
    )
    pipe = QwenImageEditPlusPipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, processor=processor, **_image_parts(seed)
    )
    path = Path(out) / "tiny-qwen-image-edit-plus"
    pipe.save_pretrained(path, safe_serialization=True)
    return path
