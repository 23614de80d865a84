"""Rollouts of the policy-gradient trainers: trajectories sampled with step log-probabilities, their rewards, and
the per-epoch sample buffers (stacked, then shuffled per sample and per step). Shared by DDPO and GRPO.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refl_ddpo.core.families import Cond, ModelFamily, cond_cat, cond_expand
from refl_ddpo.rewards import Reward

if TYPE_CHECKING:
    from refl_ddpo.run.session import Run
    from refl_ddpo.trainers.ddpo_config import DDPOConfig
    from refl_ddpo.trainers.epochs import EpochPlan

# (N, S, ...) per sample and step; step_means only with --ratio_norm (SampleSettings.keep_step_means)
STEP_KEYS = ("timesteps", "latents", "next_latents", "log_probs", "step_means")


@dataclass
class SampleBatch:
    """One sampling batch: the trajectory (what training needs) and the images and rewards (what is logged)."""

    prompts: list[str]
    prompt_metadata: list[dict]
    cond: Cond  # e.g. {"prompt_embeds": (B, L, D)}
    timesteps: torch.Tensor  # (B, S)
    latents: torch.Tensor  # (B, S, C, h, w): x_t before each step
    next_latents: torch.Tensor  # (B, S, C, h, w): x_{t-1} the sampler drew
    log_probs: torch.Tensor  # (B, S)
    images: torch.Tensor  # (B, 3, H, W) in [0, 1]
    rewards: Future | tuple[torch.Tensor, dict]
    step_means: torch.Tensor | None = None  # (B, S, C, h, w): the sampling weights' step means, or None


def _score(reward: Reward, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
    with torch.no_grad():  # grad mode is per thread: the pool's threads start with it on
        rewards, info = reward(images, prompts, metadata)
    return rewards.detach().float(), info


@dataclass
class Policy:
    """The policy an epoch samples from and trains: the family, its stochastic scheduler (DDIM, or flow matching with
    Flow-GRPO's SDE step), the network it calls (the prepared one in a run; None: the family's own), the empty
    prompt's conditioning (batch 1) for CFG (None: no CFG), and the context its forward passes run in (autocast)."""

    family: ModelFamily
    scheduler: Any
    uncond: Cond | None
    network: Any = None
    autocast: Callable[[], AbstractContextManager] = nullcontext


@dataclass(frozen=True)
class SampleSettings:
    """How an epoch samples, per process: `num_batches` batches of `batch_size` images at `resolution`, `num_steps`
    sampler steps with CFG scale `guidance_scale` and step noise `eta` (the --sample_* flags); `keep_step_means`
    keeps each step's Gaussian mean in the trajectory (--ratio_norm)."""

    batch_size: int
    num_batches: int
    num_steps: int
    guidance_scale: float
    eta: float
    resolution: int
    keep_step_means: bool = False

    @classmethod
    def from_config(cls, cfg: DDPOConfig) -> SampleSettings:
        """The --sample_* fields and the resolved --resolution."""
        return cls(
            batch_size=cfg.sample_batch_size,
            num_batches=cfg.sample_num_batches_per_epoch,
            num_steps=cfg.sample_num_steps,
            guidance_scale=cfg.sample_guidance_scale,
            eta=cfg.sample_eta,
            resolution=cfg.resolution,
            keep_step_means=cfg.ratio_norm,
        )


