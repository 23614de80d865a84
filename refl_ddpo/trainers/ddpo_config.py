"""DDPO's config: TRL `DDPOConfig` field names, ddpo-pytorch `config/base.py` defaults, its experiments as presets;
`EpochConfig`, the checks of every sample-then-train trainer's config (its parts: refl_ddpo.trainers.epoch_parts)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.prompts import FILE_SOURCES, check_prompt_source, load_prompts
from refl_ddpo.rewards import VLM_SERVER_REWARDS, parse_reward_spec
from refl_ddpo.run.config import SHARED_PARTS, check_shared
from refl_ddpo.run.parts import field_
from refl_ddpo.trainers.ddpo_presets import DDPO_PRESETS
from refl_ddpo.trainers.epoch_parts import (
    RecipePart,
    RewardsPart,
    SamplingPart,
    SchedulePart,
    TrainingPart,
)

DDPO_ALIASES = {
    "num_inference_steps": "sample_num_steps",
    "guidance_scale": "sample_guidance_scale",
    "gradient_accumulation_steps": "train_gradient_accumulation_steps",
    "validation_steps": "validation_epochs",
}


class EpochConfig:
    """The checks of every sample-then-train trainer's config (DDPO, GRPO, DiffusionNFT, AWM), a part of each: the
    epoch's sizes, the trained steps, the reward's server and the prompt source; a trainer's own part refines the
    sampler's and the loss's checks (`_check_sampler`, `_check_objective`)."""

    TRAINER: ClassVar[str] = "DDPO"  # the trainer's name in messages
    ALIASES: ClassVar[dict[str, str]] = DDPO_ALIASES

    def check(self) -> None:
        self.check_numbers()  # first: NaN != NaN would read as an alias disagreeing with its field
        self._check_aliases()
        check_shared(self)
        if self.checkpointing_steps != 0:
            raise UserError(
                f"--checkpointing_steps is not used by {self.TRAINER}, which checkpoints by epoch: use --save_freq "
                "N (epochs) instead."
            )
        self.check_positive(
            "sample_num_steps",
            "sample_batch_size",
            "sample_num_batches_per_epoch",
            "train_gradient_accumulation_steps",
            "train_num_inner_epochs",
            "num_epochs",
            "save_freq",
            "max_workers",
        )
        self._check_sampler()
        self._check_batches()
        self._check_steps()
        self._check_objective()
        self._check_sources()

    def _check_aliases(self) -> None:
        """An alias given beside its field must agree with it (__post_init__ filled the ones left unset)."""
        for alias, name in self.ALIASES.items():
            if getattr(self, alias) != getattr(self, name):
                raise UserError(
                    f"--{alias} {getattr(self, alias)} and --{name} {getattr(self, name)} disagree; "
                    f"--{alias} is an alias of --{name}: give only one of them."
                )

    def _check_sampler(self) -> None:
        """The trainer's own sampler settings (DDPO: a stochastic one)."""

    def _check_objective(self) -> None:
        """The trainer's own loss settings, after the sizes and the trained steps are checked."""

    def _check_batches(self) -> None:
        """An epoch's samples split into whole train batches and optimizer steps."""
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

    def _check_steps(self) -> None:
        """Which steps train; the advantages' clip."""
        if not 0 < self.train_timestep_fraction <= 1:
            raise UserError(
                f"--train_timestep_fraction must be in (0, 1] (got {self.train_timestep_fraction}); 1.0 "
                "trains on every step."
            )
        if not 0 <= self.train_skip_last_steps < self.sample_num_steps:
            raise UserError(
                f"--train_skip_last_steps must be in [0, --sample_num_steps {self.sample_num_steps}) "
                f"(got {self.train_skip_last_steps}): at least one step must stay trainable."
            )
        if num_train_timesteps(self) < 1:
            raise UserError(
                f"--train_timestep_fraction {self.train_timestep_fraction} x {self.trainable_steps_name()} "
                f"{self.trainable_steps()} trains on no step: raise one of them."
            )
        if not self.train_adv_clip_max > 0:
            raise UserError(f"--train_adv_clip_max must be > 0 (got {self.train_adv_clip_max}).")

    def _check_sources(self) -> None:
        """The reward's server (VLM judges) and the prompt source, before any model loads."""
        for name, _ in parse_reward_spec(
            self.reward
        ):  # unknown names and bad weights fail here, before loading
            if name in VLM_SERVER_REWARDS and not os.environ.get("OPENAI_BASE_URL"):
                via = f" (from --preset {self.preset})" if self.preset else ""
                raise UserError(
                    f"--reward {self.reward}{via} asks a VLM on an OpenAI-compatible server: set "
                    f"OPENAI_BASE_URL=http://HOST:PORT/v1 (vLLM, sglang, ...) or write --reward {name}:URL."
                )
            if name == "ocr" and importlib.util.find_spec("paddleocr") is None:
                raise UserError(
                    "--reward ocr reads with PaddleOCR, which is not installed: `pip install paddleocr "
                    "paddlepaddle` (an optional extra), or let a VLM read the text: --reward ocr:http://HOST:PORT/v1."
                )
        if self.prompt_fn != "from_file":
            check_prompt_source(self.prompt_fn, self.prompts_file)  # a file source reads it
        if self.prompt_fn == "from_file":
            if not self.prompts_file:
                raise UserError("--prompt_fn from_file needs --prompts_file PATH (one prompt per line).")
            load_prompts(self.prompts_file)
        elif self.prompts_file and self.prompt_fn not in FILE_SOURCES:
            raise UserError(
                f"--prompt_fn {self.prompt_fn} and --prompts_file both name the prompts: drop one "
                "(a prompts file alone means --prompt_fn from_file)."
            )

    def trainable_steps(self) -> int:
        """Steps of each trajectory that may be trained on (the fraction is of these)."""
        return self.sample_num_steps - self.train_skip_last_steps

    def trainable_steps_name(self) -> str:
        return (
            "(--sample_num_steps - --train_skip_last_steps)"
            if self.train_skip_last_steps
            else "--sample_num_steps"
        )


