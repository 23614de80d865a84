"""Z-Image and Z-Image-Turbo: a `ZImageTransformer2DModel` (a single-stream DiT: image and caption tokens refined
apart, then joint layers) predicting the negated flow-matching velocity on lists of latents, a Qwen3 text encoder
read through its chat template, `FlowMatchEulerDiscreteScheduler` with a fixed shift, and FLUX.1's VAE, whose 16
latent channels are stored as (z - shift_factor) * scaling_factor.

Everything the stock `ZImagePipeline.__call__` does by default is kept, so the same seed gives the same image: its
`encode_prompt` (the prompt inside the tokenizer's chat template, padded to `max_sequence_length` 512, the text
encoder's second-to-last hidden state at the attention mask's tokens: one sequence per prompt, of its own length),
its noise (float32, (B, 16, h, w)), its sigmas `linspace(1, 1 / T, T)` (shifted by the scheduler's `shift`; the `mu`
it passes counts only where the config says `use_dynamic_shifting`), the transformer called on the list of latents
(each (16, 1, h, w)) with `(1000 - timestep) / 1000`, its output negated to the velocity, the Euler step in float32
and the VAE decode. The flow maths (Euler step, Flow-GRPO's SDE step, x0, the forward process, the KLs) are SD3's.

Guidance. The pipeline guides as `text + g (text - uncond)`, CFG on for its `guidance_scale` g > 0 (default 5.0;
0 for the Turbo). That is the kit's classifier-free guidance `uncond + s (text - uncond)` with s = g + 1, so the
kit's guidance flags keep their meaning on every family (1 = off, CFG above 1): the kit's s runs the pipeline's
g = s - 1 (the pipeline's defaults of `cfg_truncation` and `cfg_normalization`: CFG at every step, no norm cap).

Z-Image-Turbo is guidance-distilled: it samples in 8 steps without CFG. Its folder has the same parts and
model_index.json as the base's; what tells them apart is the scheduler config, whose shift is 6.0 for Z-Image and
3.0 for the Turbo. A folder whose scheduler is not the base's is taken as the Turbo (`ZImageTurbo`): every guidance
flag left unset is 1 (no CFG), so a distilled model never gets CFG by mistake; a value the user sets is kept.

The conditioning is {"prompt_embeds": (B, L, 2560), "prompt_embeds_mask": (B, L)} with L the batch's longest prompt
(the pipeline's list of sequences, right-padded with zeros); `predict` hands the transformer each prompt's own
tokens again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch

from refl_ddpo.core.families.base import Cond
from refl_ddpo.core.families.sd3 import StableDiffusion3

BASE_SHIFT = 6.0  # Tongyi-MAI/Z-Image's scheduler_config.json (Z-Image-Turbo's: 3.0)


def scheduler_config(name: str) -> dict:
    """The scheduler config (scheduler/scheduler_config.json) of a local folder or hub id."""
    from refl_ddpo.core.models import looks_local

    if looks_local(name):
        return json.loads((Path(name).expanduser() / "scheduler" / "scheduler_config.json").read_text())
    from diffusers import FlowMatchEulerDiscreteScheduler

    return dict(FlowMatchEulerDiscreteScheduler.load_config(name, subfolder="scheduler"))


def padded_cond(embeds: list[torch.Tensor]) -> Cond:
    """The pipeline's list of (L_i, D) prompt embeddings as (B, L, D) right-padded with zeros, and its mask (B, L)."""
    n = max(e.shape[0] for e in embeds)
    out = embeds[0].new_zeros(len(embeds), n, embeds[0].shape[1])
    mask = torch.zeros(len(embeds), n, dtype=torch.long, device=out.device)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return {"prompt_embeds": out, "prompt_embeds_mask": mask}


def unpadded(cond: Cond) -> list[torch.Tensor]:
    """Each prompt's own tokens (L_i, D), as the pipeline passes them to the transformer."""
    mask = cond["prompt_embeds_mask"].bool()
    return [e[m] for e, m in zip(cond["prompt_embeds"], mask, strict=True)]


