"""The forward-process trainers, DiffusionNFT (refl_ddpo.trainers.nft) and AWM (refl_ddpo.trainers.awm), as one loop:
sample clean images in groups, score them, train the network's denoising output on forward-noised copies of them,
move the old policy toward the trained weights. The two differ in a `Method` chosen once at the start of `train`:
the loss of one trained timestep, the weights that sample (the old policy's, or the current ones), and the weights
released (NFT's EMA of the trained weights, or AWM's old policy). The maths is refl_ddpo.algorithms.forward's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch

from refl_ddpo.algorithms.forward import old_policy_decay, soft_update_
from refl_ddpo.algorithms.policy import zero_std_group_fraction
from refl_ddpo.core.families import cond_cat
from refl_ddpo.run.runs import start_run
from refl_ddpo.run.session import (
    Run,
    add_optimizer,
    begin_run,
    finish_run,
    load_run,
    open_accelerator,
    prepare,
    save_run_checkpoint,
    shared_checks,
    validation,
)
from refl_ddpo.run.training import nonfinite_step_error, seeded_generator
from refl_ddpo.trainers.ddpo_config import epoch_sizes, num_train_timesteps
from refl_ddpo.trainers.epochs import (
    EpochPlan,
    ImageSamplesHook,
    ScoredEpoch,
    build_epoch_reward,
    checkpoint_due,
    phase_bar,
    report_epoch,
    reward_pool,
    score_epoch,
)
from refl_ddpo.trainers.forward_config import AWMConfig, ForwardConfig, NFTConfig
from refl_ddpo.trainers.forward_training import AWM, NFT, ForwardState, Method, swapped, train_pass
from refl_ddpo.trainers.groups import check_group_arithmetic, group_sizes, grouped_advantages, grouped_prompts
from refl_ddpo.trainers.rollouts import CleanSampler, collect_rewards, sample_clean


def train(cfg: NFTConfig | AWMConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run DiffusionNFT or AWM (by the config's class) as configured; returns the output folder (final LoRA and
    config.json at its top)."""
    method = method_of(cfg)
    cfg = forward_checks(cfg)
    info = start_run(cfg, method.name, "num_epochs")
    accelerator = open_accelerator(cfg, cfg.train_gradient_accumulation_steps * num_train_timesteps(cfg))
    check_group_arithmetic(cfg, accelerator.num_processes)
    run = load_run(cfg, info, accelerator, method.name, "epoch")
    cfg, fp = run.cfg, new_state(run, method)  # the sampler, the reward
    add_optimizer(run)
    keep_copies(run, fp)  # the old policy (and NFT's EMA): the weights at the start
    prepare(run)
    sizes = forward_sizes(cfg, accelerator.num_processes)
    if (saved := begin_run(run, sizes)) is not None:
        restore(run, fp, *saved)
    counters, first = fp.counters, fp.counters.first_epoch
    validate = validation(
        run, cfg.validation_epochs, cfg.num_epochs, first, partial(released_weights, run, fp)
    )
    validate(first, counters.global_step)  # the baseline, in a fresh run
    counters.started = time.perf_counter()  # the epoch line's clock
    done = first
    with reward_pool(cfg) as executor:
        for epoch in range(first, cfg.num_epochs):
            # ---- plan and sample: prompts in groups; the old policy (NFT) or the current weights (AWM) draw ----
            plan = EpochPlan(
                *grouped_prompts(cfg, run.family, epoch, run.rank, accelerator.num_processes, run.dtype)
            )
            with (
                phase_bar(run, epoch, "sampling", cfg.sample_num_batches_per_epoch, "batch") as bar,
                sampling_weights(run, fp),
            ):
                generator = seeded_generator(cfg.seed, epoch, run.rank, 1)
                batches = sample_clean(
                    run, fp.sampler, plan, generator, executor, lambda _, b=bar: b.update(1)
                )
            collect_rewards(batches)
            # ---- rewards and advantages (over all processes), report ----
            scored = score_epoch(run, epoch, batches, partial(forward_advantages, run), plan.groups)
            report_epoch(run, epoch, counters, scored, image_samples_hook)
            # ---- training: --train_num_inner_epochs passes, then the old policy's soft update ----
            samples = clean_samples(scored)
            with (
                phase_bar(run, epoch, "training", sizes["optimizer steps per epoch"], "step") as bar,
                nonfinite_stops(run, epoch, bar),
            ):
                for inner in range(cfg.train_num_inner_epochs):
                    train_pass(run, fp, samples, seeded_generator(cfg.seed, epoch, run.rank, 2, inner), bar)
            update_old_policy(run, fp, epoch)
            done = epoch + 1
            # ---- validation and checkpoint-N ----
            if validate(epoch + 1, counters.global_step):  # --early_stop_patience ran out
                break
            if checkpoint_due(cfg, epoch + 1):
                save_run_checkpoint(run, epoch + 1, counters.state(epoch + 1), state_tensors(fp))
    release(run, fp)
    return finish_run(run, {"epochs": done, "optimizer steps": counters.global_step})


# ---- the set-up ----


def forward_checks(cfg: ForwardConfig) -> ForwardConfig:
    """The shared checks before any model loads, and the forward process' own; returns the resolved config."""
    cfg = shared_checks(cfg)
    if cfg.fsdp:
        from refl_ddpo.core.errors import UserError

        raise UserError(
            "--fsdp: DiffusionNFT and AWM keep a copy of the trained weights (the old policy) that is not "
            "sharded; train them without --fsdp (each process holds the network), or use GRPO / ReFL."
        )
    return cfg


