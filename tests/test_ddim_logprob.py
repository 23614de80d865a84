"""`ddim_step_with_logprob` against ddpo-pytorch's own outputs (tests/fixtures/ddpo_ref.pt) and diffusers' step."""

from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler

from refl_ddpo import ddim_step_with_logprob

REF = torch.load(Path(__file__).parent / "fixtures" / "ddpo_ref.pt", weights_only=True)


def _scheduler() -> DDIMScheduler:
    s = DDIMScheduler(**REF["scheduler_config"])
    s.set_timesteps(REF["num_inference_steps"])
    return s


def test_scheduler_matches_reference():
    s = _scheduler()
    assert torch.equal(s.timesteps, REF["timesteps"])
    assert torch.equal(s.alphas_cumprod, REF["alphas_cumprod"])


@pytest.mark.parametrize("case", REF["cases"], ids=[c["name"] for c in REF["cases"]])
def test_matches_ddpo_pytorch(case):
    s = _scheduler()
    generator = (
        None if case["generator_seed"] is None else torch.Generator().manual_seed(case["generator_seed"])
    )
    prev, log_prob = ddim_step_with_logprob(
        s,
        case["model_output"],
        case["timestep"],
        case["sample"],
        eta=case["eta"],
        generator=generator,
        prev_sample=case["prev_sample_given"],
    )
    rtol = 1e-5 if case["dtype"] == "torch.float32" else 1e-4
    assert prev.dtype == case["sample"].dtype
    torch.testing.assert_close(prev, case["prev_sample"], rtol=rtol, atol=rtol)
    torch.testing.assert_close(log_prob, case["log_prob"].to(log_prob.dtype), rtol=rtol, atol=0)


@pytest.mark.parametrize(
    "case",
    [c for c in REF["cases"] if c.get("diffusers_step_prev_sample") is not None and c["timestep"].ndim == 0],
    ids=lambda c: c["name"],
)
def test_sample_equals_stock_ddim_step(case):
    """Same noise -> the same next latent as today's `DDIMScheduler.step`."""
    s = _scheduler()
    prev, _ = ddim_step_with_logprob(
        s,
        case["model_output"],
        case["timestep"],
        case["sample"],
        eta=case["eta"],
        prev_sample=None,
        generator=torch.Generator().manual_seed(case["generator_seed"]),
    )
    stock = s.step(
        case["model_output"],
        case["timestep"],
        case["sample"],
        eta=case["eta"],
        variance_noise=case["variance_noise"],
    ).prev_sample
    torch.testing.assert_close(prev, stock, rtol=1e-6, atol=1e-6)


def test_log_prob_closed_form():
    """log N(x; mu, s^2) averaged over dims equals the textbook density of the sampled noise z: -z^2/2 - log s - log sqrt(2 pi)."""
    s = _scheduler()
    g = torch.Generator().manual_seed(0)
    eps, x = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    t = s.timesteps[10]
    _, lp = ddim_step_with_logprob(s, eps, t, x, eta=1.0, generator=torch.Generator().manual_seed(5))
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    a_t = s.alphas_cumprod[t]
    a_prev = s.alphas_cumprod[t - 1000 // 50]
    std = ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt()
    expected = (-(z**2) / 2 - torch.log(std) - 0.5 * torch.log(torch.tensor(2 * torch.pi))).mean(
        dim=(1, 2, 3)
    )
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)


def test_a_step_with_variance_0_is_deterministic_with_log_prob_0_and_finite_gradient():
    """With set_alpha_to_one (DDIM's default, which diffusers' test SDXL config gets) the last step goes to a_prev = 1:
    s^2 = 0 exactly, x_prev = x0. Its log-prob and KL are 0 with a finite (0) gradient, where they were NaN (issue
    #72); a stochastic step in the same batch keeps the bits it has when scored alone."""
    from refl_ddpo.core.steps.ddim import ddim_step_kl, step_alphas

    s = DDIMScheduler(**{**REF["scheduler_config"], "set_alpha_to_one": True})
    s.set_timesteps(4)
    t = torch.stack([s.timesteps[-1], s.timesteps[1]])  # (2,): the deterministic last step, a stochastic one
    assert step_alphas(s, t)[2].tolist()[0] == 0.0 and step_alphas(s, t)[2][1] > 0
    g = torch.Generator().manual_seed(0)
    eps, x = torch.randn(2, 4, 8, 8, generator=g).requires_grad_(), torch.randn(2, 4, 8, 8, generator=g)
    prev, lp = ddim_step_with_logprob(s, eps, t, x, eta=1.0, generator=torch.Generator().manual_seed(1))
    _, lp_again = ddim_step_with_logprob(s, eps * 1.01, t, x, eta=1.0, prev_sample=prev)
    lp_again.sum().backward()
    assert lp.tolist()[0] == 0.0 and lp_again.tolist()[0] == 0.0 and torch.isfinite(lp_again).all()
    assert torch.isfinite(eps.grad).all() and not eps.grad[0].any() and eps.grad[1].any()
    _, alone = ddim_step_with_logprob(s, eps[1:] * 1.01, t[1:], x[1:], eta=1.0, prev_sample=prev[1:])
    assert torch.equal(lp_again[1:], alone)
    kl = ddim_step_kl(s, eps.detach(), eps.detach() * 0.9, t, eta=1.0)
    assert kl[0] == 0 and kl[1] > 0
