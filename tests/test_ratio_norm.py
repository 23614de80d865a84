"""GRPO-Guard's RatioNorm (--ratio_norm): its closed form on a Gaussian step built by hand and on the two stochastic
steps (DDIM, Flow-GRPO's SDE), the normalised ratio 1 on-policy, GRPO and DDPO trained with the flag (the LoRA moves,
no base weight does), and the clip it needs, refused in one line before loading. CPU, tiny models."""

import math

import pytest
import torch
from helpers import cpu_accelerator, trainer_flags, watch_training

from refl_ddpo.algorithms.policy import ratio_norm
from refl_ddpo.core.families import load_family
from refl_ddpo.core.lora import add_lora
from refl_ddpo.core.steps.ddim import ddim_step_mean, ddim_step_with_logprob
from refl_ddpo.core.steps.flow_sde import flow_sde_step_mean, flow_sde_step_with_logprob
from refl_ddpo.rewards import build_reward
from refl_ddpo.trainers.epochs import EpochPlan
from refl_ddpo.trainers.ppo import PPOSettings, train_on_samples
from refl_ddpo.trainers.rollouts import Policy, SampleSettings, sample_epoch, stack_samples

RES = 32


def _gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std^2) averaged over the non-batch dims (B,); std (B,)."""
    s = std.reshape(-1, *([1] * (x.ndim - 1)))
    log_density = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return log_density.mean(dim=tuple(range(1, x.ndim)))


def test_ratio_norm_is_the_mean_of_eps_times_the_change_of_the_mean():
    """x = mu_old + s eps: s (logp - logp_old) + mean(delta^2) / (2 s) = mean(eps * delta), delta = mu - mu_old, per
    sample and with a scalar s; on-policy (delta 0) it is exactly 0 (ratio 1); a step of std 0 gives 0 and a zero
    gradient."""
    g = torch.Generator().manual_seed(0)
    old_mean = torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64)
    delta = 0.05 * torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64)
    eps = torch.randn(3, 4, 2, 2, generator=g, dtype=torch.float64)
    for std in (
        torch.tensor([0.3, 0.05, 1.2], dtype=torch.float64),
        torch.full((3,), 0.2, dtype=torch.float64),
    ):
        x = old_mean + std.reshape(-1, 1, 1, 1) * eps
        log_prob = _gaussian_log_prob(x, old_mean + delta, std)
        old_log_prob = _gaussian_log_prob(x, old_mean, std)
        expected = (eps * delta).mean(dim=(1, 2, 3))
        got = ratio_norm(log_prob, old_log_prob, old_mean + delta, old_mean, std)
        assert torch.allclose(got.double(), expected, atol=1e-6), (got, expected)
        scalar = ratio_norm(log_prob, old_log_prob, old_mean + delta, old_mean, float(std[0]))
        if bool((std == std[0]).all()):
            assert torch.allclose(scalar.double(), expected, atol=1e-6)
        # the plain log-ratio is shifted by -mean(delta^2) / (2 s^2) and scaled by 1 / s
        plain = log_prob - old_log_prob
        assert torch.allclose(
            plain, expected / std - (delta**2).mean(dim=(1, 2, 3)) / (2 * std**2), atol=1e-9
        )
    on_policy = ratio_norm(old_log_prob, old_log_prob, old_mean, old_mean, std)
    assert torch.equal(on_policy, torch.zeros(3))

    mean = (old_mean + delta).float().requires_grad_()
    lp = torch.zeros(3, requires_grad=True)
    out = ratio_norm(lp, torch.zeros(3), mean, old_mean.float(), torch.tensor([0.0, 0.5, 0.0]))
    assert out[0] == 0 and out[2] == 0
    out.sum().backward()
    assert torch.isfinite(mean.grad).all() and mean.grad[0].abs().sum() == 0 and mean.grad[2].abs().sum() == 0


def test_ratio_norm_of_the_ddim_and_flow_steps_is_the_closed_form(tiny_models):
    """On the kit's two stochastic steps: sample x_next with one model output, score it under another; the step
    functions' log-probs and means give ratio_norm = mean(eps * (mu - mu_old)), eps = (x_next - mu_old) / s."""
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 4, 4, generator=g)
    out_old = torch.randn(2, 4, 4, 4, generator=g)
    out_new = out_old + 0.02 * torch.randn(2, 4, 4, 4, generator=g)

    ddim = DDIMScheduler.from_pretrained(tiny_models / "stable-diffusion", subfolder="scheduler")
    ddim.set_timesteps(5)
    t = ddim.timesteps[torch.tensor([1, 3])]
    nxt, old_lp = ddim_step_with_logprob(ddim, out_old, t, x, eta=1.0, generator=g)
    _, new_lp = ddim_step_with_logprob(ddim, out_new, t, x, eta=1.0, prev_sample=nxt)
    old_mean, std, _ = ddim_step_mean(ddim, out_old, t, x, 1.0)
    new_mean, _, _ = ddim_step_mean(ddim, out_new, t, x, 1.0)
    std = std.reshape(-1)
    eps = (nxt - old_mean) / std.reshape(-1, 1, 1, 1)
    expected = (eps * (new_mean - old_mean)).mean(dim=(1, 2, 3))
    assert torch.allclose(ratio_norm(new_lp, old_lp, new_mean, old_mean, std), expected, atol=1e-6)

    flow = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_models / "tiny-sd3", subfolder="scheduler")
    flow.set_timesteps(5)
    t = flow.timesteps[torch.tensor([0, 2])]
    nxt, old_lp, old_mean, _ = flow_sde_step_with_logprob(flow, out_old, t, x, 0.7, generator=g)
    _, new_lp, new_mean, _ = flow_sde_step_with_logprob(flow, out_new, t, x, 0.7, prev_sample=nxt)
    mean_again, step_std, _ = flow_sde_step_mean(flow, out_old, t, x, 0.7)
    assert torch.equal(mean_again, old_mean)
    eps = (nxt - old_mean) / step_std
    expected = (eps * (new_mean - old_mean)).mean(dim=(1, 2, 3))
    assert torch.allclose(
        ratio_norm(new_lp, old_lp, new_mean, old_mean, step_std.reshape(-1)), expected, atol=1e-6
    )


