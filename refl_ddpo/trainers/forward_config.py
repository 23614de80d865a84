"""The forward-process trainers' configs: DiffusionNFT (`NFTConfig`) and AWM (`AWMConfig`) on the shared epoch and
groups, with the papers' SD3.5-M recipes and the toy world as presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from refl_ddpo.core.errors import UserError
from refl_ddpo.run.parts import field_, guidance_field
from refl_ddpo.trainers.ddpo_config import EPOCH_PARTS
from refl_ddpo.trainers.ddpo_presets import TOY_VALIDATION, TOY_WORLD_DIR
from refl_ddpo.trainers.flux2_presets import FLOW_FACTORY_NFT, FLUX2_NFT_PRESETS
from refl_ddpo.trainers.groups import GroupConfig

SD3_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


@dataclass(frozen=True)
class ForwardConfig:
    """What DiffusionNFT and AWM share, a part of their configs: clean samples from a deterministic sampler, the
    denoising loss on forward-noised samples at the sampler's timesteps, an old policy updated softly each epoch."""

    sample_num_steps: int = field_(
        10,
        "Steps of the deterministic sampler (DDIM eta 0 on SD 1.x, the flow Euler step on SD3) that draws the "
        "clean samples; training noises them again at these steps' timesteps.",
        group="sampling",
    )
    sample_guidance_scale: float | None = guidance_field(
        1.0,
        "CFG scale when sampling (1 = CFG-free, as both papers; training never uses CFG; FLUX.1-dev's embedded "
        "guidance conditions sampling and training alike).",
    )
    sample_batch_size: int = field_(8, "Images per sampling batch, per GPU.")
    sample_num_batches_per_epoch: int = field_(
        2,
        "Sampling batches per epoch, per GPU: an epoch has sample_batch_size x this x processes images, "
        "in groups of --group_size.",
    )
    train_timestep_fraction: float = field_(
        0.99,
        "Fraction of the sampler's timesteps each sample is trained at (a random subset per sample and inner "
        "epoch; DiffusionNFT: int(10 x 0.99) = 9 of 10), in (0, 1].",
        group="training",
        flags=("--timestep_fraction",),
    )
    train_timesteps: Literal["per_sample", "stratified"] = field_(
        "per_sample",
        "Which sampler timesteps a micro-batch trains at: per_sample (each sample its own random "
        "--train_timestep_fraction of them; DiffusionNFT) or stratified (one set for the whole micro-batch: the "
        "steps with t >= (1 - --train_timestep_range) x 1000 less the first, cut into as many equal spans as "
        "timesteps are trained, one drawn in each; Flow-Factory's AWM, `discrete_wo_init`). Neither trains the "
        "last --train_skip_last_steps.",
    )
    train_timestep_range: float = field_(
        0.9,
        "With --train_timesteps stratified: the share of the noise scale trained, from pure noise down "
        "(Flow-Factory's timestep_range; 0.9 leaves out the steps with t < 100 of 1000).",
        gt=0,
        le=1,
    )
    kl_weight: float = field_(
        1e-4,
        "Weight of the penalty mean((output - output_base)^2) to the base model (LoRA switched off), in the "
        "network's output space, per trained timestep (both papers' KL; 1e-4 as they use). 0 = off.",
        ge=0,
    )
    old_decay_flat: int = field_(
        0,
        "The old policy's soft update old <- d old + (1 - d) new after each epoch has d = 0 for this many "
        "ticks of --old_decay_clock, then d = min((tick - flat) x --old_decay_rate, --old_decay_max).",
        group="old policy",
        ge=0,
    )
    old_decay_rate: float = field_(
        0.001, "Growth of d per tick of --old_decay_clock (an optimizer step) after the flat part.", ge=0
    )
    old_decay_max: float = field_(
        0.5, "The largest d (0 = the old policy is the current one after each epoch).", ge=0, le=1
    )
    old_decay_clock: Literal["steps", "epochs"] = field_(
        "steps",
        "What d's clock counts: steps (the optimizer steps done when the epoch ends; DiffusionNFT's global_step) "
        "or epochs (the 0-based index of the epoch just trained, so d = 0 after the first; Flow-Factory's "
        "ema_step(step=epoch)).",
    )
    release_weights: Literal["ema", "raw"] = field_(
        "ema",
        "The weights that validation scores and the final LoRA and model card hold: ema (as the references "
        "evaluate and save: DiffusionNFT an EMA of the trained weights, --ema_decay_max; AWM its old policy, "
        "itself an EMA of them) or raw (the trained weights as the last step left them). checkpoint-N's LoRA "
        "holds the trained weights (a resume continues from them) and its train_state the EMA.",
    )

    TRAINER: ClassVar[str] = "NFT"

    def _check_objective(self) -> None:
        if self.train_timesteps == "stratified" and self.trainable_steps() < 2:
            raise UserError(
                f"--train_timesteps stratified never trains the first step: {self.trainable_steps_name()} "
                f"{self.trainable_steps()} leaves none; use --train_timesteps per_sample or train more steps."
            )
        if self.same_noise_per_group:
            raise UserError(
                f"--same_noise_per_group with {self.TRAINER}'s deterministic sampler draws the same image "
                f"{self.group_size} times per group (all advantages 0): drop it."
            )
        if self.kl_weight > 0 and not self.use_lora:
            raise UserError(
                f"--kl_weight needs --use_lora: the base model is the network with the LoRA switched off; use "
                f"--kl_weight 0 to fine-tune all of {self.TRAINER}'s network."
            )


