"""The forward-process maths (refl_ddpo.algorithms.forward) against closed forms, an independent velocity-space
write-up of DiffusionNFT's loss and the references' own numbers; the trainers' wiring (which network is the old one,
which timesteps are trained) on a one-tensor network; the families' forward-process parts (pred_x0,
training_target, noise_level) against each other and against the schedulers' own steps."""

from __future__ import annotations

import math

import pytest
import torch

from refl_ddpo.algorithms.forward import (
    ema_decay,
    matching_log_likelihood,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    output_mse,
    soft_update_,
    stratified_timestep_indices,
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


def test_ema_decay_is_the_references_warm_up_to_its_cap():
    # NVlabs/DiffusionNFT's EMAModuleWrapper(decay=0.9), stepped with the step count after the step: 2/11 first
    assert [ema_decay(s, 0.9) for s in (0, 1, 2, 80, 81, 10_000)] == pytest.approx(
        [0.1, 2 / 11, 3 / 12, 0.9, 0.9, 0.9]
    )


def _sd35_schedule() -> torch.Tensor:
    """SD3.5-M's 14-step flow schedule (shift 3), as Flow-Factory's AWM example samples it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(14)
    return scheduler.timesteps


def test_stratified_timesteps_draw_one_index_per_cut_uniformly():
    """Flow-Factory's AWM example (`discrete_wo_init`, range 0.9, 6 of 14 steps): the span is indices 1..12 (t >=
    100; index 0 is pure noise), cut at floor(linspace(1, 12, 7)) = 1, 2, 4, 6, 8, 10, 12; index j comes from cut j,
    uniformly, so 1..11 are drawn (sigma 0.97 .. 0.36) and never 0, 12 or 13."""
    schedule = _sd35_schedule()
    g = torch.Generator().manual_seed(0)
    n = 3000
    draws = torch.stack(
        [stratified_timestep_indices(schedule, 6, 0.9, 1000, 13, g) for _ in range(n)]
    )  # (n, 6)
    cuts = [(1,), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)]
    for j, cut in enumerate(cuts):
        counts = torch.bincount(draws[:, j], minlength=14)
        assert set(torch.nonzero(counts).flatten().tolist()) == set(cut), (j, counts)
        for i in cut:  # uniform in the cut: each within 5 binomial stds of n / len(cut)
            p = 1 / len(cut)
            assert abs(int(counts[i]) - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (j, i, counts)
    sigmas = schedule[draws.unique()] / 1000
    assert sigmas.max() == pytest.approx(0.973, abs=1e-3) and sigmas.min() == pytest.approx(0.357, abs=1e-3)
    # never past `last` (--train_skip_last_steps 3: index 10); DDIM's 10 steps (901 .. 1)
    assert stratified_timestep_indices(schedule, 6, 0.9, 1000, 10, g).max() < 10
    ddim = torch.arange(901, 0, -100)
    drawn = {i for _ in range(200) for i in stratified_timestep_indices(ddim, 4, 0.9, 1000, 9, g).tolist()}
    assert drawn == set(range(1, 8))  # cuts 1 | 2, 3 | 4, 5 | 6, 7 of the span 1..8 (t >= 100)
    with pytest.raises(ValueError, match="two are needed"):
        stratified_timestep_indices(schedule, 2, 0.9, 1000, 0, g)


def test_awm_loss_matches_the_reference_codes_numbers():
    """tests/fixtures/awm_ref.safetensors: X-GenGroup/Flow-Factory's own AWM code (trainers/awm.py @ a0b2bc5:
    `AWMTrainer.compute_weighted_log_prob` with `flow_match_sigma`, the target line of `_compute_awm_output` and
    the PPO-clip lines of `optimize`) run as written in a separate script on seeded inputs (8 samples, ratios on both
    sides of the clip), weightings Uniform / t / ghuber p 0.25 / ghuber p 0.5 with clip 1 / 0.2 / 1 / 0.2. The kit's
    log-likelihood of the output and of the old output, the policy loss and its gradient with respect to the output
    equal the reference's."""
    from pathlib import Path

    from safetensors.torch import load_file

    from refl_ddpo.algorithms.policy import ppo_clip_loss

    fixture = load_file(Path(__file__).parent / "fixtures" / "awm_ref.safetensors")
    for case, weighting in enumerate(("uniform", "t", "ghuber", "ghuber")):
        ref = {k.split("/", 1)[1]: v for k, v in fixture.items() if k.startswith(f"{case}/")}
        target = ref["noise"] - ref["x0"]  # the flow families' training_target (test below)
        sigma = ref["timestep"] / 1000  # Flow-Factory's flow_match_sigma; the flow families' noise_level
        power, clip = float(ref["ghuber_power"]), float(ref["clip_range"])
        v = ref["v"].clone().requires_grad_()
        ll = matching_log_likelihood(v, target, sigma, weighting, power)
        ll_old = matching_log_likelihood(ref["v_old"], target, sigma, weighting, power)
        loss, info = ppo_clip_loss(ll, ll_old, ref["advantages"], clip)
        (grad,) = torch.autograd.grad(loss, v)
        torch.testing.assert_close(ll.detach(), ref["log_prob"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ll_old, ref["old_log_prob"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss.detach(), ref["policy_loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, ref["grad_v"], rtol=1e-4, atol=1e-7)
        assert 0 < float(info["clipfrac"]) < 1, "some samples clipped, some not"


# ---- the trainers' wiring, on a one-tensor network ----


class _ScaleNet(torch.nn.Module):
    """output = x_t * w (w per channel): the trainable tensor a LoRA would be."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x_t):
        return x_t * self.w.view(1, -1, 1, 1)


class _FlowStub:
    """The family parts the forward-process trainers call, as a flow model's (sigma = t / 1000)."""

    def predict(self, x_t, t, scheduler, cond, uncond, guidance, network):
        return network(x_t)

    def pred_x0(self, scheduler, v, t, x_t):
        return x_t - (t / 1000).view(-1, 1, 1, 1) * v

    def training_target(self, scheduler, x0, noise, t):
        return noise - x0

    def noise_level(self, scheduler, t):
        return t / 1000

    def add_noise(self, scheduler, x0, noise, t):
        s = (t / 1000).view(-1, 1, 1, 1)
        return (1 - s) * x0 + s * noise


def _wired(method, cfg, w, w_old):
    """A run of `method` with a one-tensor network holding `w`, its old policy `w_old`, a flow family's parts."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from refl_ddpo.trainers.forward_training import ForwardState
    from refl_ddpo.trainers.rollouts import CleanSampler

    net = _ScaleNet(w)
    accelerator = SimpleNamespace(distributed_type=None, autocast=nullcontext)
    run = SimpleNamespace(
        cfg=cfg, name=method.name, accelerator=accelerator, network=net, params=[net.w], family=_FlowStub()
    )
    fp = ForwardState(method, CleanSampler(None))
    fp.old = [w_old.clone()]
    return fp, run


def _draw(seed: int = 0):
    from refl_ddpo.trainers.forward_training import Draw

    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    t = torch.tensor([900.0, 700.0, 500.0, 300.0])
    s = (t / 1000).view(-1, 1, 1, 1)
    return Draw(t, x0, noise, (1 - s) * x0 + s * noise), torch.tensor([1.5, -0.5, 0.8, -1.2])


def test_nft_trains_the_current_network_against_the_old_one():
    """NFT's loss of a trained timestep with the old policy away from the trained weights: its value and the
    gradient on the trained tensor are nft_loss of (the current network's x0, the old network's x0), and not of the
    pair swapped; the old policy and the trained tensor hold their own values afterwards."""
    from refl_ddpo.trainers.forward_config import NFTConfig
    from refl_ddpo.trainers.forward_training import NFT, nft_step_loss

    w, w_old = torch.tensor([1.0, 0.5, -0.3]), torch.tensor([0.2, 0.9, 0.4])
    fp, run = _wired(NFT, NFTConfig(kl_weight=0.0, nft_beta=0.7), w, w_old)
    draw, advantages = _draw()
    loss, _ = nft_step_loss(run, fp, {"advantages": advantages}, {}, draw)
    loss.backward()
    r = optimality_probability(advantages, run.cfg.train_adv_clip_max)

    def loss_of(current, old):
        current = current.clone().requires_grad_()
        pair = [
            draw.x_t - (draw.timesteps / 1000).view(-1, 1, 1, 1) * draw.x_t * x.view(1, -1, 1, 1)
            for x in (current, old)
        ]
        value, _ = nft_loss(pair[0], pair[1], draw.x0, r, 0.7, run.cfg.train_adv_clip_max)
        return value, torch.autograd.grad(value, current)[0]

    expected, expected_grad = loss_of(w, w_old)
    swapped, swapped_grad = loss_of(w_old, w)
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(run.params[0].grad, expected_grad)
    assert (
        abs(float(swapped.detach() - expected)) > 1e-3 and (swapped_grad - expected_grad).abs().max() > 1e-3
    )
    assert torch.equal(run.params[0].detach(), w) and torch.equal(fp.old[0], w_old)


def test_awm_is_on_policy_and_pulls_toward_the_old_policy():
    """AWM's loss of a trained timestep: ll_old from the trained weights as the micro-batch starts (ratio 1), the
    policy loss -mean(A) there, plus --old_kl_weight x mse(the current output, the old policy's); the gradient is
    that of the current network's terms. Computing the output with the old weights (the networks swapped) gives
    ratio != 1 and another gradient."""
    from refl_ddpo.algorithms.policy import ppo_clip_loss
    from refl_ddpo.trainers.forward_config import AWMConfig
    from refl_ddpo.trainers.forward_training import AWM

    w, w_old = torch.tensor([1.0, 0.5, -0.3]), torch.tensor([0.2, 0.9, 0.4])
    fp, run = _wired(AWM, AWMConfig(kl_weight=0.0), w, w_old)
    draw, advantages = _draw(1)
    assert AWM.micro_batch_start is not None and not AWM.sample_with_old
    AWM.micro_batch_start(run, fp, {}, [draw])
    loss, info = AWM.loss(run, fp, {"advantages": advantages}, {}, draw)
    loss.backward()
    assert float(info["ratio"]) == pytest.approx(1.0)

    def loss_of(current, old):
        current = current.clone().requires_grad_()
        v, v_old = (draw.x_t * x.view(1, -1, 1, 1) for x in (current, old))
        sigma = draw.timesteps / 1000
        ll = matching_log_likelihood(v, draw.noise - draw.x0, sigma, "ghuber", 0.25)
        ll_start = matching_log_likelihood(
            draw.x_t * w.view(1, -1, 1, 1), draw.noise - draw.x0, sigma, "ghuber"
        )
        policy, _ = ppo_clip_loss(ll, ll_start, advantages, 1.0)
        value = policy + output_mse(v, v_old).mean()
        return value, torch.autograd.grad(value, current)[0]

    expected, expected_grad = loss_of(w, w_old)
    swapped, swapped_grad = loss_of(w_old, w)
    torch.testing.assert_close(loss.detach(), expected)
    torch.testing.assert_close(run.params[0].grad, expected_grad)
    assert (
        abs(float(swapped.detach() - expected)) > 1e-3 and (swapped_grad - expected_grad).abs().max() > 1e-3
    )


@pytest.mark.parametrize("release", ["ema", "raw"])
def test_nft_releases_the_ema_of_the_trained_weights_or_the_raw_ones(release):
    """NFT's EMA starts at the initial weights and follows each optimizer step s with decay min((1 + s) / (10 + s),
    0.9); validation sees it and the final weights are it (--release_weights ema), or neither (raw: no EMA kept)."""
    from types import SimpleNamespace

    from refl_ddpo.trainers import forward_process
    from refl_ddpo.trainers.forward_config import NFTConfig
    from refl_ddpo.trainers.forward_training import NFT, after_step

    w0 = torch.tensor([1.0, 0.5, -0.3])
    fp, run = _wired(NFT, NFTConfig(release_weights=release), w0, w0)
    run.accelerator.reduce = lambda means, reduction: means
    run.accelerator.log = lambda values, step: None
    bar = SimpleNamespace(set_postfix=lambda *a, **k: None, update=lambda n: None)
    forward_process.keep_copies(run, fp)
    seen = []
    for step, w in enumerate((torch.tensor([2.0, 0.5, 0.7]), torch.tensor([3.0, 1.5, 0.7])), start=1):
        with torch.no_grad():
            run.params[0].copy_(w)
        fp.counters.global_step = step - 1
        after_step(run, fp, {"loss": [torch.tensor(0.0)]}, 1.0, bar)  # counts step s, then the EMA's update
        assert fp.counters.global_step == step
        with forward_process.released_weights(run, fp):
            seen.append(run.params[0].detach().clone())
        assert torch.equal(run.params[0].detach(), w), "the trained weights are back after validation"
    forward_process.release(run, fp)
    if release == "raw":
        assert fp.ema is None and torch.equal(seen[1], w) and torch.equal(run.params[0].detach(), w)
        return
    d1, d2 = 2 / 11, 3 / 12
    ema1 = d1 * w0 + (1 - d1) * torch.tensor([2.0, 0.5, 0.7])
    ema2 = d2 * ema1 + (1 - d2) * w
    torch.testing.assert_close(seen, [ema1, ema2])
    torch.testing.assert_close(run.params[0].detach(), ema2)


def test_draws_share_one_stratified_set_per_micro_batch_or_draw_per_sample():
    """--train_timesteps stratified (AWM's default): every sample of a micro-batch at the same timestep per draw,
    one per cut of the span; per_sample (NFT's, and the toy presets'): each sample its own."""
    import dataclasses
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler

    from refl_ddpo.trainers.forward_config import AWMConfig
    from refl_ddpo.trainers.forward_training import draw_timesteps

    cfg = AWMConfig(sample_num_steps=14, train_timestep_fraction=0.43)
    assert cfg.train_timesteps == "stratified" and cfg.old_decay_clock == "epochs"
    schedule, x0 = _sd35_schedule(), torch.zeros(8, 1, 2, 2)
    run = SimpleNamespace(cfg=cfg, family=_FlowStub())
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    g = torch.Generator().manual_seed(0)
    draws = draw_timesteps(run, scheduler, schedule, x0, 6, g)
    assert len(draws) == 6 and all(len(set(d.timesteps.tolist())) == 1 for d in draws)
    index = [int(torch.nonzero(schedule == d.timesteps[0])) for d in draws]
    assert all(
        i in cut for i, cut in zip(index, [(1,), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11)], strict=True)
    )
    run.cfg = dataclasses.replace(cfg, train_timesteps="per_sample")
    draws = draw_timesteps(run, scheduler, schedule, x0, 6, g)
    assert any(len(set(d.timesteps.tolist())) > 1 for d in draws)


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


def test_the_flow_familys_target_and_noise_level_are_flow_factorys(families):
    """The AWM fixture's conventions (test_awm_loss_matches_the_reference_codes_numbers) hold for the flow family:
    the target noise - x0 and the noise level t / 1000 (Flow-Factory's flow_match_sigma) at its own timesteps."""
    family, scheduler = families["tiny-sd3"]
    x0, noise = _latents((3, 4, 4, 4), 5)
    t = scheduler.timesteps[[0, 4, 8]]
    torch.testing.assert_close(family.training_target(scheduler, x0, noise, t), noise - x0)
    torch.testing.assert_close(family.noise_level(scheduler, t), t.float() / 1000)
