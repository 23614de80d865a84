"""Reward backprop beyond one step on the ReFL trainer: DRaFT-K, AlignProp (random K) and DRaFT-LV. The gradient
reaches the LoRA through exactly the last K network calls (and DRaFT-LV's noised copies), checkpointing changes the
memory and not the maths, the same on SD3, and one-line errors for bad flags. CPU, tiny random models."""

from pathlib import Path

import pytest
import torch
from helpers import trainer_flags, watch_training

from refl_ddpo.algorithms.reward_backprop import draft_grad_steps, parse_backprop_steps
from refl_ddpo.core.families import load_family
from refl_ddpo.core.families.sd3 import StableDiffusion3
from refl_ddpo.core.lora import add_lora
from refl_ddpo.rewards import build_reward
from refl_ddpo.trainers import refl
from refl_ddpo.trainers.backprop import Rollout, draft_step

RES, T = 32, 6
PROMPTS = ["a photo of a cat", "a red bird"]


pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


# ---- pure functions ----


@pytest.mark.parametrize(
    "spec, expected", [("3", (3, 3)), (" 1 ", (1, 1)), ("random:1-5", (1, 5)), ("random:4-4", (4, 4))]
)
def test_parse_backprop_steps(spec, expected):
    assert parse_backprop_steps(spec) == expected


@pytest.mark.parametrize("spec", ["0", "-2", "three", "random:5-2", "random:0-3", "random:3", "rand:1-2", ""])
def test_parse_backprop_steps_refuses(spec):
    with pytest.raises(ValueError):
        parse_backprop_steps(spec)


def test_draft_grad_steps_are_the_last_k():
    assert list(draft_grad_steps(10, 3)) == [7, 8, 9]
    assert list(draft_grad_steps(10, 10)) == list(range(10))
    with pytest.raises(ValueError):
        draft_grad_steps(10, 11)


# ---- the gradient path ----


class CallRecorder:
    """Wraps `family.predict`: records each call's grad mode and output; in backward, which outputs got gradient."""

    def __init__(self, family):
        self.calls: list[dict] = []
        self._predict = family.predict
        family.predict = self

    def __call__(self, *args, **kwargs):
        out = self._predict(*args, **kwargs)
        record = {"grad": torch.is_grad_enabled(), "requires_grad": out.requires_grad, "grad_norm": None}
        if out.requires_grad:

            def hook(g, record=record):
                record["grad_norm"] = float(g.norm())

            out.register_hook(hook)
        self.calls.append(record)
        return out


def _inputs(path: Path, targets: list[str]):
    family = load_family(str(path))
    # 'random' init: with a zero B the gradient of every A would be zero at the first step
    params = add_lora(family.network, 4, 4, targets, init="random")
    cond, uncond = family.encode_prompts(PROMPTS, with_negative=True)
    noise = family.initial_noise(len(PROMPTS), RES, torch.Generator().manual_seed(0), torch.float32)
    return family, params, cond, uncond, noise


def _run(family, scheduler, reward, cond, uncond, noise, k, **kw):
    return draft_step(
        _rollout(family, scheduler, cond, uncond, noise),
        reward,
        k,
        margin=10.0,  # far above the tiny reward: every sample pulls
        grad_scale=1.0,
        **kw,
    )


def _rollout(family, scheduler, cond, uncond, noise):
    generator = torch.Generator().manual_seed(1)
    return Rollout(family, scheduler, cond, uncond, PROMPTS, [{}, {}], noise, T, 3.0, generator=generator)


@pytest.fixture(scope="module")
def sd_setup(tiny_models):
    family, params, cond, uncond, noise = _inputs(
        tiny_models / "stable-diffusion", ["to_q", "to_k", "to_v", "to_out.0"]
    )
    reward = build_reward("imagereward", "cpu", torch.float32, str(tiny_models))
    return family, params, cond, uncond, noise, reward


@pytest.mark.parametrize("k, checkpointed", [(1, False), (3, False), (3, True), (T, True)])
def test_gradient_flows_through_exactly_the_last_k_network_calls(sd_setup, k, checkpointed):
    family, params, cond, uncond, noise, reward = sd_setup
    scheduler = family.rollout_scheduler("ddim")
    frozen = [p for n, p in family.network.named_parameters() if "lora_" not in n]
    for p in params:
        p.grad = None
    recorder = CallRecorder(family)
    try:
        out = _run(family, scheduler, reward, cond, uncond, noise, k, checkpoint_network=checkpointed)
        forward_calls = len(recorder.calls)
        out.loss.backward()
    finally:
        del family.predict  # back to the class's method
    calls = recorder.calls[:forward_calls]
    assert forward_calls == T, "one network call per step in forward"
    assert [c["grad"] for c in calls] == [False] * (T - k) + [True] * k
    assert not any(c["requires_grad"] for c in calls[: T - k]), "steps before the last K keep no graph"
    assert all(c["grad_norm"] and c["grad_norm"] > 0 for c in calls[T - k :]), (
        "each of the last K gets gradient"
    )
    assert out.rewards.shape == (2,) and out.images.shape == (2, 3, RES, RES)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params), (
        "every LoRA tensor gets gradient"
    )
    assert all(p.grad is None for p in frozen)
    torch.testing.assert_close(out.loss, torch.relu(10.0 - out.rewards).mean())


