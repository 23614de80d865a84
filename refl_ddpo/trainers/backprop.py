"""Reward backprop on a model family, one micro-batch at a time: ReFL's rollout with gradient at one late step k
(ImageReward's Algorithm 1), DRaFT-K / AlignProp / DRaFT-LV (gradient through the last K steps of the whole run),
the KL regulariser to the base model at the grad steps and the pretraining loss. The trainer
(refl_ddpo.trainers.reward_backprop) draws K, sums the losses and steps the optimizer; the pure maths is in
refl_ddpo.algorithms.reward_backprop."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from refl_ddpo.algorithms.reward_backprop import draft_grad_steps, refl_loss, x0_kl
from refl_ddpo.core.families import Cond, ModelFamily
from refl_ddpo.core.sampling import DenoiseOutput, denoise
from refl_ddpo.rewards import per_sample_info
from refl_ddpo.run.session import Run
from refl_ddpo.trainers.refl_config import ReFLConfig


@dataclass
class Rollout:
    """One micro-batch's rollout: the prompts, their conditioning, x_T and the sampler that takes them to an image."""

    family: ModelFamily
    scheduler: Any
    cond: Cond
    uncond: Cond | None  # CFG runs at every step when guidance_scale > 1 and uncond is given
    prompts: list[str]
    metadata: list[dict]
    noise: torch.Tensor  # (B, C, h, w): x_T before `init_noise_sigma`
    num_inference_steps: int
    guidance_scale: float = 1.0
    eta: float = 0.0
    generator: torch.Generator | None = None  # the DDPM steps' noise (and DDIM's when eta > 0), DRaFT-LV's
    network: Any = None  # the prepared network (default: the family's own)


@dataclass
class ReFLStepOutput:
    loss: torch.Tensor  # [] relu(margin - rewards).mean() * grad_scale, with graph to the trained weights
    rewards: torch.Tensor  # [B] with graph
    images: torch.Tensor  # [B, 3, H, W] in [0, 1]: the decoded predicted x0 of step k, with graph
    denoised: DenoiseOutput  # the rollout up to step k (all_latents only with keep_trajectory)
    info: dict[str, torch.Tensor]  # the reward's per-sample info, (B,) each, detached


def refl_step(
    r: Rollout, reward, k: int, margin: float = 2.0, grad_scale: float = 1e-3, keep_trajectory: bool = False
) -> ReFLStepOutput:
    """ImageReward's ReFL loss for one micro-batch: steps 0..k-1 without grad, step k with grad, decode the
    predicted x0, score it. Call under grad mode; `backward()` on `.loss` reaches the trainable network weights."""
    denoised = denoise(
        r.family,
        r.scheduler,
        r.cond,
        r.uncond,
        r.noise,
        r.num_inference_steps,
        r.guidance_scale,
        eta=r.eta,
        generator=r.generator,
        grad_steps={k},
        stop_at=k,
        keep_trajectory=keep_trajectory,
        network=r.network,
    )
    images = decode_scored(r.family, denoised.pred_original_sample, reward)  # [B, 3, H, W] in [0, 1]
    rewards, info = reward(images, r.prompts, r.metadata)  # [B]
    info = per_sample_info(info, len(rewards))
    return ReFLStepOutput(refl_loss(rewards, margin, grad_scale), rewards, images, denoised, info)


