"""Flow-matching steps of a `FlowMatchEulerDiscreteScheduler` (SD3): the deterministic Euler step and the stochastic
SDE step with the log-probability of the step (Flow-GRPO).

Maths of Flow-GRPO (Liu et al. 2025, arXiv 2505.05470, eq. 12 and its reference implementation
yifan123/flow_grpo `flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`, commit ac4c86e), written against the
public scheduler attributes of a current diffusers `FlowMatchEulerDiscreteScheduler`. Tested against the
reference's own outputs (tests/fixtures/flow_grpo_ref.pt) and against `FlowMatchEulerDiscreteScheduler.step`.

The scheduler's `sigmas` run from ~1 (noise) to 0 (data), x_sigma = (1 - sigma) x0 + sigma z, and the network
predicts the velocity v = z - x0. At step i, sigma = sigmas[i], sigma_next = sigmas[i + 1], dt = sigma_next - sigma
(< 0):
    ODE (Euler)   x_next = x + dt * v,                x0 = x - sigma * v
    SDE           std    = noise_level * sqrt(sigma / (1 - sigma))   (sigma == 1: sigmas[1] in the denominator)
                  mean   = x * (1 + std^2 / (2 sigma) * dt) + v * (1 + std^2 (1 - sigma) / (2 sigma)) * dt
                  x_next = mean + std * sqrt(-dt) * z                (unless given)
                  logp   = mean over non-batch dims of log N(x_next; mean, (std sqrt(-dt))^2)
The SDE has the ODE's marginals for any noise_level (noise_level = 0 is the Euler step).
"""

from __future__ import annotations

import math

import torch

from refl_ddpo.core.steps.ddim import step_noise


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, ...) broadcastable to `like`, on its device (an asynchronous copy: no host sync)."""
    return values.reshape(values.shape + (1,) * (like.ndim - values.ndim)).to(like.device, non_blocking=True)


def step_sigmas(
    scheduler, timestep: float | torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sigma, sigma_next, sigma_max) of the steps from `timestep` ([] or [B], values of `scheduler.timesteps`),
    float32, sigma and sigma_next of shape (B,); sigma_max = sigmas[1] stands in for 1 in 1 - sigma. Computed on
    the timestep's device (a Python number: the schedule's), the schedule copied there asynchronously: nothing
    travels back to the host."""
    if scheduler.num_inference_steps is None:
        raise ValueError("call scheduler.set_timesteps(...) before stepping")
    device = timestep.device if isinstance(timestep, torch.Tensor) else scheduler.sigmas.device
    sigmas = scheduler.sigmas.detach().to(device, torch.float32, non_blocking=True)
    schedule = scheduler.timesteps.detach().to(device, torch.float32, non_blocking=True)
    t = torch.as_tensor(timestep, device=device).detach().float().reshape(-1)
    # the index of each timestep in the schedule (nearest, so a timestep stored in another dtype still finds its step)
    index = (schedule[None, :] - t[:, None]).abs().argmin(dim=1).expand(batch_size)
    return sigmas[index], sigmas[index + 1], sigmas[1]


def flow_pred_x0(
    scheduler, model_output: torch.Tensor, timestep: float | torch.Tensor, sample: torch.Tensor
) -> torch.Tensor:
    """The predicted x0 = x - sigma * v (float32 maths, in the model output's dtype); `timestep` [] or [B]."""
    sigma = _per_sample(step_sigmas(scheduler, timestep, sample.shape[0])[0], sample)
    return (sample.float() - sigma * model_output.float()).to(model_output.dtype)


