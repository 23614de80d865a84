"""Forward-process RL maths: DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117; NVlabs/DiffusionNFT
scripts/train_nft_sd3.py) and Advantage Weighted Matching (AWM, Xue et al. 2025; as X-GenGroup/Flow-Factory's
trainers/awm.py implements it). Pure functions of tensors.

Both train on the forward process of clean sampled latents x0: x_t = a_t x0 + s_t eps at a chosen t, then regress
the network's output there. Every family's x0-prediction is affine in the network's output at fixed x_t (flow
matching: x0 = x_t - sigma v; SD 1.x epsilon: x0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar); v-prediction:
x0 = sqrt(abar) x_t - sqrt(1 - abar) v), so NFT's implicit policies, built from two outputs, are built here from
their two x0-predictions, and the same loss holds for every parameterisation.
"""

from __future__ import annotations

import torch


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r in [0, 1] of a sample (its Eq. 9's r, as the reference computes it):
    0.5 + 0.5 clip(A, -c, c) / c, for group-normalised advantages A and c = `adv_clip_max`."""
    return (advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def _adaptive_mse(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per sample: mean((x0_pred - x0)^2) / sg(max(mean |x0_pred - x0|, 1e-5)), the reference's adaptive weighting
    (the weight in float64, no gradient through it). (B, ...) -> (B,)."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_pred.double() - x0.double()).abs().mean(dim=dims).clamp(min=1e-5)
    return ((x0_pred - x0) ** 2).mean(dim=dims) / weight.to(x0_pred.dtype)


def nft_loss(
    x0_theta: torch.Tensor,
    x0_old: torch.Tensor,
    x0: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's policy loss of one forward-noised batch (the paper's Eq. 10 with its adaptive weighting).

    x0_theta: the x0-prediction of the trained network at x_t (B, ...), with gradient; x0_old: of the sampling
    ("old") network, no gradient; x0: the clean sampled latents; r (B,): optimality probabilities.
    The implicit positive policy v+ = beta v_theta + (1 - beta) v_old and negative policy
    v- = (1 + beta) v_old - beta v_theta give x0+ and x0- (affine, see the module doc); the loss is
    mean(r ||x0+ - x0||^2 / w+ + (1 - r) ||x0- - x0||^2 / w-) / beta, times `adv_clip_max` as the reference scales
    it. Returns (loss, detached parts: positive and negative losses, their mean before scaling)."""
    x0_old = x0_old.detach()
    positive = beta * x0_theta + (1.0 - beta) * x0_old
    negative = (1.0 + beta) * x0_old - beta * x0_theta
    positive_loss = _adaptive_mse(positive, x0)
    negative_loss = _adaptive_mse(negative, x0)
    per_sample = (r * positive_loss + (1.0 - r) * negative_loss) / beta
    loss = (per_sample * adv_clip_max).mean()
    info = {
        "positive_loss": positive_loss.detach().mean(),
        "negative_loss": negative_loss.detach().mean(),
        "unweighted_policy_loss": per_sample.detach().mean(),
    }
    return loss, info


AWM_WEIGHTINGS = ("uniform", "t", "ghuber")


def matching_log_likelihood(
    output: torch.Tensor,
    target: torch.Tensor,
    noise_level: torch.Tensor,
    weighting: str = "uniform",
    ghuber_power: float = 0.25,
) -> torch.Tensor:
    """AWM's stand-in for a sample's log-likelihood (B,): the negative matching loss -mean((output - target)^2),
    weighted by the noise level t (sigma on flow models, sqrt(1 - abar) on SD 1.x): "uniform" as it is, "t" times
    t, "ghuber" -(m^p - eps^p) t / p for m = the mean squared error (Flow-Factory's generalised Huber, p =
    `ghuber_power`, eps = 1e-10)."""
    mse = ((output.float() - target.float()) ** 2).mean(dim=tuple(range(1, output.ndim)))
    t = noise_level.float().to(mse.device)
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -mse * t
    if weighting == "ghuber":
        eps = mse.new_full((), 1e-10)  # on the device: no copy from the host
        return -((mse + eps) ** ghuber_power - eps**ghuber_power) * t / ghuber_power
    raise ValueError(f"weighting must be one of {AWM_WEIGHTINGS}, not {weighting!r}")


def output_mse(output: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per sample mean((output - other)^2) (B,): the KL stand-in between two networks' outputs (to the base model,
    to the old policy), in the network's output space as both reference implementations compute it."""
    return ((output.float() - other.detach().float()) ** 2).mean(dim=tuple(range(1, output.ndim)))


def old_policy_decay(step: int, flat: int, rate: float, max_decay: float) -> float:
    """The decay d of the old (sampling) policy's soft update old <- d old + (1 - d) theta after `step` optimizer
    steps: 0 for the first `flat` steps, then min((step - flat) rate, max_decay) (DiffusionNFT's `return_decay`;
    its decay_type 1 is (0, 0.001, 0.5), type 2 (75, 0.0075, 0.999); Flow-Factory's linear warm-up to d over W steps
    is (0, d / W, d))."""
    if step < flat:
        return 0.0
    return min((step - flat) * rate, max_decay)


def ema_decay(step: int, max_decay: float) -> float:
    """The decay of DiffusionNFT's EMA of the trained weights after optimizer step `step` (1-based: the reference
    steps it after counting the step): min((1 + step) / (10 + step), max_decay), its `EMAModuleWrapper` with decay
    0.9 (train_nft_sd3.py). Applied with `soft_update_`; it averages over ~10 steps at most."""
    return min((1 + step) / (10 + step), max_decay)


def stratified_timestep_indices(
    timesteps: torch.Tensor,
    num: int,
    timestep_range: float,
    max_timestep: float,
    last: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """`num` indices into the sampler's `timesteps` (descending), one set for a whole micro-batch, as Flow-Factory's
    AWM draws them (`TimeSampler.discrete`, strategy `discrete_wo_init`): of the steps with t >= (1 -
    `timestep_range`) `max_timestep` and index <= `last`, leave out the first (the initial step, pure noise on a
    flow model), cut the index span [first + 1, last one] at linspace's `num` + 1 points rounded down, and draw one
    index uniformly in each cut, its upper end excluded (so the last index of the span is never drawn, and a cut
    narrower than one index gives its lower end: indices may repeat when the span is short)."""
    t = timesteps.float().cpu()
    valid = torch.nonzero(t >= (1.0 - timestep_range) * max_timestep - 1e-3).flatten()
    valid = valid[valid <= last]
    if len(valid) < 2:
        raise ValueError(
            f"stratified timesteps: {len(valid)} of the sampler's timesteps {t.tolist()} lie in the range "
            f"{timestep_range} up to index {last}; two are needed (the first is never trained)"
        )
    start, end = int(valid.min()) + 1, int(valid.max())
    bounds = torch.linspace(start, end, num + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(num, generator=generator) * (upper - lower)).long()


@torch.no_grad()
def soft_update_(old: list[torch.Tensor], new: list[torch.Tensor], decay: float) -> None:
    """old <- decay * old + (1 - decay) * new, in place (decay 0 copies new)."""
    for o, n in zip(old, new, strict=True):
        o.mul_(decay).add_(n.detach().to(o.dtype), alpha=1.0 - decay)
