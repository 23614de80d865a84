"""PPO over stored trajectories (DDPO, GRPO): the loss of one stored step under the current weights, and one inner
epoch of PPO-clip updates over an epoch's samples (shuffled samples and timesteps, gradient accumulation
over the trained timesteps, the optional KL to the base model, the non-finite gradient guard)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from refl_ddpo.algorithms.policy import clipped_surrogate, ratio_norm
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import Cond, cond_expand
from refl_ddpo.run.zero import unwrap
from refl_ddpo.trainers.ddpo_config import DDPOConfig, num_train_timesteps
from refl_ddpo.trainers.rollouts import STEP_KEYS, Policy, shuffle_samples


@dataclass(frozen=True)
class PPOSettings:
    """One inner epoch of PPO over stored trajectories: the sampler's `num_steps` (the schedule the samples'
    timesteps come from), `guidance_scale` and `eta` as in sampling; micro-batches of `batch_size`; the first
    `num_train_steps` of each sample's shuffled steps trained; PPO's `clip_range`; `kl_weight` x the KL to the base
    model; gradients clipped to `max_grad_norm` (0: not clipped); the last `skip_last_steps` sampler steps never
    trained on; `ratio_norm`: PPO clips GRPO-Guard's normalised ratio (the samples then hold `step_means`)."""

    num_steps: int
    guidance_scale: float
    eta: float
    batch_size: int
    num_train_steps: int
    clip_range: float
    kl_weight: float = 0.0
    max_grad_norm: float = 0.0
    skip_last_steps: int = 0
    ratio_norm: bool = False

    @classmethod
    def from_config(cls, cfg: DDPOConfig, window: tuple[int, int] | None = None) -> PPOSettings:
        """The --sample_* and --train_* fields; with an SDE `window` (GRPO) the trajectory holds the window's steps
        only, all trainable."""
        return cls(
            num_steps=cfg.sample_num_steps,
            guidance_scale=cfg.sample_guidance_scale,
            eta=cfg.sample_eta,
            batch_size=cfg.train_batch_size,
            num_train_steps=num_train_timesteps(cfg),
            clip_range=cfg.train_clip_range,
            kl_weight=cfg.kl_weight,
            max_grad_norm=cfg.max_grad_norm,
            skip_last_steps=0 if window is not None else cfg.train_skip_last_steps,
            ratio_norm=cfg.ratio_norm,
        )


