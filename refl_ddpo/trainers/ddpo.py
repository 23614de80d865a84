"""DDPO: Denoising Diffusion Policy Optimization (Black et al. 2023) with LoRA, on the shared core.

    bash train_scripts/train_ddpo.sh [--preset compressibility|incompressibility|aesthetic] [--flag value ...]

One epoch (the algorithm of ddpo-pytorch `scripts/train.py`, commit 1958463, written against today's libraries):

1. sampling: `sample_batch_size x sample_num_batches_per_epoch` images per process with the stochastic DDIM sampler
   (eta > 0) of the shared loop, CFG batched; keep every step's latents, next latents, log-probabilities and
   timesteps, and the prompt embeddings;
2. rewards: any reward of the registry (need not be differentiable), optionally in a thread pool while sampling
   goes on; gathered over all processes;
3. advantages: per-prompt running mean / std over a buffer (`PerPromptStatTracker`), or the batch mean / std;
   clipped to [-train_adv_clip_max, train_adv_clip_max];
4. training, `train_num_inner_epochs` times: shuffle the samples and, independently per sample, the timesteps; for
   the first `train_timestep_fraction` of them recompute the log-probability of the stored next latent under the
   current weights (CFG as in sampling when `train_cfg`), ratio = exp(logp - logp_old), PPO-clip loss; gradients
   accumulate over the trained timesteps and `train_gradient_accumulation_steps` micro-batches per optimizer step.

DDPO-SF (the plain score-function estimator) is the configuration
`--train_clip_range inf --train_num_inner_epochs 1`.
The flags carry the names of TRL's `DDPOConfig` fields; the defaults are those of ddpo-pytorch `config/base.py`.

All randomness of an epoch (prompts, noise, shuffles) comes from generators seeded by (seed, epoch, process), so a
run resumed from `checkpoint-N` repeats epochs N+1... exactly as the uninterrupted run would.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from refl_ddpo.config import CommonConfig, field_, parse_config
from refl_ddpo.errors import UserError, cli_main
from refl_ddpo.prompts import get_prompt_fn, load_prompts
from refl_ddpo.rewards import Reward, parse_reward_spec

# A TRL-compatible image hook: (prompt_image_data, global_step, tracker) where prompt_image_data is a list of
# [images (B, 3, H, W) in [0, 1], prompts, prompt_metadata, rewards (B,), reward_metadata] batches, newest last.
ImageSamplesHook = Callable[[list[list[Any]], int, Any], None]


@dataclass
class DDPOConfig(CommonConfig):
    """DDPO with LoRA. Defaults: ddpo-pytorch config/base.py (JPEG compressibility on ImageNet animals)."""

    preset: Literal["compressibility", "incompressibility", "aesthetic", "prompt_image_alignment"] | None = (
        field_(
            None,
            "One of ddpo-pytorch's config/dgx.py experiments as defaults; --config and flags override it. "
            "prompt_image_alignment needs a LLaVA + BERTScore server that this kit does not ship and is refused.",
        )
    )
    reward: str = field_(
        "jpeg_compressibility",
        "Reward name, or a weighted sum 'a:1.0,b:0.5' (jpeg_compressibility, jpeg_incompressibility, aesthetic, "
        "imagereward).",
    )
    prompt_fn: Literal["imagenet_animals", "simple_animals", "from_file"] | None = field_(
        None,
        "Prompt source: imagenet_animals (the 398 animal classes of ImageNet-1k), simple_animals (45 common "
        "animals) or from_file (--prompts_file); default from_file when --prompts_file is given, else "
        "imagenet_animals.",
    )
    # ---- sampling ----
    sample_num_steps: int = field_(50, "Denoising steps per sampled trajectory (the policy's horizon).")
    sample_eta: float = field_(
        1.0, "DDIM eta of the sampler; must be > 0, the step log-probabilities need noise."
    )
    sample_guidance_scale: float = field_(
        5.0, "Classifier-free guidance scale when sampling (1 turns CFG off)."
    )
    sample_batch_size: int = field_(1, "Images per sampling batch, per GPU.")
    sample_num_batches_per_epoch: int = field_(
        2, "Sampling batches per epoch, per GPU: an epoch has sample_batch_size x this x processes images."
    )
    # ---- training ----
    train_batch_size: int = field_(
        1, "Samples per training micro-batch, per GPU (divides --sample_batch_size)."
    )
    train_gradient_accumulation_steps: int = field_(
        1, "Micro-batches per optimizer step; each micro-batch also accumulates over its trained timesteps."
    )
    train_num_inner_epochs: int = field_(1, "Passes over each epoch's samples (PPO inner epochs).")
    train_timestep_fraction: float = field_(
        1.0, "Fraction of each trajectory's steps trained on, chosen at random per sample, in (0, 1]."
    )
    train_clip_range: float = field_(
        1e-4, "PPO clip range c: the ratio is clipped to [1 - c, 1 + c]; 'inf' turns clipping off (DDPO-SF)."
    )
    train_adv_clip_max: float = field_(5.0, "Advantages are clipped to [-this, this].")
    train_cfg: bool = field_(
        True, "Use CFG in the training forward, as in sampling (else the conditional UNet only)."
    )
    kl_weight: float = field_(
        0.0,
        "Weight of a KL penalty to the base model (LoRA switched off): the closed-form KL of the two Gaussian "
        "DDIM steps per trained timestep, averaged per dimension like the log-probabilities. 0 = off.",
    )
    # ---- advantages ----
    per_prompt_stat_tracking: bool = field_(
        True, "Normalise rewards per prompt with a running buffer (else with the epoch's mean / std)."
    )
    per_prompt_stat_tracking_buffer_size: int = field_(16, "Rewards kept per prompt for its mean / std.")
    per_prompt_stat_tracking_min_count: int = field_(
        16, "Below this many buffered rewards a prompt uses the epoch's mean / std instead."
    )
    # ---- rewards ----
    async_reward_computation: bool = field_(
        False, "Compute rewards in a thread pool while sampling continues."
    )
    max_workers: int = field_(2, "Threads of the reward pool (with --async_reward_computation).")
    # ---- run length and state ----
    num_epochs: int = field_(100, "Epochs (sample, then train) to run in total, counting resumed ones.")
    save_freq: int = field_(
        20, "Save accelerate state to output_dir/checkpoint-N every this many epochs (and at the end)."
    )
    # ---- common fields with a DDPO meaning ----
    output_dir: str = field_(
        "checkpoint/ddpo_lora", "Where the final LoRA, its config.json and checkpoint-N/ go."
    )
    learning_rate: float = field_(3e-4, "AdamW learning rate.")
    adam_weight_decay: float = field_(1e-4, "AdamW weight decay.")
    checkpoints_total_limit: int | None = field_(
        5, "Keep at most this many checkpoint-N folders (None = all)."
    )
    num_inference_steps: int | None = field_(
        None,
        "Alias of --sample_num_steps (the common flag); if both are set to different values it is an error.",
    )
    guidance_scale: float | None = field_(
        None,
        "Alias of --sample_guidance_scale (the common flag); if both are set to different values it is an "
        "error.",
    )
    gradient_accumulation_steps: int | None = field_(
        None,
        "Alias of --train_gradient_accumulation_steps (the common flag); if both are set to different values "
        "it is an error.",
    )
    checkpointing_steps: int = field_(0, "Not used by DDPO, which saves by epoch: use --save_freq.")

    def __post_init__(self) -> None:
        # The common aliases: when given they set the DDPO field unless that one was changed too (then both must
        # agree, see check()); afterwards both hold the same value, so the saved config.json reads either way.
        defaults = {f.name: f.default for f in fields(self)}  # a preset's defaults where one is applied
        for alias, name in ALIASES.items():
            value = getattr(self, alias)
            if value is not None and getattr(self, name) == defaults[name]:
                setattr(self, name, value)
        if self.prompt_fn is None:
            self.prompt_fn = "from_file" if self.prompts_file else "imagenet_animals"

    def check(self) -> None:
        for alias, name in ALIASES.items():
            value = getattr(self, alias)
            if value is not None and value != getattr(self, name):
                raise UserError(
                    f"--{alias} {value} and --{name} {getattr(self, name)} disagree; --{alias} is an "
                    f"alias of --{name}: give only one of them."
                )
            setattr(self, alias, getattr(self, name))
        super().check()
        if self.preset == "prompt_image_alignment":
            raise UserError(
                "--preset prompt_image_alignment needs ddpo-pytorch's LLaVA + BERTScore reward server, "
                "which this kit does not ship; for a prompt-alignment reward use --reward imagereward."
            )
        if self.checkpointing_steps != 0:
            raise UserError(
                "--checkpointing_steps is not used by DDPO, which checkpoints by epoch: use --save_freq "
                "N (epochs) instead."
            )
        self.check_positive(
            "sample_num_steps", "sample_batch_size", "sample_num_batches_per_epoch",
            "train_gradient_accumulation_steps", "train_num_inner_epochs", "num_epochs", "save_freq",
            "per_prompt_stat_tracking_buffer_size", "per_prompt_stat_tracking_min_count", "max_workers",
        )
        if self.sample_eta <= 0:
            raise UserError(
                f"--sample_eta must be > 0 (got {self.sample_eta}): DDPO's step log-probabilities need "
                "a stochastic sampler; ddpo-pytorch uses 1.0."
            )
        if self.sample_batch_size < self.train_batch_size or self.sample_batch_size % self.train_batch_size:
            divisor = _largest_divisor(self.sample_batch_size, self.train_batch_size)
            raise UserError(
                f"--sample_batch_size {self.sample_batch_size} must be >= and a multiple of "
                f"--train_batch_size {self.train_batch_size}: set --train_batch_size to a divisor of "
                f"{self.sample_batch_size} (e.g. {divisor})."
            )
        per_process = self.sample_batch_size * self.sample_num_batches_per_epoch
        per_step = self.train_batch_size * self.train_gradient_accumulation_steps
        if per_process % per_step:
            # Both sides scale with the number of processes, so the per-process check is the global one.
            raise UserError(
                f"samples per epoch (--sample_batch_size {self.sample_batch_size} x --sample_num_batches_per_epoch "
                f"{self.sample_num_batches_per_epoch} = {per_process} per process) must be a multiple of the train "
                f"batch per optimizer step (--train_batch_size {self.train_batch_size} x "
                f"--train_gradient_accumulation_steps {self.train_gradient_accumulation_steps} = {per_step}): change "
                "--sample_num_batches_per_epoch or --train_gradient_accumulation_steps."
            )
        if not 0 < self.train_timestep_fraction <= 1:
            raise UserError(
                f"--train_timestep_fraction must be in (0, 1] (got {self.train_timestep_fraction}); 1.0 "
                "trains on every step."
            )
        if num_train_timesteps(self) < 1:
            raise UserError(
                f"--train_timestep_fraction {self.train_timestep_fraction} x --sample_num_steps "
                f"{self.sample_num_steps} trains on no step: raise one of them."
            )
        if not self.train_clip_range >= 0:
            raise UserError(f"--train_clip_range must be >= 0 or inf (got {self.train_clip_range}).")
        if not self.train_adv_clip_max > 0:
            raise UserError(f"--train_adv_clip_max must be > 0 (got {self.train_adv_clip_max}).")
        if self.per_prompt_stat_tracking_min_count > self.per_prompt_stat_tracking_buffer_size:
            raise UserError(
                f"--per_prompt_stat_tracking_min_count {self.per_prompt_stat_tracking_min_count} exceeds "
                f"--per_prompt_stat_tracking_buffer_size {self.per_prompt_stat_tracking_buffer_size}: the "
                "buffer could never hold enough rewards; make the buffer at least min_count."
            )
        if self.kl_weight < 0:
            raise UserError(f"--kl_weight must be >= 0 (got {self.kl_weight}).")
        if self.kl_weight > 0 and not self.use_lora:
            raise UserError(
                "--kl_weight needs --use_lora: the base model is the UNet with the LoRA switched off."
            )
        parse_reward_spec(self.reward)  # unknown names and bad weights fail here, before any model is loaded
        if self.prompt_fn == "from_file":
            if not self.prompts_file:
                raise UserError("--prompt_fn from_file needs --prompts_file PATH (one prompt per line).")
            load_prompts(self.prompts_file)
        elif self.prompts_file:
            raise UserError(
                f"--prompt_fn {self.prompt_fn} and --prompts_file both name the prompts: drop one "
                "(a prompts file alone means --prompt_fn from_file)."
            )


ALIASES = {
    "num_inference_steps": "sample_num_steps",
    "guidance_scale": "sample_guidance_scale",
    "gradient_accumulation_steps": "train_gradient_accumulation_steps",
}


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


# ddpo-pytorch config/dgx.py: its experiments ran on 8 GPUs; the batch numbers below are per GPU, as there.
_COMPRESSIBILITY = {
    "num_epochs": 100,
    "save_freq": 1,
    "checkpoints_total_limit": None,
    "use_lora": True,
    "sample_batch_size": 8,
    "sample_num_batches_per_epoch": 4,  # 8 GPUs x 8 x 4 = 256 samples per epoch
    "train_batch_size": 4,
    "train_gradient_accumulation_steps": 2,  # (8 x 4) / (4 x 2) = 4 optimizer steps per epoch
    "prompt_fn": "imagenet_animals",
    "reward": "jpeg_compressibility",
    "per_prompt_stat_tracking": True,
    "per_prompt_stat_tracking_buffer_size": 16,
    "per_prompt_stat_tracking_min_count": 16,
}
PRESETS: dict[str, dict[str, Any]] = {
    "compressibility": _COMPRESSIBILITY,
    "incompressibility": {**_COMPRESSIBILITY, "reward": "jpeg_incompressibility"},
    "aesthetic": {  # harder to optimise: 2 optimizer steps per epoch, a longer buffer, 200 epochs
        **_COMPRESSIBILITY,
        "num_epochs": 200,
        "reward": "aesthetic",
        "train_gradient_accumulation_steps": 4,
        "prompt_fn": "simple_animals",
        "per_prompt_stat_tracking_buffer_size": 32,
    },
    "prompt_image_alignment": {  # refused in check(): its reward is a LLaVA server
        **_COMPRESSIBILITY,
        "num_epochs": 200,
        "sample_num_batches_per_epoch": 6,
        "train_gradient_accumulation_steps": 6,
        "per_prompt_stat_tracking_buffer_size": 32,
    },
}


def _preset_class(name: str) -> type[DDPOConfig]:
    """DDPOConfig with the preset's values as field defaults, so that --config and flags still override them."""
    own = {f.name: f for f in fields(DDPOConfig)}
    namespace: dict[str, Any] = {"__annotations__": {}, "__module__": __name__, "__doc__": DDPOConfig.__doc__}
    for key, value in PRESETS[name].items():
        namespace["__annotations__"][key] = own[key].type
        namespace[key] = field_(value, own[key].metadata["help"])
    return dataclass(type(DDPOConfig.__name__, (DDPOConfig,), namespace))


