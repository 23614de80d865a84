"""FLUX.1 (dev and schnell): a `FluxTransformer2DModel` predicting the flow-matching velocity on 2x2-packed latents
with rotary position ids, CLIP (pooled) + T5 (sequence) text, `FlowMatchEulerDiscreteScheduler` with the
resolution-dependent shift `mu`, 16 latent channels stored as (z - shift_factor) * scaling_factor.

Everything the stock `FluxPipeline.__call__` does by default is kept, so the same seed gives the same image: its
`encode_prompt` (CLIP's pooled output, T5's hidden states, `max_sequence_length` 512), its noise (drawn as
(B, 16, h, w), then packed), its sigmas `linspace(1, 1 / T, T)` shifted by `mu = calculate_shift(image tokens)`,
the transformer called with `timestep / 1000`, the guidance embedding and the position ids, its Euler step and its
VAE decode. The flow maths (Euler step, Flow-GRPO's SDE step, x0, the forward process, the KLs) are SD3's.

Latents stay in the VAE's layout (B, 16, h, w) everywhere outside the network call: `predict` packs them into the
transformer's (B, h/2 * w/2, 64) tokens and unpacks its output (pure permutations, so the values are the
pipeline's), and the loop, the steps, the sample buffers and the forward process see 4-D latents as for SD3.

Guidance. The kit's `guidance_scale` is the pipeline's `guidance_scale`: the embedded guidance that FLUX.1-dev
(`transformer.config.guidance_embeds`) takes as an input, ignored by schnell (no guidance embedding, as in the
pipeline). A guidance flag left unset takes the pipeline's default, 3.5 (`embedded_guidance_default`), not the CFG
default of an SD trainer (7.5, or 1 where CFG is off), which would be a different image here. FLUX.1 is
guidance-distilled, so true classifier-free guidance is off: `true_cfg_scale` (the pipeline's argument of that name,
1.0 here) above 1 turns it on against the empty prompt, two network calls per step as the pipeline (where the caller
passes an uncond: the kit's callers encode one when `guidance_scale` > 1, or take `empty_cond()`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from refl_ddpo.core.families.base import Cond
from refl_ddpo.core.families.sd3 import StableDiffusion3


class Flux(StableDiffusion3):
    name = "flux"
    pipeline_class = "FluxPipeline"
    # The attention projections of both streams of the double blocks (the single blocks' attention has to_q / to_k /
    # to_v too) and the single blocks' MLP input and fused output projections (`proj_out` also names the network's
    # final output layer, which is adapted with them); diffusers' FLUX LoRA loader reads all of them.
    lora_target_modules: ClassVar[list[str]] = [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "proj_mlp",
        "proj_out",
    ]
    max_sequence_length = 512  # T5 tokens, the pipeline's default
    true_cfg_scale = 1.0  # the pipeline's true CFG (against the empty prompt) is on above 1; off by default
    embedded_guidance_default = 3.5  # FluxPipeline.__call__'s guidance_scale default

    @property
    def native_resolution(self) -> int:
        """The pipeline's default image side: default_sample_size (128) x the VAE scale factor (1024 for FLUX.1)."""
        return int(self.pipe.default_sample_size) * self.vae_scale_factor

    def prompt_reader(self):
        """T5 and `max_sequence_length`: it reads the text sequence (CLIP, cut at 77 tokens, gives the pooled
        vector only)."""
        return self.pipe.tokenizer_2, self.max_sequence_length

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The pipeline's own `encode_prompt` (T5's hidden states, CLIP's pooled output). The negative, the empty
        prompt, is encoded only for true CFG (`true_cfg_scale` > 1; None otherwise: the embedded guidance needs
        none, and T5 is not run for nothing). The text position ids are zeros (`text_ids`), made at the network
        call."""
        return self._encode_with_empty(prompts, with_negative and self.true_cfg_scale > 1.0)

    def _encode(self, prompts: list[str]) -> Cond:
        embeds, pooled, _ = self._pipeline_encode(prompts, prompt_2=None)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def text_ids(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """(L, 3) zeros, as `encode_prompt` returns them (in the first text encoder's dtype)."""
        dtype = self.pipe.text_encoder.dtype if self.pipe.text_encoder is not None else self.network.dtype
        return torch.zeros(prompt_embeds.shape[1], 3, device=prompt_embeds.device, dtype=dtype)

    def initial_noise(self, batch_size: int, resolution: int, generator, dtype: torch.dtype) -> torch.Tensor:
        """N(0, 1) latents (B, 16, h, w) as `prepare_latents` draws them before packing."""
        from diffusers.utils.torch_utils import randn_tensor

        f = self.vae_scale_factor
        if resolution % (2 * f):
            raise ValueError(
                f"resolution {resolution} is not a multiple of {2 * f} (VAE scale factor x 2x2 packing)"
            )
        shape = (batch_size, self.network.config.in_channels // 4, resolution // f, resolution // f)
        return randn_tensor(shape, generator=generator, device=self.pipe.device, dtype=dtype)

    def set_timesteps(self, scheduler, num_inference_steps: int, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: sigmas linspace(1, 1 / T, T) (none when the config says `use_flow_sigmas`) and the
        shift `mu` from the image's token count (h/2 * w/2) and the scheduler config's base / max sequence lengths
        and shifts; the scheduler uses `mu` where its config says `use_dynamic_shifting`."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        n = num_inference_steps
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        c = scheduler.config
        mu = calculate_shift(
            (latents.shape[-2] // 2) * (latents.shape[-1] // 2),
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        if sigmas is None:
            scheduler.set_timesteps(n, device="cpu", mu=mu)  # on the host: see the base class
        else:
            scheduler.set_timesteps(sigmas=sigmas, device="cpu", mu=mu)
        return scheduler.timesteps

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) -> (B, h/2 * w/2, 4C): the pipeline's `_pack_latents`."""
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)

    def unpack(self, packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, h/2 * w/2, 4C) -> (B, C, h, w): the pipeline's `_unpack_latents`."""
        f = self.vae_scale_factor
        return self.pipe._unpack_latents(packed, h * f, w * f, f)

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
        """Velocity (B, 16, h, w). `guidance_scale` is the embedded guidance where the transformer takes one
        (dev; schnell: unused); true CFG (`true_cfg_scale` > 1 and `uncond` given) as the pipeline: two calls,
        uncond + s (text - uncond). `timesteps` (values of `scheduler.timesteps`) is a scalar or one per sample
        (B,). Latents kept in float32 (the SDE step's) are cast to the text embeddings' dtype."""
        transformer = network if network is not None else self.network
        dtype = cond["prompt_embeds"].dtype
        b, _, h, w = latents.shape
        packed = self.pack(latents.to(dtype))
        timesteps = (timesteps.expand(b) if timesteps.ndim == 0 else timesteps).to(dtype)
        guidance = None
        if self.network.config.guidance_embeds:  # the pipeline's transformer: `network` may be wrapped (DDP)
            guidance = torch.full([1], guidance_scale, device=latents.device, dtype=torch.float32).expand(b)
        img_ids = self.constant(
            ("img_ids", h, w, latents.device, dtype),
            lambda: self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, dtype),
        )
        kwargs = {
            "timestep": timesteps / 1000,
            "guidance": guidance,
            "img_ids": img_ids,
            "return_dict": False,
        }
        n = packed.shape[1]  # the image's own tokens; an edit family appends its references' after them
        packed, kwargs["img_ids"] = self.with_references(packed, img_ids, cond)
        v = transformer(hidden_states=packed, **self._text_kwargs(cond), **kwargs)[0][:, :n]
        if self.true_cfg_scale > 1.0 and uncond is not None:
            v_uncond = transformer(hidden_states=packed, **self._text_kwargs(uncond), **kwargs)[0][:, :n]
            v = v_uncond + self.true_cfg_scale * (v - v_uncond)
        return self.unpack(v, h, w)

    def with_references(
        self, packed: torch.Tensor, img_ids: torch.Tensor, cond: Cond
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's image tokens (B, N, 64) and their position ids (N, 3): the latents' alone here; FLUX.1
        Kontext appends its source images' (families/flux_kontext.py)."""
        return packed, img_ids

    def _text_kwargs(self, cond: Cond) -> dict:
        embeds = cond["prompt_embeds"]
        return {
            "encoder_hidden_states": embeds,
            "pooled_projections": cond["pooled_prompt_embeds"],
            "txt_ids": self.text_ids(embeds),
        }
