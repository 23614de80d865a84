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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from refl_ddpo.algorithms.reward_backprop import draft_grad_steps
from refl_ddpo.core.errors import UserError, cli_main
from refl_ddpo.trainers.backprop import ReFLStepOutput, draft_step, kl_to_base, pretrain_loss, refl_step
from refl_ddpo.trainers.refl_config import ReFLConfig, resolve_gradient_accumulation
from refl_ddpo.trainers.skeleton import Algorithm, Run, main_for, run_training

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


def draw_k(cfg: ReFLConfig, k_generator: torch.Generator) -> int:
    """This optimizer step's K, the same on every process: ReFL's grad step k ~ U{k_lo..k_hi}; DRaFT-K's fixed K
    (no draw); AlignProp's K ~ U{lo..hi} steps with grad at the end of the run."""
    backprop = cfg.backprop_range()
    if backprop is None:
        return int(torch.randint(cfg.k_lo, cfg.k_hi + 1, (), generator=k_generator))
    lo, hi = backprop
    return lo if lo == hi else int(torch.randint(lo, hi + 1, (), generator=k_generator))


@dataclass
class MicroBatch:
    """One micro-batch's result: the loss to backpropagate, its parts (for the logs) and the gathered rewards."""

    loss: torch.Tensor
    parts: dict[str, float]
    rewards: torch.Tensor  # (processes * B,), gathered
    out: ReFLStepOutput
    prompts: list[str]


