"""The one denoising loop, on public diffusers APIs and a model family's adapter. Inference, ReFL and DDPO all
call `denoise`.

It does what the stock pipeline's `__call__` does between prompt encoding and `vae.decode` (same noise, same
classifier-free guidance in one batched network call, same scheduler steps, so the same images for the same seed),
plus what training needs: gradient on chosen steps only, stopping early, the trajectory, and step log-probabilities.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from refl_ddpo.core.families import Cond, ModelFamily
from refl_ddpo.core.lean import Folded, foldable


@dataclass
class DenoiseOutput:
    latents: torch.Tensor  # (B, C, h, w) after the last step that ran
    pred_original_sample: torch.Tensor | None  # (B, C, h, w) x0 predicted at the last step (None: PNDM/DPM)
    timesteps: torch.Tensor  # (S,) the timesteps that ran
    all_latents: list[torch.Tensor] = field(
        default_factory=list
    )  # S + 1 x (B, C, h, w), with keep_trajectory
    all_pred_x0: list[torch.Tensor] = field(default_factory=list)  # S x (B, C, h, w), with keep_trajectory
    log_probs: list[torch.Tensor] = field(default_factory=list)  # S x (B,), with with_logprob
    step_means: list[torch.Tensor] = field(default_factory=list)  # S x (B, C, h, w), with keep_step_means


def denoise(
    family: ModelFamily,
    scheduler,
    cond: Cond,
    uncond: Cond | None,
    noise: torch.Tensor,
    num_inference_steps: int,
    guidance_scale: float = 7.5,
    eta: float = 0.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    grad_steps: Collection[int] = (),
    stop_at: int | None = None,
    with_logprob: bool = False,
    keep_trajectory: bool = False,
    network=None,
    sde_steps: Collection[int] | None = None,
    checkpoint_grad_steps: bool = False,
    keep_step_means: bool = False,
) -> DenoiseOutput:
    """Run the sampler from `noise` for steps 0..stop_at (default: all), gradient only on `grad_steps`.

    CFG is on when `guidance_scale > 1` and `uncond` is given (one network call on the doubled batch, as the
    pipeline). `with_logprob` takes the family's stochastic step with log-probabilities (DDPO / GRPO); otherwise the
    scheduler's own `step` runs with `eta` / `generator` where it takes them. `network` replaces the family's own
    (a DDP-wrapped copy while training). `sde_steps` (with `with_logprob`): only these steps are stochastic, the
    others take the deterministic step (eta 0, the ODE step) and log-probability 0 (Flow-GRPO-Fast, MixGRPO).
    `checkpoint_grad_steps`: each grad step's network call runs under `torch.utils.checkpoint` (non-reentrant), so
    backward recomputes its activations and the forward keeps only its inputs (DRaFT-K over K steps).
    `keep_step_means` (with `with_logprob`): each step's Gaussian mean in `step_means` (float32; a deterministic
    step's: its next latents), which GRPO-Guard's RatioNorm compares with the trained weights' mean.
    """
    # The steps index the schedule with host timesteps, the network takes them on its device (one copy here).
    host_timesteps = family.set_timesteps(scheduler, num_inference_steps, noise)
    timesteps = host_timesteps.to(noise.device)
    last = len(timesteps) - 1 if stop_at is None else stop_at
    if not 0 <= last < len(timesteps):
        raise ValueError(f"stop_at={stop_at} outside 0..{len(timesteps) - 1}")
    grad_enabled = torch.is_grad_enabled()

    latents = noise * getattr(scheduler, "init_noise_sigma", 1.0)  # flow matching has none: x_T is the noise
    out = DenoiseOutput(latents=latents, pred_original_sample=latents, timesteps=timesteps[: last + 1])
    if keep_trajectory:
        out.all_latents.append(latents)
    fold = _fold(family, network, grad_enabled, grad_steps, last)
    step = _StepKind(with_logprob, sde_steps, keep_step_means, eta, generator)
    try:
        x0 = latents
        for i, (t, t_host) in enumerate(zip(timesteps[: last + 1], host_timesteps, strict=False)):
            with_grad = grad_enabled and i in grad_steps
            net, calls = (network, nullcontext()) if fold is None else fold.step(with_grad, network)
            with torch.set_grad_enabled(with_grad):
                if with_grad and checkpoint_grad_steps:
                    model_output = checkpoint(
                        family.predict,
                        latents,
                        t,
                        scheduler,
                        cond,
                        uncond,
                        guidance_scale,
                        network,
                        use_reentrant=False,
                    )
                else:
                    with calls:
                        model_output = family.predict(
                            latents, t, scheduler, cond, uncond, guidance_scale, net
                        )
                latents, x0 = _step(family, scheduler, out, model_output, t_host, latents, i, step)
            if keep_trajectory:
                out.all_latents.append(latents)
                out.all_pred_x0.append(x0)
    finally:
        if fold is not None:
            fold.off()
    out.latents, out.pred_original_sample = latents, x0
    return out


def _fold(family, network, grad_enabled: bool, grad_steps: Collection[int], last: int) -> Folded | None:
    """The LoRA folded for the steps without grad (refl_ddpo.core.lean), where there are any and it applies."""
    if not getattr(family, "fold_lora", True) or (
        grad_enabled and all(i in grad_steps for i in range(last + 1))
    ):
        return None
    module = foldable(family, network)
    return None if module is None else Folded(module)


@dataclass(frozen=True)
class _StepKind:
    """How `denoise` steps: with log-probabilities (on `sde_steps` only, if given), keeping the step means."""

    with_logprob: bool
    sde_steps: Collection[int] | None
    keep_step_means: bool
    eta: float
    generator: torch.Generator | list[torch.Generator] | None


def _step(family, scheduler, out: DenoiseOutput, model_output, t_host, latents, i: int, k: _StepKind):
    """One sampler step from `latents` at step i: (next latents, predicted x0); log-probs and step means into
    `out` where asked."""
    eta, generator = k.eta, k.generator
    if k.with_logprob and k.sde_steps is not None and i not in k.sde_steps:
        latents, x0 = family.step(scheduler, model_output, t_host, latents, 0.0, None)
        out.log_probs.append(torch.zeros(latents.shape[0], device=latents.device))
        if k.keep_step_means:
            out.step_means.append(latents.float())
    elif k.with_logprob:
        if k.keep_step_means:
            out.step_means.append(family.step_mean(scheduler, model_output, t_host, latents, eta)[0])
        latents, log_prob, x0 = family.step_with_logprob(
            scheduler, model_output, t_host, latents, eta, generator
        )
        out.log_probs.append(log_prob)
    else:
        latents, x0 = family.step(scheduler, model_output, t_host, latents, eta, generator)
    return latents, x0
