"""The forward-process maths (refl_ddpo.algorithms.forward) against closed forms and an independent velocity-space
write-up of DiffusionNFT's loss; the families' forward-process parts (pred_x0, training_target, noise_level)
against each other and against the schedulers' own steps."""

from __future__ import annotations

import math

import pytest
import torch

from refl_ddpo.algorithms.forward import (
    matching_log_likelihood,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    output_mse,
    soft_update_,
)
from refl_ddpo.core.families import load_family

pytestmark = pytest.mark.usefixtures("one_thread")


def test_optimality_probability_maps_clipped_advantages_to_0_1():
    a = torch.tensor([-9.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.0])
    r = optimality_probability(a, 5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0]))


def _nft_in_velocity_space(v, v_old, x_t, x0, sigma, r, beta, c):
    """DiffusionNFT's loss written from the paper's definitions on a flow model: the implicit policies in velocity
    space, each turned into x0 = x_t - sigma v, the adaptive weight sg(mean |x0_pred - x0|)."""
    s = sigma.view(-1, 1, 1, 1)
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v
    losses = []
    for pred in (x_t - s * v_pos, x_t - s * v_neg):
        err = pred - x0
        w = err.detach().abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
        losses.append((err**2).mean(dim=(1, 2, 3)) / w)
    return ((r * losses[0] + (1 - r) * losses[1]) / beta * c).mean()


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_in_x0_space_equals_the_velocity_space_definition(beta):
    g = torch.Generator().manual_seed(0)
    d = torch.float64  # both sides in double: the comparison is of the maths, not of float32 rounding
    x0, noise = torch.randn(4, 2, 3, 3, generator=g, dtype=d), torch.randn(4, 2, 3, 3, generator=g, dtype=d)
    sigma = torch.tensor([0.9, 0.6, 0.3, 0.1], dtype=d)
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
    v_old = noise - x0 + 0.3 * torch.randn(x0.shape, generator=g, dtype=d)
    v = (v_old + 0.2 * torch.randn(x0.shape, generator=g, dtype=d)).requires_grad_()
    r = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=d)
    s = sigma.view(-1, 1, 1, 1)
    ours, _ = nft_loss(x_t - s * v, x_t - s * v_old, x0, r, beta, 5.0)
    (g_ours,) = torch.autograd.grad(ours, v)
    v2 = v.detach().clone().requires_grad_()
    theirs = _nft_in_velocity_space(v2, v_old, x_t, x0, sigma, r, beta, 5.0)
    (g_theirs,) = torch.autograd.grad(theirs, v2)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["0", "1", "2"])