@dataclass(frozen=True)
class PPOPart:
    """DDPO's own fields, which GRPO (the same PPO-clip trainer) shares: the stochastic sampler's eta, the clip, CFG
    in training, the KL to the base model, the per-prompt reward statistics."""

    sample_eta: float = field_(
        1.0, "DDIM eta of the sampler; must be > 0, the step log-probabilities need noise.", group="sampling"
    )
    train_clip_range: float = field_(
        1e-4,
        "PPO clip range c: the ratio is clipped to [1 - c, 1 + c]; 'inf' turns clipping off (DDPO-SF).",
        group="training",
        allow_inf=True,
    )
    ratio_norm: bool = field_(
        False,
        "GRPO-Guard's RatioNorm (Wang et al. 2025): PPO clips exp(s * (logp - logp_old) + mean((mu - mu_old)^2) / "
        "(2 s)) = exp(mean(eps * (mu - mu_old))), s the step's std, mu and mu_old the step's Gaussian means under "
        "the trained and the sampling weights (kept with each sample: one more latent per step): a ratio centred "
        "on 1 at every step, where the plain one drifts below 1 and its spread grows as 1 / s. The log-ratio is "
        "s times smaller than the plain one: the reference pairs it with a far smaller --train_clip_range. Its "
        "per-step loss weight (1 / -dt on flow models) is not applied.",
        group="training",
    )
    train_cfg: bool = field_(
        True, "Use CFG in the training forward, as in sampling (else the conditional UNet only)."
    )
    kl_weight: float = field_(
        0.0,
        "Weight of a KL penalty to the base model (LoRA switched off): the closed-form KL of the two Gaussian "
        "steps (DDIM on SD 1.x; on SD3 Flow-GRPO's ||mean - mean_ref||^2 / (2 std_t^2)) per trained timestep, "
        "averaged per dimension like the log-probabilities. 0 = off.",
        flags=("--beta",),
    )
    per_prompt_stat_tracking: bool = field_(
        True,
        "Normalise rewards per prompt with a running buffer (else with the epoch's mean / std).",
        group="advantages",
    )
    per_prompt_stat_tracking_buffer_size: int = field_(16, "Rewards kept per prompt for its mean / std.")
    per_prompt_stat_tracking_min_count: int = field_(
        16, "Below this many buffered rewards a prompt uses the epoch's mean / std instead."
    )

    def _check_sampler(self) -> None:
        if self.sample_eta <= 0:
            raise UserError(
                f"--sample_eta must be > 0 (got {self.sample_eta}): DDPO's step log-probabilities need "
                "a stochastic sampler; ddpo-pytorch uses 1.0."
            )

    def _check_objective(self) -> None:
        """PPO's clip range, the per-prompt buffer, the KL to the base."""
        self.check_positive("per_prompt_stat_tracking_buffer_size", "per_prompt_stat_tracking_min_count")
        if not self.train_clip_range >= 0:
            raise UserError(f"--train_clip_range must be >= 0 or inf (got {self.train_clip_range}).")
        if self.per_prompt_stat_tracking_min_count > self.per_prompt_stat_tracking_buffer_size:
            raise UserError(
                f"--per_prompt_stat_tracking_min_count {self.per_prompt_stat_tracking_min_count} exceeds "
                f"--per_prompt_stat_tracking_buffer_size {self.per_prompt_stat_tracking_buffer_size}: the "
                "buffer could never hold enough rewards; make the buffer at least min_count."
            )
        if self.ratio_norm and self.train_clip_range == float("inf"):
            raise UserError(
                "--ratio_norm normalises the ratio that PPO clips, and --train_clip_range inf turns clipping off: "
                "give a finite --train_clip_range or drop --ratio_norm."
            )
        if self.kl_weight < 0:
            raise UserError(f"--kl_weight (--beta) must be >= 0 (got {self.kl_weight}).")
        if self.kl_weight > 0 and not self.use_lora:
            raise UserError(
                "--kl_weight (--beta) needs --use_lora: the base model is the UNet with the LoRA switched off."
            )


