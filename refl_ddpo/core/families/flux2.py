"""FLUX.2 [dev] and [klein]: a `Flux2Transformer2DModel` predicting the flow-matching velocity on patchified latents
(the VAE's 32 channels in 2 x 2 patches: 128 channels at 1/16 of the image side) with 4-D rotary position ids, a
decoder LLM's hidden-state stack as the text (Mistral-Small-3.1 for [dev], Qwen3 for [klein]),
`FlowMatchEulerDiscreteScheduler` with FLUX.2's empirical shift `mu`, and the `AutoencoderKLFlux2` whose patchified
latents are stored batch-normalised, (z - running_mean) / sqrt(running_var + eps).

Everything the stock `Flux2Pipeline.__call__` / `Flux2KleinPipeline.__call__` does for text-to-image is kept, so the
same seed gives the same image: their `encode_prompt` (the prompt in the text encoder's chat template, [dev]'s with
its system message, padded to `max_sequence_length` 512; the hidden states of layers (10, 20, 30) for [dev], (9, 18,
27) for [klein], stacked along the width: (B, 512, 3 x width)), their noise (drawn as (B, 128, h, w), already
patchified, then packed), their sigmas `linspace(1, 1 / T, T)` shifted by `mu = compute_empirical_mu(h * w, T)`, the
transformer called with `timestep / 1000`, the text and image position ids, their Euler step, their latent
de-normalisation, unpatchifying and VAE decode. The flow maths (Euler step, Flow-GRPO's SDE step, x0, the forward
process, the KLs) are SD3's.

Latents stay in the pipeline's patchified layout (B, 128, h, w) everywhere outside the network call: `predict` packs
them into the transformer's (B, h * w, 128) tokens and back (a transpose, so the values are the pipeline's), and the
loop, the steps, the sample buffers and the forward process see 4-D latents as for SD3.

Guidance. [dev] is guidance-distilled: the kit's `guidance_scale` is the embedded guidance the transformer takes as an
input (`transformer.config.guidance_embeds`), never classifier-free guidance (the pipeline has none), and a guidance
flag left unset takes the pipeline's default 4.0 (`embedded_guidance_default`). [klein] has no guidance embedding:
the undistilled base guides with CFG against the empty prompt (two network calls, uncond + s (text - uncond), as the
pipeline) when `guidance_scale` > 1; the step-distilled [klein] (model_index.json's `is_distilled`) ignores every
guidance scale, as the pipeline does, so it never gets CFG and the empty prompt is not even encoded.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from refl_ddpo.core.edit_data import source_tensors, to_pil
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families.base import Cond
from refl_ddpo.core.families.sd3 import StableDiffusion3


class Flux2(StableDiffusion3):
    name = "flux2"
    pipeline_class = "Flux2Pipeline"
    # The double blocks' attention projections of both streams and both streams' MLPs, and the single blocks' fused
    # QKV + MLP input projection (Flow-Factory's FLUX.2 defaults). The single blocks' output projection
    # (`attn.to_out`, a Linear there) shares its name with the double blocks' `attn.to_out` ModuleList, which peft
    # cannot adapt, so it is not among the defaults.
    lora_target_modules: ClassVar[list[str]] = [
        *StableDiffusion3.lora_target_modules,
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "to_qkv_mlp_proj",
    ]
    max_sequence_length = 512  # text tokens, the pipeline's default (every prompt is padded to it)
    embedded_guidance_default: ClassVar[float | None] = 4.0  # Flux2Pipeline.__call__'s guidance_scale default
    edits_images = True  # reference images, the pipelines' `image` (`encode_conditioning`)

    def __init__(self, pipe):
        import logging

        super().__init__(pipe)
        # [dev]'s encode_prompt hands padding and truncation to the processor's apply_chat_template as plain
        # keywords, which transformers takes and warns about at every call (every batch of a run).
        logging.getLogger("transformers.processing_utils").setLevel(logging.ERROR)

    @property
    def native_resolution(self) -> int:
        """The pipeline's default image side: default_sample_size (128) x the VAE scale factor (1024 for FLUX.2)."""
        return int(self.pipe.default_sample_size) * self.vae_scale_factor

    def uses_cfg(self) -> bool:
        """Whether a guidance scale above 1 turns on classifier-free guidance: never on [dev] (embedded guidance)."""
        return False

    def _chat(self, prompt: str) -> str:
        """The text `encode_prompt` tokenizes for `prompt`: the system turn and the user turn in the chat template."""
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        return self.pipe.tokenizer.apply_chat_template(
            format_input([prompt], self.pipe.system_message), tokenize=False
        )[0]

    def prompt_reader(self):
        """The text tokenizer and the prompt tokens that fit in `max_sequence_length` beside the chat template's."""
        tokenizer = getattr(self.pipe.tokenizer, "tokenizer", self.pipe.tokenizer)  # [dev]'s is a processor
        template = len(tokenizer(self._chat(""), add_special_tokens=False).input_ids)
        return tokenizer, self.max_sequence_length - template

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The pipeline's own `encode_prompt`; the negative, the empty prompt, only where CFG can be on (`uses_cfg`;
        None otherwise). The text position ids are made at the network call."""
        return self._encode_with_empty(prompts, with_negative and self.uses_cfg())

    def _encode(self, prompts: list[str]) -> Cond:
        embeds, _ = self._pipeline_encode(prompts)
        return {"prompt_embeds": embeds}

    def initial_noise(self, batch_size: int, resolution: int, generator, dtype: torch.dtype) -> torch.Tensor:
        """N(0, 1) latents (B, 128, h, w), patchified, as `prepare_latents` draws them before packing."""
        from diffusers.utils.torch_utils import randn_tensor

        f = 2 * self.vae_scale_factor
        if resolution % f:
            raise ValueError(
                f"resolution {resolution} is not a multiple of {f} (VAE scale factor x 2x2 patches)"
            )
        shape = (batch_size, self.network.config.in_channels, resolution // f, resolution // f)
        return randn_tensor(shape, generator=generator, device=self.pipe.device, dtype=dtype)

    def set_timesteps(self, scheduler, num_inference_steps: int, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: sigmas linspace(1, 1 / T, T) (none when the config says `use_flow_sigmas`) and FLUX.2's
        shift `mu` from the image's token count (h * w) and the number of steps; the scheduler uses `mu` where its
        config says `use_dynamic_shifting`."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        n = num_inference_steps
        mu = compute_empirical_mu(latents.shape[-2] * latents.shape[-1], n)
        if scheduler.config.get("use_flow_sigmas", False):
            scheduler.set_timesteps(n, device="cpu", mu=mu)  # on the host: see the base class
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), device="cpu", mu=mu)
        return scheduler.timesteps

    def predict(
        self,
        latents,
        timesteps,
        scheduler,
        cond: Cond,
        uncond: Cond | None,
        guidance_scale: float,
        network=None,
    ) -> torch.Tensor:
        """Velocity (B, 128, h, w). `guidance_scale` is the embedded guidance where the transformer takes one
        ([dev]); CFG (`uses_cfg`, guidance_scale > 1 and `uncond` given: [klein] base) as the pipeline: two calls,
        uncond + s (text - uncond). `timesteps` (values of `scheduler.timesteps`) is a scalar or one per sample
        (B,). Latents kept in float32 (the SDE step's) are cast to the text embeddings' dtype."""
        transformer = network if network is not None else self.network
        dtype = cond["prompt_embeds"].dtype
        b, c, h, w = latents.shape
        packed = latents.to(dtype).reshape(b, c, h * w).transpose(1, 2)  # the pipeline's _pack_latents
        timesteps = (timesteps.expand(b) if timesteps.ndim == 0 else timesteps).to(dtype)
        guidance = None
        if self.network.config.guidance_embeds:  # the pipeline's transformer: `network` may be wrapped (DDP)
            guidance = torch.full([1], guidance_scale, device=latents.device, dtype=torch.float32).expand(b)
        img_ids = self.constant(
            ("img_ids", b, h, w, latents.device),
            lambda: self.pipe._prepare_latent_ids(latents[:, :0]).to(latents.device),
        )
        n = packed.shape[1]  # the image's own tokens, then the reference images' (`with_references`)
        packed, img_ids = self.with_references(packed, img_ids, cond)
        kwargs = {
            "timestep": timesteps / 1000,
            "guidance": guidance,
            "img_ids": img_ids,
            "return_dict": False,
        }
        v = transformer(hidden_states=packed, **self._text_kwargs(cond), **kwargs)[0][:, :n]
        if self.uses_cfg() and guidance_scale > 1.0 and uncond is not None:
            v_uncond = transformer(hidden_states=packed, **self._text_kwargs(uncond), **kwargs)[0][:, :n]
            v = v_uncond + guidance_scale * (v - v_uncond)
        return v.transpose(1, 2).reshape(b, c, h, w)

    def encode_conditioning(
        self, prompts: list[str], metadata: list[dict] | None, with_negative: bool
    ) -> tuple[Cond, Cond | None]:
        """The text conditioning, and the samples' reference images (`metadata[i]["source_images"]`, as many for
        each sample) as the pipelines' `image`: their packed tokens "image_latents" (B, M, 128) and position ids
        "image_latent_ids" (B, M, 4)."""
        cond, uncond = self.encode_prompts(prompts, with_negative)
        sources = [source_tensors(m) for m in metadata or [{}] * len(prompts)]
        if not any(sources):
            return cond, uncond
        tokens, ids = zip(*(self.encode_references(s) for s in sources), strict=True)
        if len({t.shape for t in tokens}) != 1:
            raise UserError(
                "FLUX.2: the samples of a batch need as many reference images of one size; check --edit_data."
            )
        return {**cond, "image_latents": torch.cat(tokens), "image_latent_ids": torch.cat(ids)}, uncond

    @torch.no_grad()
    def encode_references(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample's reference images (3, H, W) -> tokens (1, M, 128) and ids (1, M, 4), as the pipeline: an image
        over 1024 x 1024 px resized to that area, cropped to multiples of 2 x the VAE scale factor, VAE-encoded (the
        mode), patchified and batch-normalised, the i-th at time coordinate 10 + 10 i (`prepare_image_latents`)."""
        pipe, multiple, pictures = self.pipe, self.vae_scale_factor * 2, []
        for image in map(to_pil, images):
            try:
                pipe.image_processor.check_image_input(image)  # e.g. at least 64 px a side
            except ValueError as e:
                raise UserError(f"FLUX.2's reference images: {e}") from None
            if image.size[0] * image.size[1] > 1024 * 1024:
                image = pipe.image_processor._resize_to_target_area(image, 1024 * 1024)
            width, height = (side // multiple * multiple for side in image.size)
            pictures.append(
                pipe.image_processor.preprocess(image, height=height, width=width, resize_mode="crop")
            )
        return pipe.prepare_image_latents(pictures, 1, None, pipe.device, self.vae.dtype)

    def with_references(
        self, packed: torch.Tensor, img_ids: torch.Tensor, cond: Cond
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents' tokens (B, N, 128), then the references' (B, N + M, 128), and their ids (B, N + M, 4)."""
        if "image_latents" not in cond:
            return packed, img_ids
        refs, ref_ids = cond["image_latents"], cond["image_latent_ids"]
        return torch.cat([packed, refs.to(packed.dtype)], dim=1), torch.cat(
            [img_ids, ref_ids.to(img_ids)], dim=1
        )

    def _text_kwargs(self, cond: Cond) -> dict:
        """The text and its position ids (B, L, 4) as `encode_prompt` returns them: (0, 0, 0, l) for token l."""
        embeds = cond["prompt_embeds"]
        key = ("txt_ids", *embeds.shape[:2], embeds.device)
        txt_ids = self.constant(key, lambda: self.pipe._prepare_text_ids(embeds[:, :, :0]).to(embeds.device))
        return {"encoder_hidden_states": embeds, "txt_ids": txt_ids}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """z = latents * sqrt(running_var + eps) + running_mean per patchified channel (the VAE's batch norm, the
        pipeline's arithmetic), unpatchified to (B, 32, 2h, 2w) and decoded."""
        vae = self.vae
        latents = latents.to(vae.dtype)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = self.pipe._unpatchify_latents(latents * std.to(latents.device, latents.dtype) + mean)
        images = vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


class Flux2Klein(Flux2):
    name = "flux2_klein"
    pipeline_class = "Flux2KleinPipeline"
    # No guidance embedding: the guidance flags are classifier-free guidance on the base (an unset one keeps its own
    # CFG default) and ignored on the distilled model.
    embedded_guidance_default: ClassVar[float | None] = None

    @classmethod
    def variant(cls, name: str) -> type[Flux2Klein]:
        """The [klein] base, or `Flux2KleinDistilled` where model_index.json says `is_distilled`."""
        from refl_ddpo.core.models import model_index

        return Flux2KleinDistilled if model_index(name).get("is_distilled", False) else cls

    def uses_cfg(self) -> bool:
        """CFG on the undistilled base; never on the step-distilled model (the pipeline's `is_distilled`)."""
        return not self.pipe.config.get("is_distilled", False)

    def _chat(self, prompt: str) -> str:
        return self.pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )


class Flux2KleinDistilled(Flux2Klein):
    """The step-distilled FLUX.2 [klein]: it ignores every guidance scale, so the guidance flags the user leaves unset
    take 1 (no CFG) and the saved config says what ran."""

    @classmethod
    def default_guidance_scale(cls, cfg_default: float) -> float:
        return 1.0
