"""Reward backprop: ReFL (Xu et al. 2023, "ImageReward", Algorithm 1), DRaFT-K / DRaFT-LV (Clark et al. 2023) and
AlignProp (Prabhudesai et al. 2023) on the shared core, LoRA or full network.

    python -m refl_ddpo.trainers.refl [--flag value ...]      (usually via train_scripts/train_refl_lora.sh)

One optimizer step, as ImageReward's ReFL.py (and its LoRA hackathon version), with every constant a flag:

    k ~ U{k_lo..k_hi}                      one draw per optimizer step, from a generator seeded alike on every process
    x_T ~ N(0, I)                          (B, C, resolution / vae_scale_factor, ...), per-process generator
    x_T -> ... -> x_{t_k}                  steps 0..k-1 of the T-step sampler (DDPM as the reference, or DDIM), no grad
    x0 = scheduler.step(net(x_{t_k}))      step k with gradient; the scheduler's predicted x0
    image = VAE.decode(x0) / 2 + 0.5       gradient flows through the decoder; clamp to [0, 1]
    r = reward(image)                      e.g. ImageReward: bicubic resize 224, centre crop, CLIP mean/std, as tensor ops
    loss = relu(margin - r).mean() * grad_scale                  (margin 2, grad_scale 1e-3 / 0.01 in the LoRA recipe)
         + pretrain_loss_weight * MSE(net(noisy x, t), noise)    optional, on an image-caption folder
         + kl_weight * KL term vs the base model                 optional, LoRA only, at the grad step(s) (`kl_to_base`)

State (`output_dir/checkpoint-N`): the LoRA (or network), optimizer and accelerate state through accelerate's
`save_state`; the step, the lr-scheduler state and the EMA scalars as JSON; the generators (the shared k generator
and every process's own) and the EMA weights as safetensors. A resumed run continues bit-exactly on CPU.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from refl_ddpo.core.errors import UserError
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
from refl_ddpo.trainers.backprop import (
    MicroBatch,
    Parts,
    TrainingData,
    checked,
    clipped_grad_norm,
    draft_step,
    draw_k,
    draw_rollout,
    refl_step,
    regularised,
)
from refl_ddpo.trainers.refl_config import ReFLConfig, resolve_gradient_accumulation

# The k generator's seed is `seed + K_STREAM_OFFSET`, so that its draws never coincide with the stream of a
# process's own generator (seeded `seed + rank`), in this run or in a run with a nearby seed.
K_STREAM_OFFSET = 1 << 40
CHECKSUM_DIR = "debug"  # --debug_lora_checksums writes output_dir/debug/lora_checksums_rank{R}.jsonl


def train(cfg: ReFLConfig) -> Path:
    """Run ReFL (or DRaFT-K / LV, AlignProp) as configured; returns the output folder."""
    # ---- before any model loads ----
    cfg, data = check(cfg)
    info = start_run(cfg, "refl", "max_train_steps")
    accelerator = open_accelerator(cfg, cfg.gradient_accumulation_steps)
    check_processes(accelerator.num_processes)
    # ---- the models: the family with its trainable weights, the sampler, the reward, the optimizer ----
    run = load_run(cfg, info, accelerator, "refl", "step")
    cfg = run.cfg
    parts = set_up(run, data)
    add_optimizer(run)
    state = make_state(run)
    prepare(run)
    saved = begin_run(run, sizes(run, parts))
    first = restore(run, state, *saved) if saved else 0
    validate = validation(
        run, cfg.validation_steps, cfg.max_train_steps, first, lambda: ema_weights(run, state)
    )
    validate(first, first)  # the baseline: the base model (LoRA starts at zero)
    checksums = checksum_file(run, first)
    run.network.train()
    done = first
    with progress(run, first) as bar:
        for step in range(first, cfg.max_train_steps):
            k = draw_k(cfg, state.k_generator)  # the same on every process
            lr, grad_norm, results = state.lr_scheduler.get_last_lr()[0], torch.zeros(()), []
            for _ in range(cfg.gradient_accumulation_steps):
                with accelerator.accumulate(run.network):
                    # ---- rollout -> reward -> loss ----
                    rollout = draw_rollout(run, parts, state.generator)
                    out = parts.backprop(rollout, run.reward, k)
                    loss, terms = regularised(run, parts, rollout, out, k, state.generator)
                    results.append(checked(run, step, out, loss, terms, rollout.prompts))
                    # ---- backprop and the update ----
                    accelerator.backward(loss)  # divides by gas; DDP all-reduces on the last micro-batch
                    if accelerator.sync_gradients:
                        grad_norm = clipped_grad_norm(run, step, results)
                    run.optimizer.step()
                    if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                        state.lr_scheduler.step()
                    run.optimizer.zero_grad(set_to_none=True)
            if state.ema is not None:
                state.ema.step(run.params)
            # ---- log, validate, checkpoint ----
            log_step(run, bar, step + 1, k, lr, float(grad_norm), results, checksums)
            done = step + 1
            if validate(step + 1, step + 1):  # --early_stop_patience ran out
                break
            if checkpoint_due(cfg, step + 1):
                save_run_checkpoint(run, step + 1, *state_dict(run, state, step + 1))
    if state.ema is not None:
        state.ema.copy_to(run.params)  # the averaged weights are the result of an EMA run
    return finish_run(run, {"optimizer steps": done})


# ---- before any model loads ----


def check(cfg: ReFLConfig) -> tuple[ReFLConfig, TrainingData]:
    """The shared checks, the prompts and the pretraining folder, the gradient accumulation resolved for the
    launcher's WORLD_SIZE: everything checkable before a model is loaded."""
    from refl_ddpo.core.edit_data import load_edit_data
    from refl_ddpo.core.image_captions import PretrainData
    from refl_ddpo.core.prompts import PromptDraw, resolve_prompts

    cfg = shared_checks(cfg)
    source = None if cfg.edit_data else cfg.prompt_fn  # the edits replace the prompts
    if cfg.edit_data:
        listed = load_edit_data(cfg.edit_data)
    else:
        listed = resolve_prompts(cfg.prompts_file) if cfg.prompt_fn is None else None
    data = TrainingData(
        PromptDraw(listed, source),
        PretrainData(cfg.pretrain_data_dir) if cfg.pretrain_loss_weight > 0 else None,
    )
    return resolve_gradient_accumulation(cfg, world_size()), data


