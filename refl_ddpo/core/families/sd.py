"""Stable Diffusion 1.x / 2.x: UNet with epsilon (or v) prediction, one CLIP text encoder, DDIM / DDPM schedulers,
4 latent channels scaled by `scaling_factor`."""

from __future__ import annotations

import functools
import inspect
from typing import ClassVar

import torch

from refl_ddpo.core.families.base import Cond, ModelFamily, cfg_combine, cfg_inputs
from refl_ddpo.core.steps.ddim import ddim_step_kl, ddim_step_mean, ddim_step_with_logprob_and_x0


class StableDiffusion(ModelFamily):
    name = "sd"
    pipeline_class = "StableDiffusionPipeline"
    network_name = "unet"
    lora_target_modules: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0"]
    # Only schedulers whose step returns pred_original_sample, which the loop reads (PNDM and DPM-Solver do not).
    schedulers: ClassVar[dict[str, str]] = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler"}

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        prompt_embeds, negative = self.pipe.encode_prompt(prompts, self.pipe.device, 1, with_negative)
        return {"prompt_embeds": prompt_embeds}, (None if negative is None else {"prompt_embeds": negative})

    def initial_noise(self, batch_size: int, resolution: int, generator, dtype: torch.dtype) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        f = self.vae_scale_factor
        if resolution % f:
            raise ValueError(f"resolution {resolution} is not a multiple of the VAE scale factor {f}")
        shape = (batch_size, self.network.config.in_channels, resolution // f, resolution // f)
        return randn_tensor(shape, generator=generator, device=self.pipe.device, dtype=dtype)

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
        """Noise prediction (B, C, h, w), the UNet called with `unet_conditioning`'s arguments; CFG in one call on
        the doubled batch [uncond, text] (as the pipeline) when guidance_scale > 1 and `uncond` is given.
        `timesteps` is a scalar or one per sample (B,)."""
        unet = network if network is not None else self.network
        latents = scheduler.scale_model_input(latents, timesteps)
        x, t, c, doubled = cfg_inputs(latents, timesteps, cond, uncond, guidance_scale)
        out = unet(x, t, **self.unet_conditioning(x, c), return_dict=False)[0]
        return cfg_combine(out, guidance_scale, doubled)

    def unet_conditioning(self, latents: torch.Tensor, cond: Cond) -> dict:
        """The UNet's conditioning arguments for a batch of `latents` (the network's input): the text embeddings."""
        return {"encoder_hidden_states": cond["prompt_embeds"]}

    def step(self, scheduler, model_output, timestep, latents, eta: float, generator):
        out = scheduler.step(model_output, timestep, latents, **_step_kwargs(scheduler, eta, generator))
        # PNDM / DPM-Solver steps give no x0: None then (inference needs only the latents)
        return out.prev_sample, getattr(out, "pred_original_sample", None)

    def step_with_logprob(
        self, scheduler, model_output, timestep, latents, eta: float, generator=None, prev_sample=None
    ):
        return ddim_step_with_logprob_and_x0(
            scheduler, model_output, timestep, latents, eta=eta, generator=generator, prev_sample=prev_sample
        )

    def step_mean(self, scheduler, model_output, timestep, latents, eta: float):
        mean, std, _ = ddim_step_mean(scheduler, model_output, timestep, latents, eta)
        return mean.float(), std.reshape(-1).expand(latents.shape[0]).float()

    def step_kl(self, scheduler, model_output, ref_model_output, timesteps, eta: float) -> torch.Tensor:
        return ddim_step_kl(scheduler, model_output, ref_model_output, timesteps, eta)

    def x0_kl_weight(self, scheduler, timestep) -> float:
        # x_t = sqrt(a) x0 + sqrt(1 - a) eps at fixed x_t: eps - eps_ref = -sqrt(a / (1 - a)) (x0 - x0_ref)
        a = scheduler.alphas_cumprod[int(timestep)].item()
        return a / (1 - a)

    def _abar(self, scheduler, timesteps, like: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(timesteps).reshape(-1).long().cpu()
        a = scheduler.alphas_cumprod[t].float().expand(like.shape[0])
        return a.reshape(-1, *(1,) * (like.ndim - 1)).to(like.device)

    def pred_x0(self, scheduler, model_output, timesteps, latents) -> torch.Tensor:
        a, out, x = self._abar(scheduler, timesteps, latents), model_output.float(), latents.float()
        kind = scheduler.config.prediction_type
        if kind == "epsilon":
            return (x - (1 - a).sqrt() * out) / a.sqrt()
        if kind == "v_prediction":
            return a.sqrt() * x - (1 - a).sqrt() * out
        if kind == "sample":
            return out
        raise ValueError(f"prediction_type {kind!r} is not epsilon, v_prediction or sample")

    def training_target(self, scheduler, x0, noise, timesteps) -> torch.Tensor:
        kind = scheduler.config.prediction_type
        if kind == "v_prediction":
            a = self._abar(scheduler, timesteps, x0)
            return a.sqrt() * noise.float() - (1 - a).sqrt() * x0.float()
        return (noise if kind == "epsilon" else x0).float()

    def noise_level(self, scheduler, timesteps) -> torch.Tensor:
        t = torch.as_tensor(timesteps).reshape(-1).long().cpu()
        return (1 - scheduler.alphas_cumprod[t].float()).sqrt()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


@functools.cache
def _step_params(scheduler_cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(scheduler_cls.step).parameters)


def _step_kwargs(scheduler, eta: float, generator) -> dict:
    """The optional `eta` / `generator` arguments this scheduler's `step` accepts (as the pipeline does)."""
    params = _step_params(type(scheduler))
    kw = {}
    if "eta" in params:
        kw["eta"] = eta
    if "generator" in params:
        kw["generator"] = generator
    return kw
