"""Qwen-Image: a `QwenImageTransformer2DModel` (MMDiT) predicting the flow-matching velocity on 2x2-packed latents,
a Qwen2.5-VL text encoder read through a chat template, `FlowMatchEulerDiscreteScheduler` with the
resolution-dependent shift `mu`, and the `AutoencoderKLQwenImage` (a video VAE used on one frame) whose 16 latent
channels are stored as (z - latents_mean) / latents_std.

Everything the stock `QwenImagePipeline.__call__` does is kept, so the same seed gives the same image: its
`encode_prompt` (the prompt inside the pipeline's system / user / assistant template, the text encoder's last hidden
state at the attention mask's tokens, the template's first `prompt_template_encode_start_idx` tokens dropped, padded
to the batch's longest prompt with its mask, cut at `max_sequence_length` 512), its noise (drawn as (B, 1, 16, h, w),
the same values as (B, 16, h, w)), its sigmas `linspace(1, 1 / T, T)` shifted by `mu = calculate_shift(image
tokens)`, the transformer called with `timestep / 1000` and `img_shapes`, its Euler step and its VAE decode. The flow
maths (Euler step, Flow-GRPO's SDE step, x0, the forward process, the KLs) are SD3's; packing, noise and the shift
are FLUX.1's (the same as the pipeline's).

Guidance. Qwen-Image is not guidance-distilled: the kit's `guidance_scale` is the pipeline's `true_cfg_scale`, on
above 1 where the caller passes an uncond (the empty prompt, as `negative_prompt=""`): two network calls per step,
uncond + s (text - uncond), rescaled per image token to the norm of the text prediction (the pipeline's rule).

The conditioning is {"prompt_embeds": (B, L, 3584), "prompt_embeds_mask": (B, L)} with L the batch's longest prompt;
`cond_cat` right-pads shorter batches with zeros (masked out).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from refl_ddpo.core.families.base import Cond
from refl_ddpo.core.families.flux import Flux
from refl_ddpo.core.families.sd3 import StableDiffusion3


class QwenImage(Flux):
    name = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    # SD3's (the joint attention's projections of the image and text streams) and both streams' MLPs (Flow-GRPO's
    # Qwen-Image targets); diffusers' QwenImage LoRA loader reads them under `transformer.`.
    lora_target_modules: ClassVar[list[str]] = [
        *StableDiffusion3.lora_target_modules,
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    ]
    max_sequence_length = 512  # text tokens after the template's dropped head, the pipeline's default
    # Not guidance-distilled: the guidance flags are classifier-free guidance, so an unset one keeps its own CFG
    # default (where the kit resolves unset guidance flags by family) rather than FLUX.1's embedded 3.5.
    embedded_guidance_default: ClassVar[float | None] = None

    def prompt_reader(self):
        """The Qwen tokenizer and the prompt tokens that fit in `max_sequence_length` beside the template's kept
        tail (the tokens of the template past the dropped head)."""
        pipe = self.pipe
        template = len(pipe.tokenizer(pipe.prompt_template_encode.format("")).input_ids)
        return pipe.tokenizer, self.max_sequence_length - (template - pipe.prompt_template_encode_start_idx)

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The pipeline's own `encode_prompt`; the negative is the empty prompt (None unless `with_negative`)."""
        return self._encode_with_empty(prompts, with_negative)

    def _encode(self, prompts: list[str]) -> Cond:
        embeds, mask = self._pipeline_encode(prompts)
        if mask is None:  # the pipeline drops a mask of all ones; the kit keeps one so batches can be padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

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
        """Velocity (B, 16, h, w). True CFG as the pipeline when guidance_scale > 1 and `uncond` is given: the text
        call, the uncond call, their combination rescaled per token to the text prediction's norm. `timesteps` (values
        of `scheduler.timesteps`) is a scalar or one per sample (B,). Latents kept in float32 (the SDE step's) are cast
        to the text embeddings' dtype."""
        transformer = network if network is not None else self.network
        dtype = cond["prompt_embeds"].dtype
        b, _, h, w = latents.shape
        packed = self.pack(latents.to(dtype))
        n = packed.shape[1]  # the image's own tokens; an edit family appends its references' after them
        timesteps = (timesteps.expand(b) if timesteps.ndim == 0 else timesteps).to(dtype)
        packed, img_shapes = self.with_references(packed, (1, h // 2, w // 2), cond)
        kwargs = {"timestep": timesteps / 1000, "img_shapes": img_shapes, "return_dict": False}
        v = transformer(hidden_states=packed, **self._text_kwargs(cond), **kwargs)[0][:, :n]
        if guidance_scale > 1.0 and uncond is not None:
            negative = self._text_kwargs(self.negative(cond, uncond))
            v_uncond = transformer(hidden_states=packed, **negative, **kwargs)[0][:, :n]
            guided = v_uncond + guidance_scale * (v - v_uncond)
            v = guided * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))
        return self.unpack(v, h, w)

    def with_references(self, packed: torch.Tensor, shape: tuple, cond: Cond) -> tuple[torch.Tensor, list]:
        """The transformer's image tokens (B, N, 64) and `img_shapes` (per sample, the (frames, h/2, w/2) of each
        image in the sequence): the latents' alone here; Qwen-Image-Edit-Plus appends its sources'
        (families/qwen_image_edit.py)."""
        return packed, [[shape]] * packed.shape[0]

    def negative(self, cond: Cond, uncond: Cond) -> Cond:
        """The conditioning true CFG guides away from: `uncond` here; an edit family's carries its sources."""
        return uncond

    def unpack(self, packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, h/2 * w/2, 4C) -> (B, C, h, w): the pipeline's `_unpack_latents` without its frame axis."""
        return super().unpack(packed, h, w)[:, :, 0]

    def _text_kwargs(self, cond: Cond) -> dict:
        """The text and its mask, None where every token is kept (as the pipeline passes it)."""
        mask = cond["prompt_embeds_mask"]
        return {
            "encoder_hidden_states": cond["prompt_embeds"],
            "encoder_hidden_states_mask": None if bool(mask.all()) else mask,
        }

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """z = latents / (1 / latents_std) + latents_mean per channel (the pipeline's arithmetic), decoded as one
        frame."""
        vae = self.vae
        latents = latents.to(vae.dtype)[:, :, None]  # (B, 16, 1, h, w): one frame
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        images = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)