def flow_euler_step(
    scheduler, model_output: torch.Tensor, timestep: float | torch.Tensor, sample: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's deterministic Euler step x + dt * v (float32, returned in the model output's dtype, as
    `FlowMatchEulerDiscreteScheduler.step`) and the predicted x0 = x - sigma * v; stateless, so `timestep` may be
    one per sample. Returns (prev_sample, pred_original_sample)."""
    sigma, sigma_next, _ = step_sigmas(scheduler, timestep, sample.shape[0])
    dt = _per_sample(sigma_next - sigma, sample)
    # dt * v in the model output's dtype, then added to the float32 sample: bit-equal to the stock step in bf16 too
    prev_sample = sample.float() + dt.to(model_output.dtype) * model_output
    return prev_sample.to(model_output.dtype), flow_pred_x0(scheduler, model_output, timestep, sample)


def flow_sde_step_mean(
    scheduler,
    model_output: torch.Tensor,
    timestep: float | torch.Tensor,
    sample: torch.Tensor,
    noise_level: float = 0.7,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gaussian of the SDE step from x_sigma = `sample` (see the module doc), in float32: (mean (B, ...), the
    step's std std_dev_t * sqrt(-dt) broadcastable to it (B, 1, 1, 1), std_dev_t (B,))."""
    sigma, sigma_next, sigma_max = step_sigmas(scheduler, timestep, sample.shape[0])
    std_dev_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))  # (B,)
    x, v = sample.float(), model_output.float()
    s, dt, std = _per_sample(sigma, x), _per_sample(sigma_next - sigma, x), _per_sample(std_dev_t, x)

    prev_sample_mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    return prev_sample_mean, std * torch.sqrt(-dt), std_dev_t


def flow_sde_step_with_logprob(
    scheduler,
    model_output: torch.Tensor,
    timestep: float | torch.Tensor,
    sample: torch.Tensor,
    noise_level: float = 0.7,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SDE step x_sigma -> x_sigma_next of a `FlowMatchEulerDiscreteScheduler` (after `set_timesteps`) and its
    log-probability (Flow-GRPO); see the module doc.

    `timestep` is a value of `scheduler.timesteps`, scalar or one per sample; `prev_sample`, if given, is scored
    instead of sampled. Everything is computed in float32 whatever the input dtype (as the reference), and the
    sampled next latent is returned in float32 too, so that scoring it again gives the same log-prob.
    Returns (prev_sample (B, ...), log_prob (B,) averaged over the non-batch dims, prev_sample_mean (B, ...),
    std_dev_t (B,), the std before the sqrt(-dt) factor).
    """
    prev_sample_mean, noise_std, std_dev_t = flow_sde_step_mean(
        scheduler, model_output, timestep, sample, noise_level
    )
    x = sample.float()
    if prev_sample is None:
        noise = step_noise(x.shape, generator, x.device, torch.float32)
        prev_sample = prev_sample_mean + noise_std * noise
    prev_sample = prev_sample.float()

    # Gaussian log-density of the (detached) next sample; gradient flows through the mean.
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * noise_std**2)
        - torch.log(noise_std)
        - 0.5 * math.log(2 * math.pi)
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))  # (B,)
    return prev_sample, log_prob, prev_sample_mean, std_dev_t.to(x.device, non_blocking=True)


def flow_sde_step_kl(
    scheduler,
    model_output: torch.Tensor,
    ref_model_output: torch.Tensor,
    timesteps: float | torch.Tensor,
    noise_level: float = 0.7,
) -> torch.Tensor:
    """Flow-GRPO's KL term per sample (B,): ||mean - mean_ref||^2 / (2 std_dev_t^2), averaged over the non-batch
    dims, between the SDE steps of two velocity predictions at the same state.

    The state term of the means cancels: mean - mean_ref = (v - v_ref) * (1 + std^2 (1 - sigma) / (2 sigma)) * dt,
    so no latent is needed. As in Flow-GRPO (and DESIGN.md), the divisor is std_dev_t^2, not the step's variance
    std_dev_t^2 * (-dt): this is the Gaussians' KL times -dt (multiply by 1 / -dt for the exact KL).
    """
    sigma, sigma_next, sigma_max = step_sigmas(scheduler, timesteps, model_output.shape[0])
    var = noise_level**2 * sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))  # std_dev_t^2, (B,)
    k = (1 + var * (1 - sigma) / (2 * sigma)) * (sigma_next - sigma)  # d mean / d v, (B,)
    coef = (k**2 / (2 * var)).to(model_output.device)
    sq = ((model_output.float() - ref_model_output.float()) ** 2).mean(dim=tuple(range(1, model_output.ndim)))
    return coef * sq
