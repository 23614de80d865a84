"""DDPO: Denoising Diffusion Policy Optimization (Black et al. 2023) with LoRA, on the shared core.

    bash train_scripts/train_ddpo.sh [--preset NAME] [--flag ...]
    (presets: compressibility, incompressibility, aesthetic, prompt_image_alignment, toy_world, toy_world_sd3)

One epoch (the algorithm of ddpo-pytorch `scripts/train.py`, commit 1958463, written against today's libraries):

1. sampling: `sample_batch_size x sample_num_batches_per_epoch` images per process with the family's stochastic
   sampler (DDIM with eta > 0 on SD), CFG batched; keep every step's latents, next latents, log-probabilities and
   timesteps, and the prompt conditioning;
2. rewards: any reward of the registry (need not be differentiable), optionally in a thread pool while sampling
   goes on; gathered over all processes;
3. advantages: per-prompt running mean / std over a buffer (`PerPromptStatTracker`), or the batch mean / std;
   clipped to [-train_adv_clip_max, train_adv_clip_max] (refl_ddpo.algorithms.policy);
4. training, `train_num_inner_epochs` times: shuffle the samples and, independently per sample, the timesteps; for
   the first `train_timestep_fraction` of them recompute the log-probability of the stored next latent under the
   current weights (CFG as in sampling when `train_cfg`), ratio = exp(logp - logp_old), PPO-clip loss; gradients
   accumulate over the trained timesteps and `train_gradient_accumulation_steps` micro-batches per optimizer step.

DDPO-SF (the plain score-function estimator) is the configuration `--train_clip_range inf --train_num_inner_epochs 1`.
GRPO (refl_ddpo.trainers.grpo, a `GRPOConfig`) is this loop with the epoch's prompts in groups (`epoch_groups`, one
shared x_T per group with --same_noise_per_group), group advantages in step 3 and, with --sde_window, stochastic
steps only in a window (drawn per epoch) that is all that step 4 trains on.
All randomness of an epoch (prompts, noise, shuffles) comes from generators seeded by (seed, epoch, process), so a
run resumed from `checkpoint-N` repeats epochs N+1... exactly as the uninterrupted run would.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from refl_ddpo.algorithms.policy import (
    PerPromptStatTracker,
    compute_advantages,
    group_advantages,
    ppo_clip_loss,
    zero_std_group_fraction,
)
from refl_ddpo.errors import UserError, cli_main
from refl_ddpo.families import Cond, ModelFamily, cond_expand
from refl_ddpo.rollouts import (
    STEP_KEYS,
    collect_rewards,
    draw_window_start,
    epoch_groups,
    sample_epoch,
    shuffle_samples,
    stack_samples,
)
from refl_ddpo.trainers.ddpo_config import DDPOConfig, epoch_sizes, num_train_timesteps
from refl_ddpo.trainers.grpo_config import GRPOConfig, check_group_arithmetic, group_sizes
from refl_ddpo.training import seeded_generator, stream_seed

# A TRL-compatible image hook: (prompt_image_data, global_step, tracker) where prompt_image_data is a list of
# [images (B, 3, H, W) in [0, 1], prompts, prompt_metadata, rewards (B,), reward_metadata] batches, newest last.
ImageSamplesHook = Callable[[list[list[Any]], int, Any], None]


# --------------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------------


def step_log_prob(
    family: ModelFamily,
    scheduler,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    next_latents: torch.Tensor,
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
    eta: float,
    network=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability (B,) of the stored `next_latents` under the current network, and the network's output.

    latents / next_latents (B, C, h, w), timesteps (B,) (one per sample, after shuffling), `uncond` None: no CFG.
    The scheduler must have `set_timesteps(sample_num_steps)`.
    """
    model_output = family.predict(latents, timesteps, scheduler, cond, uncond, guidance_scale, network)
    _, log_prob, _ = family.step_with_logprob(
        scheduler, model_output, timesteps, latents, eta, prev_sample=next_latents
    )
    return log_prob, model_output