def world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun


def check_processes(num_processes: int) -> None:
    """The batch arithmetic assumed WORLD_SIZE processes: refuse another count."""
    if num_processes != world_size():
        raise UserError(
            f"accelerate runs {num_processes} process(es) but WORLD_SIZE is {world_size()}; "
            "start the trainer with train_scripts/train_refl_lora.sh or accelerate launch."
        )


def preflight(cfg: ReFLConfig) -> Path | None:
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    cfg, _ = check(cfg)
    return start_run(cfg, "refl", "max_train_steps").resume


# ---- set-up ----


@dataclass
class State:
    """What moves from step to step beside the weights: the random streams, the lr schedule, the EMA."""

    k_generator: torch.Generator  # K, alike on all processes
    generator: torch.Generator  # prompts and noise, this process'
    lr_scheduler: Any
    ema: Any


def build_refl_reward(cfg: ReFLConfig, device: torch.device, dtype: torch.dtype):
    """The reward, with --reward_antialias and --reward_gradient_checkpointing passed to ImageReward's factory, and
    --reward_gradient_checkpointing to HPSv3's."""
    from refl_ddpo.rewards import build_reward

    options = {
        "imagereward": {
            "antialias": cfg.reward_antialias,
            "gradient_checkpointing": cfg.reward_gradient_checkpointing,
        },
        "hpsv3": {"gradient_checkpointing": cfg.reward_gradient_checkpointing},
    }
    return build_reward(
        cfg.reward, device, dtype, cfg.reward_model_dir, options=options, video_reduction=cfg.video_reduction
    )


