"""Stable Diffusion 3 / 3.5: an MMDiT (`transformer`) predicting the flow-matching velocity, two CLIP text encoders
and an optional T5, `FlowMatchEulerDiscreteScheduler`, 16 latent channels stored as (z - shift_factor) *
scaling_factor.

Everything the stock `StableDiffusion3Pipeline.__call__` does is kept (its `encode_prompt`, its noise, its batched
CFG, its Euler step), so the same seed gives the same image; the flow-matching maths are in `steps/flow_sde.py`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from refl_ddpo.core.families.base import Cond, ModelFamily, cfg_combine, cfg_inputs, pooled_conds
from refl_ddpo.core.steps.flow_sde import (
    flow_euler_step,
    flow_pred_x0,
    flow_sde_step_kl,
    flow_sde_step_mean,
    flow_sde_step_with_logprob,
    step_sigmas,
)


class StableDiffusion3(ModelFamily):
    name = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    network_name = "transformer"
    # the attention projections of the image stream and of the text stream ("added") of every MMDiT block
    lora_target_modules: ClassVar[list[str]] = [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    ]
    # "euler" is the Euler sampler of each family: here the flow-matching one, the stock pipeline's
    schedulers: ClassVar[dict[str, str]] = {"euler": "FlowMatchEulerDiscreteScheduler"}

    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The pipeline's own `encode_prompt` (both CLIPs, T5 or its zero padding when dropped); the negative is the
        empty prompt, as the pipeline's default."""
        encoded = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.pipe.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=with_negative,
        )
        return pooled_conds(*encoded, with_negative)

    def _pipeline_encode(self, prompts: list[str], **kwargs) -> tuple:
        """The pipeline's own `encode_prompt` of `prompts`, one image each, up to the family's `max_sequence_length`
        text tokens (FLUX.1, FLUX.2, Qwen-Image); `kwargs`: that pipeline's other arguments."""
        return self.pipe.encode_prompt(
            prompt=prompts,
            device=self.pipe.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            **kwargs,
        )

    def _encode_with_empty(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """The family's `_encode` of `prompts`, and of as many empty prompts (the negative) when `with_negative`."""
        cond = self._encode(prompts)
        return cond, (self._encode([""] * len(prompts)) if with_negative else None)

    def initial_noise(self, batch_size: int, resolution: int, generator, dtype: torch.dtype) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        f, patch = self.vae_scale_factor, self.network.config.patch_size
        if resolution % (f * patch):
            raise ValueError(
                f"resolution {resolution} is not a multiple of {f * patch} (VAE scale factor x patch size)"
            )
        shape = (batch_size, self.network.config.in_channels, resolution // f, resolution // f)
        return randn_tensor(shape, generator=generator, device=self.pipe.device, dtype=dtype)

    def rollout_scheduler(self, kind: str):
        """Flow matching has one sampler: either kind runs the model's own FlowMatchEulerDiscreteScheduler with the
        deterministic Euler step (the stock pipeline's)."""
        return self.scheduler(self.schedulers["euler"])

    def set_timesteps(self, scheduler, num_inference_steps: int, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline: with `use_dynamic_shifting` the shift `mu` follows the image's token count."""
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            patch = self.network.config.patch_size
            seq_len = (latents.shape[-2] // patch) * (latents.shape[-1] // patch)
            c = scheduler.config
            kwargs["mu"] = calculate_shift(
                seq_len,
                c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096),
                c.get("base_shift", 0.5),
                c.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(
            num_inference_steps, device="cpu", **kwargs
        )  # on the host: see the base class
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
        """Velocity (B, 16, h, w); CFG in one call on the doubled batch [uncond, text] (as the pipeline) when
        guidance_scale > 1 and `uncond` is given. `timesteps` (values of `scheduler.timesteps`) is a scalar or one
        per sample (B,). Latents kept in float32 (the SDE step's) are cast to the text embeddings' dtype."""
        transformer = network if network is not None else self.network
        latents = latents.to(cond["prompt_embeds"].dtype)
        timesteps = timesteps.expand(latents.shape[0]) if timesteps.ndim == 0 else timesteps
        x, t, c, doubled = cfg_inputs(latents, timesteps, cond, uncond, guidance_scale)
        out = transformer(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=c["prompt_embeds"],
            pooled_projections=c["pooled_prompt_embeds"],
            return_dict=False,
        )[0]
        return cfg_combine(out, guidance_scale, doubled)

    def step(self, scheduler, model_output, timestep, latents, eta: float, generator):
        """The scheduler's deterministic Euler step (stateless here; `eta` and `generator` are unused: the
        stochastic step is `step_with_logprob`). Returns (next latents, predicted x0)."""
        return flow_euler_step(scheduler, model_output, timestep, latents)

    def step_with_logprob(
        self, scheduler, model_output, timestep, latents, eta: float, generator=None, prev_sample=None
    ):
        """Flow-GRPO's SDE step with `eta` as its noise level; the next latents are float32 (see flow_sde)."""
        prev, log_prob, _, _ = flow_sde_step_with_logprob(
            scheduler, model_output, timestep, latents, eta, generator, prev_sample
        )
        return prev, log_prob, flow_pred_x0(scheduler, model_output, timestep, latents)

    def step_mean(self, scheduler, model_output, timestep, latents, eta: float):
        mean, std, _ = flow_sde_step_mean(scheduler, model_output, timestep, latents, eta)
        return mean, std.reshape(-1)

    def add_noise(self, scheduler, x0: torch.Tensor, noise: torch.Tensor, timestep) -> torch.Tensor:
        """The flow-matching forward process at `timestep`'s sigma: (1 - sigma) x0 + sigma noise."""
        sigma = step_sigmas(scheduler, timestep, x0.shape[0])[0].to(x0.device)[:, None, None, None]
        return ((1 - sigma) * x0.float() + sigma * noise.float()).to(x0.dtype)

    def step_kl(self, scheduler, model_output, ref_model_output, timesteps, eta: float) -> torch.Tensor:
        return flow_sde_step_kl(scheduler, model_output, ref_model_output, timesteps, eta)

    def x0_kl_weight(self, scheduler, timestep) -> float:
        # x0 = x_t - sigma v at fixed x_t: v - v_ref = -(x0 - x0_ref) / sigma
        sigma = step_sigmas(scheduler, timestep, 1)[0].item()
        return 1.0 / sigma**2

    def pred_x0(self, scheduler, model_output, timesteps, latents) -> torch.Tensor:
        return flow_pred_x0(scheduler, model_output.float(), timesteps, latents)

    def training_target(self, scheduler, x0, noise, timesteps) -> torch.Tensor:
        return noise.float() - x0.float()  # the velocity of x_t = (1 - sigma) x0 + sigma noise

    def noise_level(self, scheduler, timesteps) -> torch.Tensor:
        t = torch.as_tensor(timesteps).reshape(-1)
        return step_sigmas(scheduler, t, t.shape[0])[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents, return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)