def sample_epoch(
    policy: Policy,
    settings: SampleSettings,
    plan: EpochPlan,
    reward: Reward,
    generator: torch.Generator,
    executor: ThreadPoolExecutor | None = None,
    on_batch: Callable[[SampleBatch], None] | None = None,
) -> list[SampleBatch]:
    """Sample `settings.num_batches` batches of trajectories with `policy` and score them (futures with `executor`).

    `plan` gives the prompts (`prompt_fn`), the initial noise (N, C, h, w) if any, and the SDE window (start,
    length): only its steps are stochastic and kept. `generator` (CPU) draws the initial noise (without the plan's)
    and every step's noise; `on_batch` is called with each batch as it is done (a progress bar).
    """
    from refl_ddpo.core.sampling import denoise

    family, batch_size, num_steps = policy.family, settings.batch_size, settings.num_steps
    uncond = None if policy.uncond is None else cond_expand(policy.uncond, batch_size)
    batches = []
    window = slice(None) if plan.window is None else slice(plan.window[0], sum(plan.window))
    with torch.no_grad():  # sampling: no graph (training recomputes each trained step with grad)
        for b in range(settings.num_batches):
            prompts, metadata = map(list, zip(*(plan.prompt_fn() for _ in range(batch_size)), strict=True))
            cond, _ = family.encode_conditioning(prompts, metadata, with_negative=False)
            dtype = next(iter(cond.values())).dtype
            if plan.initial_noise is None:
                noise = family.initial_noise(batch_size, settings.resolution, generator, dtype)
            else:
                noise = plan.initial_noise[b * batch_size : (b + 1) * batch_size].to(
                    family.pipe.device, dtype
                )
            with policy.autocast():
                out = denoise(
                    family,
                    policy.scheduler,
                    cond,
                    uncond,
                    noise,
                    num_steps,
                    settings.guidance_scale,
                    eta=settings.eta,
                    generator=generator,
                    with_logprob=True,
                    keep_trajectory=True,
                    network=policy.network,
                    sde_steps=None if plan.window is None else range(*window.indices(num_steps)),
                    keep_step_means=settings.keep_step_means,
                )
                images = family.decode(out.latents)
            trajectory = torch.stack(out.all_latents, dim=1)  # (B, S + 1, C, h, w)
            rewards = (
                executor.submit(_score, reward, images, prompts, metadata)
                if executor is not None
                else _score(reward, images, prompts, metadata)
            )
            batches.append(
                SampleBatch(
                    prompts=prompts,
                    prompt_metadata=metadata,
                    cond=cond,
                    timesteps=out.timesteps.to(noise.device).repeat(batch_size, 1)[:, window],
                    latents=trajectory[:, :-1][:, window],
                    next_latents=trajectory[:, 1:][:, window],
                    log_probs=torch.stack(out.log_probs, dim=1)[:, window],
                    images=images,
                    rewards=rewards,
                    step_means=torch.stack(out.step_means, dim=1)[:, window] if out.step_means else None,
                )
            )
            if on_batch is not None:
                on_batch(batches[-1])
    return batches


@dataclass
class CleanBatch:
    """One batch of clean samples for the forward-process trainers: the final latents x0, no trajectory."""

    prompts: list[str]
    prompt_metadata: list[dict]
    cond: Cond  # e.g. {"prompt_embeds": (B, L, D)}
    latents: torch.Tensor  # (B, C, h, w): x0 as the sampler left it
    images: torch.Tensor  # (B, 3, H, W) in [0, 1]
    rewards: Future | tuple[torch.Tensor, dict]


@dataclass
class CleanSampler:
    """What `sample_clean` draws with besides the run: the family's deterministic scheduler (DDIM eta 0 on SD 1.x,
    the flow Euler step on SD3) and, for CFG (--sample_guidance_scale > 1), the empty prompt's conditioning
    (batch 1), else None."""

    scheduler: Any
    uncond: Cond | None = None