def set_up(run: Run, data: TrainingData) -> Parts:
    """The rollout sampler, the reward (run.reward), the VAE's checkpointing, the strategy of --backprop_steps."""
    cfg, family = run.cfg, run.family
    sampler = family.rollout_scheduler(cfg.scheduler)
    if data.pretrain is not None and family.network_name != "unet":
        raise UserError(
            f"--pretrain_loss_weight {cfg.pretrain_loss_weight}: the pretraining loss is written for SD "
            f"1.x/2.x and SDXL (UNet, epsilon/v) models, not {family.name}; set it to 0."
        )
    noise_scheduler = family.scheduler("DDPMScheduler") if data.pretrain is not None else None
    if cfg.vae_gradient_checkpointing:
        if not family.vae._supports_gradient_checkpointing:  # Qwen-Image's AutoencoderKLQwenImage
            raise UserError(
                f"--vae_gradient_checkpointing: diffusers' {type(family.vae).__name__} ({family.name}) has no "
                "gradient checkpointing; drop the flag."
            )
        family.vae.enable_gradient_checkpointing()
    run.reward = build_refl_reward(cfg, run.accelerator.device, run.dtype)
    common = {"margin": cfg.margin, "grad_scale": cfg.grad_scale, "keep_trajectory": cfg.kl_weight > 0}
    if cfg.backprop_range() is None:
        backprop = partial(refl_step, **common)
    else:
        backprop = partial(
            draft_step, lv_copies=cfg.draft_lv, checkpoint_network=cfg.backprop_checkpointing, **common
        )
    return Parts(sampler, backprop, data, noise_scheduler)


def make_state(run: Run) -> State:
    """The random streams (k alike on all processes; prompts and noise per process), the lr schedule (stepped once
    per optimizer step by the loop, not through accelerate, which steps it once per process) and the EMA."""
    from diffusers.optimization import get_scheduler

    cfg = run.cfg
    k_generator = torch.Generator().manual_seed(cfg.seed + K_STREAM_OFFSET)
    generator = torch.Generator().manual_seed(cfg.seed + run.rank)
    lr_scheduler = get_scheduler(
        cfg.lr_scheduler,
        run.optimizer,
        num_warmup_steps=cfg.lr_warmup_steps,
        num_training_steps=cfg.max_train_steps,
    )
    ema = None
    if cfg.use_ema:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(run.params, decay=cfg.ema_decay)
        ema.to(run.accelerator.device)
    return State(k_generator, generator, lr_scheduler, ema)


def sizes(run: Run, parts: Parts) -> dict:
    """What the printed config shows beside the flags."""
    cfg, family, processes = run.cfg, run.family, run.accelerator.num_processes
    batch, gas = cfg.train_batch_size, cfg.gradient_accumulation_steps
    side = cfg.resolution // family.vae_scale_factor
    return {
        "model family": family.name,
        "sampler": type(parts.sampler).__name__,
        "reward backprop": cfg.describe_backprop(),
        "images per optimizer step": f"{batch} per process x {gas} accumulation x {processes} process(es) = "
        f"{batch * gas * processes}",
        "trainable parameters": sum(p.numel() for p in run.params),
        "training prompts": parts.data.prompts.describe(),
        "latents": f"({family.network.config.in_channels}, {side}, {side})",
    }


# ---- checkpoint-N ----


def checkpoint_due(cfg: ReFLConfig, done: int) -> bool:
    """Every --checkpointing_steps; and after the last step with --push_to_hub (the hub repo gets the last state)."""
    every = cfg.checkpointing_steps and done % cfg.checkpointing_steps == 0
    return bool(every) or (cfg.push_to_hub and done == cfg.max_train_steps)


def state_dict(run: Run, state: State, done: int) -> tuple[dict, dict]:
    """checkpoint-N's counters (the step, the lr schedule, the EMA's scalars) and tensors (every process' generator,
    the k generator, the EMA's weights)."""
    accelerator = run.accelerator
    states = accelerator.gather(state.generator.get_state().to(accelerator.device)[None]).cpu()  # [P, bytes]
    tensors = {"k_generator": state.k_generator.get_state()}
    tensors.update({f"generator/rank{r}": states[r] for r in range(accelerator.num_processes)})
    counters = {
        "step": done,
        "num_processes": accelerator.num_processes,
        "lr_scheduler": state.lr_scheduler.state_dict(),
    }
    if state.ema is not None:
        ema_state = state.ema.state_dict()
        tensors.update({f"ema/{i}": p for i, p in enumerate(ema_state.pop("shadow_params"))})
        counters["ema"] = ema_state
    return counters, tensors


