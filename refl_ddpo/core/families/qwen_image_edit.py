"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509 / 2511): Qwen-Image editing one or more source images, as diffusers'
`QwenImageEditPlusPipeline`.

Everything of Qwen-Image (families/qwen_image.py: the noise, the shift `mu` from the target's token count, true CFG
with its norm rescale, the decode) plus the sources, built as the stock pipeline builds them, per sample:

- the vision-language prompt: each source resized (`VaeImageProcessor.resize`) to about CONDITION_IMAGE_SIZE pixels
  (384 x 384, the sides rounded to multiples of 32 at the source's aspect: `calculate_dimensions`), announced in the
  text as "Picture i: <|vision_start|><|image_pad|><|vision_end|>" before the instruction, inside the pipeline's
  system / user / assistant template, and read by Qwen2.5-VL with its vision tower (the pipeline's `processor`);
  the last hidden state past the template's first 64 tokens is the text conditioning;
- the reference latents: each source resized to about VAE_IMAGE_SIZE pixels (1024 x 1024), VAE-encoded (the mode),
  normalised by the VAE's latents_mean / latents_std, packed 2 x 2 and appended after the latents along the sequence,
  each with its own entry in `img_shapes`; the output keeps only the target's tokens;
- the negative of true CFG is the empty prompt with the same pictures (the pipeline's `negative_prompt=""`).

The two sizes are read from the pipeline's module at every call, as the pipeline reads them. The stock pipeline takes
one prompt at a time; a batch here is its samples encoded one by one (each with its own sources) and padded to the
longest text with its mask, as Qwen-Image pads its prompts. The conditioning carries the reference tokens
("image_latents", (B, M, 64)), their shapes ("image_shapes", (B, R, 2): each reference's (h/2, w/2) in latent
pixels) and the negative's text ("negative_prompt_embeds", "negative_prompt_embeds_mask"), so that the trainers' CFG
(which pass the empty prompt's conditioning) guides away from the negative with the pictures, as the pipeline. Every
sample of a batch has as many sources, of one size (--edit_data checks the size). A sample without a source is drawn
from its prompt alone, as the pipeline without `image`.
"""

from __future__ import annotations

import torch

from refl_ddpo.core.edit_data import source_tensors, to_pil
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families.base import Cond, cond_cat
from refl_ddpo.core.families.qwen_image import QwenImage


class QwenImageEditPlus(QwenImage):
    name = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    edits_images = True

    def prompt_reader(self):
        """The tokenizer and the pipeline's `tokenizer_max_length` (1024; it truncates nothing itself)."""
        return self.pipe.tokenizer, self.pipe.tokenizer_max_length

    def encode_conditioning(
        self, prompts: list[str], metadata: list[dict] | None, with_negative: bool
    ) -> tuple[Cond, Cond | None]:
        """Per sample: the instruction with its pictures through Qwen2.5-VL, the empty prompt with them (the
        negative), the sources' reference tokens; padded into one batch (see the module doc)."""
        sources = [[to_pil(s) for s in source_tensors(m)] for m in metadata or [{}] * len(prompts)]
        if not any(sources):
            return self.encode_prompts(prompts, with_negative)
        if len({len(s) for s in sources}) != 1:
            raise UserError(
                f"Qwen-Image-Edit-Plus: the samples of a batch have {sorted({len(s) for s in sources})} source images; "
                "give every --edit_data line as many images."
            )
        with torch.no_grad(), self.text_encoders_on_device():
            texts = [self._encode_with_pictures(p, s) for p, s in zip(prompts, sources, strict=True)]
            negatives = [self._encode_with_pictures("", s) for s in sources]
            latents, shapes = self.encode_sources(sources)
        cond, negative = cond_cat(texts), cond_cat(negatives)
        cond |= {"image_latents": latents, "image_shapes": shapes}
        cond |= {f"negative_{k}": v for k, v in negative.items()}
        return cond, (negative if with_negative else None)

    def _encode_with_pictures(self, prompt: str, images: list) -> Cond:
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock

        pictures = []
        for image in images:
            width, height = stock.calculate_dimensions(
                stock.CONDITION_IMAGE_SIZE, image.size[0] / image.size[1]
            )
            pictures.append(self.pipe.image_processor.resize(image, height, width))
        embeds, mask = self.pipe.encode_prompt(prompt=[prompt], image=pictures, device=self.pipe.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def encode_sources(self, sources: list[list]) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples' sources (PIL) -> their packed reference tokens (B, M, 64) and each reference's (h/2, w/2)
        (B, R, 2), as the pipeline's `prepare_latents`."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock

        pipe, tokens, shapes = self.pipe, [], []
        for images in sources:
            mine, sizes = [], []
            for image in images:
                width, height = stock.calculate_dimensions(
                    stock.VAE_IMAGE_SIZE, image.size[0] / image.size[1]
                )
                pixels = pipe.image_processor.preprocess(image, height, width).unsqueeze(2)  # (1, 3, 1, H, W)
                z = pipe._encode_vae_image(pixels.to(pipe.device, self.vae.dtype), None)  # (1, 16, 1, h, w)
                h, w = z.shape[3:]
                mine.append(pipe._pack_latents(z, 1, z.shape[1], h, w))
                sizes.append((h // 2, w // 2))
            tokens.append(torch.cat(mine, dim=1))
            shapes.append(sizes)
        if len({t.shape for t in tokens}) != 1:
            raise UserError(
                "Qwen-Image-Edit-Plus: the source images of a batch must share one size; check --edit_data."
            )
        return torch.cat(tokens), torch.tensor(shapes, device=pipe.device)

    def with_references(self, packed: torch.Tensor, shape: tuple, cond: Cond) -> tuple[torch.Tensor, list]:
        """The latents' tokens, then the sources' (B, N + M, 64); `img_shapes`: per sample the target's shape, then
        each source's."""
        refs = cond.get("image_latents")
        if refs is None:
            return super().with_references(packed, shape, cond)
        sources = [[(1, h, w) for h, w in sample] for sample in cond["image_shapes"].tolist()]
        return torch.cat([packed, refs.to(packed.dtype)], dim=1), [[shape, *s] for s in sources]

    def negative(self, cond: Cond, uncond: Cond) -> Cond:
        """The empty prompt with the sample's pictures (the pipeline's negative), where the conditioning has them."""
        if "negative_prompt_embeds" not in cond:
            return uncond
        return {
            "prompt_embeds": cond["negative_prompt_embeds"],
            "prompt_embeds_mask": cond["negative_prompt_embeds_mask"],
        }