_SD35M = {  # both papers' SD3.5-M setting; their rewards (GenEval, OCR) are not shipped: PickScore is
    "pretrained_model": "stabilityai/stable-diffusion-3.5-medium",
    "reward": "pickscore",
    "resolution": 512,
    "sample_guidance_scale": 1.0,
    "lora_rank": 32,
    "lora_alpha": 64,
    "lora_target_modules": SD3_ATTENTION,
    "learning_rate": 3e-4,
    "adam_weight_decay": 1e-4,
    "max_grad_norm": 1.0,
    "global_std": True,
    "mixed_precision": "bf16",
    "num_epochs": 1000,
    "save_freq": 30,
    "validation_num_steps": 40,
    "validation_guidance_scale": 1.0,
}

# The toy world (refl_ddpo.toy_world.world): one colour word, as GRPO's and DDPO's toy presets (toy-sd: green, "a green
# triangle" held out; toy-sd3: cyan, "a cyan circle"), LoRA on the text attention's keys and values. Measured with
# NFT on toy-sd3 (1 thread; held-out accuracy from 0.234; docs/trainers/nft_awm.md): this recipe 0.922 / 0.875 / 0.922 in 8
# epochs (seeds 0 / 1 / 42, 71-73 CPU s), the shapes kept. With the colour reward alone (no toy_clean) 0.719 / 0.844
# (seeds 0 / 42) and seed 0 grew the shapes (grey 0.624 -> 0.473): toy_clean's continuous reward leaves no group
# with all-equal rewards and docks the frame-filling samples. Seed 42, colour reward alone: with 2 inner epochs,
# every timestep trained, advantages clipped to 5 and KL 1e-4 0.422 (243 CPU s); lr 3e-3 0.656; never training the
# last 1 / 2 / 3 steps 0.797 / 0.859 / 0.844 (3 is the cheapest); sampled at CFG 1 0.375, at CFG 3 / 4.5 worse than
# at 7.5 after 4 epochs (0.375 / 0.359 / 0.578): the toy models draw colours poorly without CFG; a KL of weight 1 to
# the base (seed 0) 0.344. Advantages clipped to 1 make r 0 or 1 for most samples.
_TOY = {
    "pretrained_model": str(TOY_WORLD_DIR / "toy-sd"),
    "reward_model_dir": str(TOY_WORLD_DIR),
    "reward": "toy_color_match:1,toy_clean:1",
    "prompt_fn": "toy_world_green",
    "resolution": 32,
    "sample_num_steps": 10,
    "sample_guidance_scale": 7.5,
    "sample_batch_size": 16,
    "sample_num_batches_per_epoch": 2,
    "group_size": 16,
    "train_batch_size": 8,
    "train_gradient_accumulation_steps": 1,
    "train_skip_last_steps": 3,
    "train_adv_clip_max": 1.0,
    "kl_weight": 0.0,
    "lora_target_modules": ["attn2.to_k", "attn2.to_v"],
    "learning_rate": 2e-3,
    "num_epochs": 8,
    "save_freq": 8,
    "checkpoints_total_limit": 1,
    # The trained weights, not the references' EMA: over the toy's 32 optimizer steps NFT's EMA (it averages ~10)
    # lags about an epoch, and its proof (case nft_sd3, seeds 0-4, avx2) gained +0.637 +- 0.030 released as the EMA
    # against +0.685 +- 0.026 as trained (4.6 and 7.2 std above its bound). AWM's EMA (its old policy, d <= 0.0021
    # here) is the trained weights to 3 decimals of every judged number.
    "release_weights": "raw",
    **TOY_VALIDATION,
}
_TOY_SD3 = {
    **_TOY,
    "pretrained_model": str(TOY_WORLD_DIR / "toy-sd3"),
    "prompt_fn": "toy_world_cyan",
    "lora_target_modules": ["add_k_proj", "add_v_proj"],
}