def draft_step(
    r: Rollout,
    reward,
    k: int,
    margin: float = 2.0,
    grad_scale: float = 1e-3,
    lv_copies: int = 0,
    checkpoint_network: bool = True,
    keep_trajectory: bool = False,
) -> ReFLStepOutput:
    """DRaFT-K (Clark et al. 2023, Algorithm 1) and, with K drawn per step by the caller, AlignProp (Prabhudesai et
    al. 2023): the whole T-step run, steps 0..T-K-1 without grad and the last K with grad, the final latents decoded
    and scored; `loss = relu(margin - r).mean() * grad_scale` as ReFL's. `checkpoint_network` (with K > 1): each grad
    step's network call is recomputed in backward, so only its inputs are kept between the K steps.

    DRaFT-LV (`lv_copies` N, K = 1; Clark et al. Algorithm 2): N more copies of the last step, each on the final
    latents (detached) re-noised to the last step's timestep by the forward process with fresh noise from
    the rollout's generator, denoised with grad in one batched call; the loss averages the rewards of all 1 + N
    images. `.rewards` and `.images` are those of the sampler's own final images (B,), as in ReFL.
    """
    from diffusers.utils.torch_utils import randn_tensor

    from refl_ddpo.core.families import cond_cat

    if lv_copies and k != 1:
        raise ValueError(f"DRaFT-LV re-noises the last step only: lv_copies={lv_copies} needs k=1, got {k}")
    family, scheduler, generator = r.family, r.scheduler, r.generator
    denoised = denoise(
        family,
        scheduler,
        r.cond,
        r.uncond,
        r.noise,
        r.num_inference_steps,
        r.guidance_scale,
        eta=r.eta,
        generator=generator,
        grad_steps=draft_grad_steps(r.num_inference_steps, k),
        checkpoint_grad_steps=checkpoint_network and k > 1,
        keep_trajectory=keep_trajectory,
        network=r.network,
    )
    prompts, metadata = r.prompts, r.metadata
    finals = [denoised.latents]  # (B, C, h, w) with graph through the last k steps
    if lv_copies:
        t, t_host = denoised.timesteps[-1], scheduler.timesteps[-1]  # the last step's timestep (device, host)
        x0 = denoised.latents.detach().repeat(lv_copies, 1, 1, 1)  # (N B, C, h, w)
        eps = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        x_t = family.add_noise(scheduler, x0, eps, t_host)  # N fresh draws of x_t ~ q(x_t | x0)
        cond_n = cond_cat([r.cond] * lv_copies)
        uncond_n = None if r.uncond is None else cond_cat([r.uncond] * lv_copies)
        model_output = family.predict(x_t, t, scheduler, cond_n, uncond_n, r.guidance_scale, r.network)
        copies, _ = family.step(scheduler, model_output, t_host, x_t, r.eta, generator)
        finals.append(copies)
        prompts, metadata = prompts * (1 + lv_copies), metadata * (1 + lv_copies)
    images = decode_scored(family, torch.cat(finals), reward)  # [(1 + N) B, 3, H, W] in [0, 1]
    rewards, info = reward(images, prompts, metadata)  # [(1 + N) B]
    loss = refl_loss(rewards, margin, grad_scale)
    b = len(r.prompts)
    info = {k: v[:b] for k, v in per_sample_info(info, len(rewards)).items()}
    return ReFLStepOutput(loss, rewards[:b], images[:b], denoised, info)


def decode_scored(family: ModelFamily, latents: torch.Tensor, reward) -> torch.Tensor:
    """`family.decode(latents)`; of videos whose reward reads only their first frames (its `frames`, from
    --video_reduction first:K), those frames alone (the Wan family's causal decode of the latent frames they need)."""
    frames = getattr(reward, "frames", None)
    if frames is None or latents.ndim != 5:
        return family.decode(latents)
    return family.decode(latents, frames=frames)


def kl_to_base(r: Rollout, denoised: DenoiseOutput, steps: int | Collection[int]) -> torch.Tensor:
    """The KL regulariser over the grad steps: at each step i of `steps` (ReFL's one step k, or DRaFT's last K),
    mean((eps_lora - eps_base)^2) over batch and latent elements on SD (`algorithms.reward_backprop.x0_kl`), then the
    mean over the steps. The base is the family's network with the LoRA adapter switched off, under no grad, with
    the same x_t, t, prompts and CFG. `denoised` must come from a rollout with `keep_trajectory=True`."""
    from refl_ddpo.core.lora import adapters_off

    family, scheduler = r.family, r.scheduler
    steps = [steps] if isinstance(steps, int) else list(steps)
    terms = []
    for i in steps:
        x_t, t = denoised.all_latents[i], denoised.timesteps[i]
        with adapters_off(family.network):
            out_base = family.predict(x_t, t, scheduler, r.cond, r.uncond, r.guidance_scale)
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


# ---- the reward-backprop trainer's micro-batch (refl_ddpo.trainers.reward_backprop) ----


@dataclass
class TrainingData:
    """The training prompts (`PromptDraw`) and the image-caption folder of the pretraining loss (or None)."""

    prompts: Any
    pretrain: Any


@dataclass
class Parts:
    """What the loop calls: the sampler, the backprop strategy (ReFL's step or DRaFT's, chosen once), the data."""

    sampler: Any
    backprop: Any  # (rollout, reward, k) -> ReFLStepOutput
    data: TrainingData
    noise_scheduler: Any  # the pretraining loss's forward process (or None)


def draw_k(cfg: ReFLConfig, k_generator: torch.Generator) -> int:
    """This optimizer step's K, the same on every process: ReFL's grad step k ~ U{k_lo..k_hi}; DRaFT-K's fixed K
    (no draw); AlignProp's K ~ U{lo..hi} steps with grad at the end of the run."""
    backprop = cfg.backprop_range()
    if backprop is None:
        return int(torch.randint(cfg.k_lo, cfg.k_hi + 1, (), generator=k_generator))
    lo, hi = backprop
    return lo if lo == hi else int(torch.randint(lo, hi + 1, (), generator=k_generator))