def _peek_preset(argv: list[str] | None) -> str | None:
    """--preset from the command line, or else from the --config file (parse_config reports errors in either)."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--preset", default=None)
    peek.add_argument("--config", default=None)
    known, _ = peek.parse_known_args(argv)
    if known.preset is not None or known.config is None:
        return known.preset
    try:
        import yaml  # reads JSON too

        data = yaml.safe_load(Path(known.config).read_text())
        return data.get("preset") if isinstance(data, dict) else None
    except (OSError, yaml.YAMLError):
        return None


def _check_explicit_aliases(argv: list[str] | None) -> None:
    """An alias and its field both on the command line must agree, even where the field's value is its default
    (which DDPOConfig alone cannot tell from an unset field)."""
    peek = argparse.ArgumentParser(add_help=False)
    for alias, name in ALIASES.items():
        peek.add_argument(f"--{alias}")
        peek.add_argument(f"--{name}")
    known, _ = peek.parse_known_args(argv)
    for alias, name in ALIASES.items():
        a, b = getattr(known, alias), getattr(known, name)
        try:
            clash = a is not None and b is not None and float(a) != float(b)
        except ValueError:  # not a number: parse_config names the flag
            clash = False
        if clash:
            raise UserError(f"--{alias} {a} and --{name} {b} disagree; --{alias} is an alias of --{name}: "
                            "give only one of them.")


def parse_ddpo_config(argv: list[str] | None = None) -> DDPOConfig:
    """Flags (and --config FILE, and --preset NAME) -> a checked DDPOConfig. Precedence: preset < file < flags."""
    _check_explicit_aliases(argv)
    preset = _peek_preset(argv)
    cls = (
        _preset_class(preset) if preset in PRESETS else DDPOConfig
    )  # an unknown name fails in argparse choices
    return parse_config(cls, argv, description=__doc__)


def num_train_timesteps(cfg: DDPOConfig) -> int:
    """Steps trained per sample and inner epoch (ddpo-pytorch: int(num_steps * timestep_fraction))."""
    return int(cfg.sample_num_steps * cfg.train_timestep_fraction)


def epoch_sizes(cfg: DDPOConfig, num_processes: int) -> dict[str, int]:
    """The derived sizes printed before training."""
    images = cfg.sample_batch_size * cfg.sample_num_batches_per_epoch * num_processes
    effective = cfg.train_batch_size * cfg.train_gradient_accumulation_steps * num_processes
    return {
        "images per epoch (all processes)": images,
        "effective train batch (samples per optimizer step, all processes)": effective,
        "optimizer steps per epoch": images // effective * cfg.train_num_inner_epochs,
        "trained timesteps per sample": num_train_timesteps(cfg),
    }


# --------------------------------------------------------------------------------------------------------------
# the maths: PPO loss, advantages, per-prompt statistics, the KL of two DDIM steps
# --------------------------------------------------------------------------------------------------------------


def ppo_clip_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss of one step: mean(max(-A * r, -A * clip(r, 1 - c, 1 + c))), r = exp(logp - logp_old).

    All inputs (B,). Returns the loss and detached (approx_kl = 0.5 * mean((logp - logp_old)^2), clipfrac =
    fraction of |r - 1| > c) as in ddpo-pytorch.
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    info = {
        "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "clipfrac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
    }
    return loss, info


def batch_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """(r - mean) / (std + 1e-8) over the batch (population std), as ddpo-pytorch without per-prompt tracking."""
    rewards = rewards.double()
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-8)


class PerPromptStatTracker:
    """Per-prompt reward normalisation over a running buffer (ddpo-pytorch `stat_tracking.py`).

    Each prompt keeps its last `buffer_size` rewards; a prompt with at least `min_count` of them is normalised by
    their mean and (population) std + 1e-6, the others by the mean and std of the whole batch given to `update`.
    The state is plain JSON (floats round-trip exactly), so a resumed run continues bit-exactly.
    """

    def __init__(self, buffer_size: int, min_count: int):
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.buffers: dict[str, deque[float]] = {}

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """Add the rewards (B,) of `prompts` to the buffers, return advantages (B,) float64."""
        values = rewards.detach().double().cpu()
        if len(prompts) != len(values):
            raise ValueError(f"{len(prompts)} prompts but {len(values)} rewards")
        advantages = torch.empty_like(values)
        batch_mean, batch_std = values.mean(), values.std(unbiased=False) + 1e-6
        for prompt in sorted(set(prompts)):
            idx = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
            buffer = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(values[idx].tolist())
            if len(buffer) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                held = torch.tensor(list(buffer), dtype=torch.float64)
                mean, std = held.mean(), held.std(unbiased=False) + 1e-6
            advantages[idx] = (values[idx] - mean) / std
        return advantages

    def state_dict(self) -> dict:
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "buffers": {p: list(b) for p, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size, self.min_count = int(state["buffer_size"]), int(state["min_count"])
        self.buffers = {p: deque(map(float, b), maxlen=self.buffer_size) for p, b in state["buffers"].items()}


def compute_advantages(
    rewards: torch.Tensor, prompts: list[str], tracker: PerPromptStatTracker | None, adv_clip_max: float
) -> torch.Tensor:
    """Advantages (B,) float32 of gathered rewards: per prompt (tracker) or batch-normalised, then clipped."""
    advantages = tracker.update(prompts, rewards) if tracker is not None else batch_advantages(rewards)
    return advantages.clamp(-adv_clip_max, adv_clip_max).float()


def ddim_step_kl(
    scheduler, model_output: torch.Tensor, ref_model_output: torch.Tensor, timesteps: torch.Tensor, eta: float
) -> torch.Tensor:
    """KL(policy step || reference step) per sample (B,), averaged over the non-batch dims like the log-probs.

    Both DDIM steps (refl_ddpo.ddim, no sample clipping) are Gaussians with the same std = eta * s_t around means
    that are affine in the noise prediction eps: mu = sqrt(a_prev) * (x_t - sqrt(1 - a_t) eps) / sqrt(a_t)
    + sqrt(1 - a_prev - std^2) eps, so mu - mu_ref = k_t (eps - eps_ref) with
    k_t = sqrt(1 - a_prev - std^2) - sqrt(a_prev (1 - a_t) / a_t), and the KL per dimension is
    k_t^2 (eps - eps_ref)^2 / (2 std^2).
    """
    if scheduler.config.clip_sample:
        raise ValueError(
            "ddim_step_kl assumes clip_sample=False (the means are then affine in the noise prediction)"
        )
    from refl_ddpo.ddim import step_alphas

    t = torch.as_tensor(timesteps, device="cpu", dtype=torch.long).reshape(-1)
    a_t, a_prev, s2 = step_alphas(scheduler, t, torch.float64)
    var = eta**2 * s2
    k = (1 - a_prev - var).sqrt() - (a_prev * (1 - a_t) / a_t).sqrt()
    coef = (k**2 / (2 * var)).to(model_output.device, torch.float32)  # (B,)
    sq = ((model_output.float() - ref_model_output.float()) ** 2).mean(dim=tuple(range(1, model_output.ndim)))
    return coef * sq


# --------------------------------------------------------------------------------------------------------------
# sampling and the training pass (callable without the CLI, e.g. by a benchmark)
# --------------------------------------------------------------------------------------------------------------


def seeded_generator(seed: int, *stream: int) -> torch.Generator:
    """A CPU generator for (seed, stream...) e.g. (seed, epoch, process, purpose), independent of the others."""
    state = np.random.SeedSequence([seed, *stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def step_log_prob(
    unet,
    scheduler,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    next_latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_embeds: torch.Tensor | None,
    guidance_scale: float,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability (B,) of the stored `next_latents` under the current UNet, and its noise prediction.

    latents / next_latents (B, C, h, w), timesteps (B,) (one per sample, after shuffling), prompt_embeds (B, L, D),
    negative_embeds (B, L, D) or None (no CFG). The scheduler must have `set_timesteps(sample_num_steps)`.
    """
    from refl_ddpo.ddim import ddim_step_with_logprob
    from refl_ddpo.sampling import guided_noise_pred

    eps = guided_noise_pred(
        unet,
        scheduler.scale_model_input(latents, timesteps),
        timesteps,
        prompt_embeds,
        negative_embeds,
        guidance_scale,
    )
    _, log_prob = ddim_step_with_logprob(
        scheduler, eps, timesteps, latents, eta=eta, prev_sample=next_latents
    )
    return log_prob, eps