def preflight(cfg: ForwardConfig) -> None:
    """launch.sh's checks before it starts the processes: all that needs no model, output_dir's claim included."""
    start_run(forward_checks(cfg), method_of(cfg).name, "num_epochs")


def forward_sizes(cfg: ForwardConfig, num_processes: int) -> dict[str, int]:
    """The derived sizes printed before training: the epoch's (refl_ddpo.trainers.ddpo_config) and the groups'."""
    return {**epoch_sizes(cfg, num_processes), **group_sizes(cfg, num_processes)}


def new_state(run: Run, method: Method) -> ForwardState:
    """The sampler (DDIM on SD 1.x, flow-matching Euler on SD3; the pipeline's too) and run.reward."""
    scheduler = run.family.policy_scheduler()
    run.family.pipe.scheduler = scheduler
    build_epoch_reward(run)
    uncond = run.family.empty_cond() if run.cfg.sample_guidance_scale > 1.0 else None
    return ForwardState(method, CleanSampler(scheduler, uncond))


def keep_copies(run: Run, fp: ForwardState) -> None:
    """The old policy, and NFT's EMA under --release_weights ema: copies of the trainable weights as they are."""
    fp.old = [p.detach().clone() for p in run.params]
    keep_ema = fp.method.release == "ema" and run.cfg.release_weights == "ema"
    fp.ema = [p.detach().clone() for p in run.params] if keep_ema else None


def state_tensors(fp: ForwardState) -> dict[str, torch.Tensor]:
    """checkpoint-N's tensors beside the counters: the old policy and the EMA."""
    return {f"old/{i}": t for i, t in enumerate(fp.old)} | {f"ema/{i}": t for i, t in enumerate(fp.ema or [])}


def restore(run: Run, fp: ForwardState, counters: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The counters, the old policy and the EMA from checkpoint-N (a --release_weights raw run's has no EMA: the
    EMA starts at the trained weights)."""
    fp.counters.restore(counters)
    for i, t in enumerate(fp.old):
        t.copy_(tensors[f"old/{i}"])
    for i, t in enumerate(fp.ema or []):
        t.copy_(tensors.get(f"ema/{i}", run.params[i].detach()))
    run.accelerator.print(f"resumed from {run.info.resume}{fp.counters.resumed()}")


def method_of(cfg: ForwardConfig) -> Method:
    return AWM if isinstance(cfg, AWMConfig) else NFT


def sampling_weights(run: Run, fp: ForwardState):
    """The old policy's weights (NFT) or the trained ones (AWM), for the duration of the context."""
    return swapped(run.params, fp.old) if fp.method.sample_with_old else nullcontext()


def released(run: Run, fp: ForwardState) -> list[torch.Tensor] | None:
    """The weights validation sees and the final LoRA holds: NFT's EMA or AWM's old policy (--release_weights
    ema), or None: the trained weights."""
    if run.cfg.release_weights == "raw":
        return None
    return fp.ema if fp.method.release == "ema" else fp.old


def released_weights(run: Run, fp: ForwardState):
    """The released weights in the trainable tensors, for the duration of the context (validation)."""
    weights = released(run, fp)
    return nullcontext() if weights is None else swapped(run.params, weights)


def release(run: Run, fp: ForwardState) -> None:
    """The released weights into the trainable tensors, for the final save (the references save the EMA)."""
    weights = released(run, fp)
    if weights is not None:
        with torch.no_grad():
            for p, e in zip(run.params, weights, strict=True):
                p.copy_(e)


# ---- rewards and samples ----


def forward_advantages(
    run: Run, rewards: torch.Tensor, prompts: list[str], groups: torch.Tensor, parts: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """(r - the group's mean) / std, clipped to +-c (refl_ddpo.algorithms.policy.group_advantages), or GDPO's
    (--reward_aggregation gdpo, each part of --reward apart), over the finite gathered rewards (M,) and their group
    ids; the share of groups with one reward value, to log."""
    advantages = grouped_advantages(run.cfg, rewards, groups, parts)
    return advantages, {f"{run.name}/zero_std_groups": zero_std_group_fraction(rewards, groups)}


def clean_samples(scored: ScoredEpoch) -> dict[str, torch.Tensor]:
    """The epoch's training tensors (x0, advantages, the conditioning under its own names); the batches (their
    images) are let go of."""
    samples = {
        "x0": torch.cat([b.latents for b in scored.batches]),
        "advantages": scored.advantages.to(scored.batches[0].latents.device),
        **cond_cat([b.cond for b in scored.batches]),
    }
    scored.batches.clear()
    return samples


@contextmanager
def nonfinite_stops(run: Run, epoch: int, bar):
    """A non-finite gradient in the training passes stops the run with one line, before the update."""
    try:
        yield
    except FloatingPointError as e:
        bar.close()
        raise nonfinite_step_error(
            run.cfg.output_dir, f"{e} in epoch {epoch + 1}", "lower --learning_rate, or check the reward"
        ) from None


def update_old_policy(run: Run, fp: ForwardState, epoch: int) -> None:
    """After the epoch: old <- d old + (1 - d) theta, d on --old_decay_clock (optimizer steps, or the epoch)."""
    cfg, step = run.cfg, fp.counters.global_step
    clock = step if cfg.old_decay_clock == "steps" else epoch
    decay = old_policy_decay(clock, cfg.old_decay_flat, cfg.old_decay_rate, cfg.old_decay_max)
    soft_update_(fp.old, run.params, decay)
    run.accelerator.log({f"{run.name}/old_decay": decay}, step=step)
