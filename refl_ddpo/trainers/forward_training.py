"""The training passes of the forward-process trainers (refl_ddpo.trainers.forward_process): each sample trained at
some of the sampler's timesteps with fresh noise, the loss of one trained timestep (DiffusionNFT's, AWM's) calling
the network, the gradients accumulated into optimizer steps; what tells the two methods apart (`Method`) and what a
run keeps across epochs (`ForwardState`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from refl_ddpo.algorithms.forward import (
    ema_decay,
    matching_log_likelihood,
    nft_loss,
    optimality_probability,
    output_mse,
    soft_update_,
    stratified_timestep_indices,
)
from refl_ddpo.algorithms.policy import ppo_clip_loss
from refl_ddpo.core.families import Cond
from refl_ddpo.core.lora import adapters_off
from refl_ddpo.run.session import Run
from refl_ddpo.run.zero import unwrap
from refl_ddpo.trainers.ddpo_config import num_train_timesteps
from refl_ddpo.trainers.epochs import EpochCounters
from refl_ddpo.trainers.rollouts import CleanSampler


@dataclass
class Draw:
    """One trained timestep of a micro-batch: the timesteps (B,), x0, the fresh noise and x_t; AWM's ll_old (B,),
    the log-likelihood with the weights as the micro-batch starts."""

    timesteps: torch.Tensor
    x0: torch.Tensor
    noise: torch.Tensor
    x_t: torch.Tensor
    ll_old: torch.Tensor | None = None


# (run, state, micro-batch, its conditioning, draw) -> (loss, its detached parts to log)
StepLoss = Callable[[Run, "ForwardState", dict, Cond, Draw], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class Method:
    """What tells DiffusionNFT and AWM apart on the one loop (`NFT`, `AWM` below)."""

    name: str  # metric prefix, tracker project, run records
    loss: StepLoss  # the loss of one trained timestep
    # before a micro-batch's first update (AWM: each draw's ll_old), or None
    micro_batch_start: Callable[[Run, ForwardState, Cond, list[Draw]], None] | None
    # sample with the old policy's weights (NFT), else with the current ones (AWM: on-policy)
    sample_with_old: bool
    # what --release_weights ema releases: "ema" (NFT's EMA of the trained weights) or "old" (AWM's old policy)
    release: str


@dataclass
class ForwardState:
    """What a forward-process run keeps across epochs."""

    method: Method
    sampler: CleanSampler  # the family's deterministic scheduler, the empty prompt for CFG
    counters: EpochCounters = field(default_factory=EpochCounters)
    old: list[torch.Tensor] = field(default_factory=list)  # the old policy: copies of the trainable tensors
    ema: list[torch.Tensor] | None = None  # NFT's EMA of the trained weights (--release_weights ema)


# ---- the old policy's (or the EMA's) weights in the trainable tensors ----


@contextmanager
def swapped(params: list[torch.nn.Parameter], others: list[torch.Tensor]):
    """The trainable tensors hold `others`' values inside the context (no grad; the storages are exchanged, not
    copied), their own again after it."""
    with torch.no_grad():
        for p, o in zip(params, others, strict=True):
            p.data, o.data = o.data, p.data
        try:
            yield
        finally:
            for p, o in zip(params, others, strict=True):
                p.data, o.data = o.data, p.data


# ---- training ----


def train_pass(run: Run, fp: ForwardState, samples: dict[str, torch.Tensor], generator, bar) -> None:
    """One inner epoch: shuffle the samples, draw each one's timesteps and noise, accumulate the loss of every
    trained timestep of every micro-batch into the optimizer steps (a non-finite gradient norm raises
    FloatingPointError before the update)."""
    cfg, accelerator, method = run.cfg, run.accelerator, fp.method
    schedule = run.family.set_timesteps(fp.sampler.scheduler, cfg.sample_num_steps, samples["x0"])
    n, trained = len(samples["x0"]), num_train_timesteps(cfg)
    perm = torch.randperm(n, generator=generator)
    samples = {k: v[perm.to(v.device)] for k, v in samples.items()}
    cond_keys = [k for k in samples if k not in ("x0", "advantages")]
    logged: dict[str, list] = defaultdict(list)
    run.network.train()
    for start in range(0, n, cfg.train_batch_size):
        batch = {k: v[start : start + cfg.train_batch_size] for k, v in samples.items()}
        cond = {k: batch[k] for k in cond_keys}
        draws = draw_timesteps(run, fp.sampler.scheduler, schedule, batch["x0"], trained, generator)
        if method.micro_batch_start is not None:
            method.micro_batch_start(run, fp, cond, draws)
        for draw in draws:
            with accelerator.accumulate(run.network):
                with accelerator.autocast():
                    loss, info = method.loss(run, fp, batch, cond, draw)
                for k, v in {"loss": loss.detach(), **info}.items():
                    logged[k].append(v)
                accelerator.backward(loss)
                grad_norm = clip_gradients(run, loss)
                run.optimizer.step()
                run.optimizer.zero_grad()
            if accelerator.sync_gradients:
                after_step(run, fp, logged, grad_norm, bar)
                logged = defaultdict(list)


def clip_gradients(run: Run, loss: torch.Tensor) -> float | None:
    """At an optimizer step, the gradient clipped to --max_grad_norm and its norm (None between steps); a
    non-finite norm raises FloatingPointError."""
    if not run.accelerator.sync_gradients:
        return None
    grad_norm = float(run.accelerator.clip_grad_norm_(run.params, run.cfg.max_grad_norm or math.inf))
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"the gradient norm is {grad_norm} (loss {float(loss):.4g})")
    return grad_norm


def after_step(run: Run, fp: ForwardState, logged: dict[str, list], grad_norm: float, bar) -> None:
    """After an optimizer step: its logged means over the processes, the step counted, NFT's EMA moved toward the
    trained weights with decay min((1 + s) / (10 + s), --ema_decay_max), the bar."""
    means = run.accelerator.reduce({k: torch.stack(v).mean() for k, v in logged.items()}, "mean")
    info = {k: float(v) for k, v in means.items()} | {"grad_norm": grad_norm}
    run.accelerator.log({f"{run.name}/{k}": v for k, v in info.items()}, step=fp.counters.global_step)
    fp.counters.global_step += 1
    if fp.ema is not None:
        soft_update_(fp.ema, run.params, ema_decay(fp.counters.global_step, run.cfg.ema_decay_max))
    bar.set_postfix({k: f"{info[k]:.3g}" for k in ("loss", "kl") if k in info}, refresh=False)
    bar.update(1)


def draw_timesteps(
    run: Run, scheduler, schedule: torch.Tensor, x0: torch.Tensor, trained: int, generator
) -> list[Draw]:
    """Each sample's `trained` timesteps (never the last --train_skip_last_steps; per_sample: a random subset of
    the sampler's for each sample; stratified: one set for the micro-batch, refl_ddpo.algorithms.forward
    .stratified_timestep_indices) and fresh noise: the forward process x_t of x0 at each."""
    cfg = run.cfg
    b, steps = len(x0), len(schedule) - cfg.train_skip_last_steps
    if cfg.train_timesteps == "stratified":
        max_t = scheduler.config.num_train_timesteps
        shared = stratified_timestep_indices(
            schedule, trained, cfg.train_timestep_range, max_t, steps - 1, generator
        )
        order = shared.expand(b, trained)
    else:
        order = torch.stack([torch.randperm(steps, generator=generator)[:trained] for _ in range(b)])
    out = []
    for j in range(trained):
        t = schedule[order[:, j]].to(x0.device)
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0.device, x0.dtype)
        out.append(Draw(t, x0, noise, run.family.add_noise(scheduler, x0, noise, t)))
    return out


# ---- the loss of one trained timestep ----
# Each calls the network at the draw's x_t, conditional only (no CFG in training: no uncond). The sampling guidance
# scale goes in for a family that embeds it as an input (FLUX.1-dev), so that training conditions on the guidance
# the samples were drawn with; the others ignore it without an uncond.


def nft_step_loss(
    run: Run, fp: ForwardState, batch: dict, cond: Cond, draw: Draw
) -> tuple[torch.Tensor, dict]:
    """DiffusionNFT's (refl_ddpo.trainers.nft, step 3): nft_loss of the trained network's and the old policy's
    x0-predictions, + --kl_weight mean((v - v_base)^2) to the base model (LoRA off)."""
    cfg, family, scheduler = run.cfg, run.family, fp.sampler.scheduler
    inputs = (draw.x_t, draw.timesteps, scheduler, cond, None, cfg.sample_guidance_scale)
    with swapped(run.params, fp.old):
        v_old = family.predict(*inputs, unwrap(run.accelerator, run.network))
    v = family.predict(*inputs, run.network)
    x0_theta = family.pred_x0(scheduler, v, draw.timesteps, draw.x_t)
    x0_old = family.pred_x0(scheduler, v_old, draw.timesteps, draw.x_t)
    r = optimality_probability(batch["advantages"], cfg.train_adv_clip_max)
    loss, info = nft_loss(x0_theta, x0_old, draw.x0.float(), r, cfg.nft_beta, cfg.train_adv_clip_max)
    info["old_deviate"] = output_mse(v, v_old).detach().mean()
    if cfg.kl_weight > 0:
        with adapters_off(unwrap(run.accelerator, run.network)) as base:
            v_base = family.predict(*inputs, base)
        kl = output_mse(v, v_base).mean()
        loss = loss + cfg.kl_weight * kl
        info["kl"] = kl.detach()
    return loss, info


def awm_step_loss(
    run: Run, fp: ForwardState, batch: dict, cond: Cond, draw: Draw
) -> tuple[torch.Tensor, dict]:
    """AWM's (refl_ddpo.trainers.awm, step 2): PPO-clip on exp(ll - ll_old), + --kl_weight mean((v - v_base)^2)
    to the base model and --old_kl_weight mean((v - v_old)^2) to the old policy."""
    cfg, family = run.cfg, run.family
    inputs = (draw.x_t, draw.timesteps, fp.sampler.scheduler, cond, None, cfg.sample_guidance_scale)
    v = family.predict(*inputs, run.network)
    ll = matching_ll(run, fp, v, draw)
    loss, info = ppo_clip_loss(ll, draw.ll_old, batch["advantages"], cfg.train_clip_range)
    info["policy_loss"] = loss.detach()
    if cfg.kl_weight > 0:
        with adapters_off(unwrap(run.accelerator, run.network)) as base:
            v_base = family.predict(*inputs, base)
        kl = output_mse(v, v_base).mean()
        loss = loss + cfg.kl_weight * kl
        info["kl"] = kl.detach()
    if cfg.old_kl_weight > 0:
        with swapped(run.params, fp.old):
            v_old = family.predict(*inputs, unwrap(run.accelerator, run.network))
        old_kl = output_mse(v, v_old).mean()
        loss = loss + cfg.old_kl_weight * old_kl
        info["old_kl"] = old_kl.detach()
    return loss, info


def awm_old_log_likelihoods(run: Run, fp: ForwardState, cond: Cond, draws: list[Draw]) -> None:
    """Each draw's ll_old, with the weights as the micro-batch starts (no grad): AWM's ratio is 1 at its first
    update."""
    network, guidance = unwrap(run.accelerator, run.network), run.cfg.sample_guidance_scale
    with torch.no_grad(), run.accelerator.autocast():
        for d in draws:
            v = run.family.predict(d.x_t, d.timesteps, fp.sampler.scheduler, cond, None, guidance, network)
            d.ll_old = matching_ll(run, fp, v, d)


def matching_ll(run: Run, fp: ForwardState, v: torch.Tensor, draw: Draw) -> torch.Tensor:
    """AWM's stand-in for the log-likelihood of the output v (B,): the weighted matching loss against the family's
    pretraining target at the draw (refl_ddpo.algorithms.forward.matching_log_likelihood)."""
    family, scheduler, cfg = run.family, fp.sampler.scheduler, run.cfg
    target = family.training_target(scheduler, draw.x0, draw.noise, draw.timesteps)
    t = family.noise_level(scheduler, draw.timesteps)
    return matching_log_likelihood(v, target, t, cfg.awm_weighting, cfg.ghuber_power)


NFT = Method("nft", nft_step_loss, None, sample_with_old=True, release="ema")
AWM = Method("awm", awm_step_loss, awm_old_log_likelihoods, sample_with_old=False, release="old")
