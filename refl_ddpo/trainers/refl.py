"""ReFL: Reward Feedback Learning (Xu et al. 2023, "ImageReward", Algorithm 1) on the shared core, LoRA or full UNet.

    python -m refl_ddpo.trainers.refl [--flag value ...]      (usually via train_scripts/train_refl_lora.sh)

One optimizer step, as ImageReward's ReFL.py (and its LoRA hackathon version), with every constant a flag:

    k ~ U{k_lo..k_hi}                      one draw per optimizer step, from a generator seeded alike on every process
    x_T ~ N(0, I)                          (B, C, resolution / vae_scale_factor, ...), per-process generator
    x_T -> ... -> x_{t_k}                  steps 0..k-1 of the T-step sampler (DDPM as the reference, or DDIM), no grad
    x0 = scheduler.step(unet(x_{t_k}))     step k with gradient; the scheduler's predicted x0
    image = VAE.decode(x0) / 2 + 0.5       gradient flows through the decoder; clamp to [0, 1]
    r = ImageReward(preprocess(image))     bicubic resize 224, centre crop, CLIP mean/std, as tensor ops
    loss = relu(margin - r).mean() * grad_scale                  (margin 2, grad_scale 1e-3 / 0.01 in the LoRA recipe)
         + pretrain_loss_weight * MSE(unet(noisy x, t), noise)   optional, on an image-caption folder
         + kl_weight * KL term vs the base model                 optional, LoRA only (see `kl_to_base`)

State (`output_dir/checkpoint-N`): the LoRA (or UNet), optimizer and accelerate state through accelerate's
`save_state`; the step, the lr-scheduler state and the EMA scalars as JSON; the generators (the shared k generator
and every process's own) and the EMA weights as safetensors. A resumed run continues bit-exactly on CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from refl_ddpo.config import CommonConfig, field_, parse_config
from refl_ddpo.errors import UserError, cli_main
from refl_ddpo.sampling import (
    DenoiseOutput,
    decode_latents,
    denoise,
    encode_prompts,
    guided_noise_pred,
    initial_noise,
)

# The k generator's seed is `seed + K_STREAM_OFFSET`, so that its draws never coincide with the stream of a
# process's own generator (seeded `seed + rank`), in this run or in a run with a nearby seed.
K_STREAM_OFFSET = 1 << 40
CHECKSUM_DIR = "debug"  # --debug_lora_checksums writes output_dir/debug/lora_checksums_rank{R}.jsonl
IMAGEREWARD_FILES = ("ImageReward.pt", "med_config.json", "bert-base-uncased")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass
class ReFLConfig(CommonConfig):
    """ReFL (ImageReward's Reward Feedback Learning) on Stable Diffusion, LoRA or full UNet, one or many GPUs."""

    # ---- where and what ----
    output_dir: str = field_("checkpoint/refl_lora", "Where the final LoRA, its config.json and checkpoint-N/ go.")
    prompts_file: str | None = field_(
        "refl_prompts",
        "Training prompts: a file (one per line, or a JSON list of strings / {'text'|'prompt': ...} objects) or the "
        "name of a list shipped in refl_ddpo/data (refl_prompts, simple_animals, imagenet_animals).",
    )
    reward: str = field_(
        "imagereward",
        "Reward to maximise; it must be differentiable (imagereward, ...); weighted sums as name:w,name:w.",
    )
    # ---- the ReFL step ----
    grad_scale: float = field_(1e-3, "Factor on the ReFL loss (ImageReward's ReFL.py: 1e-3; LoRA recipe: 0.01).")
    margin: float = field_(2.0, "Hinge margin: the ReFL loss is relu(margin - reward); rewards above it stop pulling.")
    k_lo: int = field_(30, "Smallest step index that may run with gradient (0-based, of num_inference_steps).")
    k_hi: int = field_(39, "Largest step index that may run with gradient; k is uniform in k_lo..k_hi inclusive.")
    scheduler: Literal["ddpm", "ddim"] = field_(
        "ddpm", "Sampler of the training rollout: ddpm (ImageReward's ReFL.py) or ddim (deterministic with eta 0)."
    )
    eta: float = field_(0.0, "DDIM eta of the rollout (0 = deterministic); only with --scheduler ddim.")
    guidance_scale: float = field_(
        1.0, "Classifier-free guidance of the training rollout, grad step included; 1 = off, as the reference."
    )
    max_train_steps: int = field_(100, "Optimizer steps to train for (the total, also when resuming).")
    total_batch_size: int | None = field_(
        None,
        "Images per optimizer step over all processes; when set, gradient_accumulation_steps is derived as "
        "total_batch_size / (train_batch_size x processes), which must divide evenly.",
    )
    # ---- optimisation extras ----
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                          "polynomial"] = field_("constant", "Learning-rate schedule (diffusers.optimization).")
    lr_warmup_steps: int = field_(0, "Optimizer steps of linear warmup (with a *_with_warmup, linear or cosine "
                                     "schedule).")
    use_ema: bool = field_(False, "Keep an EMA of the UNet weights and save it at the end (full fine-tune only).")
    ema_decay: float = field_(0.9999, "EMA decay per optimizer step (diffusers' EMAModel).")
    vae_gradient_checkpointing: bool = field_(False, "Recompute VAE decoder activations in backward (saves memory).")
    reward_gradient_checkpointing: bool = field_(
        False, "Recompute ImageReward's ViT and text-layer activations in backward (saves memory)."
    )
    reward_antialias: bool = field_(
        True,
        "Antialiased bicubic resize in ImageReward's preprocessing (current torchvision); --no-reward_antialias "
        "matches torchvision < 0.17, which the 2023 ReFL runs used.",
    )
    # ---- regularisers (off by default, as the reference) ----
    pretrain_loss_weight: float = field_(
        0.0, "Weight of the standard noise-prediction MSE on --pretrain_data_dir (ImageReward paper, eq. 4)."
    )
    pretrain_data_dir: str | None = field_(
        None, "Image-caption folder: images + metadata.jsonl with {'file_name': ..., 'text': ...} per line."
    )
    pretrain_batch_size: int = field_(1, "Images of --pretrain_data_dir per micro-batch, per GPU.")
    kl_weight: float = field_(
        0.0, "Weight of the KL term to the base model (LoRA disabled) at the grad step; LoRA only."
    )
    # ---- logging ----
    image_log_steps: int = field_(50, "Log a grid of the predicted x0 images every N optimizer steps (0 = off).")
    debug_lora_checksums: bool = field_(
        False, "Each process appends the SHA-256 of its trainable weights after every optimizer step to "
               "output_dir/debug/lora_checksums_rank{R}.jsonl (to check that all processes hold the same weights)."
    )

    def check(self) -> None:
        super().check()
        from refl_ddpo.rewards import available, is_differentiable, parse_reward_spec

        T = self.num_inference_steps
        self.check_positive("max_train_steps", "grad_scale", "pretrain_batch_size")
        if self.k_lo < 0:
            raise UserError(f"--k_lo must be >= 0 (got {self.k_lo}).")
        if self.k_lo > self.k_hi:
            raise UserError(f"--k_lo {self.k_lo} > --k_hi {self.k_hi}: k is drawn from k_lo..k_hi; make k_lo <= k_hi.")
        if self.k_hi >= T:
            raise UserError(f"--k_hi {self.k_hi} must be < --num_inference_steps {T} (step indices are 0..{T - 1}); "
                            f"lower --k_hi or raise --num_inference_steps.")
        if self.eta < 0 or (self.eta != 0 and self.scheduler != "ddim"):
            raise UserError(f"--eta {self.eta}: eta must be >= 0 and applies to --scheduler ddim only.")
        if self.guidance_scale < 1:
            raise UserError(f"--guidance_scale must be >= 1 (1 = no CFG), got {self.guidance_scale}.")
        if not is_differentiable(self.reward):  # also refuses unknown names, with the list of known ones
            names = ", ".join(n for n in available() if is_differentiable(n))
            raise UserError(f"--reward {self.reward} cannot carry gradient, and ReFL backpropagates through the "
                            f"reward: choose a differentiable one ({names}) or train this reward with DDPO.")
        if "imagereward" not in [name for name, _ in parse_reward_spec(self.reward)] and (
                self.reward_gradient_checkpointing or not self.reward_antialias):
            raise UserError("--reward_gradient_checkpointing / --no-reward_antialias apply to ImageReward, which "
                            f"--reward {self.reward} does not include.")
        if self.total_batch_size is not None and self.total_batch_size <= 0:
            raise UserError(f"--total_batch_size must be > 0 (got {self.total_batch_size}).")
        if self.lr_warmup_steps < 0:
            raise UserError(f"--lr_warmup_steps must be >= 0 (got {self.lr_warmup_steps}).")
        if self.lr_warmup_steps and self.lr_scheduler == "constant":
            raise UserError("--lr_warmup_steps needs a schedule with warmup: add --lr_scheduler constant_with_warmup.")
        if self.use_ema and self.use_lora:
            raise UserError("--use_ema averages the full UNet weights: use it with --no-use_lora (or drop it).")
        if not 0 < self.ema_decay <= 1:
            raise UserError(f"--ema_decay must be in (0, 1] (got {self.ema_decay}).")
        if self.kl_weight < 0 or self.pretrain_loss_weight < 0:
            raise UserError("--kl_weight and --pretrain_loss_weight must be >= 0 (0 turns a regulariser off).")
        if self.kl_weight > 0 and not self.use_lora:
            raise UserError("--kl_weight compares with the base model by disabling the LoRA adapter, so it needs "
                            "--use_lora (a full fine-tune has no base model to compare with).")
        if self.pretrain_loss_weight > 0 and not self.pretrain_data_dir:
            raise UserError("--pretrain_loss_weight > 0 needs --pretrain_data_dir (images + metadata.jsonl).")
        if self.image_log_steps < 0:
            raise UserError(f"--image_log_steps must be >= 0 (0 = off), got {self.image_log_steps}.")
        if self.use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
            raise UserError("--use_8bit_adam needs bitsandbytes: pip install bitsandbytes (or drop the flag).")


