"""ReFL: Reward Feedback Learning (Xu et al. 2023, "ImageReward", Algorithm 1) on the shared core, LoRA or full
network.

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
import math
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from refl_ddpo.algorithms.reward_backprop import draft_grad_steps, refl_loss, x0_kl
from refl_ddpo.errors import UserError, cli_main
from refl_ddpo.families import Cond, ModelFamily
from refl_ddpo.sampling import DenoiseOutput, denoise
from refl_ddpo.trainers.refl_config import ReFLConfig, resolve_gradient_accumulation

# The k generator's seed is `seed + K_STREAM_OFFSET`, so that its draws never coincide with the stream of a
# process's own generator (seeded `seed + rank`), in this run or in a run with a nearby seed.
K_STREAM_OFFSET = 1 << 40
CHECKSUM_DIR = "debug"  # --debug_lora_checksums writes output_dir/debug/lora_checksums_rank{R}.jsonl


def build_refl_reward(cfg: ReFLConfig, device: torch.device, dtype: torch.dtype):
    """The reward, with --reward_antialias and --reward_gradient_checkpointing passed to ImageReward's factory."""
    from refl_ddpo.rewards import build_reward

    options = {
        "imagereward": {
            "antialias": cfg.reward_antialias,
            "gradient_checkpointing": cfg.reward_gradient_checkpointing,
        }
    }
    return build_reward(cfg.reward, device, dtype, cfg.reward_model_dir, options=options)


# --------------------------------------------------------------------------------------------------------------
# the maths of one micro-batch
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ReFLStepOutput:
    loss: torch.Tensor  # [] relu(margin - rewards).mean() * grad_scale, with graph to the trained weights
    rewards: torch.Tensor  # [B] with graph
    images: torch.Tensor  # [B, 3, H, W] in [0, 1]: the decoded predicted x0 of step k, with graph
    denoised: DenoiseOutput  # the rollout up to step k (all_latents only with keep_trajectory)


def refl_step(
    family: ModelFamily,
    scheduler,
    reward,
    cond: Cond,
    uncond: Cond | None,
    prompts: list[str],
    metadata: list[dict],
    noise: torch.Tensor,
    k: int,
    *,
    num_inference_steps: int,
    guidance_scale: float = 1.0,
    margin: float = 2.0,
    grad_scale: float = 1e-3,
    eta: float = 0.0,
    generator: torch.Generator | None = None,
    keep_trajectory: bool = False,
    network=None,
) -> ReFLStepOutput:
    """ImageReward's ReFL loss for one micro-batch: steps 0..k-1 without grad, step k with grad, decode the
    predicted x0, score it. Call under grad mode; `backward()` on `.loss` reaches the trainable network weights.

    `noise` (B, C, h, w) is x_T before `init_noise_sigma`; `generator` drives the DDPM steps' noise (and DDIM's when
    eta > 0); CFG runs at every step when guidance_scale > 1 and `uncond` is given.
    """
    denoised = denoise(
        family,
        scheduler,
        cond,
        uncond,
        noise,
        num_inference_steps,
        guidance_scale,
        eta=eta,
        generator=generator,
        grad_steps={k},
        stop_at=k,
        keep_trajectory=keep_trajectory,
        network=network,
    )
    images = family.decode(denoised.pred_original_sample)  # [B, 3, H, W] in [0, 1]
    rewards, _ = reward(images, prompts, metadata)  # [B]
    return ReFLStepOutput(refl_loss(rewards, margin, grad_scale), rewards, images, denoised)


