"""Reward backpropagation (ReFL; Xu et al. 2023, "ImageReward", Algorithm 1): the loss on a differentiable reward."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def refl_loss(rewards: torch.Tensor, margin: float = 2.0, grad_scale: float = 1e-3) -> torch.Tensor:
    """relu(margin - r).mean() * grad_scale over rewards (B,): rewards above the margin stop pulling."""
    return F.relu(margin - rewards).mean() * grad_scale


def x0_kl(pred_x0: torch.Tensor, ref_pred_x0: torch.Tensor, weight: float) -> torch.Tensor:
    """ReFL's KL regulariser at the grad step: weight * mse(x0, x0_ref), where the family's weight turns the x0 MSE
    into the model-output MSE at that step (SD: a / (1 - a), so it is mean((eps - eps_ref)^2)).

    Why this is a KL: both models' transitions p(x_{t-1} | x_t) are Gaussians with the same variance and means
    affine in x0, so their KL is a per-timestep multiple of this term (DPOK, Fan et al. 2023, use the same).
    """
    return weight * F.mse_loss(pred_x0.float(), ref_pred_x0.float())


# ---- beyond one step: DRaFT-K (Clark et al. 2023, "Directly Fine-Tuning Diffusion Models on Differentiable Rewards",
# arXiv 2309.17400) and AlignProp (Prabhudesai et al. 2023, arXiv 2310.03739) ----


def parse_backprop_steps(spec: str) -> tuple[int, int]:
    """`--backprop_steps` -> (lo, hi): "K" is DRaFT-K (lo = hi = K); "random:LO-HI" is AlignProp's randomised
    truncation (K uniform in LO..HI, inclusive). Raises ValueError on anything else or on K < 1."""
    text = spec.strip()
    try:
        if text.startswith("random:"):
            lo_text, hi_text = text.removeprefix("random:").split("-")
            lo, hi = int(lo_text), int(hi_text)
        else:
            lo = hi = int(text)
    except ValueError:
        raise ValueError(f"{spec!r} is neither K nor random:LO-HI") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{spec!r}: need 1 <= K (and LO <= HI)")
    return lo, hi


def draft_grad_steps(num_inference_steps: int, k: int) -> range:
    """The step indices that carry gradient in DRaFT-K: the last K of the T-step run (T - K .. T - 1)."""
    if not 1 <= k <= num_inference_steps:
        raise ValueError(f"K={k} outside 1..{num_inference_steps}")
    return range(num_inference_steps - k, num_inference_steps)