@pytest.mark.parametrize("model, eta", [("stable-diffusion", 1.0), ("tiny-sd3", 0.7)])
def test_flag_keeps_the_step_means_and_its_ratio_is_one_on_policy(tiny_models, model, eta):
    """With keep_step_means the samples hold each step's mean (the family's `step_mean` of the stored state); with
    ratio_norm and unchanged weights (lr 0) every normalised ratio is 1 (to float rounding), at every step."""
    torch.manual_seed(0)
    family = load_family(str(tiny_models / model))
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    prompts = iter(["a cat", "a dog"] * 2)
    batches = sample_epoch(
        Policy(family, scheduler, None),
        SampleSettings(
            batch_size=4,
            num_batches=1,
            num_steps=3,
            guidance_scale=1.0,
            eta=eta,
            resolution=RES,
            keep_step_means=True,
        ),
        EpochPlan(lambda: (next(prompts), {})),
        build_reward("jpeg_compressibility", "cpu"),
        torch.Generator().manual_seed(0),
    )
    samples = stack_samples(batches, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert samples["step_means"].shape == samples["latents"].shape
    # the next latent is the step's mean plus noise of the step's std
    assert not torch.equal(samples["step_means"], samples["next_latents"].float())
    accelerator = cpu_accelerator(gradient_accumulation_steps=3)
    (step,) = train_on_samples(
        Policy(family, scheduler, None, family.network),
        PPOSettings(
            num_steps=3,
            guidance_scale=1.0,
            eta=eta,
            batch_size=4,
            num_train_steps=3,
            clip_range=1e-6,
            ratio_norm=True,
        ),
        samples,
        accelerator,
        accelerator.prepare_optimizer(torch.optim.SGD(params, lr=0.0)),
        params,
        torch.Generator().manual_seed(1),
    )
    assert step["ratio"] == pytest.approx(1.0, abs=1e-6) and step["clipfrac"] == 0.0
    for i in range(3):
        assert step[f"ratio_by_step/{i:02d}"] == pytest.approx(1.0, abs=1e-6)
    assert step["ratio_raw"] == pytest.approx(1.0, abs=1e-5)


def _flags(tiny_models, out, model: str, **flags) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        "--ratio_norm",
        model=model,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",
        sample_num_steps=3,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        train_clip_range="1e-3",
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=2,
        device="cpu",
        report_to="none",
        **flags,
    )


@pytest.mark.parametrize(
    "trainer, model, flags",
    [
        ("grpo", "tiny-sd3", {"group_size": 2, "sde_window": 2, "beta": "0.04"}),
        ("ddpo", "stable-diffusion", {}),
    ],
)
def test_grpo_and_ddpo_train_with_the_flag(trainer, model, flags, tiny_models, tmp_path, capsys, monkeypatch):
    """Two epochs with --ratio_norm: the LoRA moved, no base weight did, the normalised ratio is logged."""
    import importlib

    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(_flags(tiny_models, out, model, **flags))
    assert "epoch 2/2" in capsys.readouterr().out
    watch.assert_lora_moved_and_base_not(out)
    watch.assert_loop_near_the_network()


@pytest.mark.parametrize("trainer", ["grpo", "ddpo"])
def test_flag_without_a_clip_is_refused_in_one_line_before_loading(trainer, tmp_path, capsys):
    """--ratio_norm with --train_clip_range inf: one line naming both flags, before any model loads (the model path
    does not exist)."""
    import importlib

    argv = ["--pretrained_model", str(tmp_path / "absent"), "--output_dir", str(tmp_path / "out")]
    argv += ["--ratio_norm", "--train_clip_range", "inf", "--device", "cpu", "--report_to", "none"]
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ratio_norm" in err[0] and "--train_clip_range" in err[0], err