def test_kl_over_draft_steps_is_the_mean_noise_prediction_mse_to_the_base(sd_setup):
    """DRaFT's KL regulariser: at each of the last K steps, mean((eps_lora - eps_base)^2) at that step's x_t under CFG,
    averaged over the K steps; its gradient reaches the LoRA."""
    from refl_ddpo.trainers.backprop import kl_to_base

    family, params, cond, uncond, noise, reward = sd_setup
    scheduler = family.rollout_scheduler("ddim")
    k = 3
    out = _run(family, scheduler, reward, cond, uncond, noise, k, keep_trajectory=True)
    steps = draft_grad_steps(T, k)
    for p in params:
        p.grad = None
    kl = kl_to_base(_rollout(family, scheduler, cond, uncond, noise), out.denoised, steps)
    expected = []
    with torch.no_grad():
        for i in steps:
            x_t, t = out.denoised.all_latents[i], out.denoised.timesteps[i]
            eps_lora = family.predict(x_t, t, scheduler, cond, uncond, 3.0)
            family.network.disable_adapters()
            eps_base = family.predict(x_t, t, scheduler, cond, uncond, 3.0)
            family.network.enable_adapters()
            expected.append((eps_lora - eps_base).square().mean())
    assert min(expected) > 0
    torch.testing.assert_close(kl, torch.stack(expected).mean(), rtol=1e-3, atol=1e-7)
    kl.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_checkpointing_changes_memory_not_maths(sd_setup):
    """Same loss and LoRA gradients with and without checkpointing; with it, the tensors kept for backward between the
    K steps shrink to the steps' inputs (counted with saved_tensors_hooks: the checkpointed calls save through their
    own hooks, so only what lies outside them is seen here)."""
    family, params, cond, uncond, noise, reward = sd_setup
    scheduler = family.rollout_scheduler("ddim")
    results = {}
    for checkpointed in (False, True):
        for p in params:
            p.grad = None
        saved = {}

        def pack(t, saved=saved):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _run(family, scheduler, reward, cond, uncond, noise, 3, checkpoint_network=checkpointed)
        out.loss.backward()
        results[checkpointed] = (out.loss.detach(), [p.grad.clone() for p in params], sum(saved.values()))
    (loss0, grads0, bytes0), (loss1, grads1, bytes1) = results[False], results[True]
    torch.testing.assert_close(loss1, loss0)
    for a, b in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert bytes1 < bytes0 / 2, (bytes0, bytes1)


def test_draft_lv_copies_carry_gradient_from_detached_renoised_latents(sd_setup):
    family, params, cond, uncond, noise, reward = sd_setup
    scheduler = family.rollout_scheduler("ddpm")
    n = 2
    seen = {}

    def scoring(images, prompts, metadata):
        seen["batch"] = len(images)
        return reward(images, prompts, metadata)

    recorder = CallRecorder(family)
    try:
        out = _run(family, scheduler, scoring, cond, uncond, noise, 1, lv_copies=n)
        forward_calls = len(recorder.calls)
        out.loss.backward()
    finally:
        del family.predict
    calls = recorder.calls[:forward_calls]
    # the T steps (only the last with grad), then one batched call on the N re-noised copies
    assert forward_calls == T + 1
    assert [c["grad"] for c in calls] == [False] * (T - 1) + [True, True]
    assert calls[-2]["grad_norm"] > 0 and calls[-1]["grad_norm"] > 0
    assert seen["batch"] == (1 + n) * len(PROMPTS), "the rewards of 1 + N copies are averaged"
    assert out.rewards.shape == (2,) and out.images.shape == (2, 3, RES, RES)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    with pytest.raises(ValueError):
        _run(family, scheduler, reward, cond, uncond, noise, 2, lv_copies=1)


def test_add_noise_is_the_forward_process(sd_setup, tiny_models):
    family = sd_setup[0]
    scheduler = family.rollout_scheduler("ddim")
    scheduler.set_timesteps(T)
    x0, eps = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    t = scheduler.timesteps[-2]
    a = scheduler.alphas_cumprod[int(t)]
    torch.testing.assert_close(family.add_noise(scheduler, x0, eps, t), a.sqrt() * x0 + (1 - a).sqrt() * eps)
    sd3 = load_family(str(tiny_models / "tiny-sd3"))
    flow = sd3.rollout_scheduler("ddim")
    sd3.set_timesteps(flow, T, x0)
    sigma = flow.sigmas[T - 2]
    torch.testing.assert_close(
        sd3.add_noise(flow, x0, eps, flow.timesteps[T - 2]), (1 - sigma) * x0 + sigma * eps
    )