@dataclass
class SampleBatch:
    """One sampling batch: the trajectory (what training needs) and the images and rewards (what is logged)."""

    prompts: list[str]
    prompt_metadata: list[dict]
    prompt_embeds: torch.Tensor  # (B, L, D)
    timesteps: torch.Tensor  # (B, S)
    latents: torch.Tensor  # (B, S, C, h, w): x_t before each step
    next_latents: torch.Tensor  # (B, S, C, h, w): x_{t-1} the sampler drew
    log_probs: torch.Tensor  # (B, S)
    images: torch.Tensor  # (B, 3, H, W) in [0, 1]
    rewards: Future | tuple[torch.Tensor, dict]


def _score(reward: Reward, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
    with torch.no_grad():  # grad mode is per thread: the pool's threads start with it on
        rewards, info = reward(images, prompts, metadata)
    return rewards.detach().float(), info


@torch.no_grad()
def sample_epoch(
    pipe,
    unet,
    scheduler,
    prompt_fn,
    reward: Reward,
    negative_embed: torch.Tensor,
    cfg: DDPOConfig,
    generator: torch.Generator,
    device: torch.device,
    autocast=None,
    executor: ThreadPoolExecutor | None = None,
    progress: bool = False,
) -> list[SampleBatch]:
    """Sample `cfg.sample_num_batches_per_epoch` batches of trajectories and score them (futures with `executor`).

    `unet` may be the accelerate-wrapped UNet (pipe.unet is its unwrapped self); `negative_embed` (1, L, D) is the
    empty prompt's embedding; `generator` (CPU) draws the initial noise and every step's noise.
    """
    from contextlib import nullcontext

    from tqdm.auto import tqdm

    from refl_ddpo.sampling import decode_latents, denoise, encode_prompts, initial_noise

    autocast = autocast or nullcontext
    bs = cfg.sample_batch_size
    batches = []
    for _ in tqdm(
        range(cfg.sample_num_batches_per_epoch), desc="sampling", disable=not progress, leave=False
    ):
        prompts, metadata = map(list, zip(*(prompt_fn() for _ in range(bs))))
        prompt_embeds, _ = encode_prompts(pipe, prompts, device, with_negative=False)
        negative = negative_embed.expand(bs, -1, -1)
        noise = initial_noise(
            bs, pipe.unet, cfg.resolution, pipe.vae_scale_factor, generator, device, prompt_embeds.dtype
        )
        with autocast():
            out = denoise(
                unet,
                scheduler,
                prompt_embeds,
                negative,
                noise,
                cfg.sample_num_steps,
                cfg.sample_guidance_scale,
                eta=cfg.sample_eta,
                generator=generator,
                with_logprob=True,
                keep_trajectory=True,
            )
            images = decode_latents(pipe.vae, out.latents)
        trajectory = torch.stack(out.all_latents, dim=1)  # (B, S + 1, C, h, w)
        if executor is not None:
            rewards = executor.submit(_score, reward, images, prompts, metadata)
        else:
            rewards = _score(reward, images, prompts, metadata)
        batches.append(
            SampleBatch(
                prompts=prompts,
                prompt_metadata=metadata,
                prompt_embeds=prompt_embeds,
                timesteps=out.timesteps.to(device).repeat(bs, 1),
                latents=trajectory[:, :-1],
                next_latents=trajectory[:, 1:],
                log_probs=torch.stack(out.log_probs, dim=1),
                images=images,
                rewards=rewards,
            )
        )
    return batches


def collect_rewards(batches: list[SampleBatch]) -> None:
    """Wait for reward futures, in place: each batch's `rewards` becomes (rewards (B,), info)."""
    for batch in batches:
        if isinstance(batch.rewards, Future):
            batch.rewards = batch.rewards.result()


def stack_samples(batches: list[SampleBatch], advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """The training tensors of an epoch, batches concatenated: N = batches x batch size samples per process."""
    samples = {
        key: torch.cat([getattr(b, key) for b in batches])
        for key in ("prompt_embeds", "timesteps", "latents", "next_latents", "log_probs")
    }
    samples["advantages"] = advantages.to(samples["log_probs"].device)
    return samples


def shuffle_samples(samples: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Shuffle samples, then each sample's timesteps independently (ddpo-pytorch), drawn from `generator`."""
    n, steps = samples["timesteps"].shape
    perm = torch.randperm(n, generator=generator, device=generator.device)
    out = {k: v[perm.to(v.device)] for k, v in samples.items()}
    time_perm = torch.stack(
        [torch.randperm(steps, generator=generator, device=generator.device) for _ in range(n)]
    )  # (N, S)
    rows = torch.arange(n)[:, None]
    for key in ("timesteps", "latents", "next_latents", "log_probs"):
        v = out[key]
        out[key] = v[rows.to(v.device), time_perm.to(v.device)]
    return out


def train_on_samples(
    unet,
    scheduler,
    samples: dict[str, torch.Tensor],
    negative_embed: torch.Tensor,
    cfg: DDPOConfig,
    accelerator,
    optimizer,
    params: list[torch.nn.Parameter],
    generator: torch.Generator,
    progress: bool = False,
) -> list[dict[str, float]]:
    """One inner epoch: shuffle, then PPO on the first `num_train_timesteps` steps of each sample.

    `unet` is the prepared (possibly DDP-wrapped) UNet and `optimizer` the prepared optimizer (it steps only when
    gradients sync); `accelerator` was made with gradient_accumulation_steps = train_gradient_accumulation_steps x
    num_train_timesteps, so one optimizer step covers every trained timestep of `train_gradient_accumulation_steps`
    micro-batches. Returns one dict of metrics (mean over its micro-steps and
    processes) per optimizer step.
    """
    from tqdm.auto import tqdm

    from refl_ddpo.sampling import guided_noise_pred

    scheduler.set_timesteps(cfg.sample_num_steps, device=samples["latents"].device)
    samples = shuffle_samples(samples, generator)
    n, bs, n_steps = samples["timesteps"].shape[0], cfg.train_batch_size, num_train_timesteps(cfg)
    use_cfg = cfg.train_cfg and cfg.sample_guidance_scale > 1.0
    negative = negative_embed.expand(bs, -1, -1) if use_cfg else None
    base = accelerator.unwrap_model(unet)
    results, acc = [], defaultdict(list)
    unet.train()
    for start in tqdm(range(0, n, bs), desc="training", disable=not progress, leave=False):
        batch = {k: v[start : start + bs] for k, v in samples.items()}
        for j in range(n_steps):
            with accelerator.accumulate(unet):
                with accelerator.autocast():
                    log_prob, eps = step_log_prob(
                        unet,
                        scheduler,
                        batch["latents"][:, j],
                        batch["timesteps"][:, j],
                        batch["next_latents"][:, j],
                        batch["prompt_embeds"],
                        negative,
                        cfg.sample_guidance_scale,
                        cfg.sample_eta,
                    )
                    loss, info = ppo_clip_loss(
                        log_prob, batch["log_probs"][:, j], batch["advantages"], cfg.train_clip_range
                    )
                    if cfg.kl_weight > 0:
                        with torch.no_grad():
                            base.disable_adapters()
                            try:
                                ref_eps = guided_noise_pred(
                                    unet,
                                    scheduler.scale_model_input(
                                        batch["latents"][:, j], batch["timesteps"][:, j]
                                    ),
                                    batch["timesteps"][:, j],
                                    batch["prompt_embeds"],
                                    negative,
                                    cfg.sample_guidance_scale,
                                )
                            finally:
                                base.enable_adapters()
                        kl = ddim_step_kl(
                            scheduler, eps, ref_eps, batch["timesteps"][:, j], cfg.sample_eta
                        ).mean()
                        info["kl"] = kl.detach()
                        loss = loss + cfg.kl_weight * kl
                info["loss"] = loss.detach()
                for k, v in info.items():
                    acc[k].append(v)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                means = accelerator.reduce(
                    {k: torch.stack(v).mean() for k, v in acc.items()}, reduction="mean"
                )
                results.append({k: float(v) for k, v in means.items()})
                acc = defaultdict(list)
    return results


# --------------------------------------------------------------------------------------------------------------
# the script
# --------------------------------------------------------------------------------------------------------------


def default_image_hook(accelerator) -> ImageSamplesHook:
    """Log the newest batch as a captioned grid ('prompt | reward') to tensorboard each epoch."""
    from refl_ddpo.training import log_image_grid

    def hook(prompt_image_data: list[list[Any]], global_step: int, tracker: Any) -> None:
        images, prompts, _, rewards, _ = prompt_image_data[-1]
        captions = [f"{p} | {r:.3g}" for p, r in zip(prompts, rewards.tolist())]
        log_image_grid(accelerator, "ddpo/samples", images[:16], captions[:16], global_step)

    return hook


def _tracker_config(cfg: DDPOConfig) -> dict:
    """tensorboard hparams take scalars and strings only."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in cfg.to_dict().items()}


def _lora_digest(params: list[torch.nn.Parameter]) -> str:
    """sha256 of the trained weights' bytes: equal digests = bit-identical weights."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _reward_stats(cfg: DDPOConfig, rewards: torch.Tensor, infos: list[dict], accelerator) -> dict[str, float]:
    """reward/<name>/mean|std of the gathered rewards (and of each part of a weighted sum)."""
    parts = parse_reward_spec(cfg.reward)
    if len(parts) == 1 and parts[0][1] == 1.0:
        named = {parts[0][0]: rewards}
    else:  # a weighted sum: the total and each part (its info carries the part's rewards under its name)
        named = {"total": rewards}
        for name, _ in parts:
            part = torch.cat([info[name].float() for info in infos]).to(accelerator.device)
            named[name] = accelerator.gather(part).cpu()
    out = {}
    for name, values in named.items():
        values = values.double()
        out[f"reward/{name}/mean"] = float(values.mean())
        out[f"reward/{name}/std"] = float(values.std(unbiased=False))
    return out


def train(cfg: DDPOConfig, image_samples_hook: ImageSamplesHook | None = None) -> Path:
    """Run DDPO as configured; returns the output folder (final LoRA + config.json at its top)."""
    from accelerate.utils import gather_object, set_seed
    from diffusers import DDIMScheduler
    from tqdm.auto import tqdm

    from refl_ddpo.models import check_pretrained_model, load_pipeline
    from refl_ddpo.rewards import build_reward
    from refl_ddpo.sampling import encode_prompts
    from refl_ddpo.training import (
        check_output_dir,
        load_checkpoint,
        make_accelerator,
        make_optimizer,
        make_trainable,
        print_config,
        register_unet_hooks,
        resolve_resume,
        save_checkpoint,
        save_final,
        weight_dtype,
    )

    # ---- checks before anything heavy ----
    check_pretrained_model(cfg.pretrained_model)
    check_output_dir(cfg.output_dir)
    resume = resolve_resume(cfg)
    if os.environ.get("REFL_DDPO_PREFLIGHT"):  # launch.sh: checks only, before starting several processes
        return Path(cfg.output_dir)
    accelerator = make_accelerator(cfg, cfg.train_gradient_accumulation_steps * num_train_timesteps(cfg))
    main = accelerator.is_main_process
    if main:
        print_config(
            cfg,
            {
                **epoch_sizes(cfg, accelerator.num_processes),
                "processes": accelerator.num_processes,
                "resume from": resume,
            },
        )

    # ---- models ----
    dtype = weight_dtype(accelerator)
    pipe = load_pipeline(cfg.pretrained_model, dtype, accelerator.device)
    pipe.scheduler = scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    if cfg.kl_weight > 0 and scheduler.config.clip_sample:
        raise UserError(
            f"--kl_weight needs a scheduler with clip_sample=False (Stable Diffusion's); "
            f"{cfg.pretrained_model} clips x0: use --kl_weight 0."
        )
    set_seed(cfg.seed)  # the same LoRA init on every process and in every run with this seed
    params = make_trainable(pipe.unet, cfg)
    optimizer = make_optimizer(params, cfg)
    register_unet_hooks(accelerator, pipe.unet)
    unet, optimizer = accelerator.prepare(pipe.unet, optimizer)
    reward = build_reward(cfg.reward, accelerator.device, dtype, cfg.reward_model_dir)
    negative_embed, _ = encode_prompts(pipe, [""], accelerator.device, with_negative=False)  # (1, L, D)
    tracker = (
        PerPromptStatTracker(cfg.per_prompt_stat_tracking_buffer_size, cfg.per_prompt_stat_tracking_min_count)
        if cfg.per_prompt_stat_tracking
        else None
    )
    hook = image_samples_hook or default_image_hook(accelerator)
    if cfg.report_to != "none":
        accelerator.init_trackers("ddpo", config=_tracker_config(cfg))

    # ---- resume ----
    first_epoch, global_step = 0, 0
    if resume is not None:
        counters, _ = load_checkpoint(accelerator, resume)
        first_epoch, global_step = int(counters["epoch"]), int(counters["global_step"])
        if tracker is not None and counters.get("stat_tracker"):
            tracker.load_state_dict(counters["stat_tracker"])
        if main:
            print(
                f"resumed from {resume}: {first_epoch} epoch(s) done, {global_step} optimizer step(s)",
                flush=True,
            )

    rank, progress = accelerator.process_index, accelerator.is_local_main_process
    executor = ThreadPoolExecutor(cfg.max_workers) if cfg.async_reward_computation else None
    try:
        for epoch in tqdm(
            range(first_epoch, cfg.num_epochs),
            desc="epochs",
            disable=not progress,
            initial=first_epoch,
            total=cfg.num_epochs,
        ):
            # ---- sampling (prompts, noise and shuffles seeded by (seed, epoch, process): resumable) ----
            unet.eval()
            prompt_fn = get_prompt_fn(
                cfg.prompts_file if cfg.prompt_fn == "from_file" else cfg.prompt_fn,
                seed=int(np.random.SeedSequence([cfg.seed, epoch, rank, 0]).generate_state(1)[0]),
            )
            batches = sample_epoch(
                pipe,
                unet,
                scheduler,
                prompt_fn,
                reward,
                negative_embed,
                cfg,
                seeded_generator(cfg.seed, epoch, rank, 1),
                accelerator.device,
                accelerator.autocast,
                executor,
                progress,
            )
            collect_rewards(batches)

            # ---- rewards -> advantages, over all processes ----
            local_rewards = torch.cat([b.rewards[0] for b in batches]).to(accelerator.device)  # (N,)
            all_rewards = accelerator.gather(local_rewards).cpu()  # (P * N,), process-major
            all_prompts = gather_object([p for b in batches for p in b.prompts])
            advantages = compute_advantages(all_rewards, all_prompts, tracker, cfg.train_adv_clip_max)
            advantages = advantages.reshape(accelerator.num_processes, -1)[rank]  # this process' samples
            stats = _reward_stats(cfg, all_rewards, [b.rewards[1] for b in batches], accelerator)
            accelerator.log({**stats, "ddpo/epoch": epoch}, step=global_step)
            if main:
                tqdm.write(
                    f"epoch {epoch + 1}/{cfg.num_epochs}: {len(all_rewards)} rewards from "
                    f"{accelerator.num_processes} process(es), "
                    + ", ".join(f"{k} {v:.4g}" for k, v in stats.items())
                )
                hook(
                    [[b.images, b.prompts, b.prompt_metadata, b.rewards[0], b.rewards[1]] for b in batches],
                    global_step,
                    accelerator.trackers[0] if accelerator.trackers else None,
                )

            # ---- training ----
            samples = stack_samples(batches, advantages)
            del batches
            for inner_epoch in range(cfg.train_num_inner_epochs):
                steps = train_on_samples(
                    unet,
                    scheduler,
                    samples,
                    negative_embed,
                    cfg,
                    accelerator,
                    optimizer,
                    params,
                    seeded_generator(cfg.seed, epoch, rank, 2, inner_epoch),
                    progress,
                )
                for info in steps:
                    accelerator.log(
                        {f"ddpo/{k}": v for k, v in info.items()} | {"ddpo/inner_epoch": inner_epoch},
                        step=global_step,
                    )
                    global_step += 1

            # ---- state ----
            done = epoch + 1
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

    save_final(accelerator, unet, cfg)
    # Ranks must hold the same weights (DDP averages the gradients): compare digests, a cheap exact check.
    digests = gather_object([_lora_digest(params)])
    if len(set(digests)) != 1:
        raise RuntimeError(f"processes diverged: weight digests {digests}")
    if main:
        print(f"weights identical on all {len(digests)} process(es) (sha256 {digests[0][:16]})", flush=True)
    accelerator.end_training()
    return Path(cfg.output_dir)


@cli_main
def main(argv: list[str] | None = None) -> None:
    train(parse_ddpo_config(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
