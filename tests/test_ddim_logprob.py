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