# --------------------------------------------------------------------------------------------------------------
# inputs, checked before any model is loaded
# --------------------------------------------------------------------------------------------------------------


def load_training_prompts(name_or_path: str | None) -> list[tuple[str, dict]]:
    """[(prompt, metadata)] from a file, or from a list shipped in refl_ddpo/data by its registry name."""
    from refl_ddpo.prompts import DATA_DIR, PROMPT_SOURCES, load_prompts

    if not name_or_path:
        raise UserError("--prompts_file is empty: pass a prompts file or a shipped list name (refl_prompts).")
    if name_or_path in PROMPT_SOURCES and not Path(name_or_path).exists():
        return load_prompts(DATA_DIR / f"{name_or_path}.txt")
    return load_prompts(name_or_path)


def check_reward_files(cfg: ReFLConfig) -> None:
    """A local ImageReward folder must hold all three of its files (a hub id is fetched when the reward loads)."""
    from refl_ddpo.rewards import parse_reward_spec

    if "imagereward" not in [name for name, _ in parse_reward_spec(cfg.reward)]:
        return
    folder = cfg.reward_model_dir
    if not os.path.exists(folder) and _HUB_ID.fullmatch(folder):
        return
    missing = [name for name in IMAGEREWARD_FILES if not (Path(folder) / name).exists()]
    if missing:
        raise UserError(f"--reward_model_dir {folder} lacks {', '.join(missing)}: put ImageReward.pt, "
                        "med_config.json and bert-base-uncased/ there (see checkpoint/README.md).")


