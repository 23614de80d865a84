"""`flow_sde_step_with_logprob` against Flow-GRPO's own outputs (tests/fixtures/flow_grpo_ref.pt), the Euler step
against diffusers' `FlowMatchEulerDiscreteScheduler.step`, the on-policy ratio and the KL's closed form."""

from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from refl_ddpo import flow_sde_step_with_logprob
from refl_ddpo.core.steps.flow_sde import flow_euler_step, flow_sde_step_kl

REF = torch.load(Path(__file__).parent / "fixtures" / "flow_grpo_ref.pt", weights_only=True)


def _scheduler(num_steps: int, shift: float = 3.0) -> FlowMatchEulerDiscreteScheduler:
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    s.set_timesteps(num_steps)
    return s


def _id(c) -> str:
    step = c["step_index"].tolist() if torch.is_tensor(c["step_index"]) else c["step_index"]
    return f"{c['kind']}-{c['dtype'][6:]}-n{c['num_steps']}-i{step}-eta{c['noise_level']}"


@pytest.mark.parametrize("case", REF["cases"], ids=[_id(c) for c in REF["cases"]])
def test_matches_flow_grpo(case):
    s = _scheduler(case["num_steps"], case["shift"])
    t = case["timestep"]
    assert torch.equal(s.timesteps[case["step_index"]].expand_as(t), t)  # the reference's schedule
    gen = case["kind"] == "gen"
    prev, log_prob, mean, std = flow_sde_step_with_logprob(
        s,
        case["model_output"],
        case["timestep"],
        case["sample"],
        noise_level=case["noise_level"],
        generator=torch.Generator().manual_seed(case["generator_seed"]) if gen else None,
        prev_sample=None if gen else case["given_prev_sample"],
    )
    assert log_prob.dtype == mean.dtype == torch.float32  # whatever the input dtype
    torch.testing.assert_close(log_prob, case["log_prob"], rtol=1e-5, atol=0)
    torch.testing.assert_close(mean, case["prev_sample_mean"], rtol=0, atol=1e-5)
    torch.testing.assert_close(std, case["std_dev_t"], rtol=1e-6, atol=0)
    if gen:
        torch.testing.assert_close(prev, case["prev_sample"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_euler_step_equals_stock_step(dtype):
    s = _scheduler(10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 4, 4, generator=g).to(dtype)
    for t in s.timesteps:  # the stock step is stateful: walk the whole schedule
        v = torch.randn(2, 16, 4, 4, generator=g).to(dtype)
        ours, x0 = flow_euler_step(s, v, t, x)
        stock = s.step(v, t, x, return_dict=False)[0]
        assert ours.dtype == stock.dtype == dtype and torch.equal(ours, stock)
        sigma = s.sigmas[s.index_for_timestep(t)]
        assert torch.equal(x0, (x.float() - sigma * v.float()).to(dtype))
        x = stock


def test_noise_level_zero_mean_is_the_euler_step():
    s = _scheduler(10)
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 16, 4, 4, generator=g), torch.randn(2, 16, 4, 4, generator=g)
    _, _, mean, _ = flow_sde_step_with_logprob(s, v, s.timesteps[3], x, noise_level=0.0, prev_sample=x)
    torch.testing.assert_close(mean, flow_euler_step(s, v, s.timesteps[3], x)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_policy_ratio_is_one(dtype):
    """Scoring the sampled next latent again (per-sample timesteps, as a trainer does) gives the same log-prob."""
    s = _scheduler(10)
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(3, 16, 4, 4, generator=g).to(dtype), torch.randn(3, 16, 4, 4, generator=g).to(dtype)
    t = s.timesteps[[0, 4, 9]]
    prev, log_prob, _, _ = flow_sde_step_with_logprob(s, v, t, x, generator=torch.Generator().manual_seed(3))
    _, again, _, _ = flow_sde_step_with_logprob(s, v, t, x, prev_sample=prev)
    assert torch.equal(again, log_prob)
    # and the batch of per-sample timesteps equals stepping each sample alone
    for i in range(3):
        _, alone, _, _ = flow_sde_step_with_logprob(
            s, v[i : i + 1], t[i], x[i : i + 1], prev_sample=prev[i : i + 1]
        )
        torch.testing.assert_close(alone, log_prob[i : i + 1], rtol=1e-6, atol=0)


def test_log_prob_closed_form():
    """log N(x; mean, s^2) averaged over dims equals the density of the drawn noise z: -z^2/2 - log s - log sqrt(2 pi)."""
    s = _scheduler(10)
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(2, 16, 4, 4, generator=g), torch.randn(2, 16, 4, 4, generator=g)
    t = s.timesteps[5]
    _, lp, _, std = flow_sde_step_with_logprob(s, v, t, x, 0.7, torch.Generator().manual_seed(5))
    z = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(5))
    scale = std * (s.sigmas[5] - s.sigmas[6]).sqrt()
    expected = (-(z**2) / 2).mean(dim=(1, 2, 3)) - scale.log() - 0.5 * torch.log(torch.tensor(2 * torch.pi))
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)


def test_kl_closed_form():
    """Flow-GRPO's KL term ||mean - mean_ref||^2 / (2 std_dev_t^2) from the two step means, and its relation to the
    exact KL of the two Gaussians (the same divided by -dt)."""
    s = _scheduler(10)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 16, 4, 4, generator=g)
    v, v_ref = torch.randn(3, 16, 4, 4, generator=g), torch.randn(3, 16, 4, 4, generator=g)
    t = s.timesteps[[0, 5, 9]]
    kl = flow_sde_step_kl(s, v, v_ref, t, noise_level=0.7)
    _, _, mean, std = flow_sde_step_with_logprob(s, v, t, x, 0.7, prev_sample=x)
    _, _, mean_ref, _ = flow_sde_step_with_logprob(s, v_ref, t, x, 0.7, prev_sample=x)
    expected = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std**2)
    torch.testing.assert_close(kl, expected, rtol=1e-5, atol=0)
    assert torch.equal(flow_sde_step_kl(s, v, v, t), torch.zeros(3))
    # exact KL(N(m, s^2) || N(m_ref, s^2)) per dimension, s = std_dev_t sqrt(-dt), by Monte Carlo on the log-probs
    i = 1
    z = torch.randn(4096, 16, 4, 4, generator=g)
    dt = s.sigmas[6] - s.sigmas[5]
    samples = mean[i] + std[i] * (-dt).sqrt() * z
    lp = flow_sde_step_with_logprob(s, v[i].expand_as(z), t[i], x[i].expand_as(z), 0.7, prev_sample=samples)[
        1
    ]
    lp_ref = flow_sde_step_with_logprob(
        s, v_ref[i].expand_as(z), t[i], x[i].expand_as(z), 0.7, prev_sample=samples
    )[1]
    torch.testing.assert_close((lp - lp_ref).mean(), kl[i] / -dt, rtol=2e-2, atol=0)
