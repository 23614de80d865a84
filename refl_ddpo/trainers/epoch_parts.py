"""The parts of every sample-then-train trainer's config (DDPO, GRPO, DiffusionNFT, AWM): the recipe, the reward and
the prompts, the epoch's sampling and training sizes, the rewards' options, the run length and validation by epoch.
Defaults: ddpo-pytorch config/base.py. Their checks are `refl_ddpo.trainers.ddpo_config.EpochConfig`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refl_ddpo.run.parts import field_, guidance_field


def default_prompt_fn(cfg) -> str:
    """--prompt_fn left unset: from_file when --prompts_file is given, else imagenet_animals."""
    return "from_file" if cfg.prompts_file else "imagenet_animals"


@dataclass(frozen=True)
class RecipePart:
    """The recipe (--preset), the reward and the prompt source."""

    preset: str | None = field_(
        None,
        "A recipe as defaults (ddpo-pytorch's config/dgx.py experiments, or toy_world / toy_world_sd3); --config and "
        "flags override it. prompt_image_alignment asks a VLM on an OpenAI-compatible server (OPENAI_BASE_URL) to "
        "describe each image and rewards the BERTScore recall of the prompt (reward vlm_bertscore).",
        group="recipe",
    )
    reward: str = field_(
        "jpeg_compressibility",
        "Reward name, or a weighted sum 'a:1.0,b:0.5' (jpeg_compressibility, jpeg_incompressibility, aesthetic, "
        "imagereward, pickscore, hpsv2, clip_score, vlm_judge, vlm_bertscore, unifiedreward, vlm_yesno, geneval2, "
        "ocr[:URL], geneval:URL for GenEval's server, remote:URL for a reward server); "
        "your own reward_fn(images, prompts, metadata) -> (rewards, info) as pkg.module:function.",
        group="reward and prompts",
    )
    prompt_fn: str | None = field_(
        None,
        "Prompt source: imagenet_animals (the 398 animal classes of ImageNet-1k), simple_animals (45 common "
        "animals), toy_world_train (the toy world's 12 training prompts), toy_world_green / toy_world_cyan (its 2 "
        "training prompts of one colour word), toy_world_cyan_anchored (cyan's 2 and 2 magenta prompts the toy-sd3 "
        "base draws right), from_file (--prompts_file), geneval_file / ocr_file (with --prompts_file: flow_grpo's "
        "GenEval metadata JSONL, each line the prompt's metadata / its OCR prompts, the quoted text as metadata "
        "ocr_text), or your own prompt_fn() -> (prompt, "
        "metadata) as pkg.module:function (given an `rng` keyword if it takes one: a random.Random seeded per "
        "epoch, the same on every process); default from_file when --prompts_file is given, else imagenet_animals.",
        fill=default_prompt_fn,
    )


@dataclass(frozen=True)
class SamplingPart:
    """The epoch's sampling: the sampler's steps and guidance, the batches (the common flags are aliases)."""

    sample_num_steps: int = field_(
        50, "Denoising steps per sampled trajectory (the policy's horizon).", group="sampling"
    )
    sample_guidance_scale: float | None = guidance_field(
        5.0, "Classifier-free guidance scale when sampling (1 turns CFG off)."
    )
    sample_batch_size: int = field_(1, "Images per sampling batch, per GPU.")
    sample_num_batches_per_epoch: int = field_(
        2, "Sampling batches per epoch, per GPU: an epoch has sample_batch_size x this x processes images."
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


@dataclass(frozen=True)
class TrainingPart:
    """The epoch's training: micro-batches, optimizer steps, inner epochs, the trained steps, the advantages' clip."""

    train_batch_size: int = field_(
        1, "Samples per training micro-batch, per GPU (divides --sample_batch_size)."
    )
    train_gradient_accumulation_steps: int = field_(
        1,
        "Micro-batches per optimizer step; each micro-batch also accumulates over its trained timesteps.",
        group="training",
    )
    train_num_inner_epochs: int = field_(1, "Passes over each epoch's samples (PPO inner epochs).")
    train_timestep_fraction: float = field_(
        1.0,
        "Fraction of each trajectory's steps trained on, chosen at random per sample, in (0, 1].",
        flags=("--timestep_fraction",),
    )
    train_skip_last_steps: int = field_(
        0,
        "Never train on the last N sampler steps (--train_timestep_fraction is then a fraction of the other "
        "steps). Their tiny noise scale makes their log-probability gradients the largest while they change only "
        "fine detail; skipping them focuses the update on the steps that decide the image's content.",
    )
    train_adv_clip_max: float = field_(5.0, "Advantages are clipped to [-this, this].")
    learning_rate: float = field_(3e-4, "AdamW learning rate.")
    adam_weight_decay: float = field_(1e-4, "AdamW weight decay.")
    gradient_accumulation_steps: int | None = field_(
        None,
        "Alias of --train_gradient_accumulation_steps (the common flag); if both are set to different values "
        "it is an error.",
    )


@dataclass(frozen=True)
class RewardsPart:
    """What a non-finite reward does, the VLM judges' model and question, the reward pool."""

    nonfinite_rewards: Literal["error", "drop"] = field_(
        "error",
        "A NaN or inf reward stops the run (error, before that epoch's update); drop trains on the epoch's other "
        "samples instead (a dropped sample gets advantage 0 and stays out of the reward statistics; the count is "
        "logged as ddpo/nonfinite_rewards_dropped). All of an epoch's rewards non-finite always stops.",
        group="rewards",
    )
    vlm_model: str | None = field_(
        None,
        "Model that the VLM rewards (vlm_judge, vlm_bertscore, unifiedreward, vlm_yesno, geneval2, ocr:URL) ask on "
        "their OpenAI-compatible server; default: the first of its /v1/models.",
    )
    vlm_question: str | None = field_(
        None,
        "Question vlm_judge / vlm_bertscore / unifiedreward / vlm_yesno ask about each image ({prompt} is replaced by "
        "the prompt); default: each reward's own (docs/rewards.md), e.g. vlm_judge's 'Does this image show {prompt}? "
        "Answer yes or no.'",
    )
    async_reward_computation: bool = field_(
        False, "Compute rewards in a thread pool while sampling continues."
    )
    max_workers: int = field_(2, "Threads of the reward pool (with --async_reward_computation).")


@dataclass(frozen=True)
class SchedulePart:
    """The run length, checkpoints and validation, by epoch."""

    num_epochs: int = field_(
        100,
        "Epochs (sample, then train) to run in total, counting resumed ones.",
        group="run length and state",
    )
    save_freq: int = field_(
        20, "Save accelerate state to output_dir/checkpoint-N every this many epochs (and at the end)."
    )
    checkpoints_total_limit: int | None = field_(
        5, "Keep at most this many checkpoint-N folders (None = all)."
    )
    checkpointing_steps: int = field_(0, "Not used: this trainer saves by epoch, use --save_freq.")
    validation_epochs: int = field_(
        10,
        "With --validation_prompts_file: validate every N epochs, besides before the first epoch and after the "
        "last (0 = only then).",
        group="validation (by epoch)",
        ge=0,
    )
    validation_steps: int | None = field_(
        None,
        "Alias of --validation_epochs: this trainer validates by epoch (an epoch = sampling, then training).",
    )
