"""Tiny random models in the checkpoint/ layout, for tests and the demo on machines with no hub access.

    python -m refl_ddpo.tiny OUT

writes
    OUT/stable-diffusion/   diffusers layout (unet, vae, text_encoder, tokenizer, scheduler, model_index.json)
    OUT/ImageReward.pt      official key layout, tiny dims
    OUT/med_config.json
    OUT/bert-base-uncased/  a plain BERT tokenizer folder
    OUT/aesthetic/          tiny CLIP ViT + LAION-style linear head (see refl_ddpo.rewards.aesthetic)

Same code paths and file layouts as the real weights, random values from fixed seeds, a few MB, a few seconds.
The models are random: images are noise and rewards mean nothing except that they can be optimised.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# The scheduler settings of the real SD v1.x scheduler_config.json (a PNDM scheduler; trainers switch to DDIM/DDPM
# with from_config, which keeps betas, steps_offset, set_alpha_to_one and clip_sample).
SD_SCHEDULER_CONFIG = dict(
    beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
    set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1, clip_sample=False, trained_betas=None,
)


def _byte_level_vocab() -> dict[str, int]:
    """A CLIP BPE vocab with no merges: every byte-char, every byte-char + '</w>', and the two special tokens."""
    # GPT-2/CLIP byte-to-unicode table: printable bytes map to themselves, the rest to chars from U+0100 on.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}


def write_tiny_stable_diffusion(out: Path, seed: int = 0) -> Path:
    """A StableDiffusionPipeline folder with tiny random UNet / VAE / CLIP text encoder. Returns its path."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out = Path(out)
    tok_dir = out / "_tokenizer_src"
    tok_dir.mkdir(parents=True, exist_ok=True)
    (tok_dir / "vocab.json").write_text(json.dumps(_byte_level_vocab()))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(tok_dir / "vocab.json"), str(tok_dir / "merges.txt"), model_max_length=77,
                              pad_token="<|endoftext|>")

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
        norm_num_groups=32,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        sample_size=32, norm_num_groups=32,
    )
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ))
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        scheduler=PNDMScheduler.from_config(SD_SCHEDULER_CONFIG), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    sd_dir = out / "stable-diffusion"
    pipe.save_pretrained(sd_dir, safe_serialization=True)
    for f in tok_dir.iterdir():
        f.unlink()
    tok_dir.rmdir()
    return sd_dir


def write_tiny_models(out: str | Path, seed: int = 0) -> Path:
    """Everything `checkpoint/` holds, tiny and random, under `out`."""
    from refl_ddpo.rewards import aesthetic, imagereward

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_tiny_stable_diffusion(out, seed)
    imagereward.write_tiny(out, seed=seed)
    aesthetic.write_tiny(out / "aesthetic", seed=seed)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="Folder to write (created if missing).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_tiny_models(args.out, args.seed)
    print(f"tiny random models written to {out} (random weights: outputs are noise, for tests and demos only)")


if __name__ == "__main__":
    main()