class ZImage(StableDiffusion3):
    name = "z_image"
    pipeline_class = "ZImagePipeline"
    # Every transformer block's attention projections and gated MLP (the noise and caption refiners' and the joint
    # layers'), Flow-Factory's default Z-Image targets; diffusers' Z-Image LoRA loader reads them under
    # `transformer.`.
    lora_target_modules: ClassVar[list[str]] = [
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    ]
    max_sequence_length = 512  # tokens of the templated prompt, the pipeline's default

    @classmethod
    def variant(cls, name: str) -> type[ZImage]:
        """Z-Image (the base's scheduler shift, 6.0) or `ZImageTurbo` (any other)."""
        return cls if scheduler_config(name).get("shift") == BASE_SHIFT else ZImageTurbo

    @property
    def native_resolution(self) -> int:
        """The pipeline's default image side, 1024."""
        return 1024

    def prompt_reader(self):
        """The Qwen tokenizer and the prompt tokens that fit in `max_sequence_length` beside the chat template's."""
        template = len(self.pipe.tokenizer(self._templated("")).input_ids)
        return self.pipe.tokenizer, self.max_sequence_length - template

    def _templated(self, prompt: str) -> str:
        message = [{"role": "user", "content": prompt}]
        return self.pipe.tokenizer.apply_chat_template(
            message, tokenize=False, add_generation_prompt=True, enable_thinking=True
        )

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The pipeline's own `encode_prompt` (which rewrites the list it is given: a copy goes in); the negative is
        the empty prompt (None unless `with_negative`)."""
        embeds, negative = self.pipe.encode_prompt(
            prompt=list(prompts),
            device=self.pipe.device,
            do_classifier_free_guidance=with_negative,
            max_sequence_length=self.max_sequence_length,
        )
        return padded_cond(embeds), (padded_cond(negative) if with_negative else None)

    def initial_noise(self, batch_size: int, resolution: int, generator, dtype: torch.dtype) -> torch.Tensor:
        """N(0, 1) latents (B, 16, h, w) in float32 whatever `dtype` (the pipeline draws and steps them in
        float32), as `prepare_latents` draws them."""
        from diffusers.utils.torch_utils import randn_tensor

        f = self.vae_scale_factor
        if resolution % (2 * f):
            raise ValueError(
                f"resolution {resolution} is not a multiple of {2 * f} (VAE scale factor x patch size 2)"
            )
        shape = (batch_size, self.network.config.in_channels, resolution // f, resolution // f)
        return randn_tensor(shape, generator=generator, device=self.pipe.device, dtype=torch.float32)

    def set_timesteps(self, scheduler, num_inference_steps: int, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: its sigmas `linspace(1, 1 / T, T)` and the shift `mu` from the image's token count (used
        only with `use_dynamic_shifting`)."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

        c = scheduler.config
        mu = calculate_shift(
            (latents.shape[-2] // 2) * (latents.shape[-1] // 2),
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        sigmas = get_default_z_image_sigmas(num_inference_steps)
        scheduler.set_timesteps(sigmas=sigmas, device="cpu", mu=mu)  # on the host: see the base class
        return scheduler.timesteps

    def texts(self, cond: Cond) -> list[torch.Tensor]:
        """The transformer's text input: each prompt's own tokens (`unpadded`)."""
        return unpadded(cond)

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
        """Velocity (B, 16, h, w) in float32. CFG as the pipeline when guidance_scale > 1 and `uncond` is given: one
        call on the list [text..., uncond...], then text + (s - 1) (text - uncond) per image in float32.
        `timesteps` (values of `scheduler.timesteps`) is a scalar or one per sample (B,). Latents are cast to the
        text embeddings' dtype."""
        transformer = network if network is not None else self.network
        b = latents.shape[0]
        x = latents.to(cond["prompt_embeds"].dtype).unsqueeze(2)  # (B, 16, 1, h, w): one frame
        t = (1000 - (timesteps.expand(b) if timesteps.ndim == 0 else timesteps)) / 1000
        texts = self.texts(cond)
        doubled = guidance_scale > 1.0 and uncond is not None
        if doubled:
            x, t, texts = torch.cat([x, x]), torch.cat([t, t]), texts + self.texts(uncond)
        out = transformer(list(x.unbind(0)), t, texts, return_dict=False)[0]
        out = torch.stack([o.float() for o in out]).squeeze(2)
        if doubled:
            text, negative = out[:b], out[b:]
            out = text + (guidance_scale - 1.0) * (text - negative)
        return -out


class ZImageTurbo(ZImage):
    """Z-Image-Turbo: guidance-distilled, so the guidance flags the user leaves unset take 1 (no CFG), the
    pipeline's `guidance_scale=0.0` for the Turbo."""

    @classmethod
    def default_guidance_scale(cls, cfg_default: float) -> float:
        return 1.0
