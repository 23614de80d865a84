"""ReFL's config (and that of its relatives on the same trainer) and the checks of its inputs before loading."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from refl_ddpo.core.errors import UserError
from refl_ddpo.run.config import SHARED_PARTS, check_shared
from refl_ddpo.run.parts import field_, guidance_field
from refl_ddpo.toy_world import DATA_DIR as TOY_WORLD_DIR

# The toy world's ReFL recipe: toy-sd, its classifier as the differentiable reward, the 12 training prompts, the
# gradient step anywhere after the first 3 of 10 (docs/toy_world.md).
REFL_PRESETS: dict[str, dict] = {
    "toy_world": {
        "pretrained_model": str(TOY_WORLD_DIR / "toy-sd"),
        "reward_model_dir": str(TOY_WORLD_DIR),
        "reward": "toy_classifier",
        "prompts_file": "toy_world_train",
        "resolution": 32,
        "scheduler": "ddim",
        "guidance_scale": 7.5,
        "num_inference_steps": 10,
        "k_lo": 3,  # the colour is decided early: the grad step ranges over all but the first steps
        "k_hi": 9,
        "learning_rate": 1e-3,
        "grad_scale": 1.0,
        "train_batch_size": 8,
        "max_train_steps": 160,
        "image_log_steps": 20,
        # the 6 held-out colour / shape combinations, 2 seeds each, 20 deterministic steps, every 80 steps
        "validation_prompts_file": "toy_world_heldout",
        "validation_steps": 80,
        "num_validation_images": 2,
        "validation_num_steps": 20,
    },
}
# The same on toy-sd3 (flow matching): the colour word cyan ("a cyan circle" held out), 40 steps, LoRA on the text
# stream's keys / values only (docs/toy_world.md; with more targets it breaks the shapes: docs/record/toy_world.md).
REFL_PRESETS["toy_world_sd3"] = {
    **REFL_PRESETS["toy_world"],
    "pretrained_model": str(TOY_WORLD_DIR / "toy-sd3"),
    "prompts_file": "toy_world_cyan",
    "max_train_steps": 40,
    "validation_steps": 40,
    "lora_target_modules": ["add_k_proj", "add_v_proj"],
}


@dataclass(frozen=True)
class ReFLConfig(*SHARED_PARTS):
    """ReFL (ImageReward's Reward Feedback Learning) on Stable Diffusion, LoRA or full network, one or many GPUs."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = REFL_PRESETS

    output_dir: str = field_(
        "checkpoint/refl_lora",
        "Where the final LoRA, its config.json and checkpoint-N/ go. A folder that already holds a run is refused "
        "unless --resume_from_checkpoint continues it or --overwrite_output_dir replaces it.",
        group="data and output",
    )
    prompts_file: str | None = field_(
        "refl_prompts",
        "Training prompts: a file (one per line, or a JSON list of strings / {'text'|'prompt': ...} objects) or the "
        "name of a list shipped in refl_ddpo/data (refl_prompts, simple_animals, imagenet_animals).",
    )
    prompt_fn: str | None = field_(
        None,
        "A prompt source instead of --prompts_file: your own prompt_fn() -> (prompt, metadata) as pkg.module:function "
        "(as DDPO takes it) or a shipped source (imagenet_animals, simple_animals, ...), called --train_batch_size "
        "times per micro-batch. A function that takes `rng=` gets a random.Random seeded from this process' stream "
        "(resume stays bit-exact); one that draws from its own state is not restored by a resume.",
        group="reward and prompts",
    )
    reward: str = field_(
        "imagereward",
        "Reward to maximise; it must be differentiable (imagereward, toy_classifier, ...); weighted sums as "
        "name:w,name:w; your own reward_fn as pkg.module:function (marked `differentiable = True`).",
        group="reward and prompts",
    )
    preset: str | None = field_(
        None, "A recipe as defaults (toy_world, toy_world_sd3); --config and flags override it."
    )
    grad_scale: float = field_(
        1e-3,
        "Factor on the ReFL loss (ImageReward's ReFL.py: 1e-3; LoRA recipe: 0.01).",
        group="the ReFL step",
    )
    margin: float = field_(
        2.0, "Hinge margin: the ReFL loss is relu(margin - reward); rewards above it stop pulling."
    )
    k_lo: int = field_(
        30, "Smallest step index that may run with gradient (0-based, of num_inference_steps)."
    )
    k_hi: int = field_(
        39, "Largest step index that may run with gradient; k is uniform in k_lo..k_hi inclusive."
    )
    backprop_steps: str | None = field_(
        None,
        "Reward backprop beyond one step: K runs the whole sampler and keeps the gradient through its last K steps, "
        "scoring the final image (DRaFT-K); random:LO-HI draws K uniformly in LO..HI per optimizer step "
        "(AlignProp). Unset: ReFL (one step k in k_lo..k_hi, its predicted x0 scored); k_lo/k_hi are unused when set.",
        group="reward backprop beyond one step (DRaFT, AlignProp)",
    )
    draft_lv: int = field_(
        0,
        "DRaFT-LV: N extra copies of the last step, each on the final latents re-noised to that step's level with "
        "fresh noise and denoised with gradient; the loss averages the 1 + N rewards. Implies --backprop_steps 1.",
    )
    backprop_checkpointing: bool = field_(
        True,
        "With --backprop_steps K > 1: recompute each grad step's network activations in backward "
        "(torch.utils.checkpoint around each network call), so memory grows by about one latent per extra step "
        "instead of one network's activations.",
    )
    scheduler: Literal["ddpm", "ddim"] = field_(
        "ddpm",
        "Sampler of the training rollout: ddpm (ImageReward's ReFL.py) or ddim (deterministic with eta 0).",
    )
    eta: float = field_(0.0, "DDIM eta of the rollout (0 = deterministic); only with --scheduler ddim.")
    guidance_scale: float | None = guidance_field(
        1.0,
        "Classifier-free guidance of the training rollout, grad step included; 1 = off, as the reference.",
    )
    max_train_steps: int = field_(100, "Optimizer steps to train for (the total, also when resuming).")
    total_batch_size: int | None = field_(
        None,
        "Images per optimizer step over all processes; when set, gradient_accumulation_steps is derived as "
        "total_batch_size / (train_batch_size x processes), which must divide evenly.",
    )
    lr_scheduler: Literal[
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = field_("constant", "Learning-rate schedule (diffusers.optimization).", group="optimisation extras")
    lr_warmup_steps: int = field_(
        0, "Optimizer steps of linear warmup (with a *_with_warmup, linear or cosine schedule)."
    )
    use_ema: bool = field_(
        False, "Keep an EMA of the UNet weights and save it at the end (full fine-tune only)."
    )
    ema_decay: float = field_(0.9999, "EMA decay per optimizer step (diffusers' EMAModel).")
    vae_gradient_checkpointing: bool = field_(
        False, "Recompute VAE decoder activations in backward (saves memory)."
    )
    reward_gradient_checkpointing: bool = field_(
        False,
        "Recompute the reward model's activations in backward (saves memory): ImageReward's ViT and text layers, "
        "HPSv3's vision blocks and decoder layers.",
    )
    reward_antialias: bool = field_(
        True,
        "Antialiased bicubic resize in ImageReward's preprocessing (current torchvision); --no-reward_antialias "
        "matches torchvision < 0.17, which the 2023 ReFL runs used.",
    )
    pretrain_loss_weight: float = field_(
        0.0,
        "Weight of the standard noise-prediction MSE on --pretrain_data_dir (ImageReward paper, eq. 4).",
        group="regularisers (off by default)",
    )
    pretrain_data_dir: str | None = field_(
        None, "Image-caption folder: images + metadata.jsonl with {'file_name': ..., 'text': ...} per line."
    )
    pretrain_batch_size: int = field_(1, "Images of --pretrain_data_dir per micro-batch, per GPU.")
    kl_weight: float = field_(
        0.0,
        "Weight of the KL term to the base model (LoRA disabled) at the grad step (DRaFT / AlignProp: the mean over "
        "the K grad steps); LoRA only, not with --draft_lv.",
    )
    image_log_steps: int = field_(
        50, "Log a grid of the predicted x0 images every N optimizer steps (0 = off).", group="logging"
    )
    debug_lora_checksums: bool = field_(
        False,
        "Each process appends the SHA-256 of its trainable weights after every optimizer step to "
        "output_dir/debug/lora_checksums_rank{R}.jsonl (to check that all processes hold the same weights).",
    )
    validation_steps: int = field_(
        50,
        "With --validation_prompts_file: validate every N optimizer steps, besides before the first step and after "
        "the last (0 = only then).",
        group="validation (ReFL)",
        ge=0,
    )

    def check(self) -> None:
        super().check()
        check_shared(self)
        self.check_positive("max_train_steps", "grad_scale", "pretrain_batch_size")
        self._check_steps()
        self._check_rollout_and_reward()
        self._check_optimizer_and_regularisers()

    def _check_steps(self) -> None:
        """ReFL's k range, or DRaFT / AlignProp's K and DRaFT-LV, against the sampler's steps."""
        T = self.num_inference_steps
        reflk = self.backprop_range() is None  # k_lo / k_hi are ReFL's: unused (and unchecked) under DRaFT
        if reflk and self.k_lo < 0:
            raise UserError(f"--k_lo must be >= 0 (got {self.k_lo}).")
        if reflk and self.k_lo > self.k_hi:
            raise UserError(
                f"--k_lo {self.k_lo} > --k_hi {self.k_hi}: k is drawn from k_lo..k_hi; make k_lo <= k_hi."
            )
        if reflk and self.k_hi >= T:
            raise UserError(
                f"--k_hi {self.k_hi} must be < --num_inference_steps {T} (step indices are 0..{T - 1}); "
                f"lower --k_hi or raise --num_inference_steps."
            )
        if self.draft_lv < 0:
            raise UserError(f"--draft_lv must be >= 0 (0 = off), got {self.draft_lv}.")
        backprop = self.backprop_range()
        if backprop is not None:
            lo, hi = backprop
            if hi > T:
                raise UserError(
                    f"--backprop_steps {self.backprop_steps}: K goes up to {hi} but the sampler has "
                    f"--num_inference_steps {T} steps; lower K or raise --num_inference_steps."
                )
            if self.draft_lv and (lo, hi) != (1, 1):
                raise UserError(
                    f"--draft_lv {self.draft_lv} re-noises the last step only (DRaFT-LV is DRaFT-1): drop "
                    f"--backprop_steps {self.backprop_steps} or set it to 1."
                )
            if self.kl_weight > 0 and self.draft_lv:
                raise UserError(
                    "--kl_weight is taken at the sampler's own grad steps; DRaFT-LV's re-noised copies have none: "
                    "with --draft_lv set it to 0."
                )

    def _check_rollout_and_reward(self) -> None:
        """The sampler's eta and CFG; a reward that carries gradient, and ImageReward's options only with it; the
        prompt source imports."""
        from refl_ddpo.core.prompts import check_prompt_source
        from refl_ddpo.rewards import REWARDS, available, is_differentiable, parse_reward_spec

        if self.prompt_fn is not None:
            check_prompt_source(self.prompt_fn)
        if self.eta < 0 or (self.eta != 0 and self.scheduler != "ddim"):
            raise UserError(f"--eta {self.eta}: eta must be >= 0 and applies to --scheduler ddim only.")
        if self.guidance_scale is not None and self.guidance_scale < 1:
            raise UserError(f"--guidance_scale must be >= 1 (1 = no CFG), got {self.guidance_scale}.")
        if not is_differentiable(self.reward):  # also refuses unknown names, with the list of known ones
            names = ", ".join(n for n in available() if REWARDS[n][2])
            raise UserError(
                f"--reward {self.reward} cannot carry gradient, and ReFL backpropagates through the "
                f"reward: choose a differentiable one ({names}), mark your own reward_fn `differentiable = True` "
                "if it keeps the graph, or train this reward with DDPO."
            )
        names = [name for name, _ in parse_reward_spec(self.reward)]
        if "imagereward" not in names and not self.reward_antialias:
            raise UserError(
                f"--no-reward_antialias applies to ImageReward, which --reward {self.reward} does not include."
            )
        if not {"imagereward", "hpsv3"} & set(names) and self.reward_gradient_checkpointing:
            raise UserError(
                "--reward_gradient_checkpointing applies to ImageReward and HPSv3, which "
                f"--reward {self.reward} does not include."
            )

    def _check_optimizer_and_regularisers(self) -> None:
        """Batch, lr schedule, EMA, the KL and pretraining regularisers, logging, 8-bit Adam."""
        if self.total_batch_size is not None and self.total_batch_size <= 0:
            raise UserError(f"--total_batch_size must be > 0 (got {self.total_batch_size}).")
        if self.lr_warmup_steps < 0:
            raise UserError(f"--lr_warmup_steps must be >= 0 (got {self.lr_warmup_steps}).")
        if self.lr_warmup_steps and self.lr_scheduler == "constant":
            raise UserError(
                "--lr_warmup_steps needs a schedule with warmup: add --lr_scheduler constant_with_warmup."
            )
        if self.use_ema and self.use_lora:
            raise UserError(
                "--use_ema averages the full UNet weights: use it with --no-use_lora (or drop it)."
            )
        if self.use_ema and self.fsdp:
            raise UserError(
                "--use_ema keeps a whole copy of the network beside its FSDP shards: drop --use_ema or --fsdp."
            )
        if not 0 < self.ema_decay <= 1:
            raise UserError(f"--ema_decay must be in (0, 1] (got {self.ema_decay}).")
        if self.kl_weight < 0 or self.pretrain_loss_weight < 0:
            raise UserError(
                "--kl_weight and --pretrain_loss_weight must be >= 0 (0 turns a regulariser off)."
            )
        if self.kl_weight > 0 and not self.use_lora:
            raise UserError(
                "--kl_weight compares with the base model by disabling the LoRA adapter, so it needs "
                "--use_lora (a full fine-tune has no base model to compare with)."
            )
        if self.pretrain_loss_weight > 0 and not self.pretrain_data_dir:
            raise UserError("--pretrain_loss_weight > 0 needs --pretrain_data_dir (images + metadata.jsonl).")
        if self.image_log_steps < 0:
            raise UserError(f"--image_log_steps must be >= 0 (0 = off), got {self.image_log_steps}.")
        if self.use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
            raise UserError(
                "--use_8bit_adam needs bitsandbytes: pip install bitsandbytes (or drop the flag)."
            )

    def backprop_range(self) -> tuple[int, int] | None:
        """(lo, hi) of the number of steps with gradient under DRaFT / AlignProp (K uniform in lo..hi; (1, 1) for
        DRaFT-LV alone), or None for ReFL."""
        from refl_ddpo.algorithms.reward_backprop import parse_backprop_steps

        if self.backprop_steps is None:
            return (1, 1) if self.draft_lv else None
        try:
            return parse_backprop_steps(self.backprop_steps)
        except ValueError:
            raise UserError(
                f"--backprop_steps {self.backprop_steps!r}: expected K (DRaFT-K, e.g. 3) or random:LO-HI "
                "(AlignProp, e.g. random:1-5) with 1 <= LO <= HI."
            ) from None

    def describe_backprop(self) -> str:
        """Which steps carry gradient and what is scored, in one line (printed with the config)."""
        backprop = self.backprop_range()
        if backprop is None:
            return f"ReFL: one step k in {self.k_lo}..{self.k_hi} with grad, its predicted x0 scored"
        lo, hi = backprop
        name = f"DRaFT-{lo}" if lo == hi else f"AlignProp (K in {lo}..{hi})"
        if self.draft_lv:
            name = f"DRaFT-LV ({self.draft_lv} extra noised copies of the last step)"
        checkpointed = self.backprop_checkpointing and hi > 1
        return f"{name}: the last K steps with grad{' (network checkpointed)' if checkpointed else ''}, final image scored"


def resolve_gradient_accumulation(cfg: ReFLConfig, num_processes: int) -> ReFLConfig:
    """With --total_batch_size, derive gradient_accumulation_steps for this many processes."""
    if cfg.total_batch_size is None:
        return cfg
    per_step = cfg.train_batch_size * num_processes
    if cfg.total_batch_size % per_step:
        raise UserError(
            f"--total_batch_size {cfg.total_batch_size} is not a multiple of --train_batch_size "
            f"{cfg.train_batch_size} x {num_processes} process(es) = {per_step}; change one of them "
            "(or NUM_PROCESSES)."
        )
    steps = cfg.total_batch_size // per_step
    if cfg.gradient_accumulation_steps not in (1, steps):
        raise UserError(
            f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} contradicts "
            f"--total_batch_size {cfg.total_batch_size} (which gives {steps}); pass only one of them."
        )
    return dataclasses.replace(cfg, gradient_accumulation_steps=steps)