def test_draft_on_sd3_moves_the_lora_with_a_finite_loss(tiny_models):
    family, params, cond, uncond, noise = _inputs(
        tiny_models / "tiny-sd3", StableDiffusion3.lora_target_modules
    )
    reward = build_reward("imagereward", "cpu", torch.float32, str(tiny_models))
    scheduler = family.rollout_scheduler("ddim")
    before = [p.detach().clone() for p in params]
    out = _run(family, scheduler, reward, cond, uncond, noise, 3)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    torch.optim.AdamW(params, lr=1e-3).step()
    assert all(not torch.equal(a, p) for a, p in zip(before, params, strict=True)), "every LoRA tensor moves"
    lv = _run(family, scheduler, reward, cond, uncond, noise, 1, lv_copies=1)
    assert torch.isfinite(lv.loss)


# ---- the script: DRaFT and AlignProp end to end, bad flags ----


def _args(tiny_models, out: Path, *extra: str) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        resolution=RES,
        num_inference_steps=T,
        k_lo=2,
        k_hi=5,
        device="cpu",
        max_train_steps=2,
        report_to="none",
        lora_init="random",
    )


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--backprop_steps", "random:1-3"], "AlignProp (K in 1..3)"),
        (["--draft_lv", "1"], "DRaFT-LV (1 extra"),
        (["--backprop_steps", "2", "--kl_weight", "0.1", "--report_to", "tensorboard"], "DRaFT-2"),
    ],
)
def test_trainer_runs_alignprop_draft_lv_and_draft_with_kl(
    tiny_models, tmp_path, capsys, monkeypatch, flags, says
):
    from safetensors.torch import load_file

    from refl_ddpo.core.lora import LORA_WEIGHTS_NAME

    watch = watch_training(monkeypatch)
    out = tmp_path / "out"
    refl.main(_args(tiny_models, out, *flags))
    printed = capsys.readouterr().out
    assert says in printed
    if "--kl_weight" in flags:  # the KL over DRaFT's grad steps is logged, and positive once the LoRA moved
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (events,) = out.glob("logs/run-1/refl/events.out.tfevents.*")
        acc = EventAccumulator(str(events))
        acc.Reload()
        kl = [e.value for e in acc.Scalars("refl/kl")]
        assert len(kl) == 2 and all(v >= 0 for v in kl) and kl[-1] > 0, kl
    lora = load_file(str(out / LORA_WEIGHTS_NAME))
    assert lora and all(torch.isfinite(v).all() for v in lora.values())
    watch.assert_lora_moved_and_base_not(out)


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--backprop_steps", "0"], "--backprop_steps"),
        (["--backprop_steps", "random:3-1"], "--backprop_steps"),
        (["--backprop_steps", str(T + 1)], "--backprop_steps"),
        (["--backprop_steps", "random:1-9"], "--backprop_steps"),
        (["--draft_lv", "-1"], "--draft_lv"),
        (["--draft_lv", "2", "--backprop_steps", "3"], "--draft_lv"),
        (["--draft_lv", "1", "--kl_weight", "0.1"], "--kl_weight"),
    ],
)
def test_bad_backprop_flags_are_one_line_errors(tiny_models, tmp_path, capsys, flags, field):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        refl.main(_args(tiny_models, out, *flags))
    assert exc.value.code != 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], lines
    assert not out.exists() or not any(out.iterdir())


def test_two_processes_stay_identical_with_checkpointed_draft(tiny_models, tmp_path):
    """DDP with the K network calls checkpointed (recomputed in backward through the wrapped network): the shell script
    on two CPU processes keeps the ranks' LoRA identical after every step, while they saw different samples."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "ddp"
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "NUM_PROCESSES")}
    env.update(PYTHON=sys.executable, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", NUM_PROCESSES="2")
    flags = _args(tiny_models, out, "--backprop_steps", "3", "--debug_lora_checksums")
    flags += ["--gradient_accumulation_steps", "2", "--max_train_steps", "3"]
    r = subprocess.run(
        ["bash", "train_scripts/train_refl_lora.sh", *flags],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DRaFT-3: the last K steps with grad (network checkpointed)" in r.stdout
    ranks = [
        [
            json.loads(line)
            for line in (out / "debug" / f"lora_checksums_rank{i}.jsonl").read_text().splitlines()
        ]
        for i in (0, 1)
    ]
    assert [x["sha256"] for x in ranks[0]] == [x["sha256"] for x in ranks[1]], "ranks diverged"
    assert len({x["sha256"] for x in ranks[0]}) == 3, "the weights change every step"
    assert [x["refl_loss"] for x in ranks[0]] != [x["refl_loss"] for x in ranks[1]]
