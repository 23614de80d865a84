"""Stochastic DDIM step that also returns the log-probability of the step (DDPO).

Maths of ddpo-pytorch `ddpo_pytorch/diffusers_patch/ddim_with_logprob.py` (Black et al. 2023, commit 1958463) and of
diffusers' `DDIMScheduler.step` (Song et al. 2021, eq. 12), written against the public scheduler attributes of a
current diffusers `DDIMScheduler`. Tested against the reference's own outputs (tests/fixtures/ddpo_ref.pt) and against
`DDIMScheduler.step` with the same noise.

With a_t = alphas_cumprod[t] and a_prev = alphas_cumprod[t_prev] (final_alpha_cumprod before t = 0):
    x0      = (x_t - sqrt(1 - a_t) * eps) / sqrt(a_t)
    s^2     = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    std     = eta * s
    mu      = sqrt(a_prev) * x0 + sqrt(1 - a_prev - std^2) * eps
    x_prev  = mu + std * z                    (unless given)
    logp    = mean over non-batch dims of log N(x_prev; mu, std^2)

A step to a_prev = 1 has s^2 = 0 at any eta: it is deterministic (x_prev = x0), with no density to score. That is
the last step wherever final_alpha_cumprod is 1 (`set_alpha_to_one`, DDIM's default, which a scheduler config
without the key gets: diffusers' own test SDXL; SD's and SDXL base's configs set it false). Such a step's logp is 0
with no gradient, as `denoise`'s deterministic steps outside `sde_steps`, and its KL is 0: it contributes nothing to
a policy gradient. Every other step computes exactly what it did before (the same values, bit for bit).
"""

from __future__ import annotations

import math

import torch


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] or [] -> broadcastable to `like` ([B, C, H, W]), on its device (an asynchronous copy: no host sync)."""
    return values.reshape(values.shape + (1,) * (like.ndim - values.ndim)).to(like.device, non_blocking=True)


def step_noise(shape, generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' `randn_tensor` (the same numbers for the same generators), copied to `device` asynchronously:
    CPU generators draw on the CPU, and a blocking copy would stall the host once per step."""
    from diffusers.utils.torch_utils import randn_tensor

    gen = generator[0] if isinstance(generator, list) else generator
    rand_device = gen.device if gen is not None else torch.device(device)
    noise = randn_tensor(shape, generator=generator, device=rand_device, dtype=dtype)
    return noise.to(device, non_blocking=True)


def step_alphas(
    scheduler, timestep: int | torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a_t, a_prev, s^2) of the DDIM step from `timestep` ([] or [B]) in `dtype`, on the timestep's device (a
    Python number: the CPU), so that no value travels back to the host; see the module doc."""
    if scheduler.num_inference_steps is None:
        raise ValueError("call scheduler.set_timesteps(...) before stepping")
    device = timestep.device if isinstance(timestep, torch.Tensor) else torch.device("cpu")
    timestep = torch.as_tensor(timestep, device=device).long()
    prev_timestep = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alphas_cumprod = scheduler.alphas_cumprod.to(device, dtype, non_blocking=True)
    a_t = alphas_cumprod[timestep]
    a_prev = torch.where(
        prev_timestep >= 0, alphas_cumprod[prev_timestep.clamp(min=0)], float(scheduler.final_alpha_cumprod)
    ).to(dtype)
    return a_t, a_prev, (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)


def ddim_step_mean(
    scheduler,
    model_output: torch.Tensor,
    timestep: int | torch.Tensor,
    sample: torch.Tensor,
    eta: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gaussian of the DDIM step from x_t = `sample` (see the module doc): (mean mu (B, ...), std = eta * s
    broadcastable to it (B, 1, 1, 1) or [], float32, and the predicted x0), in the model output's dtype where
    `sample` and `model_output` are."""
    if scheduler.config.prediction_type != "epsilon":
        raise ValueError(
            f"ddim_step_with_logprob supports prediction_type='epsilon', not "
            f"'{scheduler.config.prediction_type}'"
        )
    alpha_prod_t, alpha_prod_t_prev, variance = step_alphas(scheduler, timestep)  # float32, as the reference
    std_dev_t = _per_sample(eta * variance**0.5, sample)  # float32, as the reference
    alpha_prod_t = _per_sample(alpha_prod_t, sample)
    alpha_prod_t_prev = _per_sample(alpha_prod_t_prev, sample)

    pred_original_sample = (sample - (1 - alpha_prod_t) ** 0.5 * model_output) / alpha_prod_t**0.5
    if scheduler.config.clip_sample:
        r = scheduler.config.clip_sample_range
        pred_original_sample = pred_original_sample.clamp(-r, r)
    direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** 0.5 * model_output
    prev_sample_mean = alpha_prod_t_prev**0.5 * pred_original_sample + direction
    return prev_sample_mean, std_dev_t, pred_original_sample


