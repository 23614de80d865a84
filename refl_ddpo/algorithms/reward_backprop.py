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
