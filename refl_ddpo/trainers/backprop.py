"""Reward backprop on a model family, one micro-batch at a time: ReFL's rollout with gradient at one late step k
(ImageReward's Algorithm 1), DRaFT-K / AlignProp / DRaFT-LV (gradient through the last K steps of the whole run),
the KL regulariser to the base model at the grad steps and the pretraining loss. The trainer
(refl_ddpo.trainers.refl) draws K, sums the losses and steps the optimizer; the pure maths is in
refl_ddpo.algorithms.reward_backprop."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from refl_ddpo.algorithms.reward_backprop import draft_grad_steps, refl_loss, x0_kl
from refl_ddpo.core.families import Cond, ModelFamily
from refl_ddpo.core.sampling import DenoiseOutput, denoise


@dataclass
class ReFLStepOutput:
    loss: torch.Tensor  # [] relu(margin - rewards).mean() * grad_scale, with graph to the trained weights
    rewards: torch.Tensor  # [B] with graph
    images: torch.Tensor  # [B, 3, H, W] in [0, 1]: the decoded predicted x0 of step k, with graph
    denoised: DenoiseOutput  # the rollout up to step k (all_latents only with keep_trajectory)


def refl_step(
    family: ModelFamily,
    scheduler,
    reward,
    cond: Cond,
    uncond: Cond | None,
    prompts: list[str],
    metadata: list[dict],
    noise: torch.Tensor,
    k: int,
    *,
    num_inference_steps: int,
    guidance_scale: float = 1.0,
    margin: float = 2.0,
    grad_scale: float = 1e-3,
    eta: float = 0.0,
    generator: torch.Generator | None = None,
    keep_trajectory: bool = False,
    network=None,
) -> ReFLStepOutput:
    """ImageReward's ReFL loss for one micro-batch: steps 0..k-1 without grad, step k with grad, decode the
    predicted x0, score it. Call under grad mode; `backward()` on `.loss` reaches the trainable network weights.

    `noise` (B, C, h, w) is x_T before `init_noise_sigma`; `generator` drives the DDPM steps' noise (and DDIM's when
    eta > 0); CFG runs at every step when guidance_scale > 1 and `uncond` is given.
    """
    denoised = denoise(
        family,
        scheduler,
        cond,
        uncond,
        noise,
        num_inference_steps,
        guidance_scale,
        eta=eta,
        generator=generator,
        grad_steps={k},
        stop_at=k,
        keep_trajectory=keep_trajectory,
        network=network,
    )
    images = family.decode(denoised.pred_original_sample)  # [B, 3, H, W] in [0, 1]
    rewards, _ = reward(images, prompts, metadata)  # [B]
    return ReFLStepOutput(refl_loss(rewards, margin, grad_scale), rewards, images, denoised)


def draft_step(
    family: ModelFamily,
    scheduler,
    reward,
    cond: Cond,
    uncond: Cond | None,
    prompts: list[str],
    metadata: list[dict],
    noise: torch.Tensor,
    k: int,
    *,
    num_inference_steps: int,
    guidance_scale: float = 1.0,
    margin: float = 2.0,
    grad_scale: float = 1e-3,
    eta: float = 0.0,
    generator: torch.Generator | None = None,
    lv_copies: int = 0,
    checkpoint_network: bool = True,
    keep_trajectory: bool = False,
    network=None,
) -> ReFLStepOutput:
    """DRaFT-K (Clark et al. 2023, Algorithm 1) and, with K drawn per step by the caller, AlignProp (Prabhudesai et
    al. 2023): the whole T-step run, steps 0..T-K-1 without grad and the last K with grad, the final latents decoded
    and scored; `loss = relu(margin - r).mean() * grad_scale` as ReFL's. `checkpoint_network` (with K > 1): each grad
    step's network call is recomputed in backward, so only its inputs are kept between the K steps.

    DRaFT-LV (`lv_copies` N, K = 1; Clark et al. Algorithm 2): N more copies of the last step, each on the final
    latents (detached) re-noised to the last step's timestep by the forward process with fresh noise from
    `generator`, denoised with grad in one batched call; the loss averages the rewards of all 1 + N images.
    `.rewards` and `.images` are those of the sampler's own final images (B,), as in ReFL.
    """
    from diffusers.utils.torch_utils import randn_tensor

    from refl_ddpo.core.families import cond_cat

    if lv_copies and k != 1:
        raise ValueError(f"DRaFT-LV re-noises the last step only: lv_copies={lv_copies} needs k=1, got {k}")
    denoised = denoise(
        family,
        scheduler,
        cond,
        uncond,
        noise,
        num_inference_steps,
        guidance_scale,
        eta=eta,
        generator=generator,
        grad_steps=draft_grad_steps(num_inference_steps, k),
        checkpoint_grad_steps=checkpoint_network and k > 1,
        keep_trajectory=keep_trajectory,
        network=network,
    )
    batch = len(prompts)
    finals = [denoised.latents]  # (B, C, h, w) with graph through the last k steps
    if lv_copies:
        t, t_host = denoised.timesteps[-1], scheduler.timesteps[-1]  # the last step's timestep (device, host)
        x0 = denoised.latents.detach().repeat(lv_copies, 1, 1, 1)  # (N B, C, h, w)
        eps = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        x_t = family.add_noise(scheduler, x0, eps, t_host)  # N fresh draws of x_t ~ q(x_t | x0)
        cond_n = cond_cat([cond] * lv_copies)
        uncond_n = None if uncond is None else cond_cat([uncond] * lv_copies)
        model_output = family.predict(x_t, t, scheduler, cond_n, uncond_n, guidance_scale, network)
        copies, _ = family.step(scheduler, model_output, t_host, x_t, eta, generator)
        finals.append(copies)
        prompts, metadata = prompts * (1 + lv_copies), metadata * (1 + lv_copies)
    images = family.decode(torch.cat(finals))  # [(1 + N) B, 3, H, W] in [0, 1]
    rewards, _ = reward(images, prompts, metadata)  # [(1 + N) B]
    loss = refl_loss(rewards, margin, grad_scale)
    return ReFLStepOutput(loss, rewards[:batch], images[:batch], denoised)


def kl_to_base(
    family: ModelFamily,
    scheduler,
    denoised: DenoiseOutput,
    steps: int | Collection[int],
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
) -> torch.Tensor:
    """The KL regulariser over the grad steps: at each step i of `steps` (ReFL's one step k, or DRaFT's last K),
    mean((eps_lora - eps_base)^2) over batch and latent elements on SD (`algorithms.reward_backprop.x0_kl`), then the
    mean over the steps. The base is the family's network with the LoRA adapter switched off, under no grad, with
    the same x_t, t, prompts and CFG. `denoised` must come from a rollout with `keep_trajectory=True`."""
    from refl_ddpo.core.lora import adapters_off

    steps = [steps] if isinstance(steps, int) else list(steps)
    terms = []
    for i in steps:
        x_t, t = denoised.all_latents[i], denoised.timesteps[i]
        with adapters_off(family.network):
            out_base = family.predict(x_t, t, scheduler, cond, uncond, guidance_scale)
            # A throwaway generator: the step's noise is not used, and the run's own streams must not move.
            _, x0_base = family.step(scheduler, out_base, t, x_t, 0.0, torch.Generator().manual_seed(0))
        terms.append(x0_kl(denoised.all_pred_x0[i], x0_base, family.x0_kl_weight(scheduler, t)))
    return terms[0] if len(terms) == 1 else torch.stack(terms).mean()


def pretrain_loss(
    family: ModelFamily,
    network,
    noise_scheduler,
    images: torch.Tensor,
    captions: list[str],
    generator: torch.Generator,
) -> torch.Tensor:
    """The standard text-to-image denoising loss on real image-caption pairs (diffusers' train_text_to_image):
    latents = VAE.encode(2 x - 1) * scaling_factor, t ~ U{0..T_train-1}, x_t = add_noise(latents, eps, t),
    MSE(net(x_t, t, caption), target) with target eps (epsilon models) or v (v-prediction models)."""
    from diffusers.utils.torch_utils import randn_tensor

    vae, device = family.vae, family.pipe.device
    with torch.no_grad():
        pixels = (images * 2 - 1).to(device, vae.dtype)  # [B, 3, R, R] in [-1, 1]
        latents = vae.encode(pixels).latent_dist.sample(generator) * vae.config.scaling_factor  # [B, C, h, w]
        cond, _ = family.encode_prompts(captions, with_negative=False)
    noise = randn_tensor(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    timesteps = torch.randint(
        0, noise_scheduler.config.num_train_timesteps, (len(latents),), generator=generator
    ).to(device)  # [B]
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    if noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    # the family's network call (SDXL adds its pooled text and time ids); DDPM's scale_model_input is the identity
    pred = family.predict(noisy, timesteps, noise_scheduler, cond, None, 1.0, network)
    return F.mse_loss(pred.float(), target.float())