def ppo_step_loss(
    policy: Policy, settings: PPOSettings, base, batch: dict[str, torch.Tensor], j: int, cond: Cond
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """PPO-clip's loss at the j-th trained step of a micro-batch (plus `kl_weight` x the step's KL to `base`, the
    unwrapped network with its LoRA switched off); `policy.uncond` is the micro-batch's (or None: no CFG). Returns
    (loss, metrics, the log importance ratio (B,) PPO clipped, the step's values that a non-finite gradient is traced
    to (B, len(TRACED)), detached)."""
    from refl_ddpo.core.lora import adapters_off

    family, scheduler, uncond, network = policy.family, policy.scheduler, policy.uncond, policy.network
    guidance_scale, eta = settings.guidance_scale, settings.eta
    x_t, t = batch["latents"][:, j], batch["timesteps"][:, j]  # (B, C, h, w), (B,): one timestep per sample
    old_log_prob = batch["log_probs"][:, j]
    # the stored next latent's log-probability under the current weights (the scheduler is set to the run's steps)
    model_output = family.predict(x_t, t, scheduler, cond, uncond, guidance_scale, network)
    _, log_prob, _ = family.step_with_logprob(
        scheduler, model_output, t, x_t, eta, prev_sample=batch["next_latents"][:, j]
    )
    log_ratio = log_prob - old_log_prob
    if settings.ratio_norm:
        mean, std = family.step_mean(scheduler, model_output, t, x_t, eta)
        log_ratio = ratio_norm(log_prob, old_log_prob, mean, batch["step_means"][:, j], std)
    loss, info = clipped_surrogate(log_ratio, batch["advantages"], settings.clip_range)
    if settings.ratio_norm:
        info["ratio_raw"] = torch.exp(log_prob.detach() - old_log_prob).mean()  # the left-shifted ratio
    kl = torch.zeros_like(log_prob)
    if settings.kl_weight > 0:
        with adapters_off(base):
            ref_output = family.predict(x_t, t, scheduler, cond, uncond, guidance_scale, network)
        kl = family.step_kl(scheduler, model_output, ref_output, t, eta)  # (B,)
        kl_mean = kl.mean()
        info["kl"] = kl_mean.detach()
        loss = loss + settings.kl_weight * kl_mean
    # in TRACED's order; the network's output as its largest |value| per sample (NaN or inf where any element is)
    biggest = model_output.detach().float().abs().amax(dim=tuple(range(1, model_output.ndim)))
    traced = [batch["advantages"], old_log_prob, biggest, log_prob.detach(), kl.detach()]
    return loss, info, log_ratio.detach(), torch.stack([v.float().to(log_prob.device) for v in traced], dim=1)


# A non-finite log-probability of a finite network output: the step's Gaussian has no finite density there.
NOT_THE_LEARNING_RATE = " (the learning rate is not the cause)"
SCHEDULER_FIX = (
    "check the scheduler config (the step's variance at that timestep) and --sample_eta"
    + NOT_THE_LEARNING_RATE,
    "lower --learning_rate, or check the scheduler config and --sample_eta",
)
# What a non-finite gradient norm is traced to, in the order the values arise in a PPO step: (name in the error, the
# advice before any update, the advice after updates). A NaN before any update is not a learning rate to lower.
TRACED = (
    ("the advantage", "check the reward", "check the reward"),
    ("the sampling pass's log-probability", *SCHEDULER_FIX),
    (
        "the network's output",
        "check the model's weights and --mixed_precision" + NOT_THE_LEARNING_RATE,
        "lower --learning_rate, or set --max_grad_norm",
    ),
    ("the log-probability", *SCHEDULER_FIX),
    (
        "the KL to the base model",
        "check the model's weights" + NOT_THE_LEARNING_RATE,
        "lower --learning_rate or --kl_weight",
    ),
)
# every value above finite: the backward pass itself made the non-finite number
BACKWARD_FIX = (
    "try --mixed_precision no, or check the model" + NOT_THE_LEARNING_RATE,
    "lower --learning_rate, or set --max_grad_norm",
)


class NonFiniteGradient(FloatingPointError):
    """A non-finite gradient norm, traced: `cause` is the index in TRACED of the first non-finite value of the
    optimizer step's forward passes (None: all were finite), `updates` the optimizer steps this call had taken."""

    def __init__(self, message: str, cause: int | None, updates: int):
        super().__init__(message)
        self.cause, self.updates = cause, updates

    def error(self, output_dir: str, epoch: int, updated_before: bool) -> UserError:
        """The run's one-line UserError, with the advice that fits the cause; `updated_before`: the weights were
        updated before this call (an earlier epoch or inner epoch, a resumed run)."""
        from refl_ddpo.run.training import nonfinite_step_error

        first = not updated_before and self.updates == 0
        when = "the first optimizer step: the weights were never updated" if first else "an optimizer step"
        advice = BACKWARD_FIX if self.cause is None else TRACED[self.cause][1:]
        return nonfinite_step_error(output_dir, f"{self} (epoch {epoch}, {when})", advice[0 if first else 1])


def nonfinite_gradient(
    grad_norm: float,
    loss: torch.Tensor,
    traced: list[torch.Tensor],
    timesteps: list[torch.Tensor],
    schedule: torch.Tensor,
    updates: int,
) -> NonFiniteGradient:
    """The error for a non-finite gradient norm: the first non-finite value of the optimizer step's micro-steps
    (`traced`: (B, len(TRACED)) each, `timesteps`: (B,) each), its timestep and its place among the `schedule`'s
    steps; or that every value was finite (the backward made it)."""
    what = f"the gradient norm is {grad_norm} (PPO loss {float(loss.detach()):.4g})"
    for values, t in zip(traced, timesteps, strict=True):
        bad = ~torch.isfinite(values)  # (B, len(TRACED))
        if bad.any():
            # the earliest kind of value in TRACED's order of any sample, then the first sample with it
            cause = int(bad.any(0).int().argmax())
            sample = int(bad[:, cause].int().argmax())
            timestep = int(t[sample])
            step = int((schedule == timestep).int().argmax())
            where = f"at timestep {timestep} (sampler step {step + 1} of {len(schedule)})"
            return NonFiniteGradient(
                f"{what}: {TRACED[cause][0]} is {float(values[sample, cause])} {where}", cause, updates
            )
    return NonFiniteGradient(
        f"{what}: every advantage, log-probability and network output of the step was finite, so the backward "
        "pass made it",
        None,
        updates,
    )


def count_ratios(
    step_ratios: torch.Tensor, schedule: torch.Tensor, t: torch.Tensor, log_ratio: torch.Tensor
) -> None:
    """Add a micro-step's importance ratios exp(log_ratio) (B,) to `step_ratios` (2, steps): summed ratios and
    sample counts at each sample's sampler step (0 = the first: its timestep t's place in the schedule)."""
    step = (t[:, None] == schedule[None]).int().argmax(1).to(step_ratios.device)
    ratio = torch.exp(log_ratio.detach()).to(step_ratios)  # (B,)
    step_ratios[0].index_add_(0, step, ratio)
    step_ratios[1].index_add_(0, step, torch.ones_like(ratio))


def step_metrics(
    accelerator, acc: dict[str, list], step_ratios: torch.Tensor, grad_norm: float
) -> dict[str, float]:
    """An optimizer step's metrics: the means of its micro-steps' `acc` over processes, the gradient norm and, per
    sampler step NN it trained on, the mean importance ratio `ratio_by_step/NN` (`step_ratios`: (2, steps) summed
    ratios and counts on this process)."""
    means = accelerator.reduce({k: torch.stack(v).mean() for k, v in acc.items()}, reduction="mean")
    sums, counts = accelerator.reduce(step_ratios, reduction="sum").tolist()
    by_step = {
        f"ratio_by_step/{i:02d}": r / c for i, (r, c) in enumerate(zip(sums, counts, strict=True)) if c
    }
    return {**{k: float(v) for k, v in means.items()}, **by_step, "grad_norm": grad_norm}


def train_on_samples(
    policy: Policy,
    settings: PPOSettings,
    samples: dict[str, torch.Tensor],
    accelerator,
    optimizer,
    params: list[torch.nn.Parameter],
    generator: torch.Generator,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """One inner epoch: shuffle, then PPO on the first `settings.num_train_steps` steps of each sample.

    `policy.network` is the prepared (possibly DDP-wrapped) network (None: the family's own) and `optimizer` the
    prepared optimizer (it steps only when gradients sync); `accelerator` was made with gradient_accumulation_steps
    = micro-batches per optimizer step x `num_train_steps`, so one optimizer step covers every trained timestep of
    its micro-batches. `policy.uncond` None trains without CFG. Returns one dict of metrics (mean over its
    micro-steps and processes, and the gradient norm) per optimizer step, also handed to `on_step` as each step ends
    (a progress bar); besides `ratio` (the mean importance ratio) it holds `ratio_by_step/NN`, the mean ratio of the
    samples trained at sampler step NN (0 = the first), for each step the optimizer step trained on. A non-finite
    gradient norm raises NonFiniteGradient (a FloatingPointError) before the update (on all processes alike),
    naming the first non-finite value of the step and its timestep."""
    schedule = policy.family.set_timesteps(policy.scheduler, settings.num_steps, samples["latents"])
    schedule = schedule.to(samples["timesteps"].device)
    if not torch.isin(samples["timesteps"], schedule).all():
        raise ValueError("the samples' timesteps are not those of a num_steps schedule")
    samples = shuffle_samples(samples, generator, samples["timesteps"].shape[1] - settings.skip_last_steps)
    n, batch_size = samples["timesteps"].shape[0], settings.batch_size
    cond_keys = [k for k in samples if k not in (*STEP_KEYS, "advantages")]
    network = policy.family.network if policy.network is None else policy.network
    uncond = None if policy.uncond is None else cond_expand(policy.uncond, batch_size)
    policy = replace(policy, network=network, uncond=uncond)
    base = unwrap(accelerator, network)
    results, acc = [], defaultdict(list)
    traced, traced_t = [], []  # the optimizer step's micro-steps' ppo_step_loss values and timesteps
    # per sampler step: summed importance ratios and sample counts (summed over processes when the step ends)
    step_ratios = torch.zeros(2, len(schedule), dtype=torch.float64, device=accelerator.device)
    network.train()
    for start in range(0, n, batch_size):
        batch = {k: v[start : start + batch_size] for k, v in samples.items()}
        cond = {k: batch[k] for k in cond_keys}
        for j in range(settings.num_train_steps):
            with accelerator.accumulate(network):
                with accelerator.autocast():
                    loss, info, log_ratio, values = ppo_step_loss(policy, settings, base, batch, j, cond)
                traced.append(values)
                traced_t.append(batch["timesteps"][:, j])
                info["loss"] = loss.detach()
                for k, v in info.items():
                    acc[k].append(v)
                count_ratios(step_ratios, schedule, batch["timesteps"][:, j], log_ratio)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    # the all-reduced norm, the same on every process (clipping by inf multiplies by exactly 1)
                    grad_norm = float(accelerator.clip_grad_norm_(params, settings.max_grad_norm or math.inf))
                    if not math.isfinite(grad_norm):
                        raise nonfinite_gradient(grad_norm, loss, traced, traced_t, schedule, len(results))
                    traced, traced_t = [], []
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                results.append(step_metrics(accelerator, acc, step_ratios, grad_norm))
                acc = defaultdict(list)
                step_ratios.zero_()
                if on_step is not None:
                    on_step(results[-1])
    return results
