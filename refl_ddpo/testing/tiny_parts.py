"""Pieces the tiny builders share (refl_ddpo.testing.tiny, tiny_rewards, toy_train): the real SD v1.x scheduler
settings, a CLIP and a T5 tokenizer built offline (no hub) and the byte table of CLIP's and Qwen's, a tiny CLIP text
config, and the tiny VAE and T5 encoder of the SD / SD3 / SDXL / FLUX.1 folders."""

from __future__ import annotations

import json
from pathlib import Path

# The scheduler settings of the real SD v1.x scheduler_config.json (a PNDM scheduler; trainers switch to DDIM/DDPM
# with from_config, which keeps betas, steps_offset, set_alpha_to_one and clip_sample).
SD_SCHEDULER_CONFIG = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "clip_sample": False,
    "trained_betas": None,
}


def byte_chars() -> list[str]:
    """The GPT-2 / CLIP / Qwen byte-to-unicode table, byte by byte: printable bytes map to themselves, the rest to
    chars from U+0100 on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _byte_level_vocab() -> dict[str, int]:
    """A CLIP BPE vocab with no merges: every byte-char, every byte-char + '</w>', and the two special tokens."""
    chars = byte_chars()
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}


def tiny_clip_config(tokenizer, hidden: int = 32, **extra):
    """A tiny CLIP text config (2 layers, 4 heads, 77 positions) on `tokenizer`'s vocabulary and special tokens."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def clip_tokenizer():
    """A CLIP tokenizer built offline: the byte-level vocab, no merges, 77 tokens (as SD's)."""
    import tempfile

    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "vocab.json").write_text(json.dumps(_byte_level_vocab()))
        (Path(d) / "merges.txt").write_text("#version: 0.2\n")
        return CLIPTokenizer(
            str(Path(d) / "vocab.json"),
            str(Path(d) / "merges.txt"),
            model_max_length=77,
            pad_token="<|endoftext|>",
        )


def t5_tokenizer():
    """A T5 tokenizer built offline: a unigram model over the printable ASCII characters (with and without the
    word-start mark), `</s>` appended, pad 0 and eos 1 as T5's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5Tokenizer

    chars = [chr(c) for c in range(32, 127)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    vocab += [(c, -2.0) for c in chars] + [("\u2581" + c, -1.5) for c in chars]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return T5Tokenizer(
        tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0
    )


def tiny_vae(seed: int, latent_channels: int, sample_size: int = 32, **extra):
    """A tiny random AutoencoderKL (`sample_size` px in, two blocks of 32 and 64 channels) drawn from `seed`; `extra`
    holds the family's own settings (scaling / shift factors, quant convs, force_upcast)."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        sample_size=sample_size,
        norm_num_groups=32,
        **extra,
    )


def tiny_t5(seed: int):
    """(the offline T5 tokenizer, a tiny random one-layer T5 encoder of width 64 drawn from `seed`)."""
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = t5_tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=1,
        num_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer, T5EncoderModel(config)