# An epoch trainer's parts, last first (see refl_ddpo.run.config.SHARED_PARTS): a trainer lists its own before them.
EPOCH_PARTS = (EpochConfig, SchedulePart, RewardsPart, TrainingPart, SamplingPart, RecipePart, *SHARED_PARTS)


@dataclass(frozen=True)
class DDPOConfig(PPOPart, *EPOCH_PARTS):
    """DDPO with LoRA. Defaults: ddpo-pytorch config/base.py (JPEG compressibility on ImageNet animals)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = DDPO_PRESETS

    output_dir: str = field_(
        "checkpoint/ddpo_lora",
        "Where the final LoRA, its config.json and checkpoint-N/ go. A folder that already holds a run is refused "
        "unless --resume_from_checkpoint continues it or --overwrite_output_dir replaces it.",
        group="data and output",
    )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def num_train_timesteps(cfg: DDPOConfig) -> int:
    """Steps trained per sample and inner epoch (ddpo-pytorch: int(num_steps * timestep_fraction)), of the steps
    not skipped by --train_skip_last_steps (GRPO: of its SDE window's steps)."""
    return int(cfg.trainable_steps() * cfg.train_timestep_fraction)


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


def parse_ddpo_config(argv: list[str] | None = None) -> DDPOConfig:
    """Flags (and --config FILE, --preset NAME, a script's defaults) -> a checked DDPOConfig."""
    from refl_ddpo.run.flags import parse_config

    return parse_config(DDPOConfig, argv)
