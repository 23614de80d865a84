"""refl_ddpo.core.lean: the no-grad calls of a 16-bit network with LoRA run as the stock pipeline's (the LoRA
folded, no autocast), the trained layers come back bit for bit, nothing changes in float32, and PPO's first update
stays on policy with the rollout folded (bf16 autocast on the CPU)."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from refl_ddpo.core import sampling
from refl_ddpo.core.families import load_family
from refl_ddpo.core.lean import Folded, foldable
from refl_ddpo.core.lora import add_lora

PROMPTS = ["a cat", "a dog", "a red ball", "a tree"]


def _family(tiny_models, model: str, dtype):
    torch.manual_seed(0)
    family = load_family(str(tiny_models / model), dtype)
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    return family, params


def test_float32_networks_are_not_folded(tiny_models):
    family, _ = _family(tiny_models, "stable-diffusion", torch.float32)
    assert foldable(family, None) is None


def test_fold_calls_the_stock_network_and_gives_the_layers_back(tiny_models):
    """Folded: the adapters off, the base weights W + scale B A (rounded once), the output close to the LoRA
    network's under autocast; off: the very tensors back, adapters on, the class forward again."""
    family, params = _family(tiny_models, "stable-diffusion", torch.bfloat16)
    net = family.network
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    x = torch.randn(1, 4, 16, 16, dtype=torch.bfloat16)
    states = torch.randn(1, 77, net.config.cross_attention_dim, dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = net(x, 500, encoder_hidden_states=states).sample.float()
    fold = Folded(foldable(family, None))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        module, calls = fold.step(False, None)
        with calls:
            assert not torch.is_autocast_enabled("cpu")
            got = module(x.float(), 500, encoder_hidden_states=states).sample.float()
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())
    fold.off()
    assert "forward" not in net.__dict__
    assert all(torch.equal(before[n], p) for n, p in net.named_parameters())
    assert all(p.requires_grad for p in params)


def _first_update(family, params, eta: float, steps: int = 3):
    """PPO's first step after sampling two batches of 2 (bf16 autocast on the CPU, accelerate-prepared network);
    its stats."""
    from refl_ddpo.algorithms.policy import batch_advantages
    from refl_ddpo.rewards import build_reward
    from refl_ddpo.trainers.epochs import EpochPlan
    from refl_ddpo.trainers.ppo import PPOSettings, train_on_samples
    from refl_ddpo.trainers.rollouts import Policy, SampleSettings, sample_epoch, stack_samples

    AcceleratorState._reset_state()
    acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=steps)
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    network, optimizer = acc.prepare(family.network, torch.optim.AdamW(params, lr=1e-3))
    wrapped = family.network.forward
    prompts, uncond = iter(PROMPTS), family.empty_cond()
    kw = {"num_steps": steps, "guidance_scale": 3.0, "eta": eta}
    batches = sample_epoch(
        Policy(family, scheduler, uncond, network, acc.autocast),
        SampleSettings(batch_size=2, num_batches=2, resolution=32, **kw),
        EpochPlan(lambda: (next(prompts), {})),
        build_reward("jpeg_compressibility", "cpu"),
        torch.Generator().manual_seed(0),
    )
    assert family.network.forward is wrapped  # accelerate's autocast forward back after the rollout
    samples = stack_samples(batches, batch_advantages(torch.cat([b.rewards[0] for b in batches])).float())
    policy, settings = (
        Policy(family, scheduler, uncond, network),
        PPOSettings(batch_size=2, num_train_steps=steps, clip_range=1e-4, **kw),
    )
    steps_ = train_on_samples(
        policy, settings, samples, acc, optimizer, params, torch.Generator().manual_seed(1)
    )
    AcceleratorState._reset_state()
    return {k: float(steps_[0][k]) for k in ("approx_kl", "ratio")}


@pytest.mark.parametrize(
    ("model", "eta", "ratio_tol", "kl_tol"),
    [("tiny-sd3", 0.7, 1e-3, 1e-6), ("stable-diffusion", 1.0, 0.03, 1e-3)],
)
def test_ppo_first_update_stays_on_policy_with_the_rollout_folded(
    tiny_models, model, eta, ratio_tol, kl_tol, monkeypatch
):
    """bf16 autocast on the CPU: the first update's mean ratio and approximate KL with the rollout folded, against
    the rollout as the trainer ran it before the fold, both within the measured tolerance (3 steps: SD3 1.00005 /
    1.1e-8 folded, 1.0 / 0 not; SD 1.x 0.978 / 3.7e-4 folded, 0.985 / 2.5e-4 not: bf16's own gap between sampling
    under the rollout's autocast region and training, of the same order with the fold)."""
    family, params = _family(tiny_models, model, torch.bfloat16)
    state = {n: p.detach().clone() for n, p in zip(range(len(params)), params, strict=True)}
    folded = _first_update(family, params, eta)
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(state[i])
    monkeypatch.setattr(sampling, "foldable", lambda family, network: None)
    plain = _first_update(family, params, eta)
    for stats in (folded, plain):
        assert abs(stats["ratio"] - 1) <= ratio_tol and stats["approx_kl"] <= kl_tol, (folded, plain)


def test_no_fold_lora_leaves_the_no_grad_calls_as_trained(tiny_models):
    """--no-fold_lora (the family's `fold_lora`, set by the run from the flag): nothing folded."""
    from refl_ddpo.core.sampling import _fold

    family, _ = _family(tiny_models, "stable-diffusion", torch.bfloat16)
    assert _fold(family, None, False, (), 3) is not None
    family.fold_lora = False
    assert _fold(family, None, False, (), 3) is None
