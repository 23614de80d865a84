"""FLUX.1 Kontext (dev): FLUX.1 that edits a source image, as diffusers' `FluxKontextPipeline`.

Everything of FLUX.1 (families/flux.py: the prompt encoding, the noise, the shift `mu` from the target's token count,
the embedded guidance, the Euler / SDE steps, the decode) plus the reference, built as the stock pipeline builds it:

- the source image (3, H, W) in [0, 1] -> 2x - 1 (`VaeImageProcessor.preprocess`), VAE-encoded, the latent
  distribution's mode (`retrieve_latents(..., sample_mode="argmax")`), stored as (z - shift_factor) * scaling_factor:
  the conditioning's "image_latents" (B, 16, H/8, W/8), encoded once per batch and kept with the prompts' embeddings
  (so the trainers' sample buffers carry it like any other conditioning tensor);
- at every network call it is packed like the latents and appended after them along the sequence, with the same
  position ids as a target of its size but the first id axis set to 1 (`prepare_latents`' `image_ids`); the
  transformer's output keeps only the target's tokens (`noise_pred[:, : latents.size(1)]`); both calls of true CFG
  see the reference.

The source is used at its own size (the stock pipeline with `_auto_resize=False`; --edit_data checks that every
source has one size, sides multiples of 16), and the target is drawn at --resolution: the stock pipeline gives the
same image called with height = width = resolution and `max_area` = resolution ** 2 (it otherwise rescales the
target to 1024 x 1024 pixels). Kontext takes one source image per edit (the stock pipeline reads a list of images as
a batch). A sample without a source image is drawn from the prompt alone, as the stock pipeline does without `image`.
"""

from __future__ import annotations

import torch

from refl_ddpo.core.edit_data import source_tensors
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families.base import Cond
from refl_ddpo.core.families.flux import Flux


class FluxKontext(Flux):
    name = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    edits_images = True

    def encode_conditioning(
        self, prompts: list[str], metadata: list[dict] | None, with_negative: bool
    ) -> tuple[Cond, Cond | None]:
        """FLUX.1's text conditioning, and the source images' latents as "image_latents" (B, 16, H/8, W/8) when the
        samples have them (`metadata[i]["source_images"]`)."""
        cond, uncond = self.encode_prompts(prompts, with_negative)
        sources = [source_tensors(m) for m in metadata or [{}] * len(prompts)]
        if not any(sources):
            return cond, uncond
        if not all(len(s) == 1 for s in sources):
            counts = sorted({len(s) for s in sources})
            raise UserError(
                f"FLUX.1 Kontext edits one source image per instruction, and this batch has {counts} per sample; "
                "give each --edit_data line one 'image'."
            )
        return {**cond, "image_latents": self.encode_sources([s[0] for s in sources])}, uncond

    @torch.no_grad()
    def encode_sources(self, images: list[torch.Tensor]) -> torch.Tensor:
        """Source images (3, H, W) in [0, 1] -> their latents (B, 16, H/8, W/8) as the stock `prepare_latents`."""
        vae = self.vae
        f = self.vae_scale_factor * 2
        if (
            any(im.shape[-1] % f or im.shape[-2] % f for im in images)
            or len({im.shape for im in images}) != 1
        ):
            shapes = sorted({tuple(im.shape) for im in images})
            raise UserError(
                f"FLUX.1 Kontext: the source images of a batch must share one size with sides multiples of {f}; "
                f"got {shapes}."
            )
        pixels = torch.stack(images).to(self.pipe.device, vae.dtype) * 2 - 1  # (B, 3, H, W) in [-1, 1]
        z = vae.encode(pixels).latent_dist.mode()
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    def with_references(
        self, packed: torch.Tensor, img_ids: torch.Tensor, cond: Cond
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents' tokens, then the source's (B, N + M, 64); their position ids (N + M, 3), the source's with
        the first axis 1."""
        refs = cond.get("image_latents")
        if refs is None:
            return packed, img_ids
        b, _, h, w = refs.shape
        key = ("kontext_ids", img_ids.shape[0], h, w, packed.device, packed.dtype)

        def ids() -> torch.Tensor:
            ref_ids = self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, packed.device, packed.dtype)
            ref_ids[..., 0] = 1
            return torch.cat([img_ids, ref_ids], dim=0)

        return torch.cat([packed, self.pack(refs.to(packed.dtype))], dim=1), self.constant(key, ids)