class ReFL(Algorithm):
    """ReFL's parts for the run skeleton (refl_ddpo.trainers.skeleton); DRaFT-K, DRaFT-LV and AlignProp are its
    `--backprop_steps` / `--draft_lv` strategies (`draw_k`, `draft_step`)."""

    name = "refl"
    unit = "step"
    iterations_field = "max_train_steps"

    # ---- set-up ----

    def check(self) -> None:
        import os

        from refl_ddpo.core.image_captions import PretrainData
        from refl_ddpo.core.prompts import PromptDraw, resolve_prompts

        cfg = self.cfg
        listed = resolve_prompts(cfg.prompts_file) if cfg.prompt_fn is None else None
        self.prompts = PromptDraw(listed, cfg.prompt_fn)  # the training prompts of each micro-batch
        self.pretrain_data = PretrainData(cfg.pretrain_data_dir) if cfg.pretrain_loss_weight > 0 else None
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun
        self.cfg = resolve_gradient_accumulation(cfg, self.world_size)

    def accumulation_steps(self) -> int:
        return self.cfg.gradient_accumulation_steps

    def check_processes(self, num_processes: int) -> None:
        if num_processes != self.world_size:  # the batch arithmetic assumed WORLD_SIZE processes
            raise UserError(
                f"accelerate runs {num_processes} process(es) but WORLD_SIZE is {self.world_size}; "
                "start the trainer with train_scripts/train_refl_lora.sh or accelerate launch."
            )

    def setup(self, run: Run) -> None:
        cfg, family = self.cfg, run.family
        self.scheduler = family.rollout_scheduler(cfg.scheduler)
        if self.pretrain_data is not None and family.network_name != "unet":
            raise UserError(
                f"--pretrain_loss_weight {cfg.pretrain_loss_weight}: the pretraining loss is written for SD "
                f"1.x/2.x and SDXL (UNet, epsilon/v) models, not {family.name}; set it to 0."
            )
        # forward process of the pretraining loss
        self.noise_scheduler = family.scheduler("DDPMScheduler") if self.pretrain_data is not None else None
        if cfg.vae_gradient_checkpointing:
            if not family.vae._supports_gradient_checkpointing:  # Qwen-Image's AutoencoderKLQwenImage
                raise UserError(
                    f"--vae_gradient_checkpointing: diffusers' {type(family.vae).__name__} ({family.name}) has no "
                    "gradient checkpointing; drop the flag."
                )
            family.vae.enable_gradient_checkpointing()
        run.reward = build_refl_reward(cfg, run.accelerator.device, run.dtype)
        # random streams: k alike on all processes; prompts and noise per process
        self.k_generator = torch.Generator().manual_seed(cfg.seed + K_STREAM_OFFSET)
        self.generator = torch.Generator().manual_seed(cfg.seed + run.rank)

    def setup_optimizer(self, run: Run) -> None:
        from diffusers.optimization import get_scheduler

        cfg = self.cfg
        # Stepped once per optimizer step by us (not through accelerate, which steps it once per process).
        self.lr_scheduler = get_scheduler(
            cfg.lr_scheduler,
            run.optimizer,
            num_warmup_steps=cfg.lr_warmup_steps,
            num_training_steps=cfg.max_train_steps,
        )
        self.ema = None
        if cfg.use_ema:
            from diffusers.training_utils import EMAModel

            self.ema = EMAModel(run.params, decay=cfg.ema_decay)
            self.ema.to(run.accelerator.device)

    def describe(self, run: Run) -> dict:
        cfg, family, processes = self.cfg, run.family, run.accelerator.num_processes
        batch, gas, side = (
            cfg.train_batch_size,
            cfg.gradient_accumulation_steps,
            cfg.resolution // family.vae_scale_factor,
        )
        return {
            "model family": family.name,
            "sampler": type(self.scheduler).__name__,
            "reward backprop": cfg.describe_backprop(),
            "images per optimizer step": f"{batch} per process x {gas} accumulation x {processes} process(es) = "
            f"{batch * gas * processes}",
            "trainable parameters": sum(p.numel() for p in run.params),
            "training prompts": self.prompts.describe(),
            "latents": f"({family.network.config.in_channels}, {side}, {side})",
        }

    # ---- state ----

    @property
    def validation_every(self) -> int:
        return self.cfg.validation_steps

    @contextmanager
    def validation_weights(self, run: Run):
        """The EMA's weights in an EMA run (they are the result), the current ones otherwise."""
        if self.ema is not None:
            self.ema.store(run.params)
            self.ema.copy_to(run.params)
        try:
            yield
        finally:
            if self.ema is not None:
                self.ema.restore(run.params)

    def checkpoint_due(self, done: int) -> bool:
        cfg = self.cfg
        every = cfg.checkpointing_steps and done % cfg.checkpointing_steps == 0
        return bool(every) or (
            cfg.push_to_hub and done == cfg.max_train_steps
        )  # the hub repo gets the last state

    def state(self, run: Run, done: int) -> tuple[dict, dict]:
        accelerator = run.accelerator
        states = accelerator.gather(
            self.generator.get_state().to(accelerator.device)[None]
        ).cpu()  # [P, bytes]
        tensors = {"k_generator": self.k_generator.get_state()}
        tensors.update({f"generator/rank{r}": states[r] for r in range(accelerator.num_processes)})
        counters = {
            "step": done,
            "num_processes": accelerator.num_processes,
            "lr_scheduler": self.lr_scheduler.state_dict(),
        }
        if self.ema is not None:
            ema_state = self.ema.state_dict()
            tensors.update({f"ema/{i}": p for i, p in enumerate(ema_state.pop("shadow_params"))})
            counters["ema"] = ema_state
        return counters, tensors

    def load_state(self, run: Run, counters: dict, tensors: dict) -> int:
        self.k_generator.set_state(tensors["k_generator"])
        self.generator.set_state(tensors[f"generator/rank{run.rank}"])
        self.lr_scheduler.load_state_dict(counters["lr_scheduler"])
        if self.ema is not None:
            shadow = [tensors[f"ema/{i}"].to(run.accelerator.device) for i in range(len(run.params))]
            self.ema.load_state_dict({**counters["ema"], "shadow_params": shadow})
        return int(counters["step"])

    def resumed(self, start: int) -> str:
        return f" at step {start}"

    # ---- the loop ----

    def begin(self, run: Run, start: int) -> None:
        from refl_ddpo.core.progress import progress_bar

        cfg = self.cfg
        self.checksum_file = None
        if cfg.debug_lora_checksums:
            self.checksum_file = Path(cfg.output_dir) / CHECKSUM_DIR / f"lora_checksums_rank{run.rank}.jsonl"
            self.checksum_file.parent.mkdir(parents=True, exist_ok=True)
            if start == 0:
                self.checksum_file.write_text("")
        self.progress = progress_bar(
            total=cfg.max_train_steps,
            initial=start,
            desc="ReFL",
            unit="step",
            enabled=run.accelerator.is_local_main_process,
        )
        run.network.train()

    def end(self, run: Run) -> None:
        self.progress.close()

    def finish(self, run: Run) -> dict[str, int]:
        if self.ema is not None:
            self.ema.copy_to(run.params)  # the averaged weights are the result of an EMA run
        return {"optimizer steps": self.cfg.max_train_steps}

    def iteration(self, run: Run, step: int) -> None:
        """One optimizer step: K drawn, `gradient_accumulation_steps` micro-batches backpropagated, the update."""
        cfg, accelerator = self.cfg, run.accelerator
        k = draw_k(cfg, self.k_generator)
        lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step's update uses
        grad_norm, results = torch.zeros(()), []
        for _ in range(cfg.gradient_accumulation_steps):
            with accelerator.accumulate(run.network):
                results.append(self.micro_batch(run, step, k))
                accelerator.backward(
                    results[-1].loss
                )  # divides by gas; DDP all-reduces on the last micro-batch
                if accelerator.sync_gradients:
                    # the pre-clipping norm of the all-reduced gradient (no clipping when max_grad_norm is 0)
                    grad_norm = accelerator.clip_grad_norm_(run.params, cfg.max_grad_norm or math.inf)
                    self.check_grad_norm(float(grad_norm), step, results)
                run.optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    self.lr_scheduler.step()
                run.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(run.params)
        self.log(run, step + 1, k, lr, float(grad_norm), results)

    def micro_batch(self, run: Run, step: int, k: int) -> MicroBatch:
        """Prompts and noise from this process' generator, the rollout with gradient at K, the loss with its
        regularisers; a non-finite reward on any process stops every process (the rewards are gathered)."""
        from refl_ddpo.rewards import count_nonfinite
        from refl_ddpo.run.training import nonfinite_step_error

        cfg, family, generator = self.cfg, run.family, self.generator
        prompts, metadata = self.prompts(cfg.train_batch_size, generator)
        cond, uncond = family.encode_prompts(prompts, with_negative=cfg.guidance_scale > 1.0)
        noise = family.initial_noise(
            cfg.train_batch_size, cfg.resolution, generator, cond["prompt_embeds"].dtype
        )
        common = {
            "num_inference_steps": cfg.num_inference_steps,
            "guidance_scale": cfg.guidance_scale,
            "margin": cfg.margin,
            "grad_scale": cfg.grad_scale,
            "eta": cfg.eta,
            "generator": generator,
            "keep_trajectory": cfg.kl_weight > 0,
            "network": run.network,
        }
        inputs = (family, self.scheduler, run.reward, cond, uncond, prompts, metadata, noise, k)
        if cfg.backprop_range() is None:
            out, kl_steps = refl_step(*inputs, **common), k
        else:
            out = draft_step(
                *inputs, lv_copies=cfg.draft_lv, checkpoint_network=cfg.backprop_checkpointing, **common
            )
            kl_steps = draft_grad_steps(cfg.num_inference_steps, k)
        loss, parts = out.loss, {"refl": out.loss.item(), "kl": 0.0, "pretrain": 0.0}
        # ---- regularisers ----
        if cfg.kl_weight > 0:
            kl = kl_to_base(family, self.scheduler, out.denoised, kl_steps, cond, uncond, cfg.guidance_scale)
            loss = loss + cfg.kl_weight * kl
            parts["kl"] = kl.item()
        if self.pretrain_data is not None:
            pidx = torch.randint(len(self.pretrain_data), (cfg.pretrain_batch_size,), generator=generator)
            images, captions = self.pretrain_data.batch(pidx.tolist(), cfg.resolution)
            pl = pretrain_loss(family, run.network, self.noise_scheduler, images, captions, generator)
            loss = loss + cfg.pretrain_loss_weight * pl
            parts["pretrain"] = pl.item()
        # gathered now, so that every process sees a non-finite reward and stops together
        rewards = run.accelerator.gather(out.rewards.detach())
        bad = count_nonfinite(rewards)
        if bad:
            self.progress.close()  # the error's line starts a line of its own
            raise nonfinite_step_error(
                cfg.output_dir,
                f"--reward {cfg.reward} gave {bad} non-finite reward(s) (NaN or inf) of {len(rewards)} samples at "
                f"step {step + 1}",
                "check the reward and its files in --reward_model_dir",
            )
        return MicroBatch(loss, parts, rewards, out, prompts)

    def check_grad_norm(self, grad_norm: float, step: int, results: list[MicroBatch]) -> None:
        """Stop before the update when the (all-reduced: the same on every process) gradient norm is not finite."""
        from refl_ddpo.run.training import nonfinite_step_error

        if not math.isfinite(grad_norm):
            self.progress.close()
            loss = sum(r.parts["refl"] for r in results) / self.cfg.gradient_accumulation_steps
            raise nonfinite_step_error(
                self.cfg.output_dir,
                f"the gradient norm is {grad_norm} at step {step + 1} (ReFL loss {loss:.4g})",
                "lower --learning_rate or --grad_scale, or check the reward's gradient",
            )

    def log(self, run: Run, global_step: int, k: int, lr: float, grad_norm: float, results: list[MicroBatch]):
        """Means over micro-batches and processes to the trackers and the bar; images and weight checksums."""
        from refl_ddpo.rewards import reward_stats
        from refl_ddpo.run.training import log_image_grid, weights_digest

        cfg, accelerator = self.cfg, run.accelerator
        gas = cfg.gradient_accumulation_steps
        sums = {key: sum(r.parts[key] / gas for r in results) for key in ("refl", "kl", "pretrain")}
        rewards_all = torch.cat([r.rewards for r in results]).cpu()  # [gas * processes * B]
        losses = accelerator.gather(
            torch.tensor([sums["refl"], sums["kl"], sums["pretrain"]], device=accelerator.device)[None]
        )
        losses = losses.mean(0).tolist()
        stats = reward_stats(cfg.reward, rewards_all)
        logs = {"refl/loss": losses[0], **stats, "lr": lr, "grad_norm": grad_norm}
        logs["refl/k" if cfg.backprop_range() is None else "refl/backprop_steps"] = k
        if cfg.kl_weight > 0:
            logs["refl/kl"] = losses[1]
        if self.pretrain_data is not None:
            logs["refl/pretrain_loss"] = losses[2]
        accelerator.log(logs, step=global_step)
        mean_key = next(iter(stats))
        self.progress.set_postfix(
            loss=f"{logs['refl/loss']:.4g}", reward=f"{stats[mean_key]:.3f}", k=k, refresh=False
        )
        self.progress.update(1)  # draws the postfix with it
        last = results[-1]
        if cfg.image_log_steps and global_step % cfg.image_log_steps == 0:
            captions = [
                f"{p} | r={r:.2f}" for p, r in zip(last.prompts, last.out.rewards.tolist(), strict=True)
            ]
            log_image_grid(accelerator, "refl/pred_x0", last.out.images, captions, global_step)
        if self.checksum_file is not None:
            record = {"step": global_step, "sha256": weights_digest(run.params), "refl_loss": sums["refl"]}
            with self.checksum_file.open("a") as f:
                f.write(json.dumps(record) + "\n")


def train(cfg: ReFLConfig) -> Path:
    """Run ReFL (or DRaFT / AlignProp) as configured; returns the output folder."""
    return run_training(ReFL(cfg))


def preflight(cfg: ReFLConfig) -> Path | None:
    """Everything checkable before a model is loaded; returns the checkpoint to resume from (or None)."""
    return ReFL(cfg).preflight().resume


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(ReFL, ReFLConfig, argv, __doc__)


if __name__ == "__main__":
    main()