class PretrainData:
    """An image-caption folder for the pretraining loss: images + `metadata.jsonl`, one JSON object per line with
    `file_name` and a caption in `text` (or `caption` / `prompt`), the layout of diffusers' text-to-image examples."""

    CAPTION_KEYS = ("text", "caption", "prompt")

    def __init__(self, folder: str, resolution: int):
        from PIL import Image, UnidentifiedImageError

        root = Path(folder)
        meta = root / "metadata.jsonl"
        if not meta.is_file():
            raise UserError(f"--pretrain_data_dir {folder} has no metadata.jsonl "
                            "(one {\"file_name\": ..., \"text\": ...} per line).")
        self.items: list[tuple[Path, str]] = []
        for n, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                caption = next(record[k] for k in self.CAPTION_KEYS if k in record)
                path = root / record["file_name"]
            except (json.JSONDecodeError, StopIteration, KeyError, TypeError):
                raise UserError(f"--pretrain_data_dir {meta} line {n}: expected {{\"file_name\": ..., \"text\": ...}}."
                                ) from None
            try:
                Image.open(path).close()  # reads the header only
            except (OSError, UnidentifiedImageError):
                raise UserError(f"--pretrain_data_dir {meta} line {n}: {path} is missing or not an image.") from None
            self.items.append((path, str(caption)))
        if not self.items:
            raise UserError(f"--pretrain_data_dir {meta} lists no images.")
        from torchvision import transforms

        self.transform = transforms.Compose([
            transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR, antialias=True),
            transforms.CenterCrop(resolution),
            transforms.ToTensor(),  # [3, R, R] in [0, 1]
        ])

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, list[str]]:
        """(images [B, 3, R, R] in [0, 1], captions)."""
        from PIL import Image

        images = []
        for i in indices:
            with Image.open(self.items[i][0]) as im:
                images.append(self.transform(im.convert("RGB")))
        return torch.stack(images), [self.items[i][1] for i in indices]