def test_nft_loss_matches_the_reference_codes_numbers(case):
    """tests/fixtures/nft_ref.safetensors: NVlabs/DiffusionNFT's own loss lines run on tiny inputs
    (tests/fixtures/make_nft_ref.py), beta 1 / 0.1 / 1 and adv_clip_max 5 / 5 / 1; the loss and its gradient with
    respect to the network's velocity, to 1e-5."""
    from pathlib import Path

    from safetensors.torch import load_file

    ref = {
        k.split("/", 1)[1]: v
        for k, v in load_file(Path(__file__).parent / "fixtures" / "nft_ref.safetensors").items()
        if k.startswith(case + "/")
    }
    beta, c = float(ref["beta"]), float(ref["adv_clip_max"])
    s = ref["t"].view(-1, 1, 1, 1)
    v = ref["v"].clone().requires_grad_()
    r = optimality_probability(ref["advantages"], c)
    loss, _ = nft_loss(ref["xt"] - s * v, ref["xt"] - s * ref["v_old"], ref["x0"], r, beta, c)
    (grad,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(loss.double(), ref["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref["grad_v"], rtol=1e-5, atol=1e-6)


def test_on_policy_nft_gradient_is_the_advantage_weighted_denoising_gradient():
    """At theta = old, x0+ = x0- = x0_old: d loss / d x0_theta = c (2r - 1) 2 (x0_theta - x0) / (w n B) per sample,
    with 2r - 1 = A / c: the advantage A weights the gradient of the (adaptively weighted) denoising loss."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64)
    x0_old = x0 + 0.5 * torch.randn(x0.shape, generator=g, dtype=torch.float64)
    x0_theta = x0_old.clone().requires_grad_()
    advantages = torch.tensor([2.0, -1.0, 0.0], dtype=torch.float64)
    c, beta = 5.0, 0.7
    r = optimality_probability(advantages, c)
    loss, _ = nft_loss(x0_theta, x0_old, x0, r, beta, c)
    (grad,) = torch.autograd.grad(loss, x0_theta)
    err = x0_old - x0
    n = err[0].numel()
    w = err.abs().mean(dim=(1, 2, 3)).view(-1, 1, 1, 1)
    expected = advantages.view(-1, 1, 1, 1) * 2 * err / (w * n * len(x0))
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-14)


def test_matching_log_likelihood_weightings():
    out, target = torch.zeros(2, 1, 2, 2), torch.full((2, 1, 2, 2), 2.0)
    target[1] = 1.0  # mse 4 and 1
    t = torch.tensor([0.5, 0.25])
    torch.testing.assert_close(matching_log_likelihood(out, target, t, "uniform"), torch.tensor([-4.0, -1.0]))
    torch.testing.assert_close(matching_log_likelihood(out, target, t, "t"), torch.tensor([-2.0, -0.25]))
    p = 0.25
    eps = 1e-10**p
    expected = torch.tensor([-(4.0**p - eps) * 0.5 / p, -(1.0**p - eps) * 0.25 / p])
    torch.testing.assert_close(
        matching_log_likelihood(out, target, t, "ghuber", p), expected, rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="weighting"):
        matching_log_likelihood(out, target, t, "huber")


def test_output_mse_is_per_sample_and_stops_the_others_gradient():
    a = torch.ones(2, 3, requires_grad=True)
    b = torch.zeros(2, 3, requires_grad=True)
    m = output_mse(a, b)
    torch.testing.assert_close(m, torch.ones(2))
    m.sum().backward()
    assert b.grad is None and a.grad is not None


def test_old_policy_decay_follows_the_reference_schedules():
    # DiffusionNFT's decay_type 1 (0, 0.001, 0.5) and 2 (75, 0.0075, 0.999)
    assert [old_policy_decay(s, 0, 0.001, 0.5) for s in (0, 1, 100, 499, 500, 10_000)] == pytest.approx(
        [0.0, 0.001, 0.1, 0.499, 0.5, 0.5]
    )
    assert [old_policy_decay(s, 75, 0.0075, 0.999) for s in (0, 74, 75, 76, 175, 300)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.0075, 0.75, 0.999]
    )


def test_soft_update_interpolates_in_place():
    old, new = [torch.zeros(3), torch.ones(2)], [torch.full((3,), 4.0), torch.full((2,), 3.0)]
    soft_update_(old, new, 0.25)
    torch.testing.assert_close(old[0], torch.full((3,), 3.0))
    torch.testing.assert_close(old[1], torch.full((2,), 2.5))
    soft_update_(old, new, 0.0)
    torch.testing.assert_close(old[0], new[0])


# ---- the families' forward-process parts ----


@pytest.fixture(scope="module")
def families(tiny_models):
    out = {}
    for model in ("stable-diffusion", "tiny-sd3"):
        family = load_family(str(tiny_models / model))
        scheduler = family.policy_scheduler()
        family.set_timesteps(scheduler, 10, None)
        out[model] = (family, scheduler)
    return out


def _latents(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("model", ["stable-diffusion", "tiny-sd3"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_the_training_target_predicts_x0_exactly(families, model, prediction_type):
    """A network that outputs the pretraining target at x_t = add_noise(x0, noise, t) predicts x0 itself."""
    family, scheduler = families[model]
    if model == "tiny-sd3" and prediction_type == "v_prediction":
        pytest.skip("flow matching has one parameterisation")
    if model == "stable-diffusion":
        scheduler = type(scheduler).from_config({**scheduler.config, "prediction_type": prediction_type})
        family.set_timesteps(scheduler, 10, None)
    x0, noise = _latents((4, 4, 4, 4), 0)
    t = scheduler.timesteps[torch.tensor([0, 3, 6, 9])]
    x_t = family.add_noise(scheduler, x0, noise, t)
    target = family.training_target(scheduler, x0, noise, t)
    torch.testing.assert_close(family.pred_x0(scheduler, target, t, x_t), x0, rtol=1e-4, atol=1e-4)
    level = family.noise_level(scheduler, t)
    assert level.shape == (4,) and bool((level[:-1] > level[1:]).all()) and 0 < float(level.min()) < 1


@pytest.mark.parametrize("model", ["stable-diffusion", "tiny-sd3"])
def test_pred_x0_is_the_deterministic_steps_predicted_x0(families, model):
    """pred_x0 per sample equals the x0 the family's own deterministic step predicts at each timestep."""
    family, scheduler = families[model]
    x_t, out = _latents((3, 4, 4, 4), 1)
    for i in (0, 4, 9):
        t = scheduler.timesteps[i]
        _, x0_step = family.step(scheduler, out, t, x_t, 0.0, None)
        mine = family.pred_x0(scheduler, out, t.repeat(3), x_t)
        torch.testing.assert_close(mine, x0_step.float(), rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(mine.sum()))
