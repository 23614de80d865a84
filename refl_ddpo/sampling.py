"""The one denoising loop, on public diffusers APIs. Inference, ReFL and DDPO all call `denoise`.

It does what `StableDiffusionPipeline.__call__` does between `encode_prompt` and `vae.decode` (same noise, same
classifier-free guidance in one batched UNet call, same scheduler steps, so the same images for the same seed), plus
what training needs: gradient on chosen steps only, stopping early, the trajectory, and DDIM log-probabilities.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from diffusers.utils.torch_utils import randn_tensor

from refl_ddpo.ddim import ddim_step_with_logprob_and_x0


@dataclass
class DenoiseOutput:
    latents: torch.Tensor  # (B, C, h, w) after the last step that ran
    pred_original_sample: torch.Tensor | None  # (B, C, h, w) x0 predicted at the last step (None: PNDM/DPM)
    timesteps: torch.Tensor  # (S,) the timesteps that ran
    all_latents: list[torch.Tensor] = field(default_factory=list)  # S + 1 x (B, C, h, w), with keep_trajectory
    log_probs: list[torch.Tensor] = field(default_factory=list)  # S x (B,), with with_logprob


@torch.no_grad()
def encode_prompts(pipe, prompts: list[str], device: torch.device | str,
                   with_negative: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prompt_embeds (B, L, D), negative_prompt_embeds (B, L, D) of the empty prompt, or None)."""
    prompt_embeds, negative = pipe.encode_prompt(prompts, device, 1, with_negative)
    return prompt_embeds, negative


def initial_noise(batch_size: int, unet, resolution: int, vae_scale_factor: int,
                  generator: torch.Generator | list[torch.Generator] | None, device, dtype) -> torch.Tensor:
    """Gaussian latents (B, C, resolution / vae_scale_factor, ...), drawn as the pipeline draws them."""
    if resolution % vae_scale_factor:
        raise ValueError(f"resolution {resolution} is not a multiple of the VAE scale factor {vae_scale_factor}")
    side = resolution // vae_scale_factor
    shape = (batch_size, unet.config.in_channels, side, side)
    return randn_tensor(shape, generator=generator, device=torch.device(device), dtype=dtype)


def _step_kwargs(scheduler, eta: float, generator) -> dict:
    """The optional `eta` / `generator` arguments this scheduler's `step` accepts (as the pipeline does)."""
    params = inspect.signature(scheduler.step).parameters
    kw = {}
    if "eta" in params:
        kw["eta"] = eta
    if "generator" in params:
        kw["generator"] = generator
    return kw


def guided_noise_pred(unet, latents: torch.Tensor, timesteps: torch.Tensor, prompt_embeds: torch.Tensor,
                      negative_prompt_embeds: torch.Tensor | None, guidance_scale: float) -> torch.Tensor:
    """The UNet's noise prediction (B, C, h, w), with classifier-free guidance in one UNet call on the doubled
    batch [uncond, text] (as the pipeline) when guidance_scale > 1 and `negative_prompt_embeds` is given.

    `latents` are already `scheduler.scale_model_input`-ed; `timesteps` is a scalar or one per sample (B,).
    """
    if guidance_scale > 1.0 and negative_prompt_embeds is not None:
        if timesteps.ndim == 1:
            timesteps = torch.cat([timesteps, timesteps])
        eps = unet(torch.cat([latents, latents]), timesteps,
                   encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]), return_dict=False)[0]
        uncond, text = eps.chunk(2)
        return uncond + guidance_scale * (text - uncond)
    return unet(latents, timesteps, encoder_hidden_states=prompt_embeds, return_dict=False)[0]


def denoise(
    unet,
    scheduler,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor | None,
    noise: torch.Tensor,
    num_inference_steps: int,
    guidance_scale: float = 7.5,
    eta: float = 0.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    grad_steps: Collection[int] = (),
    stop_at: int | None = None,
    with_logprob: bool = False,
    keep_trajectory: bool = False,
    progress: bool = False,
) -> DenoiseOutput:
    """Run the sampler from `noise` for steps 0..stop_at (default: all), gradient only on `grad_steps`.

    CFG is on when `guidance_scale > 1` and `negative_prompt_embeds` is given (one UNet call on the doubled
    batch, as the pipeline). `with_logprob` uses the stochastic DDIM step of DDPO (the scheduler must be a
    `DDIMScheduler`); otherwise the scheduler's own `step` runs with `eta` / `generator` where it takes them.
    """
    from tqdm.auto import tqdm

    scheduler.set_timesteps(num_inference_steps, device=noise.device)
    timesteps = scheduler.timesteps
    last = len(timesteps) - 1 if stop_at is None else stop_at
    if not 0 <= last < len(timesteps):
        raise ValueError(f"stop_at={stop_at} outside 0..{len(timesteps) - 1}")
    step_kwargs = _step_kwargs(scheduler, eta, generator)
    grad_enabled = torch.is_grad_enabled()

    latents = noise * scheduler.init_noise_sigma
    out = DenoiseOutput(latents=latents, pred_original_sample=latents, timesteps=timesteps[: last + 1])
    if keep_trajectory:
        out.all_latents.append(latents)
    for i, t in enumerate(tqdm(timesteps[: last + 1], disable=not progress, desc="denoise", leave=False)):
        with torch.set_grad_enabled(grad_enabled and i in grad_steps):
            noise_pred = guided_noise_pred(unet, scheduler.scale_model_input(latents, t), t, prompt_embeds,
                                           negative_prompt_embeds, guidance_scale)
            if with_logprob:
                latents, log_prob, x0 = ddim_step_with_logprob_and_x0(
                    scheduler, noise_pred, t, latents, eta=eta, generator=generator)
                out.log_probs.append(log_prob)
            else:
                step = scheduler.step(noise_pred, t, latents, **step_kwargs)
                # PNDM / DPM-Solver steps give no x0: None then (inference needs only the latents)
                latents, x0 = step.prev_sample, getattr(step, "pred_original_sample", None)
        if keep_trajectory:
            out.all_latents.append(latents)
    out.latents, out.pred_original_sample = latents, x0
    return out


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """VAE-decode latents to images (B, 3, H, W) in [0, 1] (differentiable where the caller enables grad)."""
    images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)