def train_on_samples(
    family: ModelFamily,
    network,
    scheduler,
    samples: dict[str, torch.Tensor],
    uncond: Cond | None,
    accelerator,
    optimizer,
    params: list[torch.nn.Parameter],
    generator: torch.Generator,
    *,
    num_steps: int,
    batch_size: int,
    num_train_steps: int,
    guidance_scale: float,
    eta: float,
    clip_range: float,
    kl_weight: float = 0.0,
    max_grad_norm: float = 0.0,
    skip_last_steps: int = 0,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """One inner epoch: shuffle, then PPO on the first `num_train_steps` steps of each sample.

    `network` is the prepared (possibly DDP-wrapped) network and `optimizer` the prepared optimizer (it steps only
    when gradients sync); `accelerator` was made with gradient_accumulation_steps = micro-batches per optimizer step
    x `num_train_steps`, so one optimizer step covers every trained timestep of its micro-batches. `uncond` None
    trains without CFG; the last `skip_last_steps` sampler steps of each trajectory are never trained on.
    Returns one dict of metrics (mean over its micro-steps and processes, and the gradient norm) per optimizer step,
    also handed to `on_step` as each step ends (a progress bar); besides `ratio` (the mean importance ratio) it holds
    `ratio_by_step/NN`, the mean ratio of the samples trained at sampler step NN (0 = the first), for each step the
    optimizer step trained on. A non-finite gradient norm raises FloatingPointError before the update (on every
    process alike).
    """
    from refl_ddpo.lora import adapters_off

    schedule = family.set_timesteps(scheduler, num_steps, samples["latents"])
    schedule = schedule.to(samples["timesteps"].device)
    if not torch.isin(samples["timesteps"], schedule).all():
        raise ValueError("the samples' timesteps are not those of a num_steps schedule")
    samples = shuffle_samples(samples, generator, samples["timesteps"].shape[1] - skip_last_steps)
    n = samples["timesteps"].shape[0]
    cond_keys = [k for k in samples if k not in (*STEP_KEYS, "advantages")]
    uncond = None if uncond is None else cond_expand(uncond, batch_size)
    base = accelerator.unwrap_model(network)
    results, acc = [], defaultdict(list)
    # per sampler step: summed importance ratios and sample counts (summed over processes when the step ends)
    step_ratios = torch.zeros(2, len(schedule), dtype=torch.float64, device=accelerator.device)
    network.train()
    for start in range(0, n, batch_size):
        batch = {k: v[start : start + batch_size] for k, v in samples.items()}
        cond = {k: batch[k] for k in cond_keys}
        for j in range(num_train_steps):
            x_t, t = batch["latents"][:, j], batch["timesteps"][:, j]
            with accelerator.accumulate(network):
                with accelerator.autocast():
                    log_prob, model_output = step_log_prob(
                        family,
                        scheduler,
                        x_t,
                        t,
                        batch["next_latents"][:, j],
                        cond,
                        uncond,
                        guidance_scale,
                        eta,
                        network,
                    )
                    loss, info = ppo_clip_loss(
                        log_prob, batch["log_probs"][:, j], batch["advantages"], clip_range
                    )
                    if kl_weight > 0:
                        with adapters_off(base):
                            ref_output = family.predict(
                                x_t, t, scheduler, cond, uncond, guidance_scale, network
                            )
                        kl = family.step_kl(scheduler, model_output, ref_output, t, eta).mean()
                        info["kl"] = kl.detach()
                        loss = loss + kl_weight * kl
                info["loss"] = loss.detach()
                for k, v in info.items():
                    acc[k].append(v)
                # (B,) each sample's sampler step (0 = the first), its timestep's place in the schedule
                step = (t[:, None] == schedule[None]).int().argmax(1).to(step_ratios.device)
                ratio = torch.exp(log_prob.detach() - batch["log_probs"][:, j]).to(step_ratios)  # (B,)
                step_ratios[0].index_add_(0, step, ratio)
                step_ratios[1].index_add_(0, step, torch.ones_like(ratio))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    # the all-reduced norm, the same on every process (clipping by inf multiplies by exactly 1)
                    grad_norm = float(accelerator.clip_grad_norm_(params, max_grad_norm or math.inf))
                    if not math.isfinite(grad_norm):
                        raise FloatingPointError(
                            f"the gradient norm is {grad_norm} (PPO loss {float(loss):.4g}, advantages in "
                            f"[{float(batch['advantages'].min()):.3g}, {float(batch['advantages'].max()):.3g}])"
                        )
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                means = accelerator.reduce(
                    {k: torch.stack(v).mean() for k, v in acc.items()}, reduction="mean"
                )
                sums, counts = accelerator.reduce(step_ratios, reduction="sum").tolist()
                by_step = {f"ratio_by_step/{i:02d}": r / c for i, (r, c) in enumerate(zip(sums, counts)) if c}
                results.append({**{k: float(v) for k, v in means.items()}, **by_step, "grad_norm": grad_norm})
                acc = defaultdict(list)
                step_ratios.zero_()
                if on_step is not None:
                    on_step(results[-1])
    return results


# --------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------


# the training bar's metrics (train_on_samples' info)
POSTFIX_KEYS = ("loss", "ratio", "approx_kl", "clipfrac", "kl")


def default_image_hook(accelerator, tag: str = "ddpo/samples") -> ImageSamplesHook:
    """Log the newest batch as a captioned grid ('prompt | reward') to the trackers each epoch."""
    from refl_ddpo.training import log_image_grid

    def hook(prompt_image_data: list[list[Any]], global_step: int, tracker: Any) -> None:
        images, prompts, _, rewards, _ = prompt_image_data[-1]
        captions = [f"{p} | {r:.3g}" for p, r in zip(prompts, rewards.tolist())]
        log_image_grid(accelerator, tag, images[:16], captions[:16], global_step)

    return hook


def check_rewards(cfg: DDPOConfig, rewards: torch.Tensor, epoch: int) -> torch.Tensor:
    """Which of an epoch's gathered rewards (N,) are finite. A NaN or inf reward stops the run (the same on every
    process: the rewards are gathered), unless --nonfinite_rewards drop, which keeps the others; all dropped stops."""
    from refl_ddpo.training import nonfinite_step_error

    finite = torch.isfinite(rewards)
    bad = len(rewards) - int(finite.sum())
    if bad and (cfg.nonfinite_rewards == "error" or bad == len(rewards)):
        fix = (
            "check the reward, or pass --nonfinite_rewards drop to train on the other samples"
            if bad < len(rewards)
            else "check the reward (or the model: do its images hold NaN?)"
        )
        raise nonfinite_step_error(
            cfg,
            f"--reward {cfg.reward} gave {bad} non-finite reward(s) (NaN or inf) of {len(rewards)} samples in "
            f"epoch {epoch + 1}",
            fix,
        )
    return finite


def preflight(cfg: DDPOConfig) -> Path | None:
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    from refl_ddpo.families import resolve_lora_targets
    from refl_ddpo.hub import check_push
    from refl_ddpo.models import check_pretrained_model
    from refl_ddpo.rewards import check_reward_files
    from refl_ddpo.runs import start_run
    from refl_ddpo.validation import check_validation_prompts

    check_pretrained_model(cfg.pretrained_model)
    check_reward_files(cfg.reward, cfg.reward_model_dir)
    check_validation_prompts(cfg)
    check_push(cfg)
    resolve_lora_targets(cfg)  # before start_run, which records them
    return start_run(cfg, cfg.ALGORITHM, "num_epochs")  # output_dir free or continued; the checkpoint fits


def grouped_epoch(
    cfg: GRPOConfig, family: ModelFamily, epoch: int, rank: int, num_processes: int, dtype: torch.dtype
):
    """GRPO's epoch plan, the same on every process: this process' prompt_fn (its slice of the groups), the group id
    of each of its samples (N,), their initial noise (one x_T per group with --same_noise_per_group, else None),
    and the SDE window (start, length) or None."""
    from refl_ddpo.prompts import get_prompt_fn

    per_process = cfg.sample_batch_size * cfg.sample_num_batches_per_epoch
    num_groups = per_process * num_processes // cfg.group_size
    prompt_fn = get_prompt_fn(  # one stream for all processes: every one of them draws the same groups
        cfg.prompts_file if cfg.prompt_fn == "from_file" else cfg.prompt_fn,
        seed=stream_seed(cfg.seed, epoch, 0, 3),
    )
    samples, group_ids = epoch_groups(prompt_fn, num_groups, cfg.group_size)
    mine = slice(rank * per_process, (rank + 1) * per_process)
    local = iter(samples[mine])
    noise = None
    if cfg.same_noise_per_group:
        group_noise = [
            family.initial_noise(1, cfg.resolution, seeded_generator(cfg.seed, epoch, 4, g), dtype)
            for g in range(num_groups)
        ]
        noise = torch.cat([group_noise[g] for g in group_ids[mine].tolist()])
    window = None
    if cfg.sde_window:
        start = cfg.sde_window_start
        if start is None:
            last = cfg.sample_num_steps - cfg.train_skip_last_steps  # the window ends at or before this step
            start = draw_window_start(seeded_generator(cfg.seed, epoch, 5), last, cfg.sde_window)
        window = (start, cfg.sde_window)
    return (lambda: next(local)), group_ids[mine], noise, window


def train(cfg: DDPOConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run DDPO (or GRPO, with a `GRPOConfig`) as configured; returns the output folder (final LoRA + config.json
    at its top)."""
    import time

    from accelerate.utils import gather_object, set_seed

    from refl_ddpo.progress import progress_bar, run_clock
    from refl_ddpo.prompts import get_prompt_fn
    from refl_ddpo.rewards import build_reward, parse_reward_spec, reward_stats
    from refl_ddpo.training import (
        check_identical_weights,
        load_checkpoint,
        load_trainable_family,
        make_accelerator,
        make_optimizer,
        nonfinite_step_error,
        print_config,
        save_checkpoint,
        save_final,
        start_trackers,
    )

    resume = preflight(cfg)
    name = cfg.ALGORITHM  # "ddpo" or "grpo": metric keys, trackers
    grouped = isinstance(cfg, GRPOConfig)
    accelerator = make_accelerator(cfg, cfg.train_gradient_accumulation_steps * num_train_timesteps(cfg))
    main, rank = accelerator.is_main_process, accelerator.process_index
    if grouped:  # the config's check read WORLD_SIZE; a launcher that does not set it is caught here
        check_group_arithmetic(cfg, accelerator.num_processes)
    repo_id = None
    if cfg.push_to_hub and main:
        from refl_ddpo.hub import create_hub_repo

        repo_id = create_hub_repo(cfg)  # before loading: a wrong token or id fails at once

    # ---- models ----
    set_seed(cfg.seed)  # the same LoRA init on every process and in every run with this seed
    family, params, dtype = load_trainable_family(accelerator, cfg)
    scheduler = family.policy_scheduler()  # DDIM (SD 1.x) or flow matching with Flow-GRPO's SDE step (SD3)
    family.pipe.scheduler = scheduler
    if cfg.kl_weight > 0 and scheduler.config.get("clip_sample", False):
        raise UserError(
            f"--kl_weight needs a scheduler with clip_sample=False (Stable Diffusion's); "
            f"{cfg.pretrained_model} clips x0: use --kl_weight 0."
        )
    optimizer = make_optimizer(params, cfg)
    network, optimizer = accelerator.prepare(family.network, optimizer)
    vlm = {k: v for k, v in (("model", cfg.vlm_model), ("question", cfg.vlm_question)) if v is not None}
    options = {"vlm_judge": vlm, "vlm_bertscore": vlm}
    reward = build_reward(cfg.reward, accelerator.device, dtype, cfg.reward_model_dir, options=options)
    uncond, _ = family.encode_prompts([""], with_negative=False)  # batch 1
    tracker = (
        PerPromptStatTracker(cfg.per_prompt_stat_tracking_buffer_size, cfg.per_prompt_stat_tracking_min_count)
        if cfg.per_prompt_stat_tracking
        else None
    )
    hook = image_samples_hook or default_image_hook(accelerator, f"{name}/samples")
    start_trackers(accelerator, cfg, name)
    if main:
        print_config(
            cfg,
            {
                **epoch_sizes(cfg, accelerator.num_processes),
                **(group_sizes(cfg, accelerator.num_processes) if grouped else {}),
                "processes": accelerator.num_processes,
                "resume from": resume,
            },
        )

    # ---- resume ----
    first_epoch, global_step = 0, 0
    if resume is not None:
        counters, _ = load_checkpoint(accelerator, resume)
        first_epoch, global_step = int(counters["epoch"]), int(counters["global_step"])
        if tracker is not None and counters.get("stat_tracker"):
            tracker.load_state_dict(counters["stat_tracker"])
        accelerator.print(
            f"resumed from {resume}: {first_epoch} epoch(s) done, {global_step} optimizer step(s)"
        )

    from refl_ddpo.validation import make_validator

    validator = make_validator(
        accelerator,
        family,
        reward,
        cfg,
        every=cfg.validation_epochs,
        unit="epoch",
        last=cfg.num_epochs,
        start=first_epoch,
    )
    if validator is not None and first_epoch == 0:
        validator(0, global_step)  # the baseline: the base model (LoRA starts at zero)

    executor = ThreadPoolExecutor(cfg.max_workers) if cfg.async_reward_computation else None
    train_uncond = uncond if cfg.train_cfg and cfg.sample_guidance_scale > 1.0 else None
    steps_per_epoch = epoch_sizes(cfg, accelerator.num_processes)["optimizer steps per epoch"]
    started = time.perf_counter()

    def phase_bar(epoch: int, phase: str, total: int, unit: str):
        """One bar per phase of an epoch (sampling, training), gone when it ends: the epoch's line stays."""
        return progress_bar(
            total,
            f"epoch {epoch + 1}/{cfg.num_epochs} {phase}",
            unit=unit,
            leave=False,
            enabled=accelerator.is_local_main_process,
        )

    def step_done(info: dict[str, float]) -> None:
        """One tick of the epoch's training bar per optimizer step, its metrics as the postfix."""
        bar.set_postfix({k: f"{info[k]:.3g}" for k in POSTFIX_KEYS if k in info}, refresh=False)
        bar.update(1)

    try:
        for epoch in range(first_epoch, cfg.num_epochs):
            # ---- sampling (prompts, noise and shuffles seeded by (seed, epoch, process): resumable) ----
            network.eval()
            initial_noise, window = None, None
            if grouped:
                prompt_fn, local_groups, initial_noise, window = grouped_epoch(
                    cfg, family, epoch, rank, accelerator.num_processes, dtype
                )
            else:
                prompt_fn = get_prompt_fn(
                    cfg.prompts_file if cfg.prompt_fn == "from_file" else cfg.prompt_fn,
                    seed=stream_seed(cfg.seed, epoch, rank, 0),
                )
            with phase_bar(epoch, "sampling", cfg.sample_num_batches_per_epoch, "batch") as bar:
                batches = sample_epoch(
                    family,
                    scheduler,
                    prompt_fn,
                    reward,
                    uncond,
                    batch_size=cfg.sample_batch_size,
                    num_batches=cfg.sample_num_batches_per_epoch,
                    num_steps=cfg.sample_num_steps,
                    guidance_scale=cfg.sample_guidance_scale,
                    eta=cfg.sample_eta,
                    resolution=cfg.resolution,
                    generator=seeded_generator(cfg.seed, epoch, rank, 1),
                    network=network,
                    autocast=accelerator.autocast,
                    executor=executor,
                    initial_noise=initial_noise,
                    sde_window=window,
                    on_batch=lambda _, tick=bar.update: tick(1),
                )
            collect_rewards(batches)

            # ---- rewards -> advantages, over all processes ----
            local_rewards = torch.cat([b.rewards[0] for b in batches]).to(accelerator.device)  # (N,)
            all_rewards = accelerator.gather(local_rewards).cpu()  # (P * N,), process-major
            all_prompts = gather_object([p for b in batches for p in b.prompts])
            finite = check_rewards(cfg, all_rewards, epoch)  # (P * N,) bool: False = dropped
            advantages = torch.zeros(len(all_rewards))  # a dropped sample: advantage 0, no gradient
            group_stats = {}
            if grouped:
                all_groups = accelerator.gather(local_groups.to(accelerator.device)).cpu()  # (P * N,)
                advantages[finite] = group_advantages(
                    all_rewards[finite], all_groups[finite], cfg.global_std, cfg.train_adv_clip_max
                )
                group_stats[f"{name}/zero_std_groups"] = zero_std_group_fraction(
                    all_rewards[finite], all_groups[finite]
                )
                if window is not None:
                    group_stats[f"{name}/sde_window_start"] = window[0]
            else:
                advantages[finite] = compute_advantages(
                    all_rewards[finite],
                    [p for p, ok in zip(all_prompts, finite.tolist()) if ok],
                    tracker,
                    cfg.train_adv_clip_max,
                )
            advantages = advantages.reshape(accelerator.num_processes, -1)[rank]  # this process' samples
            parts = {
                name: accelerator.gather(
                    torch.cat([b.rewards[1][name].float() for b in batches]).to(accelerator.device)
                ).cpu()[finite]
                for name, _ in parse_reward_spec(cfg.reward)
                if name in batches[0].rewards[1]
            }
            stats = {**reward_stats(cfg.reward, all_rewards[finite], parts), **group_stats}
            dropped = len(all_rewards) - int(finite.sum())
            if cfg.nonfinite_rewards == "drop":
                stats[f"{name}/nonfinite_rewards_dropped"] = dropped
            accelerator.log({**stats, f"{name}/epoch": epoch}, step=global_step)
            if main:
                clock = run_clock(
                    time.perf_counter() - started, epoch + 1 - first_epoch, cfg.num_epochs - epoch - 1
                )
                print(
                    f"epoch {epoch + 1}/{cfg.num_epochs} ({clock}): {len(all_rewards)} rewards from "
                    f"{accelerator.num_processes} process(es)"
                    + (f" ({dropped} non-finite, dropped), " if dropped else ", ")
                    + ", ".join(f"{k} {v:.4g}" for k, v in stats.items()),
                    flush=True,
                )
                hook(
                    [[b.images, b.prompts, b.prompt_metadata, b.rewards[0], b.rewards[1]] for b in batches],
                    global_step,
                    accelerator.trackers[0] if accelerator.trackers else None,
                )

            # ---- training ----
            samples = stack_samples(batches, advantages)
            del batches
            bar = phase_bar(epoch, "training", steps_per_epoch, "step")
            for inner_epoch in range(cfg.train_num_inner_epochs):
                try:
                    steps = train_on_samples(
                        family,
                        network,
                        scheduler,
                        samples,
                        train_uncond,
                        accelerator,
                        optimizer,
                        params,
                        seeded_generator(cfg.seed, epoch, rank, 2, inner_epoch),
                        num_steps=cfg.sample_num_steps,
                        batch_size=cfg.train_batch_size,
                        num_train_steps=num_train_timesteps(cfg),
                        guidance_scale=cfg.sample_guidance_scale,
                        eta=cfg.sample_eta,
                        clip_range=cfg.train_clip_range,
                        kl_weight=cfg.kl_weight,
                        max_grad_norm=cfg.max_grad_norm,
                        # a window's trajectory holds its steps only, all trainable
                        skip_last_steps=0 if window is not None else cfg.train_skip_last_steps,
                        on_step=step_done,
                    )
                except FloatingPointError as e:
                    bar.close()
                    raise nonfinite_step_error(
                        cfg,
                        f"{e} in epoch {epoch + 1}",
                        "lower --learning_rate, or check the reward",
                    ) from None
                for info in steps:
                    accelerator.log(
                        {f"{name}/{k}": v for k, v in info.items()} | {f"{name}/inner_epoch": inner_epoch},
                        step=global_step,
                    )
                    global_step += 1
            bar.close()

            # ---- validation, state ----
            done = epoch + 1
            if validator is not None and validator.due(done):
                validator(done, global_step)
            if done % cfg.save_freq == 0 or done == cfg.num_epochs:
                counters = {
                    "epoch": done,
                    "global_step": global_step,
                    "stat_tracker": tracker.state_dict() if tracker is not None else None,
                }
                save_checkpoint(accelerator, cfg, done, counters, {})
    finally:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    save_final(
        accelerator,
        network,
        cfg,
        family,
        name,
        {"epochs": cfg.num_epochs, "optimizer steps": global_step},
        repo_id,
    )
    check_identical_weights(accelerator, params)
    accelerator.end_training()
    return Path(cfg.output_dir)


@cli_main
def main(argv: list[str] | None = None) -> None:
    from refl_ddpo.config import parse_config
    from refl_ddpo.training import run_or_preflight

    run_or_preflight(train, parse_config(DDPOConfig, argv, description=__doc__), preflight)


if __name__ == "__main__":
    main()
