"""DiffusionNFT: Online Diffusion Reinforcement with Forward Process (Zheng et al. 2025, arXiv 2509.16117) with
LoRA, on the shared core; the forward-process epoch that AWM (refl_ddpo.trainers.awm) shares.

    bash train_scripts/train_nft.sh [--preset toy_world|toy_world_sd3|nft_sd35m] [--flag ...]

One epoch (the algorithm of NVlabs/DiffusionNFT scripts/train_nft_sd3.py, written against our core):

1. sampling: prompts in groups (--group_size, as GRPO), each sample drawn by the family's deterministic sampler (DDIM
   eta 0 on SD 1.x, the flow Euler step on SD3), CFG-free by default, with the old policy's weights; only the clean
   latents x0 and the prompt conditioning are kept;
2. rewards: any reward of the registry (no gradient needed); A = (r - the group's mean) / (std + 1e-4), the std of
   the group or with --global_std of the epoch (the reference's), clipped to +-c = --train_adv_clip_max; the
   optimality probability r = 0.5 + 0.5 A / c (refl_ddpo.algorithms.forward.optimality_probability);
3. training, --train_num_inner_epochs times: shuffle the samples; each sample is trained at a random
   --train_timestep_fraction of the sampler's timesteps t (less the last --train_skip_last_steps; or as AWM's,
   --train_timesteps), with fresh noise: x_t = the family's forward process of x0 at t; the network's output v, the old policy's v_old (no grad) and, with --kl_weight, the base model's (LoRA
   off); loss = nft_loss (the implicit positive and negative policies, beta = --nft_beta, the adaptive x0-space
   weighting) + kl_weight mean((v - v_base)^2); gradients accumulate over the trained timesteps and
   --train_gradient_accumulation_steps micro-batches per optimizer step; after each, the EMA of the trained
   weights moves toward them with decay min((1 + s) / (10 + s), --ema_decay_max) (the reference's, step s);
4. after the epoch the old policy moves toward the trained weights: old <- d old + (1 - d) theta, d from the
   optimizer step count (--old_decay_flat, --old_decay_rate, --old_decay_max, --old_decay_clock).

Validation, the final LoRA and the card hold the EMA, as the reference's (--release_weights raw: the trained ones).
No log-probabilities, no SDE, no CFG in training: the loss is the family's own denoising loss (in x0 space) on the
forward process, so any sampler may draw the samples. On SD 1.x the same objective holds in epsilon (or v)
parameterisation: x0 is affine in the network's output at fixed x_t, so the implicit policies' x0-predictions are
the same mixtures of the two networks' x0-predictions (refl_ddpo.algorithms.forward's module doc).
The old policy's weights and the EMA (copies of the trainable tensors) are saved in checkpoint-N's train_state
beside the trained weights: resume is bit-exact on CPU.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from refl_ddpo.algorithms.forward import (
    ema_decay,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    output_mse,
    soft_update_,
    stratified_timestep_indices,
)
from refl_ddpo.algorithms.policy import group_advantages, zero_std_group_fraction
from refl_ddpo.core.errors import cli_main
from refl_ddpo.core.families import cond_cat
from refl_ddpo.run.training import seeded_generator
from refl_ddpo.run.zero import unwrap
from refl_ddpo.trainers.ddpo_config import num_train_timesteps
from refl_ddpo.trainers.epochs import EpochAlgorithm, EpochPlan, ScoredEpoch
from refl_ddpo.trainers.forward_config import ForwardConfig, NFTConfig
from refl_ddpo.trainers.groups import check_group_arithmetic, group_sizes, grouped_prompts
from refl_ddpo.trainers.rollouts import collect_rewards, sample_clean
from refl_ddpo.trainers.skeleton import Run, main_for, run_training


def forward_sizes(cfg: ForwardConfig, num_processes: int) -> dict[str, int]:
    images = cfg.sample_batch_size * cfg.sample_num_batches_per_epoch * num_processes
    effective = cfg.train_batch_size * cfg.train_gradient_accumulation_steps * num_processes
    return {
        "images per epoch (all processes)": images,
        "effective train batch (samples per optimizer step, all processes)": effective,
        "optimizer steps per epoch": images // effective * cfg.train_num_inner_epochs,
        "trained timesteps per sample": num_train_timesteps(cfg),
        **group_sizes(cfg, num_processes),
    }


@dataclass
class Draw:
    """One trained timestep of a micro-batch: its index, the timesteps (B,), x0, the fresh noise and x_t."""

    index: int
    timesteps: torch.Tensor
    x0: torch.Tensor
    noise: torch.Tensor
    x_t: torch.Tensor


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


class ForwardProcess(EpochAlgorithm):
    """The forward-process epoch (module doc, steps 1-4); a subclass supplies `batch_start` and `draw_loss`."""

    sample_with_old = (
        True  # sample with the old policy's weights (DiffusionNFT), else with the current ones (AWM)
    )

    # ---- set-up ----

    def accumulation_steps(self) -> int:
        return self.cfg.train_gradient_accumulation_steps * num_train_timesteps(self.cfg)

    def check(self) -> None:
        if self.cfg.fsdp:
            from refl_ddpo.core.errors import UserError

            raise UserError(
                "--fsdp: DiffusionNFT and AWM keep a copy of the trained weights (the old policy) that is not "
                "sharded; train them without --fsdp (each process holds the network), or use GRPO / ReFL."
            )

    def check_processes(self, num_processes: int) -> None:
        check_group_arithmetic(self.cfg, num_processes)

    def setup(self, run: Run) -> None:
        self.scheduler = run.family.policy_scheduler()  # DDIM (SD 1.x), flow-matching Euler (SD3)
        run.family.pipe.scheduler = self.scheduler
        self.build_reward(run)
        cfg = self.cfg
        self.uncond = run.family.empty_cond() if cfg.sample_guidance_scale > 1.0 else None

    def setup_optimizer(self, run: Run) -> None:
        self.old = [p.detach().clone() for p in run.params]  # the old (sampling) policy: theta at the start

    def released(self) -> list[torch.Tensor] | None:
        """The EMA that validation and the final LoRA hold (--release_weights ema), or None (the trained weights)."""
        return None

    def validation_weights(self, run: Run):
        released = self.released()
        return nullcontext() if released is None else swapped(run.params, released)

    def finish(self, run: Run) -> dict[str, int]:
        released = self.released()
        if released is not None:  # the EMA is the result, as the reference saves it
            with torch.no_grad():
                for p, e in zip(run.params, released, strict=True):
                    p.copy_(e)
        return super().finish(run)

    def after_step(self, run: Run) -> None:
        """After each optimizer step, `self.global_step` counted (NFT: the EMA's update)."""

    def describe(self, run: Run) -> dict:
        return forward_sizes(self.cfg, run.accelerator.num_processes)

    # ---- state: the old policy beside the counters ----

    def state(self, run: Run, done: int) -> tuple[dict, dict]:
        counters, _ = super().state(run, done)
        return counters, {f"old/{i}": t for i, t in enumerate(self.old)}

    def load_state(self, run: Run, counters: dict, tensors: dict) -> int:
        done = super().load_state(run, counters, tensors)
        for i, t in enumerate(self.old):
            t.copy_(tensors[f"old/{i}"])
        return done

    # ---- the parts of one epoch ----

    def plan_epoch(self, run: Run, epoch: int) -> EpochPlan:
        prompt_fn, groups, noise = grouped_prompts(
            self.cfg, run.family, epoch, run.rank, run.accelerator.num_processes, run.dtype
        )
        return EpochPlan(prompt_fn, groups, noise)

    def sample(self, run: Run, epoch: int, plan: EpochPlan) -> list:
        cfg = self.cfg
        network = unwrap(run.accelerator, run.network)
        network.eval()
        weights = swapped(run.params, self.old) if self.sample_with_old else nullcontext()
        with (
            self.phase_bar(run, epoch, "sampling", cfg.sample_num_batches_per_epoch, "batch") as bar,
            weights,
        ):
            batches = sample_clean(
                run.family,
                self.scheduler,
                plan.prompt_fn,
                run.reward,
                self.uncond,
                batch_size=cfg.sample_batch_size,
                num_batches=cfg.sample_num_batches_per_epoch,
                num_steps=cfg.sample_num_steps,
                guidance_scale=cfg.sample_guidance_scale,
                resolution=cfg.resolution,
                generator=seeded_generator(cfg.seed, epoch, run.rank, 1),
                network=network,
                autocast=run.accelerator.autocast,
                executor=self.executor,
                initial_noise=plan.initial_noise,
                on_batch=lambda _, tick=bar.update: tick(1),
            )
        collect_rewards(batches)
        return batches

    def advantages(
        self, run: Run, plan: EpochPlan, rewards: torch.Tensor, prompts: list[str], finite: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        accelerator, cfg = run.accelerator, self.cfg
        groups = accelerator.gather(plan.groups.to(accelerator.device)).cpu()  # (P * N,)
        advantages = group_advantages(
            rewards[finite], groups[finite], cfg.global_std, cfg.train_adv_clip_max, cfg.std_floor
        )
        return advantages, {
            f"{self.name}/zero_std_groups": zero_std_group_fraction(rewards[finite], groups[finite])
        }

    def train(self, run: Run, epoch: int, plan: EpochPlan, scored: ScoredEpoch) -> None:
        """The forward-process passes over the epoch's samples, then the old policy's soft update."""
        from refl_ddpo.run.training import nonfinite_step_error

        cfg = self.cfg
        samples = {
            "x0": torch.cat([b.latents for b in scored.batches]),
            "advantages": scored.advantages.to(scored.batches[0].latents.device),
            **cond_cat([b.cond for b in scored.batches]),
        }
        scored.batches.clear()
        steps = forward_sizes(cfg, run.accelerator.num_processes)["optimizer steps per epoch"]
        with self.phase_bar(run, epoch, "training", steps, "step") as bar:
            for inner in range(cfg.train_num_inner_epochs):
                try:
                    self.train_pass(run, samples, seeded_generator(cfg.seed, epoch, run.rank, 2, inner), bar)
                except FloatingPointError as e:
                    bar.close()
                    raise nonfinite_step_error(
                        cfg.output_dir,
                        f"{e} in epoch {epoch + 1}",
                        "lower --learning_rate, or check the reward",
                    ) from None
        clock = self.global_step if cfg.old_decay_clock == "steps" else epoch
        decay = old_policy_decay(clock, cfg.old_decay_flat, cfg.old_decay_rate, cfg.old_decay_max)
        soft_update_(self.old, run.params, decay)
        run.accelerator.log({f"{self.name}/old_decay": decay}, step=self.global_step)

    def train_pass(self, run: Run, samples: dict[str, torch.Tensor], generator: torch.Generator, bar) -> None:
        """One inner epoch: shuffle the samples, draw each one's timesteps and noise, accumulate the loss of every
        trained timestep of every micro-batch into the optimizer steps."""
        import math

        cfg, accelerator, family = self.cfg, run.accelerator, run.family
        schedule = family.set_timesteps(self.scheduler, cfg.sample_num_steps, samples["x0"])
        n, trained = len(samples["x0"]), num_train_timesteps(cfg)
        perm = torch.randperm(n, generator=generator)
        samples = {k: v[perm.to(v.device)] for k, v in samples.items()}
        cond_keys = [k for k in samples if k not in ("x0", "advantages")]
        acc: dict[str, list] = defaultdict(list)
        run.network.train()
        for start in range(0, n, cfg.train_batch_size):
            batch = {k: v[start : start + cfg.train_batch_size] for k, v in samples.items()}
            cond = {k: batch[k] for k in cond_keys}
            draws = self.draws(family, schedule, batch["x0"], trained, generator)
            prepared = self.batch_start(run, batch, cond, draws)
            for draw in draws:
                with accelerator.accumulate(run.network):
                    with accelerator.autocast():
                        loss, info = self.draw_loss(run, batch, cond, draw, prepared)
                    for k, v in {"loss": loss.detach(), **info}.items():
                        acc[k].append(v)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grad_norm = float(
                            accelerator.clip_grad_norm_(run.params, cfg.max_grad_norm or math.inf)
                        )
                        if not math.isfinite(grad_norm):
                            raise FloatingPointError(
                                f"the gradient norm is {grad_norm} (loss {float(loss):.4g})"
                            )
                    run.optimizer.step()
                    run.optimizer.zero_grad()
                if accelerator.sync_gradients:
                    means = accelerator.reduce({k: torch.stack(v).mean() for k, v in acc.items()}, "mean")
                    info = {k: float(v) for k, v in means.items()} | {"grad_norm": grad_norm}
                    accelerator.log({f"{self.name}/{k}": v for k, v in info.items()}, step=self.global_step)
                    self.global_step += 1
                    self.after_step(run)
                    acc = defaultdict(list)
                    bar.set_postfix({k: f"{info[k]:.3g}" for k in ("loss", "kl") if k in info}, refresh=False)
                    bar.update(1)

    def draws(self, family, schedule: torch.Tensor, x0: torch.Tensor, trained: int, generator) -> list[Draw]:
        """Each sample's `trained` timesteps (never the last --train_skip_last_steps; per_sample: a random subset
        of the sampler's for each sample; stratified: one set for the micro-batch, refl_ddpo.algorithms.forward
        .stratified_timestep_indices) and fresh noise."""
        cfg = self.cfg
        b, steps = len(x0), len(schedule) - cfg.train_skip_last_steps
        if cfg.train_timesteps == "stratified":
            max_t = self.scheduler.config.num_train_timesteps
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
            out.append(Draw(j, t, x0, noise, family.add_noise(self.scheduler, x0, noise, t)))
        return out

    def predict(self, run: Run, draw: Draw, cond, network) -> torch.Tensor:
        """The network's output at the draw's x_t, conditional only (no CFG in training: no uncond). The sampling
        guidance scale is passed for a family that embeds it as an input (FLUX.1-dev), so training conditions on
        the guidance the samples were drawn with; the others ignore it without an uncond."""
        return run.family.predict(
            draw.x_t, draw.timesteps, self.scheduler, cond, None, self.cfg.sample_guidance_scale, network
        )

    def base_output(self, run: Run, draw: Draw, cond) -> torch.Tensor | None:
        """The base model's output (LoRA switched off) when --kl_weight > 0, else None."""
        if self.cfg.kl_weight <= 0:
            return None
        from refl_ddpo.core.lora import adapters_off

        with adapters_off(unwrap(run.accelerator, run.network)) as base:
            return self.predict(run, draw, cond, base)

    def old_output(self, run: Run, draw: Draw, cond) -> torch.Tensor:
        with swapped(run.params, self.old):
            return self.predict(run, draw, cond, unwrap(run.accelerator, run.network))

    def batch_start(self, run: Run, batch: dict, cond, draws: list[Draw]) -> Any:
        """Anything computed once per micro-batch before its first update (AWM: the old log-likelihoods)."""
        return None

    @abstractmethod
    def draw_loss(self, run: Run, batch: dict, cond, draw: Draw, prepared: Any) -> tuple[torch.Tensor, dict]:
        """The loss of one trained timestep of a micro-batch and its detached parts to log (NFT, AWM)."""


class NFT(ForwardProcess):
    """DiffusionNFT's loss of one trained timestep (module doc, step 3) and its EMA of the trained weights."""

    name = "nft"

    def setup_optimizer(self, run: Run) -> None:
        super().setup_optimizer(run)
        keep = self.cfg.release_weights == "ema"
        self.ema = [p.detach().clone() for p in run.params] if keep else None

    def released(self) -> list[torch.Tensor] | None:
        return self.ema

    def after_step(self, run: Run) -> None:
        if self.ema is not None:
            soft_update_(self.ema, run.params, ema_decay(self.global_step, self.cfg.ema_decay_max))

    def state(self, run: Run, done: int) -> tuple[dict, dict]:
        counters, tensors = super().state(run, done)
        return counters, {**tensors, **{f"ema/{i}": t for i, t in enumerate(self.ema or [])}}

    def load_state(self, run: Run, counters: dict, tensors: dict) -> int:
        done = super().load_state(run, counters, tensors)
        for i, t in enumerate(self.ema or []):  # a --release_weights raw run's has none: the EMA starts here
            t.copy_(tensors.get(f"ema/{i}", run.params[i].detach()))
        return done

    def draw_loss(self, run: Run, batch: dict, cond, draw: Draw, prepared: Any) -> tuple[torch.Tensor, dict]:
        cfg, family = self.cfg, run.family
        v_old = self.old_output(run, draw, cond)
        v = self.predict(run, draw, cond, run.network)
        x0_theta = family.pred_x0(self.scheduler, v, draw.timesteps, draw.x_t)
        x0_old = family.pred_x0(self.scheduler, v_old, draw.timesteps, draw.x_t)
        r = optimality_probability(batch["advantages"], cfg.train_adv_clip_max)
        loss, info = nft_loss(x0_theta, x0_old, draw.x0.float(), r, cfg.nft_beta, cfg.train_adv_clip_max)
        info["old_deviate"] = output_mse(v, v_old).detach().mean()
        v_base = self.base_output(run, draw, cond)
        if v_base is not None:
            kl = output_mse(v, v_base).mean()
            loss = loss + cfg.kl_weight * kl
            info["kl"] = kl.detach()
        return loss, info


def train(cfg: NFTConfig, image_samples_hook=None):
    """Run DiffusionNFT as configured; returns the output folder (final LoRA + config.json at its top)."""
    return run_training(NFT(cfg, image_samples_hook))


@cli_main
def main(argv: list[str] | None = None) -> None:
    main_for(NFT, NFTConfig, argv, __doc__)


if __name__ == "__main__":
    main()