def resolve_gradient_accumulation(cfg: ReFLConfig, num_processes: int) -> ReFLConfig:
    """With --total_batch_size, derive gradient_accumulation_steps for this many processes."""
    if cfg.total_batch_size is None:
        return cfg
    per_step = cfg.train_batch_size * num_processes
    if cfg.total_batch_size % per_step:
        raise UserError(f"--total_batch_size {cfg.total_batch_size} is not a multiple of --train_batch_size "
                        f"{cfg.train_batch_size} x {num_processes} process(es) = {per_step}; change one of them "
                        "(or NUM_PROCESSES).")
    steps = cfg.total_batch_size // per_step
    if cfg.gradient_accumulation_steps not in (1, steps):
        raise UserError(f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} contradicts "
                        f"--total_batch_size {cfg.total_batch_size} (which gives {steps}); pass only one of them.")
    return dataclasses.replace(cfg, gradient_accumulation_steps=steps)


# --------------------------------------------------------------------------------------------------------------
# the reward
# --------------------------------------------------------------------------------------------------------------


def build_refl_reward(cfg: ReFLConfig, device: torch.device, dtype: torch.dtype):
    """The reward as a `refl_ddpo.rewards.Reward`, with --reward_antialias and --reward_gradient_checkpointing
    passed to ImageReward's factory."""
    from refl_ddpo.rewards import build_reward

    options = {"imagereward": {"antialias": cfg.reward_antialias,
                               "gradient_checkpointing": cfg.reward_gradient_checkpointing}}
    return build_reward(cfg.reward, device, dtype, cfg.reward_model_dir, options=options)


def reward_log_key(spec: str) -> str:
    """'imagereward' -> 'reward/imagereward/mean'; a weighted sum -> 'reward/weighted/mean'."""
    return f"reward/{spec}/mean" if re.fullmatch(r"[\w-]+", spec) else "reward/weighted/mean"


# --------------------------------------------------------------------------------------------------------------
# the maths of one micro-batch
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ReFLStepOutput:
    loss: torch.Tensor  # [] relu(margin - rewards).mean() * grad_scale, with graph to the trained weights
    rewards: torch.Tensor  # [B] with graph
    images: torch.Tensor  # [B, 3, H, W] in [0, 1]: the decoded predicted x0 of step k, with graph
    denoised: DenoiseOutput  # the rollout up to step k (all_latents only with keep_trajectory)