def sample_clean(
    run: Run,
    sampler: CleanSampler,
    plan: EpochPlan,
    generator: torch.Generator,
    executor: ThreadPoolExecutor | None = None,
    on_batch: Callable[[CleanBatch], None] | None = None,
) -> list[CleanBatch]:
    """Sample --sample_num_batches_per_epoch batches of --sample_batch_size clean latents from `plan`'s prompts
    with the weights run.network holds (--sample_num_steps, --sample_guidance_scale, --resolution), decode and score
    them with run.reward (futures with `executor`). `generator` (CPU) draws the initial noise unless the plan brings
    it (N, C, h, w); `on_batch` is called with each batch as it is done (a progress bar)."""
    from refl_ddpo.core.sampling import denoise
    from refl_ddpo.run.zero import unwrap

    cfg, family, batch_size = run.cfg, run.family, run.cfg.sample_batch_size
    network = unwrap(run.accelerator, run.network)
    network.eval()
    batches = []
    with torch.no_grad():
        for b in range(cfg.sample_num_batches_per_epoch):
            prompts, metadata = map(list, zip(*(plan.prompt_fn() for _ in range(batch_size)), strict=True))
            cond, _ = family.encode_conditioning(prompts, metadata, with_negative=False)
            dtype = next(iter(cond.values())).dtype
            if plan.initial_noise is None:
                noise = family.initial_noise(batch_size, cfg.resolution, generator, dtype)
            else:
                noise = plan.initial_noise[b * batch_size : (b + 1) * batch_size].to(
                    family.pipe.device, dtype
                )
            guided = None if sampler.uncond is None else cond_expand(sampler.uncond, batch_size)
            with run.accelerator.autocast():
                out = denoise(
                    family,
                    sampler.scheduler,
                    cond,
                    guided,
                    noise,
                    cfg.sample_num_steps,
                    cfg.sample_guidance_scale,
                    network=network,
                )
                images = family.decode(out.latents)
            rewards = (
                executor.submit(_score, run.reward, images, prompts, metadata)
                if executor is not None
                else _score(run.reward, images, prompts, metadata)
            )
            batches.append(CleanBatch(prompts, metadata, cond, out.latents, images, rewards))
            if on_batch is not None:
                on_batch(batches[-1])
    return batches


def collect_rewards(batches: list) -> None:
    """Wait for reward futures, in place: each batch's `rewards` becomes (rewards (B,), info)."""
    for batch in batches:
        if isinstance(batch.rewards, Future):
            batch.rewards = batch.rewards.result()


def stack_samples(batches: list[SampleBatch], advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """The training tensors of an epoch, batches concatenated: N = batches x batch size samples per process; the
    conditioning tensors under their own names."""
    samples = {
        key: torch.cat([getattr(b, key) for b in batches])
        for key in STEP_KEYS
        if getattr(batches[0], key) is not None
    }
    samples.update(cond_cat([b.cond for b in batches]))
    samples["advantages"] = advantages.to(samples["log_probs"].device)
    return samples


def shuffle_samples(
    samples: dict[str, torch.Tensor], generator: torch.Generator, trainable_steps: int | None = None
) -> dict[str, torch.Tensor]:
    """Shuffle samples, then each sample's timesteps independently (ddpo-pytorch), drawn from `generator`.

    With `trainable_steps` k < S only the first k steps of each trajectory are shuffled and put first; the last
    S - k follow in order, so a trainer taking the first <= k shuffled steps never trains on them.
    """
    n, steps = samples["timesteps"].shape
    keep = steps if trainable_steps is None else trainable_steps
    perm = torch.randperm(n, generator=generator, device=generator.device)
    out = {k: v[perm.to(v.device)] for k, v in samples.items()}
    tail = torch.arange(keep, steps, device=generator.device)
    time_perm = torch.stack(
        [
            torch.cat([torch.randperm(keep, generator=generator, device=generator.device), tail])
            for _ in range(n)
        ]
    )  # (N, S)
    rows = torch.arange(n)[:, None]
    for key in STEP_KEYS:
        if key in out:
            v = out[key]
            out[key] = v[rows.to(v.device), time_perm.to(v.device)]
    return out


# ---- GRPO's groups ----


def epoch_groups(prompt_fn, num_groups: int, group_size: int) -> tuple[list[tuple[str, dict]], torch.Tensor]:
    """The (prompt, metadata) of every sample of an epoch, over all processes: `num_groups` prompts from `prompt_fn`,
    each repeated `group_size` times in a row, and each sample's group id (num_groups x group_size,). Process p takes
    the p-th equal slice, so a group may be spread over processes; `prompt_fn` must be the same on all of them."""
    prompts = [prompt_fn() for _ in range(num_groups)]
    samples = [(p, dict(m)) for p, m in prompts for _ in range(group_size)]
    return samples, torch.arange(num_groups).repeat_interleave(group_size)


def draw_window_start(generator: torch.Generator, trainable_steps: int, window: int) -> int:
    """A window's first step, uniform in [0, trainable_steps - window], from `generator`."""
    return int(torch.randint(0, trainable_steps - window + 1, (1,), generator=generator))
