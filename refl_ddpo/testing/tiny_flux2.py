"""Tiny random FLUX.2 folders in the real diffusers layout (refl_ddpo.testing.tiny writes them):

    OUT/tiny-flux2/               FLUX.2 [dev]-like (`Flux2Pipeline`): a Flux2Transformer2DModel with the guidance
                                  embedding, a Mistral3 text encoder (its Pixtral vision tower is loaded but never run
                                  for text) and a PixtralProcessor (tokenizer + chat template) built offline
    OUT/tiny-flux2-klein/         FLUX.2 [klein]-like, distilled (`Flux2KleinPipeline`, is_distilled true): a
                                  transformer without the guidance embedding, a Qwen3 text encoder and a Qwen2
                                  tokenizer with a Qwen3-style chat template built offline
    OUT/tiny-flux2-klein-base/    the same weights as [klein] with is_distilled false (the undistilled base, CFG)

All three have an AutoencoderKLFlux2 of 8 latent channels (FLUX.2's has 32) with one 2x downsampling and random
batch-norm statistics (the latents' normalisation; FLUX.2's own are learnt), so 2 x 2 patches give the transformer
32 channels. The text encoders have one layer more than the deepest hidden state the pipelines stack ((10, 20, 30)
for [dev], (9, 18, 27) for [klein]), so every stacked state is an intermediate layer's as in the real 40- and 36-layer
encoders. The tokenizers are byte-level with no merges, so the prompts are longer in tokens than with the real ones:
the same code paths, other lengths. At 32 px: 8 x 8 patchified latents, 64 image tokens; text 512 tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from refl_ddpo.testing.tiny_flux import DEV_SCHEDULER
from refl_ddpo.testing.tiny_parts import byte_chars
from refl_ddpo.testing.tiny_qwen import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

# FLUX.2's scheduler config: FLUX.1-dev's, as diffusers' scripts/convert_flux2_to_diffusers.py builds the pipeline
# (dynamic shifting on, so the `mu` the pipelines compute with `compute_empirical_mu` is used).
FLUX2_SCHEDULER = DEV_SCHEDULER
TEXT_WIDTH = 16  # the tiny text encoders' hidden size; the prompt embedding stacks 3 layers: 48 wide
LATENT_CHANNELS = 8

# Mistral-Small-3.1's chat template reduced to what Flux2Pipeline sends (a system turn, then user turns whose content
# is a list of text blocks): <s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST].
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set text = message['content'] if message['content'] is string "
    "else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def _byte_tokenizer(specials: list[str], **named):
    """A byte-level BPE tokenizer with no merges: one token per byte, then `specials` (added as special tokens);
    `named` maps the tokenizer's roles (bos_token, pad_token ...) to some of them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*byte_chars(), *specials])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **named)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def mistral_processor():
    """A PixtralProcessor as FLUX.2 [dev]'s tokenizer folder holds one: a byte-level tokenizer with Mistral's control
    tokens, Pixtral's image processor and the chat template above."""
    from transformers import PixtralImageProcessor, PixtralProcessor

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    specials += ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tokenizer = _byte_tokenizer(
        specials, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(), tokenizer=tokenizer, chat_template=MISTRAL_CHAT_TEMPLATE
    )


def qwen3_tokenizer():
    """Qwen-Image's offline Qwen2 tokenizer (refl_ddpo.testing.tiny_qwen) with Qwen3's thinking tokens and the chat
    template above."""
    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def tiny_mistral3(tokenizer, seed: int):
    """A tiny random Mistral3 (31 text layers of width 16, grouped-query attention; a one-layer Pixtral tower)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = {
        k: tokenizer.convert_tokens_to_ids(t) for k, t in [("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>")]
    }
    text = {
        "model_type": "mistral",
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 2 * TEXT_WIDTH,
        "num_hidden_layers": 31,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": TEXT_WIDTH // 2,
        "max_position_embeddings": 1024,
        "sliding_window": None,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "image_size": 32,
        "patch_size": 8,
    }
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(config)


def tiny_qwen3(tokenizer, seed: int):
    """A tiny random Qwen3 causal LM (28 layers of width 16, grouped-query attention)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=2 * TEXT_WIDTH,
        num_hidden_layers=28,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=TEXT_WIDTH // 2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def tiny_flux2_vae(seed: int):
    """An AutoencoderKLFlux2 (two blocks: one 2x downsampling) with random batch-norm statistics."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=32,
    )
    vae.bn.running_mean.normal_(0.0, 0.2)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def tiny_flux2_transformer(seed: int, guidance_embeds: bool):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,  # the VAE's channels x the 2 x 2 patches
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH,  # three stacked hidden states
        axes_dims_rope=(4, 4, 4, 4),  # (T, H, W, L), sums to attention_head_dim
        guidance_embeds=guidance_embeds,
    )


def write_tiny_flux2(out: Path, seed: int = 0) -> tuple[Path, Path, Path]:
    """OUT/tiny-flux2/, OUT/tiny-flux2-klein/ and OUT/tiny-flux2-klein-base/ (see the module doc); returns them."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    out = Path(out)
    processor = mistral_processor()
    dev = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=tiny_flux2_vae(seed + 1),
        text_encoder=tiny_mistral3(processor.tokenizer, seed + 2),
        tokenizer=processor,
        transformer=tiny_flux2_transformer(seed, guidance_embeds=True),
    )
    dev.save_pretrained(out / "tiny-flux2", safe_serialization=True)
    tokenizer = qwen3_tokenizer()
    klein = {
        "vae": tiny_flux2_vae(seed + 1),
        "text_encoder": tiny_qwen3(tokenizer, seed + 3),
        "tokenizer": tokenizer,
        "transformer": tiny_flux2_transformer(seed, guidance_embeds=False),
    }
    paths = [out / "tiny-flux2"]
    for dirname, distilled in [("tiny-flux2-klein", True), ("tiny-flux2-klein-base", False)]:
        scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)
        pipe = Flux2KleinPipeline(scheduler=scheduler, is_distilled=distilled, **klein)
        pipe.save_pretrained(out / dirname, safe_serialization=True)
        paths.append(out / dirname)
    return paths[0], paths[1], paths[2]