def refl_step(unet, vae, scheduler, reward, prompt_embeds: torch.Tensor,
              negative_prompt_embeds: torch.Tensor | None, prompts: list[str], metadata: list[dict],
              noise: torch.Tensor, k: int, *, num_inference_steps: int, guidance_scale: float = 1.0,
              margin: float = 2.0, grad_scale: float = 1e-3, eta: float = 0.0,
              generator: torch.Generator | None = None, keep_trajectory: bool = False) -> ReFLStepOutput:
    """ImageReward's ReFL loss for one micro-batch: steps 0..k-1 without grad, step k with grad, decode the
    predicted x0, score it. Call under grad mode; `backward()` on `.loss` reaches the trainable UNet weights.

    `noise` (B, C, h, w) is x_T before `init_noise_sigma`; `generator` drives the DDPM steps' noise (and DDIM's when
    eta > 0); CFG runs at every step when guidance_scale > 1 and `negative_prompt_embeds` is given.
    """
    denoised = denoise(unet, scheduler, prompt_embeds, negative_prompt_embeds, noise, num_inference_steps,
                       guidance_scale, eta=eta, generator=generator, grad_steps={k}, stop_at=k,
                       keep_trajectory=keep_trajectory)
    images = decode_latents(vae, denoised.pred_original_sample)  # [B, 3, H, W] in [0, 1]
    rewards, _ = reward(images, prompts, metadata)  # [B]
    loss = F.relu(margin - rewards).mean() * grad_scale
    return ReFLStepOutput(loss, rewards, images, denoised)


def kl_to_base(unet, scheduler, denoised: DenoiseOutput, k: int, prompt_embeds: torch.Tensor,
               negative_prompt_embeds: torch.Tensor | None, guidance_scale: float) -> torch.Tensor:
    """The KL regulariser at the grad step: mean((eps_lora - eps_base)^2) over batch and latent elements.

    eps_* is the noise implied by the scheduler's predicted x0 at (x_{t_k}, t_k): x_t = sqrt(a) x0 + sqrt(1 - a) eps
    with a = alphas_cumprod[t_k], so eps_lora - eps_base = -sqrt(a / (1 - a)) (x0_lora - x0_base) whatever the
    model's prediction type (epsilon or v; exact with clip_sample / thresholding off, as in SD's config). The base
    prediction is the same UNet with the LoRA adapter disabled (diffusers' `disable_adapters` / `enable_adapters`,
    since `add_adapter` leaves no peft `PeftModel` whose `disable_adapter()` context manager we could use), under
    no grad, with the same x_t, t, prompts and CFG. Why this is a KL: both models' transitions
    p(x_{t-1} | x_t) are Gaussians with the same variance s^2 and means c0 x0 + c1 x_t, so
    KL = ||mu_lora - mu_base||^2 / (2 s^2) = c0^2 ||x0_lora - x0_base||^2 / (2 s^2), a per-timestep multiple of the
    term returned here (DPOK, Fan et al. 2023, regularise with the same quantity).

    `unet` is the bare (unwrapped) model; `denoised` must come from `refl_step(..., keep_trajectory=True)`.
    """
    x_t, t = denoised.all_latents[k], denoised.timesteps[k]
    with torch.no_grad():
        unet.disable_adapters()  # also sets requires_grad False on the LoRA weights; enable_adapters restores it
        try:
            eps_base = guided_noise_pred(unet, scheduler.scale_model_input(x_t, t), t, prompt_embeds,
                                         negative_prompt_embeds, guidance_scale)
        finally:
            unet.enable_adapters()
        # A throwaway generator: the step's noise is not used, and the run's own streams must not move.
        x0_base = scheduler.step(eps_base, t, x_t, generator=torch.Generator().manual_seed(0)).pred_original_sample
    a = scheduler.alphas_cumprod[int(t)].item()
    return a / (1 - a) * F.mse_loss(denoised.pred_original_sample.float(), x0_base.float())