def ddim_step_with_logprob_and_x0(
    scheduler,
    model_output: torch.Tensor,
    timestep: int | torch.Tensor,
    sample: torch.Tensor,
    eta: float = 1.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ddim_step_with_logprob` that also returns the predicted x0 (the shared loop uses it)."""
    prev_sample_mean, std_dev_t, pred_original_sample = ddim_step_mean(
        scheduler, model_output, timestep, sample, eta
    )
    if prev_sample is None:
        noise = step_noise(model_output.shape, generator, model_output.device, model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * noise

    # Gaussian log-density of the (detached) next sample; gradient flows through the mean (and std).
    # A deterministic step (std 0, see the module doc) divides by 1 instead, so that its log-density and gradient
    # are finite before `where` puts 0 in its place (0 x inf in backward would be NaN); == 0 lets a NaN std through.
    deterministic = std_dev_t == 0  # (B, 1, 1, 1) or []
    std_safe = torch.where(deterministic, 1.0, std_dev_t)
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std_safe**2)
        - torch.log(std_safe)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = torch.where(deterministic, 0.0, log_prob)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))  # [B]
    return prev_sample.type(sample.dtype), log_prob, pred_original_sample


def ddim_step_with_logprob(
    scheduler,
    model_output: torch.Tensor,
    timestep: int | torch.Tensor,
    sample: torch.Tensor,
    eta: float = 1.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DDIM step x_t -> x_{t-1} of a `DDIMScheduler` (after `set_timesteps`) and its log-probability.

    `timestep` is a scalar or one per sample; `prev_sample`, if given, is scored instead of sampled.
    Returns (prev_sample [B, ...], log_prob [B]) with log_prob averaged over the non-batch dims.
    """
    prev, log_prob, _ = ddim_step_with_logprob_and_x0(
        scheduler, model_output, timestep, sample, eta, generator, prev_sample
    )
    return prev, log_prob


def ddim_step_kl(
    scheduler, model_output: torch.Tensor, ref_model_output: torch.Tensor, timesteps: torch.Tensor, eta: float
) -> torch.Tensor:
    """KL(policy step || reference step) per sample (B,), averaged over the non-batch dims like the log-probs.

    Both DDIM steps (no sample clipping) are Gaussians with the same std = eta * s_t around means that are affine in
    the noise prediction eps: mu = sqrt(a_prev) * (x_t - sqrt(1 - a_t) eps) / sqrt(a_t) + sqrt(1 - a_prev - std^2)
    eps, so mu - mu_ref = k_t (eps - eps_ref) with k_t = sqrt(1 - a_prev - std^2) - sqrt(a_prev (1 - a_t) / a_t),
    and the KL per dimension is k_t^2 (eps - eps_ref)^2 / (2 std^2).
    """
    if scheduler.config.clip_sample:
        raise ValueError(
            "ddim_step_kl assumes clip_sample=False (the means are then affine in the noise prediction)"
        )
    t = torch.as_tensor(timesteps).reshape(-1)
    a_t, a_prev, s2 = step_alphas(scheduler, t, torch.float64)
    var = eta**2 * s2
    k = (1 - a_prev - var).sqrt() - (a_prev * (1 - a_t) / a_t).sqrt()
    # a deterministic step (var 0): KL 0, see the module doc
    coef = torch.where(var == 0, 0.0, k**2 / (2 * var))
    coef = coef.to(model_output.device, torch.float32, non_blocking=True)  # (B,)
    sq = ((model_output.float() - ref_model_output.float()) ** 2).mean(dim=tuple(range(1, model_output.ndim)))
    return coef * sq