def draw_rollout(run: Run, parts: Parts, generator: torch.Generator) -> Rollout:
    """A micro-batch's prompts and x_T from this process' generator, the prompts encoded."""
    cfg, family = run.cfg, run.family
    prompts, metadata = parts.data.prompts(cfg.train_batch_size, generator)
    cond, uncond = family.encode_conditioning(prompts, metadata, with_negative=cfg.guidance_scale > 1.0)
    noise = family.initial_noise(cfg.train_batch_size, cfg.resolution, generator, cond["prompt_embeds"].dtype)
    return Rollout(
        family,
        parts.sampler,
        cond,
        uncond,
        prompts,
        metadata,
        noise,
        cfg.num_inference_steps,
        cfg.guidance_scale,
        cfg.eta,
        generator,
        run.network,
    )


def regularised(
    run: Run, parts: Parts, rollout: Rollout, out: ReFLStepOutput, k: int, generator: torch.Generator
) -> tuple[torch.Tensor, dict[str, float]]:
    """The reward loss plus --kl_weight times the KL to the base at the grad step(s) and --pretrain_loss_weight
    times the pretraining loss on a batch of the image-caption folder; the terms' values to log."""
    cfg = run.cfg
    loss, terms = out.loss, {"refl": out.loss.item(), "kl": 0.0, "pretrain": 0.0}
    if cfg.kl_weight > 0:
        steps = k if cfg.backprop_range() is None else draft_grad_steps(cfg.num_inference_steps, k)
        kl = kl_to_base(rollout, out.denoised, steps)
        loss = loss + cfg.kl_weight * kl
        terms["kl"] = kl.item()
    pretrain = parts.data.pretrain
    if pretrain is not None:
        pidx = torch.randint(len(pretrain), (cfg.pretrain_batch_size,), generator=generator)
        images, captions = pretrain.batch(pidx.tolist(), cfg.resolution)
        pl = pretrain_loss(run.family, run.network, parts.noise_scheduler, images, captions, generator)
        loss = loss + cfg.pretrain_loss_weight * pl
        terms["pretrain"] = pl.item()
    return loss, terms


@dataclass
class MicroBatch:
    """One micro-batch's result: the loss's terms (for the logs), the gathered rewards, the step's output."""

    terms: dict[str, float]
    rewards: torch.Tensor  # (processes * B,), gathered
    out: ReFLStepOutput
    prompts: list[str]
    info: dict[str, torch.Tensor]  # the reward's per-sample info, each (processes * B,), gathered


def checked(
    run: Run, step: int, out: ReFLStepOutput, loss: torch.Tensor, terms: dict, prompts: list[str]
) -> MicroBatch:
    """The rewards gathered now, so that a non-finite one on any process stops every process together."""
    from refl_ddpo.rewards import count_nonfinite
    from refl_ddpo.run.training import nonfinite_step_error

    rewards = run.accelerator.gather(out.rewards.detach())
    bad = count_nonfinite(rewards)
    if bad:
        raise nonfinite_step_error(
            run.cfg.output_dir,
            f"--reward {run.cfg.reward} gave {bad} non-finite reward(s) (NaN or inf) of {len(rewards)} samples at "
            f"step {step + 1}",
            "check the reward and its files in --reward_model_dir",
        )
    info = {k: run.accelerator.gather(v.float()) for k, v in out.info.items()}
    return MicroBatch(terms, rewards, out, prompts, info)


def clipped_grad_norm(run: Run, step: int, results: list[MicroBatch]) -> torch.Tensor:
    """The pre-clipping norm of the all-reduced gradient (no clipping when --max_grad_norm is 0); a non-finite one
    (the same on every process) stops the run before the update."""
    from refl_ddpo.run.training import nonfinite_step_error

    cfg = run.cfg
    grad_norm = run.accelerator.clip_grad_norm_(run.params, cfg.max_grad_norm or math.inf)
    if not math.isfinite(float(grad_norm)):
        loss = sum(r.terms["refl"] for r in results) / cfg.gradient_accumulation_steps
        raise nonfinite_step_error(
            cfg.output_dir,
            f"the gradient norm is {float(grad_norm)} at step {step + 1} (ReFL loss {loss:.4g})",
            "lower --learning_rate or --grad_scale, or check the reward's gradient",
        )
    return grad_norm