def restore(run: Run, state: State, counters: dict, tensors: dict) -> int:
    """`state_dict`'s output back in place; returns the steps done."""
    state.k_generator.set_state(tensors["k_generator"])
    state.generator.set_state(tensors[f"generator/rank{run.rank}"])
    state.lr_scheduler.load_state_dict(counters["lr_scheduler"])
    if state.ema is not None:
        shadow = [tensors[f"ema/{i}"].to(run.accelerator.device) for i in range(len(run.params))]
        state.ema.load_state_dict({**counters["ema"], "shadow_params": shadow})
    done = int(counters["step"])
    run.accelerator.print(f"resumed from {run.info.resume} at step {done}")
    return done


@contextmanager
def ema_weights(run: Run, state: State):
    """The EMA's weights in an EMA run (they are the result), the current ones otherwise."""
    if state.ema is not None:
        state.ema.store(run.params)
        state.ema.copy_to(run.params)
    try:
        yield
    finally:
        if state.ema is not None:
            state.ema.restore(run.params)


# ---- logging ----


def progress(run: Run, first: int):
    from refl_ddpo.core.progress import progress_bar

    return progress_bar(
        total=run.cfg.max_train_steps,
        initial=first,
        desc="ReFL",
        unit="step",
        enabled=run.accelerator.is_local_main_process,
    )


def checksum_file(run: Run, first: int) -> Path | None:
    """output_dir/debug/lora_checksums_rank{R}.jsonl with --debug_lora_checksums (emptied by a fresh run)."""
    if not run.cfg.debug_lora_checksums:
        return None
    path = Path(run.cfg.output_dir) / CHECKSUM_DIR / f"lora_checksums_rank{run.rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if first == 0:
        path.write_text("")
    return path


def log_step(
    run: Run, bar, global_step: int, k: int, lr: float, grad_norm: float, results: list[MicroBatch], checksums
) -> None:
    """Means over micro-batches and processes to the trackers and the bar; images and weight checksums."""
    from refl_ddpo.rewards import info_means, parse_reward_spec, reward_stats
    from refl_ddpo.run.training import log_image_grid, weights_digest

    cfg, accelerator = run.cfg, run.accelerator
    gas = cfg.gradient_accumulation_steps
    sums = {key: sum(r.terms[key] / gas for r in results) for key in ("refl", "kl", "pretrain")}
    rewards_all = torch.cat([r.rewards for r in results]).cpu()  # [gas * processes * B]
    losses = accelerator.gather(
        torch.tensor([sums["refl"], sums["kl"], sums["pretrain"]], device=accelerator.device)[None]
    )
    losses = losses.mean(0).tolist()
    info = {k: torch.cat([r.info[k] for r in results]).cpu() for k in results[0].info}
    parts = {name: info[name] for name, _ in parse_reward_spec(cfg.reward) if name in info}
    stats = reward_stats(cfg.reward, rewards_all, parts) | info_means(cfg.reward, info)
    logs = {"refl/loss": losses[0], **stats, "lr": lr, "grad_norm": grad_norm}
    logs["refl/k" if cfg.backprop_range() is None else "refl/backprop_steps"] = k
    if cfg.kl_weight > 0:
        logs["refl/kl"] = losses[1]
    if cfg.pretrain_loss_weight > 0:
        logs["refl/pretrain_loss"] = losses[2]
    accelerator.log(logs, step=global_step)
    mean_key = next(iter(stats))
    bar.set_postfix(loss=f"{logs['refl/loss']:.4g}", reward=f"{stats[mean_key]:.3f}", k=k, refresh=False)
    bar.update(1)  # draws the postfix with it
    last = results[-1]
    if cfg.image_log_steps and global_step % cfg.image_log_steps == 0:
        captions = [f"{p} | r={r:.2f}" for p, r in zip(last.prompts, last.out.rewards.tolist(), strict=True)]
        log_image_grid(accelerator, "refl/pred_x0", last.out.images, captions, global_step)
    if checksums is not None:
        record = {"step": global_step, "sha256": weights_digest(run.params), "refl_loss": sums["refl"]}
        with checksums.open("a") as f:
            f.write(json.dumps(record) + "\n")