NFT_PRESETS: dict[str, dict[str, Any]] = {
    # NVlabs/DiffusionNFT config/nft.py sd3_pickscore: 10 deterministic steps (their 2nd-order solver; ours is the
    # family's Euler / DDIM step), CFG-free, groups of 24 from 48 prompts over 8 GPUs, beta 1, decay type 1.
    "nft_sd35m": {
        **_SD35M,
        "sample_num_steps": 10,
        "sample_batch_size": 9,
        "sample_num_batches_per_epoch": 16,
        "group_size": 24,
        "train_batch_size": 9,
        "train_gradient_accumulation_steps": 16,
        "train_timestep_fraction": 0.99,
        "kl_weight": 1e-4,
        "nft_beta": 1.0,
    },
    # X-GenGroup/Flow-Factory examples/nft/lora/z_image/default.yaml (per GPU): 10 ODE steps at 512 px sampled with
    # CFG 4 in the pipeline's terms (the kit's 5), groups of 16, one optimizer step per epoch, 2 timesteps per sample
    # stratified over the upper half of the noise scale (their discrete sampling, timestep_range 0.5), beta 0.1, no
    # KL, the old policy's decay piecewise linear (flat 0, rate 0.001, at most 0.5), lr 3e-4, LoRA r 64 / alpha 128 on
    # the family's default targets (theirs), bf16; evaluation 40 steps at CFG 4. Their time_shift 3.0 is not the kit's.
    "nft_z_image": {
        **FLOW_FACTORY_NFT,
        "pretrained_model": "Tongyi-MAI/Z-Image",
        "reward": "pickscore",
        "resolution": 512,
        "sample_num_steps": 10,
        "sample_guidance_scale": 5.0,
        "train_timestep_fraction": 0.2,  # 2 of 10
        "train_timesteps": "stratified",
        "train_timestep_range": 0.5,
        "learning_rate": 3e-4,
        "save_freq": 40,
        "validation_num_steps": 40,
        "validation_guidance_scale": 5.0,
    },
    "toy_world": _TOY,
    "toy_world_sd3": _TOY_SD3,
}
NFT_PRESETS.update(FLUX2_NFT_PRESETS)  # Flow-Factory's FLUX.2 [klein] base recipe
AWM_PRESETS: dict[str, dict[str, Any]] = {
    # X-GenGroup/Flow-Factory examples/awm/lora/sd3_5/default.yaml: 14 ODE steps, CFG-free, groups of 16 from 48
    # prompts, ghuber weighting, clip 1, advantages clipped to 1, KL 1e-4 to the base and 1 to the EMA, 6 timesteps
    # stratified over indices 1..11 (t >= 100: sigma 0.97 .. 0.36) and shared by the batch, the EMA's decay on an
    # epoch clock (one optimizer step per epoch here: either clock gives the same d, one epoch later by steps).
    "awm_sd35m": {
        **_SD35M,
        "sample_num_steps": 14,
        "sample_batch_size": 8,
        "sample_num_batches_per_epoch": 12,
        "group_size": 16,
        "train_batch_size": 8,
        "train_gradient_accumulation_steps": 12,
        "train_timestep_fraction": 0.43,  # 6 of 14
        "train_timesteps": "stratified",
        "train_timestep_range": 0.9,
        "old_decay_clock": "epochs",
        "train_adv_clip_max": 1.0,
        "train_clip_range": 1.0,
        "kl_weight": 1e-4,
        "old_kl_weight": 1.0,
    },
    # NFT's toy recipe (above); AWM on toy-sd3 with it: 0.234 -> 0.641 held out in 8 epochs (82 CPU s, seed 42).
    # Per-sample timesteps: the toy's 10 steps less the 3 skipped leave indices 1..6 to stratify, and 6 cuts of
    # them at linspace's floors always give the same set (1, 1, 2, 3, 4, 5).
    "toy_world": {**_TOY, "train_timesteps": "per_sample"},
    "toy_world_sd3": {**_TOY_SD3, "train_timesteps": "per_sample"},
}