def draft_step(
    family: ModelFamily,
    scheduler,
    reward,
    cond: Cond,
    uncond: Cond | None,
    prompts: list[str],
    metadata: list[dict],
    noise: torch.Tensor,
    k: int,
    *,
    num_inference_steps: int,
    guidance_scale: float = 1.0,
    margin: float = 2.0,
    grad_scale: float = 1e-3,
    eta: float = 0.0,
    generator: torch.Generator | None = None,
    lv_copies: int = 0,
    checkpoint_network: bool = True,
    keep_trajectory: bool = False,
    network=None,
) -> ReFLStepOutput:
    """DRaFT-K (Clark et al. 2023, Algorithm 1) and, with K drawn per step by the caller, AlignProp (Prabhudesai et
    al. 2023): the whole T-step run, steps 0..T-K-1 without grad and the last K with grad, the final latents decoded
    and scored; `loss = relu(margin - r).mean() * grad_scale` as ReFL's. `checkpoint_network` (with K > 1): each grad
    step's network call is recomputed in backward, so only its inputs are kept between the K steps.

    DRaFT-LV (`lv_copies` N, K = 1; Clark et al. Algorithm 2): N more copies of the last step, each on the final
    latents (detached) re-noised to the last step's timestep by the forward process with fresh noise from
    `generator`, denoised with grad in one batched call; the loss averages the rewards of all 1 + N images.
    `.rewards` and `.images` are those of the sampler's own final images (B,), as in ReFL.
    """
    from diffusers.utils.torch_utils import randn_tensor

    from refl_ddpo.families import cond_cat

    if lv_copies and k != 1:
        raise ValueError(f"DRaFT-LV re-noises the last step only: lv_copies={lv_copies} needs k=1, got {k}")
    denoised = denoise(
        family,
        scheduler,
        cond,
        uncond,
        noise,
        num_inference_steps,
        guidance_scale,
        eta=eta,
        generator=generator,
        grad_steps=draft_grad_steps(num_inference_steps, k),
        checkpoint_grad_steps=checkpoint_network and k > 1,
        keep_trajectory=keep_trajectory,
        network=network,
    )
    batch = len(prompts)
    finals = [denoised.latents]  # (B, C, h, w) with graph through the last k steps
    if lv_copies:
        t, t_host = denoised.timesteps[-1], scheduler.timesteps[-1]  # the last step's timestep (device, host)
        x0 = denoised.latents.detach().repeat(lv_copies, 1, 1, 1)  # (N B, C, h, w)
        eps = randn_tensor(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        x_t = family.add_noise(scheduler, x0, eps, t_host)  # N fresh draws of x_t ~ q(x_t | x0)
        cond_n = cond_cat([cond] * lv_copies)
        uncond_n = None if uncond is None else cond_cat([uncond] * lv_copies)
        model_output = family.predict(x_t, t, scheduler, cond_n, uncond_n, guidance_scale, network)
        copies, _ = family.step(scheduler, model_output, t_host, x_t, eta, generator)
        finals.append(copies)
        prompts, metadata = prompts * (1 + lv_copies), metadata * (1 + lv_copies)
    images = family.decode(torch.cat(finals))  # [(1 + N) B, 3, H, W] in [0, 1]
    rewards, _ = reward(images, prompts, metadata)  # [(1 + N) B]
    loss = refl_loss(rewards, margin, grad_scale)
    return ReFLStepOutput(loss, rewards[:batch], images[:batch], denoised)


def kl_to_base(
    family: ModelFamily,
    scheduler,
    denoised: DenoiseOutput,
    steps: int | Collection[int],
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
) -> torch.Tensor:
    """The KL regulariser over the grad steps: at each step i of `steps` (ReFL's one step k, or DRaFT's last K),
    mean((eps_lora - eps_base)^2) over batch and latent elements on SD (`algorithms.reward_backprop.x0_kl`), then the
    mean over the steps. The base is the family's network with the LoRA adapter switched off, under no grad, with
    the same x_t, t, prompts and CFG. `denoised` must come from a rollout with `keep_trajectory=True`."""
    from refl_ddpo.lora import adapters_off

    steps = [steps] if isinstance(steps, int) else list(steps)
    terms = []
    for i in steps:
        x_t, t = denoised.all_latents[i], denoised.timesteps[i]
        with adapters_off(family.network):
            out_base = family.predict(x_t, t, scheduler, cond, uncond, guidance_scale)
            # A throwaway generator: the step's noise is not used, and the run's own streams must not move.
            _, x0_base = family.step(scheduler, out_base, t, x_t, 0.0, torch.Generator().manual_seed(0))
        terms.append(x0_kl(denoised.all_pred_x0[i], x0_base, family.x0_kl_weight(scheduler, t)))
    return terms[0] if len(terms) == 1 else torch.stack(terms).mean()


def pretrain_loss(
    family: ModelFamily,
    network,
    noise_scheduler,
    images: torch.Tensor,
    captions: list[str],
    generator: torch.Generator,
) -> torch.Tensor:
    """The standard text-to-image denoising loss on real image-caption pairs (diffusers' train_text_to_image):
    latents = VAE.encode(2 x - 1) * scaling_factor, t ~ U{0..T_train-1}, x_t = add_noise(latents, eps, t),
    MSE(net(x_t, t, caption), target) with target eps (epsilon models) or v (v-prediction models)."""
    from diffusers.utils.torch_utils import randn_tensor

    vae, device = family.vae, family.pipe.device
    with torch.no_grad():
        pixels = (images * 2 - 1).to(device, vae.dtype)  # [B, 3, R, R] in [-1, 1]
        latents = vae.encode(pixels).latent_dist.sample(generator) * vae.config.scaling_factor  # [B, C, h, w]
        cond, _ = family.encode_prompts(captions, with_negative=False)
    noise = randn_tensor(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    timesteps = torch.randint(
        0, noise_scheduler.config.num_train_timesteps, (len(latents),), generator=generator
    ).to(device)  # [B]
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    if noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    pred = network(noisy, timesteps, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
    return F.mse_loss(pred.float(), target.float())


# --------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------


def preflight(cfg: ReFLConfig):
    """Everything checkable before a model is loaded: (cfg, prompts, pretrain data, resume path, world size)."""
    from refl_ddpo.families import resolve_lora_targets
    from refl_ddpo.hub import check_push
    from refl_ddpo.image_captions import PretrainData
    from refl_ddpo.models import check_pretrained_model
    from refl_ddpo.prompts import resolve_prompts
    from refl_ddpo.rewards import check_reward_files
    from refl_ddpo.runs import start_run
    from refl_ddpo.validation import check_validation_prompts

    check_pretrained_model(cfg.pretrained_model)
    resolve_lora_targets(cfg)  # before start_run, which records them
    check_reward_files(cfg.reward, cfg.reward_model_dir)
    prompts = resolve_prompts(cfg.prompts_file)
    check_validation_prompts(cfg)
    check_push(cfg)
    pretrain_data = PretrainData(cfg.pretrain_data_dir) if cfg.pretrain_loss_weight > 0 else None
    world_size = int(
        os.environ.get("WORLD_SIZE", "1")
    )  # set by accelerate launch / torchrun for every process
    cfg = resolve_gradient_accumulation(cfg, world_size)
    resume_path = start_run(cfg, "refl", "max_train_steps")  # output_dir free or continued; checkpoint fits
    return cfg, prompts, pretrain_data, resume_path, world_size


def train(cfg: ReFLConfig) -> None:
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler

    from refl_ddpo.progress import progress_bar
    from refl_ddpo.rewards import count_nonfinite, reward_stats
    from refl_ddpo.training import (
        load_checkpoint,
        load_trainable_family,
        log_image_grid,
        make_accelerator,
        make_optimizer,
        nonfinite_step_error,
        print_config,
        save_checkpoint,
        save_final,
        start_trackers,
        weights_digest,
    )

    cfg, prompts, pretrain_data, resume_path, world_size = preflight(cfg)
    accelerator = make_accelerator(cfg, cfg.gradient_accumulation_steps)
    if accelerator.num_processes != world_size:  # the batch arithmetic above assumed WORLD_SIZE processes
        raise UserError(
            f"accelerate runs {accelerator.num_processes} process(es) but WORLD_SIZE is {world_size}; "
            "start the trainer with train_scripts/train_refl_lora.sh or accelerate launch."
        )
    rank, device = accelerator.process_index, accelerator.device
    repo_id = None
    if cfg.push_to_hub and accelerator.is_main_process:
        from refl_ddpo.hub import create_hub_repo

        repo_id = create_hub_repo(cfg)  # before loading: a wrong token or id fails at once
    set_seed(cfg.seed)  # the same LoRA init on every process (DDP also broadcasts rank 0's weights)

    # ---- models ----
    family, params, dtype = load_trainable_family(accelerator, cfg)
    scheduler = family.rollout_scheduler(cfg.scheduler)
    if pretrain_data is not None and family.network_name != "unet":
        raise UserError(
            f"--pretrain_loss_weight {cfg.pretrain_loss_weight}: the pretraining loss is written for SD 1.x/2.x "
            f"(UNet, epsilon/v) models, not {family.name}; set it to 0."
        )
    # forward process of the pretraining loss
    noise_scheduler = family.scheduler("DDPMScheduler") if pretrain_data is not None else None
    if cfg.vae_gradient_checkpointing:
        family.vae.enable_gradient_checkpointing()
    reward = build_refl_reward(cfg, device, dtype)
    optimizer = make_optimizer(params, cfg)
    # Stepped once per optimizer step by us (not through accelerate, which steps it once per process).
    lr_scheduler = get_scheduler(
        cfg.lr_scheduler,
        optimizer,
        num_warmup_steps=cfg.lr_warmup_steps,
        num_training_steps=cfg.max_train_steps,
    )
    ema = None
    if cfg.use_ema:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(params, decay=cfg.ema_decay)
        ema.to(device)
    # The network goes through prepare so that DDP all-reduces its gradients: every forward with grad must call
    # `network` (the wrapper), never `family.network`, or the wrapper would not know about the backward pass.
    network, optimizer = accelerator.prepare(family.network, optimizer)

    # ---- random streams: k alike on all processes; prompts and noise per process ----
    k_generator = torch.Generator().manual_seed(cfg.seed + K_STREAM_OFFSET)
    generator = torch.Generator().manual_seed(cfg.seed + rank)
    start_step = 0
    if resume_path is not None:
        counters, tensors = load_checkpoint(accelerator, resume_path)
        start_step = int(counters["step"])
        k_generator.set_state(tensors["k_generator"])
        generator.set_state(tensors[f"generator/rank{rank}"])
        lr_scheduler.load_state_dict(counters["lr_scheduler"])
        if ema is not None:
            shadow = [tensors[f"ema/{i}"].to(device) for i in range(len(params))]
            ema.load_state_dict({**counters["ema"], "shadow_params": shadow})
        accelerator.print(f"resumed from {resume_path} at step {start_step}")
    elif cfg.resume_from_checkpoint:
        accelerator.print(f"no checkpoint-N in {cfg.output_dir} yet: starting at step 0")

    # ---- start ----
    gas, batch = cfg.gradient_accumulation_steps, cfg.train_batch_size
    do_cfg = cfg.guidance_scale > 1.0
    start_trackers(accelerator, cfg, "refl")
    if accelerator.is_main_process:
        side = cfg.resolution // family.vae_scale_factor
        print_config(
            cfg,
            {
                "model family": family.name,
                "sampler": type(scheduler).__name__,
                "reward backprop": _describe_backprop(cfg),
                "processes": accelerator.num_processes,
                "images per optimizer step": f"{batch} per process x {gas} accumulation x {accelerator.num_processes} "
                f"process(es) = {batch * gas * accelerator.num_processes}",
                "trainable parameters": sum(p.numel() for p in params),
                "training prompts": len(prompts),
                "latents": f"({family.network.config.in_channels}, {side}, {side})",
            },
        )
    checksum_file = None
    if cfg.debug_lora_checksums:
        checksum_file = Path(cfg.output_dir) / CHECKSUM_DIR / f"lora_checksums_rank{rank}.jsonl"
        checksum_file.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0:
            checksum_file.write_text("")
    from refl_ddpo.validation import make_validator

    validator = make_validator(
        accelerator,
        family,
        reward,
        cfg,
        every=cfg.validation_steps,
        unit="step",
        last=cfg.max_train_steps,
        start=start_step,
    )

    def validate(count: int) -> None:
        """Validation of the current weights (the EMA's in an EMA run: they are the result)."""
        if ema is not None:
            ema.store(params)
            ema.copy_to(params)
        validator(count, count)
        if ema is not None:
            ema.restore(params)

    def checkpoint(global_step: int) -> None:
        states = accelerator.gather(generator.get_state().to(device)[None]).cpu()  # [processes, state bytes]
        tensors = {"k_generator": k_generator.get_state()}
        tensors.update({f"generator/rank{r}": states[r] for r in range(accelerator.num_processes)})
        counters = {
            "step": global_step,
            "num_processes": accelerator.num_processes,
            "lr_scheduler": lr_scheduler.state_dict(),
        }
        if ema is not None:
            ema_state = ema.state_dict()
            tensors.update({f"ema/{i}": p for i, p in enumerate(ema_state.pop("shadow_params"))})
            counters["ema"] = ema_state
        path = save_checkpoint(accelerator, cfg, global_step, counters, tensors)
        if accelerator.is_local_main_process:
            progress.write(f"saved {path}")

    if validator is not None and start_step == 0:
        validate(0)  # the baseline: the base model (LoRA starts at zero)
    progress = progress_bar(
        total=cfg.max_train_steps,
        initial=start_step,
        desc="ReFL",
        unit="step",
        enabled=accelerator.is_local_main_process,
    )

    network.train()
    backprop = cfg.backprop_range()  # None: ReFL; (lo, hi): DRaFT-K (lo = hi) or AlignProp
    for step in range(start_step, cfg.max_train_steps):
        if backprop is None:  # ReFL: the one grad step k
            k = int(torch.randint(cfg.k_lo, cfg.k_hi + 1, (), generator=k_generator))
        elif backprop[0] == backprop[1]:  # DRaFT-K: k steps with grad, no draw
            k = backprop[0]
        else:  # AlignProp: k steps with grad, drawn alike on every process
            k = int(torch.randint(backprop[0], backprop[1] + 1, (), generator=k_generator))
        sums = {"refl": 0.0, "pretrain": 0.0, "kl": 0.0}
        rewards_seen = []
        lr = lr_scheduler.get_last_lr()[0]  # the lr this step's update uses
        grad_norm = torch.zeros(())
        for _ in range(gas):
            with accelerator.accumulate(network):
                # ---- one micro-batch: prompts, noise, the ReFL step ----
                idx = torch.randint(len(prompts), (batch,), generator=generator).tolist()
                batch_prompts = [prompts[i][0] for i in idx]
                metadata = [dict(prompts[i][1]) for i in idx]
                cond, uncond = family.encode_prompts(batch_prompts, with_negative=do_cfg)
                noise = family.initial_noise(batch, cfg.resolution, generator, cond["prompt_embeds"].dtype)
                common = {
                    "num_inference_steps": cfg.num_inference_steps,
                    "guidance_scale": cfg.guidance_scale,
                    "margin": cfg.margin,
                    "grad_scale": cfg.grad_scale,
                    "eta": cfg.eta,
                    "generator": generator,
                    "network": network,
                }
                inputs = (family, scheduler, reward, cond, uncond, batch_prompts, metadata, noise, k)
                if backprop is None:
                    out = refl_step(*inputs, keep_trajectory=cfg.kl_weight > 0, **common)
                else:
                    out = draft_step(
                        *inputs,
                        lv_copies=cfg.draft_lv,
                        checkpoint_network=cfg.backprop_checkpointing,
                        keep_trajectory=cfg.kl_weight > 0,
                        **common,
                    )
                loss = out.loss
                sums["refl"] += out.loss.item() / gas
                # ---- regularisers ----
                if cfg.kl_weight > 0:
                    kl_steps = k if backprop is None else draft_grad_steps(cfg.num_inference_steps, k)
                    kl = kl_to_base(
                        family, scheduler, out.denoised, kl_steps, cond, uncond, cfg.guidance_scale
                    )
                    loss = loss + cfg.kl_weight * kl
                    sums["kl"] += kl.item() / gas
                if pretrain_data is not None:
                    pidx = torch.randint(len(pretrain_data), (cfg.pretrain_batch_size,), generator=generator)
                    images, captions = pretrain_data.batch(pidx.tolist(), cfg.resolution)
                    pl = pretrain_loss(family, network, noise_scheduler, images, captions, generator)
                    loss = loss + cfg.pretrain_loss_weight * pl
                    sums["pretrain"] += pl.item() / gas
                # gathered now, so that every process sees a non-finite reward and stops together
                rewards_seen.append(accelerator.gather(out.rewards.detach()))
                bad = count_nonfinite(rewards_seen[-1])
                if bad:
                    progress.close()  # the error's line starts a line of its own
                    raise nonfinite_step_error(
                        cfg,
                        f"--reward {cfg.reward} gave {bad} non-finite reward(s) (NaN or inf) of "
                        f"{len(rewards_seen[-1])} samples at step {step + 1}",
                        "check the reward and its files in --reward_model_dir",
                    )
                # ---- update ----
                accelerator.backward(loss)  # divides by gas; DDP all-reduces on the last micro-batch
                if accelerator.sync_gradients:
                    # the pre-clipping norm of the all-reduced gradient (no clipping when max_grad_norm is 0)
                    grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
                    if not math.isfinite(float(grad_norm)):  # the same on every process: all stop
                        progress.close()
                        raise nonfinite_step_error(
                            cfg,
                            f"the gradient norm is {float(grad_norm)} at step {step + 1} (ReFL loss "
                            f"{sums['refl']:.4g})",
                            "lower --learning_rate or --grad_scale, or check the reward's gradient",
                        )
                optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.step(params)
        global_step = step + 1

        # ---- logging (means over all processes) ----
        rewards_all = torch.cat(rewards_seen).cpu()  # [gas * processes * B], gathered per micro-batch
        losses = accelerator.gather(
            torch.tensor([sums["refl"], sums["kl"], sums["pretrain"]], device=device)[None]
        )
        losses = losses.mean(0).tolist()
        stats = reward_stats(cfg.reward, rewards_all)
        logs = {"refl/loss": losses[0], **stats, "lr": lr, "grad_norm": float(grad_norm)}
        logs["refl/k" if backprop is None else "refl/backprop_steps"] = k
        if cfg.kl_weight > 0:
            logs["refl/kl"] = losses[1]
        if pretrain_data is not None:
            logs["refl/pretrain_loss"] = losses[2]
        accelerator.log(logs, step=global_step)
        mean_key = next(iter(stats))
        progress.set_postfix(
            loss=f"{logs['refl/loss']:.4g}", reward=f"{stats[mean_key]:.3f}", k=k, refresh=False
        )
        progress.update(1)  # draws the postfix with it
        if cfg.image_log_steps and global_step % cfg.image_log_steps == 0:
            captions = [f"{p} | r={r:.2f}" for p, r in zip(batch_prompts, out.rewards.tolist())]
            log_image_grid(accelerator, "refl/pred_x0", out.images, captions, global_step)
        if checksum_file is not None:
            record = {"step": global_step, "sha256": weights_digest(params), "refl_loss": sums["refl"]}
            with checksum_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

        # ---- validation, checkpoint ----
        if validator is not None and validator.due(global_step):
            validate(global_step)
        saved = cfg.checkpointing_steps and global_step % cfg.checkpointing_steps == 0
        if saved or (
            cfg.push_to_hub and global_step == cfg.max_train_steps
        ):  # the hub repo gets the last state
            checkpoint(global_step)
    progress.close()

    # ---- final weights: always, at the top of output_dir ----
    if ema is not None:
        ema.copy_to(params)  # the averaged weights are the result of an EMA run
    save_final(accelerator, network, cfg, family, "refl", {"optimizer steps": cfg.max_train_steps}, repo_id)
    accelerator.end_training()


def _describe_backprop(cfg: ReFLConfig) -> str:
    backprop = cfg.backprop_range()
    if backprop is None:
        return f"ReFL: one step k in {cfg.k_lo}..{cfg.k_hi} with grad, its predicted x0 scored"
    lo, hi = backprop
    name = f"DRaFT-{lo}" if lo == hi else f"AlignProp (K in {lo}..{hi})"
    if cfg.draft_lv:
        name = f"DRaFT-LV ({cfg.draft_lv} extra noised copies of the last step)"
    checkpointed = cfg.backprop_checkpointing and hi > 1
    return f"{name}: the last K steps with grad{' (network checkpointed)' if checkpointed else ''}, final image scored"


def _preflight_only(cfg: ReFLConfig) -> None:
    preflight(cfg)


@cli_main
def main(argv: list[str] | None = None) -> None:
    from refl_ddpo.config import parse_config
    from refl_ddpo.training import run_or_preflight

    run_or_preflight(train, parse_config(ReFLConfig, argv, description=__doc__), _preflight_only)


if __name__ == "__main__":
    main()
