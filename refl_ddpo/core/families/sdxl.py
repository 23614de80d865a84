"""Stable Diffusion XL: the SD 1.x UNet maths (epsilon or v prediction, DDIM / DDPM / Euler schedulers, 4 latent
channels) with two CLIP text encoders and the UNet's added conditions: the second encoder's pooled projection
(`text_embeds`) and the micro-conditioning `time_ids` (original size, crop top-left, target size).

Everything the stock `StableDiffusionXLPipeline.__call__` does by default is kept, so the same seed gives the same
image: its `encode_prompt` (penultimate hidden states of both CLIPs side by side, the pooled output of the second;
zeros for the negative when `force_zeros_for_empty_prompt`), `add_time_ids` = (H, W, 0, 0, H, W) for an H x W image,
CFG on the doubled batch, and its VAE decode (`latents_mean` / `latents_std` where the VAE config has them, a float16
VAE upcast to float32 when its config says `force_upcast`).
"""

from __future__ import annotations

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families.base import Cond, pooled_conds
from refl_ddpo.core.families.sd import StableDiffusion


class StableDiffusionXL(StableDiffusion):
    name = "sdxl"
    pipeline_class = "StableDiffusionXLPipeline"
    # LoRA targets, schedulers and every step's maths are SD 1.x's (diffusers' train_text_to_image_lora_sdxl.py
    # targets the same attention projections)

    def __init__(self, pipe):
        super().__init__(pipe)
        if pipe.unet.config.time_cond_proj_dim is not None:
            raise UserError(
                "this SDXL UNet takes a guidance embedding (time_cond_proj_dim: a guidance-distilled model such as "
                "LCM); this kit trains SDXL models with plain classifier-free guidance."
            )
        # The stock pipeline decodes a float16 VAE with force_upcast in float32 (SDXL's VAE overflows in float16);
        # kept in float32 here once, so decoding with gradient needs no dtype switch mid-graph.
        if pipe.vae.dtype == torch.float16 and pipe.vae.config.force_upcast:
            pipe.vae.to(torch.float32)

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The pipeline's own `encode_prompt` (both CLIPs, the same prompt to each); the negative is its default (no
        negative prompt): zeros with `force_zeros_for_empty_prompt` (SDXL base's config), else the empty prompt."""
        encoded = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.pipe.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=with_negative,
        )
        return pooled_conds(*encoded, with_negative)

    def empty_cond(self) -> Cond:
        """The pipeline's negative conditioning without a negative prompt (batch 1): zeros of the empty prompt's
        shapes with `force_zeros_for_empty_prompt`, else the empty prompt's encoding."""
        cond = self.encode_prompts([""], with_negative=False)[0]
        if self.pipe.config.force_zeros_for_empty_prompt:
            return {k: torch.zeros_like(v) for k, v in cond.items()}
        return cond

    def add_time_ids(self, latents: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(B, 6) micro-conditioning for these latents' image size H x W, as the pipeline's default
        `_get_add_time_ids`: original size (H, W), crop top-left (0, 0), target size (H, W), in `like`'s dtype."""
        f = self.vae_scale_factor
        height, width = latents.shape[-2] * f, latents.shape[-1] * f
        row = [[height, width, 0, 0, height, width]]
        ids = self.constant(
            ("time_ids", height, width, like.device, like.dtype),
            lambda: torch.tensor(row, dtype=like.dtype, device=like.device),
        )
        return ids.expand(latents.shape[0], 6)

    def unet_conditioning(self, latents: torch.Tensor, cond: Cond) -> dict:
        """The text embeddings and the UNet's added conditions for a batch of `latents` (the network's input, CFG's
        doubled batch included): the pooled text and `time_ids`."""
        embeds = cond["prompt_embeds"]
        added = {"text_embeds": cond["pooled_prompt_embeds"], "time_ids": self.add_time_ids(latents, embeds)}
        return {"encoder_hidden_states": embeds, "added_cond_kwargs": added}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: latents * latents_std / scaling_factor + latents_mean where the VAE config has both,
        else latents / scaling_factor; then the VAE's decoder; images in [0, 1]."""
        vae = self.vae
        config = vae.config
        latents = latents.to(vae.dtype)
        if config.get("latents_mean") is not None and config.get("latents_std") is not None:
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents)
            latents = latents * std / config.scaling_factor + mean
        else:
            latents = latents / config.scaling_factor
        images = vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)