def pretrain_loss(unet, vae, text_pipe, noise_scheduler, images: torch.Tensor, captions: list[str],
                  generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """The standard text-to-image denoising loss on real image-caption pairs (diffusers' train_text_to_image):
    latents = VAE.encode(2 x - 1) * scaling_factor, t ~ U{0..T_train-1}, x_t = add_noise(latents, eps, t),
    MSE(unet(x_t, t, caption), target) with target eps (epsilon models) or v (v-prediction models)."""
    from diffusers.utils.torch_utils import randn_tensor

    with torch.no_grad():
        pixels = (images * 2 - 1).to(device, vae.dtype)  # [B, 3, R, R] in [-1, 1]
        latents = vae.encode(pixels).latent_dist.sample(generator) * vae.config.scaling_factor  # [B, C, h, w]
        prompt_embeds, _ = encode_prompts(text_pipe, captions, device, with_negative=False)
    noise = randn_tensor(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (len(latents),),
                              generator=generator).to(device)  # [B]
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    if noise_scheduler.config.prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    pred = unet(noisy, timesteps, encoder_hidden_states=prompt_embeds, return_dict=False)[0]
    return F.mse_loss(pred.float(), target.float())


# --------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------


def weights_checksum(params: list[torch.nn.Parameter]) -> str:
    """SHA-256 over the bytes of the trainable tensors, in order (equal hashes = bit-identical weights)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _checkpoint_world_size(path: Path) -> int:
    from refl_ddpo.training import TRAIN_STATE_JSON

    return int(json.loads((path / TRAIN_STATE_JSON).read_text()).get("num_processes", 1))


def train(cfg: ReFLConfig) -> None:
    from refl_ddpo.models import check_pretrained_model
    from refl_ddpo.training import check_output_dir, resolve_resume

    # ---- checks before anything heavy is loaded ----
    check_pretrained_model(cfg.pretrained_model)
    check_reward_files(cfg)
    prompts = load_training_prompts(cfg.prompts_file)
    pretrain_data = PretrainData(cfg.pretrain_data_dir, cfg.resolution) if cfg.pretrain_loss_weight > 0 else None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch / torchrun for every process
    cfg = resolve_gradient_accumulation(cfg, world_size)
    resume_path = resolve_resume(cfg)
    if resume_path is not None and _checkpoint_world_size(resume_path) != world_size:
        raise UserError(f"--resume_from_checkpoint {resume_path} was written by {_checkpoint_world_size(resume_path)}"
                        f" process(es); resume it with NUM_PROCESSES={_checkpoint_world_size(resume_path)} "
                        "(each process continues its own random stream).")
    check_output_dir(cfg.output_dir)
    if os.environ.get("REFL_DDPO_PREFLIGHT"):  # launch.sh: checks only, before starting several processes
        return
    _train(cfg, prompts, pretrain_data, resume_path, world_size)


def _train(cfg: ReFLConfig, prompts: list[tuple[str, dict]], pretrain_data: PretrainData | None,
           resume_path: Path | None, world_size: int) -> None:
    from accelerate.utils import set_seed
    from diffusers import DDIMScheduler, DDPMScheduler
    from diffusers.optimization import get_scheduler
    from tqdm.auto import tqdm

    from refl_ddpo.models import load_pipeline
    from refl_ddpo.training import (
        load_checkpoint,
        log_image_grid,
        make_accelerator,
        make_optimizer,
        make_trainable,
        print_config,
        register_unet_hooks,
        save_checkpoint,
        save_final,
        weight_dtype,
    )

    accelerator = make_accelerator(cfg, cfg.gradient_accumulation_steps)
    if accelerator.num_processes != world_size:  # the batch arithmetic above assumed WORLD_SIZE processes
        raise UserError(f"accelerate runs {accelerator.num_processes} process(es) but WORLD_SIZE is {world_size}; "
                        "start the trainer with train_scripts/train_refl_lora.sh or accelerate launch.")
    rank, device = accelerator.process_index, accelerator.device
    set_seed(cfg.seed)  # the same LoRA init on every process (DDP also broadcasts rank 0's weights)
    dtype = weight_dtype(accelerator)

    # ---- models ----
    pipe = load_pipeline(cfg.pretrained_model, dtype, device)
    vae_scale = pipe.vae_scale_factor
    if cfg.resolution % vae_scale:
        raise UserError(f"--resolution {cfg.resolution} must be a multiple of the VAE scale factor {vae_scale}.")
    scheduler = (DDPMScheduler if cfg.scheduler == "ddpm" else DDIMScheduler).from_config(pipe.scheduler.config)
    noise_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)  # forward process of the pretraining loss
    base_unet = pipe.unet
    params = make_trainable(base_unet, cfg)
    if cfg.vae_gradient_checkpointing:
        pipe.vae.enable_gradient_checkpointing()
    reward = build_refl_reward(cfg, device, dtype)
    optimizer = make_optimizer(params, cfg)
    # Stepped once per optimizer step by us (not through accelerate, which steps it once per process).
    lr_scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.lr_warmup_steps,
                                 num_training_steps=cfg.max_train_steps)
    ema = None
    if cfg.use_ema:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(params, decay=cfg.ema_decay)
        ema.to(device)
    register_unet_hooks(accelerator, base_unet)
    # The UNet goes through prepare so that DDP all-reduces its gradients: every forward with grad must call
    # `unet` (the wrapper), never `base_unet`, or the wrapper would not know about the backward pass.
    unet, optimizer = accelerator.prepare(base_unet, optimizer)

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
    accelerator.init_trackers("refl")
    if accelerator.is_main_process:
        print_config(cfg, {
            "processes": accelerator.num_processes,
            "images per optimizer step": f"{batch} per process x {gas} accumulation x {accelerator.num_processes} "
                                         f"process(es) = {batch * gas * accelerator.num_processes}",
            "trainable parameters": sum(p.numel() for p in params),
            "training prompts": len(prompts),
            "latents": f"({base_unet.config.in_channels}, {cfg.resolution // vae_scale}, "
                       f"{cfg.resolution // vae_scale})",
        })
    checksum_file = None
    if cfg.debug_lora_checksums:
        checksum_file = Path(cfg.output_dir) / CHECKSUM_DIR / f"lora_checksums_rank{rank}.jsonl"
        checksum_file.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0:
            checksum_file.write_text("")
    reward_key = reward_log_key(cfg.reward)
    progress = tqdm(total=cfg.max_train_steps, initial=start_step, desc="ReFL",
                    disable=not accelerator.is_local_main_process)

    unet.train()
    for step in range(start_step, cfg.max_train_steps):
        k = int(torch.randint(cfg.k_lo, cfg.k_hi + 1, (), generator=k_generator))
        sums = {"refl": 0.0, "pretrain": 0.0, "kl": 0.0}
        rewards_seen = []
        lr = lr_scheduler.get_last_lr()[0]  # the lr this step's update uses
        grad_norm = torch.zeros(())
        for _ in range(gas):
            with accelerator.accumulate(unet):
                # ---- one micro-batch: prompts, noise, the ReFL step ----
                idx = torch.randint(len(prompts), (batch,), generator=generator).tolist()
                batch_prompts = [prompts[i][0] for i in idx]
                metadata = [dict(prompts[i][1]) for i in idx]
                prompt_embeds, negative = encode_prompts(pipe, batch_prompts, device, with_negative=do_cfg)
                noise = initial_noise(batch, base_unet, cfg.resolution, vae_scale, generator, device,
                                      prompt_embeds.dtype)  # (B, C, h, w)
                out = refl_step(unet, pipe.vae, scheduler, reward, prompt_embeds, negative, batch_prompts, metadata,
                                noise, k, num_inference_steps=cfg.num_inference_steps,
                                guidance_scale=cfg.guidance_scale, margin=cfg.margin, grad_scale=cfg.grad_scale,
                                eta=cfg.eta, generator=generator, keep_trajectory=cfg.kl_weight > 0)
                loss = out.loss
                sums["refl"] += out.loss.item() / gas
                # ---- regularisers ----
                if cfg.kl_weight > 0:
                    kl = kl_to_base(base_unet, scheduler, out.denoised, k, prompt_embeds, negative,
                                    cfg.guidance_scale)
                    loss = loss + cfg.kl_weight * kl
                    sums["kl"] += kl.item() / gas
                if pretrain_data is not None:
                    pidx = torch.randint(len(pretrain_data), (cfg.pretrain_batch_size,), generator=generator)
                    images, captions = pretrain_data.batch(pidx.tolist())
                    pl = pretrain_loss(unet, pipe.vae, pipe, noise_scheduler, images, captions, generator, device)
                    loss = loss + cfg.pretrain_loss_weight * pl
                    sums["pretrain"] += pl.item() / gas
                rewards_seen.append(out.rewards.detach())
                # ---- update ----
                accelerator.backward(loss)  # divides by gas; DDP all-reduces on the last micro-batch
                if accelerator.sync_gradients:
                    # the pre-clipping norm of the all-reduced gradient (no clipping when max_grad_norm is 0)
                    grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
                optimizer.step()
                if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.step(params)
        global_step = step + 1

        # ---- logging (means over all processes) ----
        rewards_all = accelerator.gather(torch.cat(rewards_seen))  # [gas * B * processes]
        losses = accelerator.gather(torch.tensor([sums["refl"], sums["kl"], sums["pretrain"]], device=device)[None])
        losses = losses.mean(0).tolist()
        logs = {"refl/loss": losses[0], reward_key: rewards_all.mean().item(),
                reward_key.replace("/mean", "/std"): rewards_all.std().item() if len(rewards_all) > 1 else 0.0,
                "lr": lr, "grad_norm": float(grad_norm), "refl/k": k}
        if cfg.kl_weight > 0:
            logs["refl/kl"] = losses[1]
        if pretrain_data is not None:
            logs["refl/pretrain_loss"] = losses[2]
        accelerator.log(logs, step=global_step)
        progress.update(1)
        progress.set_postfix(loss=f"{logs['refl/loss']:.4g}", reward=f"{logs[reward_key]:.3f}", k=k)
        if cfg.image_log_steps and global_step % cfg.image_log_steps == 0:
            captions = [f"{p} | r={r:.2f}" for p, r in zip(batch_prompts, out.rewards.tolist())]
            log_image_grid(accelerator, "refl/pred_x0", out.images, captions, global_step)
        if checksum_file is not None:
            record = {"step": global_step, "sha256": weights_checksum(params), "refl_loss": sums["refl"]}
            with checksum_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

        # ---- checkpoint ----
        if cfg.checkpointing_steps and global_step % cfg.checkpointing_steps == 0:
            states = accelerator.gather(generator.get_state().to(device)[None]).cpu()  # [processes, state bytes]
            tensors = {"k_generator": k_generator.get_state()}
            tensors.update({f"generator/rank{r}": states[r] for r in range(accelerator.num_processes)})
            counters = {"step": global_step, "num_processes": accelerator.num_processes,
                        "lr_scheduler": lr_scheduler.state_dict()}
            if ema is not None:
                ema_state = ema.state_dict()
                tensors.update({f"ema/{i}": p for i, p in enumerate(ema_state.pop("shadow_params"))})
                counters["ema"] = ema_state
            path = save_checkpoint(accelerator, cfg, global_step, counters, tensors)
            if accelerator.is_local_main_process:
                progress.write(f"saved {path}")
    progress.close()

    # ---- final weights: always, at the top of output_dir ----
    if ema is not None:
        ema.copy_to(params)  # the averaged weights are the result of an EMA run
    save_final(accelerator, unet, cfg)
    accelerator.end_training()


@cli_main
def main(argv: list[str] | None = None) -> None:
    try:
        train(parse_config(ReFLConfig, argv))
    except UserError as e:
        if int(os.environ.get("RANK", "0")) > 0:  # every process hits the same check: only rank 0 prints it
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