@dataclass(frozen=True)
class NFTConfig(ForwardConfig, GroupConfig, *EPOCH_PARTS):
    """DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) with LoRA: sample clean images with the old policy, turn
    group advantages into optimality probabilities, train the implicit positive and negative policies on the forward
    process. Defaults: the reference's SD3.5-M settings (NVlabs/DiffusionNFT config/nft.py) at one GPU's batch."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = NFT_PRESETS

    nft_beta: float = field_(
        1.0,
        "beta of the implicit policies v+ = beta v + (1 - beta) v_old and v- = (1 + beta) v_old - beta v: how far "
        "a step moves from the old policy (1.0 for GenEval / PickScore in the reference, 0.1 for OCR).",
        group="DiffusionNFT",
        gt=0,
    )
    ema_decay_max: float = field_(
        0.9,
        "The EMA of the trained weights (--release_weights ema) has decay min((1 + s) / (10 + s), this) after "
        "optimizer step s, as the reference's (0.9: it averages over the last ~10 steps).",
        ge=0,
        lt=1,
    )
    output_dir: str = field_(
        "checkpoint/nft_lora",
        "Where the final LoRA, its config.json and checkpoint-N/ go. A folder that already holds a run is refused "
        "unless --resume_from_checkpoint continues it or --overwrite_output_dir replaces it.",
        group="data and output",
    )


@dataclass(frozen=True)
class AWMConfig(ForwardConfig, GroupConfig, *EPOCH_PARTS):
    """Advantage Weighted Matching (Xue et al. 2025) with LoRA, as Flow-Factory's trainers/awm.py: the negative
    (weighted) matching loss stands in for the log-likelihood in a PPO-clip objective, with KL terms to the base
    model and to an EMA of the weights (the old policy). Samples come from the current weights."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = AWM_PRESETS

    awm_weighting: Literal["uniform", "t", "ghuber"] = field_(
        "ghuber",
        "Weighting of the matching loss m by the noise level t: uniform (-m), t (-t m), ghuber (-(m^p - eps^p) t / "
        "p, Flow-Factory's default).",
        group="AWM",
    )
    ghuber_power: float = field_(0.25, "p of the ghuber weighting.", gt=0)
    train_clip_range: float = field_(
        1.0, "PPO clip range c of the ratio exp(ll - ll_old): clipped to [1 - c, 1 + c].", gt=0
    )
    old_kl_weight: float = field_(
        1.0,
        "Weight of mean((output - output_old)^2) to the EMA of the weights (the old policy), which steadies "
        "training (Flow-Factory's ema_kl_beta). 0 = off.",
        ge=0,
    )
    old_decay_rate: float = field_(
        0.0003, "Growth of d per tick of --old_decay_clock (an epoch) after the flat part.", ge=0
    )
    old_decay_max: float = field_(
        0.3, "The largest d (Flow-Factory's EMA decay 0.3 reached over 1000 epochs).", ge=0, le=1
    )
    old_decay_clock: Literal["steps", "epochs"] = field_(
        "epochs",
        "What d's clock counts: epochs (the 0-based index of the epoch just trained, so d = 0 after the first; "
        "Flow-Factory's ema_step(step=epoch)) or steps (the optimizer steps done when the epoch ends; "
        "DiffusionNFT's global_step).",
    )
    train_timesteps: Literal["per_sample", "stratified"] = field_(
        "stratified",
        "Which sampler timesteps a micro-batch trains at: stratified (one set for the whole micro-batch: the "
        "steps with t >= (1 - --train_timestep_range) x 1000 less the first, cut into as many equal spans as "
        "timesteps are trained, one drawn in each; Flow-Factory's AWM, `discrete_wo_init`) or per_sample (each "
        "sample its own random --train_timestep_fraction of them). Neither trains the last "
        "--train_skip_last_steps.",
    )
    train_adv_clip_max: float = field_(1.0, "Advantages are clipped to [-this, this].")
    output_dir: str = field_(
        "checkpoint/awm_lora",
        "Where the final LoRA, its config.json and checkpoint-N/ go. A folder that already holds a run is refused "
        "unless --resume_from_checkpoint continues it or --overwrite_output_dir replaces it.",
        group="data and output",
    )

    TRAINER: ClassVar[str] = "AWM"
