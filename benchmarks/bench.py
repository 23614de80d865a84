#!/usr/bin/env python
"""Speed and memory of ReFL, DDPO and inference on the real Stable Diffusion v1.5 architecture, or on tiny models.

    python benchmarks/bench.py --device cuda --dtype bf16 --out benchmarks/results/h200
    python benchmarks/bench.py --tiny --device cpu --out benchmarks/results/cpu_tiny
    python benchmarks/bench.py --sweep --device cuda --out benchmarks/results/h200_sweep   # before/after table

The models are built from config files with random weights (speed and memory do not depend on the values):
benchmarks/configs/ holds SD v1.5's unet/vae/text_encoder configs and BLIP's med_config.json of ImageReward (its
ViT-L/16 is the default of refl_ddpo.rewards.imagereward); `--tiny` takes the configs of refl_ddpo.tiny's models.
Tokenizers are refl_ddpo.tiny's (no hub access); they pad to the real lengths (77 CLIP, 35 BERT tokens).
The timed regions call the kit's own functions, set up as the trainers set them up (make_trainable, make_optimizer,
make_accelerator + prepare, the trainers' defaults: LoRA rank 4 on to_q/to_k/to_v/to_out.0, AdamW, clipping at 1):

  refl         refl_ddpo.trainers.refl.refl_step + accelerator.backward + clip + AdamW: one ReFL optimizer step,
               40 DDPM steps, 0..k-1 without grad, k with grad (k fixed by --refl_k), predicted x0 -> VAE decode ->
               ImageReward -> relu(2 - r) * grad_scale; LoRA and full UNet (--refl_modes) at each batch size
               (--refl_batch_sizes); CFG off (as the reference). The trainer's logging (.item(), gather) is left out.
  ddpo_sample  refl_ddpo.trainers.ddpo.sample_epoch for one batch: 50 stochastic DDIM steps (eta 1), CFG,
               log-probs, VAE decode; the reward is a stand-in pixel mean (JPEG / aesthetic / ImageReward excluded)
  ddpo_train   refl_ddpo.trainers.ddpo.train_on_samples over that batch: every timestep (timestep_fraction 1),
               CFG in the forward, PPO-clip, backward per timestep, one optimizer step for the whole batch
  inference    refl_ddpo.generate.generate_batch: CLIP text encoder, 50 DDIM steps (eta 0), CFG, VAE decode;
               weights in --dtype without autocast (as the inference scripts); reported per image too
  forward      one no-grad forward of each model (UNet at batch 1 without CFG, VAE decoder, text encoder,
               ImageReward): the check that the real architecture builds and runs (cheap on CPU at --resolution 64)

Per case: median and spread of --repeats runs after --warmup runs (CUDA events on a GPU, perf_counter on a CPU,
where nothing is asynchronous); peak memory (torch.cuda.max_memory_allocated after reset_peak_memory_stats on a
GPU; on a CPU the process's peak RSS, which is process-wide and never goes down, so a case's number includes every
case before it); FLOPs of one run counted with torch.utils.flop_counter (model FLOPs: gradient checkpointing is
switched off and torch.compile bypassed for the counting run) and, on a GPU, the model FLOPs utilisation against
--peak_tflops; on a GPU also the device->host syncs of one run (torch.cuda.set_sync_debug_mode).
Writes results.json and results.md in --out.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# The script runs as `python benchmarks/bench.py` from a checkout: make the package importable without installing.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch

from refl_ddpo.config import ConfigBase, field_, parse_config
from refl_ddpo.errors import UserError, cli_main

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
REAL_CONFIG_FILES = {
    "unet": "sd15_unet.json",
    "vae": "sd15_vae.json",
    "text_encoder": "sd15_text_encoder.json",
    "reward": "imagereward_med_config.json",
}
CASES = ("refl", "ddpo_sample", "ddpo_train", "inference", "forward")
DEFAULT_CASES = "refl,ddpo_sample,ddpo_train,inference"
GIB = 2**30


@dataclass
class BenchConfig(ConfigBase):
    """What to benchmark and how; every speed option is a flag so that a sweep can switch it on and off."""

    # ---- what ----
    tiny: bool = field_(
        False, "Use the tiny random models of refl_ddpo.tiny instead of the real SD v1.5 architecture."
    )
    device: Literal["cuda", "cpu"] | None = field_(
        None,
        "Device: cuda (the first visible GPU; pick one with CUDA_VISIBLE_DEVICES) or cpu; default cuda if "
        "available, else cpu.",
    )
    dtype: Literal["fp32", "bf16", "fp16"] | None = field_(
        None,
        "Dtype of the frozen weights and of autocast (trainable weights stay fp32); default bf16 on a GPU, "
        "fp32 on a CPU.",
    )
    out: str = field_("benchmarks/results/latest", "Folder for results.json and results.md (created).")
    only: str = field_(DEFAULT_CASES, f"Comma-separated cases to run, from {', '.join(CASES)}.")
    repeats: int = field_(3, "Timed runs per case; the table gives their median and spread.")
    warmup: int = field_(
        1, "Untimed runs per case before timing (at least 1 with --compile, which compiles there)."
    )
    seed: int = field_(0, "Seed of the random weights, prompts and noise.")
    resolution: int | None = field_(
        None, "Image side in pixels; default 512 (real) or 32 (tiny: VAE factor 2)."
    )
    # ---- workloads (defaults: the reference recipes) ----
    refl_modes: list[str] = field_(
        ["lora", "full"], "ReFL variants: lora (LoRA on the UNet) and/or full (all UNet)."
    )
    refl_batch_sizes: list[int] = field_([1, 4], "ReFL batch sizes (images per optimizer step, per GPU).")
    refl_steps: int = field_(40, "ReFL denoising steps (ImageReward's ReFL: 40).")
    refl_k: int = field_(
        35,
        "The ReFL step that runs with grad (the trainer draws it from 30..39; fixed to time "
        "it: k + 1 UNet calls per step, the mean of the draw is 35.5).",
    )
    grad_scale: float = field_(
        1e-3, "ReFL loss scale (the reference's 1e-3; values do not change the speed)."
    )
    ddpo_sample_batch_size: int = field_(8, "DDPO images sampled per batch, per GPU (ddpo-pytorch's 8).")
    ddpo_train_batch_size: int = field_(
        4, "DDPO images per training micro-batch, per GPU (ddpo-pytorch's 4)."
    )
    ddpo_steps: int = field_(50, "DDPO sampling steps (ddpo-pytorch's 50).")
    ddpo_guidance_scale: float = field_(5.0, "DDPO CFG scale (ddpo-pytorch's 5.0) for sampling and training.")
    inference_batch_sizes: list[int] = field_(
        [1, 4], "Images per inference batch; the table also gives per image."
    )
    inference_steps: int = field_(50, "Inference DDIM steps.")
    inference_guidance_scale: float = field_(7.5, "Inference CFG scale.")
    lora_rank: int = field_(4, "LoRA rank (the kit's default; alpha = rank).")
    # ---- speed options ----
    attention: Literal["sdpa", "eager"] = field_(
        "sdpa",
        "sdpa: PyTorch scaled_dot_product_attention (diffusers' AttnProcessor2_0, timm's fused attention, "
        "transformers' sdpa); eager: explicit matmul-softmax everywhere (the 'before' of the SDPA change).",
    )
    tf32: bool = field_(True, "Allow TF32 for fp32 matmuls and convolutions (CUDA only; no effect on a CPU).")
    channels_last: bool = field_(
        False, "UNet and VAE weights (and so their activations) in channels_last format."
    )
    gradient_checkpointing: bool = field_(
        False, "Recompute activations in backward: UNet, VAE decoder, ImageReward."
    )
    compile: bool = field_(
        False, "torch.compile the UNet, the VAE decoder and ImageReward (compiles in warm-up)."
    )
    cpu_threads: int = field_(
        0,
        "Torch CPU threads (0: torch's default). On a small shared CPU, 1 avoids threads "
        "waiting on each other in the many tiny ops of the tiny models.",
    )
    peak_tflops: float = field_(
        788.0,
        "Dense bf16 rate for MFU, TFLOP/s: 788 is what an 8192^3 bf16 matmul reached on an H200 here "
        "(datasheet 989); used for every dtype.",
    )
    flops_only: bool = field_(
        False,
        "Run nothing: count every case's model FLOPs on the meta device (per-sample "
        "counts of each model call, composed) and write flops.md with the time floor "
        "at --peak_tflops. Needs no GPU and no memory.",
    )
    # ---- sweep ----
    sweep: bool = field_(
        False,
        "Run one child benchmark per speed option (each in a fresh process, into "
        "--out/<variant>/; a variant already there with the same flags is kept) and write "
        "a before/after table to --out/sweep.md.",
    )

    def check(self) -> None:
        cases = self.cases
        unknown = [c for c in cases if c not in CASES]
        if unknown or not cases:
            raise UserError(f"--only {self.only}: choose cases from {', '.join(CASES)} (comma-separated).")
        self.check_positive("repeats", "refl_steps", "ddpo_sample_batch_size", "ddpo_train_batch_size", "ddpo_steps",
                            "inference_steps", "lora_rank")
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0 (got {self.warmup}).")
        if self.compile and self.warmup < 1:
            raise UserError(
                "--compile needs --warmup >= 1: compilation happens in the first run and must not be timed."
            )
        if not 0 <= self.refl_k < self.refl_steps:
            raise UserError(f"--refl_k {self.refl_k} must be in 0..--refl_steps-1 ({self.refl_steps - 1}).")
        bad = [m for m in self.refl_modes if m not in ("lora", "full")]
        if bad:
            raise UserError(f"--refl_modes {' '.join(bad)}: use lora and/or full.")
        for name in ("refl_batch_sizes", "inference_batch_sizes"):
            if any(b <= 0 for b in getattr(self, name)):
                raise UserError(f"--{name} must all be > 0 (got {getattr(self, name)}).")
        if self.ddpo_sample_batch_size % self.ddpo_train_batch_size:
            raise UserError(
                f"--ddpo_sample_batch_size {self.ddpo_sample_batch_size} must be a multiple of "
                f"--ddpo_train_batch_size {self.ddpo_train_batch_size}."
            )
        if self.resolution is not None and self.resolution <= 0:
            raise UserError(f"--resolution must be > 0 (got {self.resolution}).")
        if self.cpu_threads < 0:
            raise UserError(f"--cpu_threads must be >= 0 (got {self.cpu_threads}; 0 keeps torch's default).")
        if self.peak_tflops <= 0:
            raise UserError(f"--peak_tflops must be > 0 (got {self.peak_tflops}).")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: CUDA is not available here; use --device cpu.")

    @property
    def cases(self) -> list[str]:
        return [c.strip() for c in self.only.split(",") if c.strip()]

    @property
    def resolved_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    @property
    def resolved_dtype(self) -> torch.dtype:
        name = self.dtype or ("bf16" if self.resolved_device.type == "cuda" else "fp32")
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


# --------------------------------------------------------------------------------------------------------------
# models from configs
# --------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def real_configs() -> dict[str, dict]:
    """{'unet', 'vae', 'text_encoder', 'reward'} -> the SD v1.5 / ImageReward configs kept in benchmarks/configs."""
    return {name: _read_json(CONFIG_DIR / f) for name, f in REAL_CONFIG_FILES.items()}


def model_configs(tiny: bool, workdir: Path) -> dict[str, dict]:
    """The real configs, or refl_ddpo.tiny's. Writes the tiny models into `workdir` either way (a few MB, seconds):
    their tokenizers serve both sizes."""
    from refl_ddpo.rewards import imagereward
    from refl_ddpo.tiny import write_tiny_stable_diffusion

    sd = write_tiny_stable_diffusion(workdir)
    imagereward.write_tiny(workdir)
    if not tiny:
        return real_configs()
    return {
        "unet": _read_json(sd / "unet" / "config.json"),
        "vae": _read_json(sd / "vae" / "config.json"),
        "text_encoder": _read_json(sd / "text_encoder" / "config.json"),
        "reward": _read_json(workdir / imagereward.MED_CONFIG_FILE),
    }


def construct(name: str, config: dict, attention: str = "sdpa", tokenizer=None):
    """One model with freshly initialised random weights, on the current default device (a `torch.device` context:
    meta for counting parameters, the GPU to skip a slow CPU init). `tokenizer`: ImageReward's BERT tokenizer."""
    if name == "unet":
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel.from_config(config)
    if name == "vae":
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_config(config)
    if name == "text_encoder":
        from transformers import CLIPTextConfig, CLIPTextModel

        return CLIPTextModel(CLIPTextConfig(**config, attn_implementation=attention))
    if name == "reward":
        from refl_ddpo.rewards.imagereward import ImageRewardModel

        model = ImageRewardModel(config, tokenizer)  # the tokenizer only serves `tokenize`
        # The model skips timm's init (a checkpoint replaces it), which leaves cls_token / pos_embed as torch.empty
        # garbage (NaN seen): draw timm's own init instead.
        model.blip.visual_encoder.init_weights()
        return model
    raise ValueError(name)


def parameter_counts(configs: dict[str, dict]) -> dict[str, int]:
    """Parameters of each model, built on the meta device (no memory, no init)."""
    counts = {}
    with torch.device("meta"):
        for name, config in configs.items():
            model = construct(name, config)
            counts[name] = sum(p.numel() for p in model.parameters())
            if name == "reward":
                counts["reward.vision"] = sum(p.numel() for p in model.blip.visual_encoder.parameters())
                counts["reward.text"] = sum(p.numel() for p in model.blip.text_encoder.parameters())
    return counts


class Bench:
    """Device, dtype, options, configs and tokenizers of one run; builds models and pipelines as the trainers do."""

    def __init__(self, cfg: BenchConfig, configs: dict[str, dict], workdir: Path):
        from transformers import BertTokenizer, CLIPTokenizer

        from refl_ddpo.config import CommonConfig
        from refl_ddpo.prompts import get_prompt_fn
        from refl_ddpo.rewards import imagereward
        from refl_ddpo.training import make_accelerator

        self.cfg = cfg
        self.dtype = cfg.resolved_dtype
        self.configs = configs
        self.resolution = cfg.resolution or (32 if cfg.tiny else 512)
        self.vae_scale_factor = 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
        if self.resolution % self.vae_scale_factor:
            raise UserError(
                f"--resolution {self.resolution} must be a multiple of the VAE scale factor "
                f"{self.vae_scale_factor}."
            )
        # The trainers' accelerator (autocast in the prepared UNet's forward, backward, clipping, accumulation).
        mixed = {torch.float32: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]
        self.common = CommonConfig(
            mixed_precision=mixed,
            report_to="none",
            output_dir=str(workdir),
            device="cpu" if cfg.resolved_device.type == "cpu" else None,
            allow_tf32=cfg.tf32,
            lora_rank=cfg.lora_rank,
            gradient_checkpointing=cfg.gradient_checkpointing,
        )
        self.accelerator = make_accelerator(self.common, 1)
        self.device = self.accelerator.device
        if self.device.type == "cuda":  # make_accelerator only ever switches TF32 on
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32
        # Tokenizers of the tiny models (no hub access): CLIP pads to 77 and ImageReward to 35 tokens whatever the
        # vocabulary, so the models see the shapes the real tokenizers give; ids stay inside the real vocabularies.
        self.clip_tokenizer = CLIPTokenizer.from_pretrained(workdir / "stable-diffusion" / "tokenizer")
        self.bert_tokenizer = BertTokenizer.from_pretrained(workdir / imagereward.TOKENIZER_DIR)
        torch.manual_seed(cfg.seed)  # the random weights
        # CPU generators, as the trainers use (noise is drawn on the CPU and copied to the device).
        self.generator = torch.Generator().manual_seed(cfg.seed)
        # ddpo-pytorch's prompt source: a new prompt for every image of every run.
        self.prompt_fn = get_prompt_fn("imagenet_animals", seed=cfg.seed)

    # ---- models ----

    def build(self, name: str):
        """A frozen model in `dtype` on the device, with attention / channels_last as asked."""
        with torch.device(self.device):
            model = construct(name, self.configs[name], self.cfg.attention, self.bert_tokenizer)
        model.requires_grad_(False).eval()
        model.to(dtype=self.dtype)
        if name in ("unet", "vae"):
            if self.cfg.attention == "eager":
                from diffusers.models.attention_processor import AttnProcessor

                model.set_attn_processor(AttnProcessor())
            if self.cfg.channels_last:
                model.to(memory_format=torch.channels_last)
        if name == "reward" and self.cfg.attention == "eager":
            for module in model.modules():  # timm's Attention: explicit matmul-softmax instead of SDPA
                if hasattr(module, "fused_attn"):
                    module.fused_attn = False
        return model

    def pipeline(self, unet, scheduler: str = "ddim"):
        """A StableDiffusionPipeline around `unet` with a fresh VAE and text encoder (what load_pipeline gives)."""
        import diffusers
        from diffusers import StableDiffusionPipeline

        from refl_ddpo.tiny import SD_SCHEDULER_CONFIG

        scheduler_cls = {"ddim": diffusers.DDIMScheduler, "ddpm": diffusers.DDPMScheduler}[scheduler]
        return StableDiffusionPipeline(
            unet=unet,
            vae=self.build("vae"),
            text_encoder=self.build("text_encoder"),
            tokenizer=self.clip_tokenizer,
            scheduler=scheduler_cls.from_config(SD_SCHEDULER_CONFIG),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    def trainable_unet(self, mode: str, config=None) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        """The UNet as the trainers set it up (refl_ddpo.training.make_trainable): LoRA on a frozen base in dtype
        (adapters fp32), or all of it in fp32; gradient checkpointing if asked."""
        from refl_ddpo.training import make_trainable

        unet = self.build("unet")
        config = dataclasses.replace(
            config or self.common,
            use_lora=mode == "lora",
            lora_rank=self.cfg.lora_rank,
            gradient_checkpointing=self.cfg.gradient_checkpointing,
        )
        return unet, make_trainable(unet, config)

    def prepare(self, unet, params, config, gradient_accumulation_steps: int = 1):
        """The trainers' `make_optimizer` + `accelerator.prepare(unet, optimizer)`."""
        from refl_ddpo.training import make_optimizer

        self.accelerator.gradient_accumulation_steps = gradient_accumulation_steps
        return self.accelerator.prepare(unet, make_optimizer(params, config or self.common))

    def finish(self, unet=None, vae=None, reward=None) -> None:
        """VAE / reward gradient checkpointing and torch.compile, last (after LoRA and prepare)."""
        if self.cfg.gradient_checkpointing:
            set_checkpointing(True, None, vae, reward)  # the UNet's is make_trainable's
        if self.cfg.compile:
            for module in (unet, vae.decoder if vae is not None else None, reward):
                if module is not None:
                    module.compile()

    def imagereward(self, model):
        """The ReFL trainer's reward function around `model` (as `refl_ddpo.rewards.build_reward` makes it)."""
        from refl_ddpo.rewards import Reward
        from refl_ddpo.rewards.imagereward import reward_from_model

        return Reward("imagereward", reward_from_model(model), differentiable=True)

    def prompts(self, batch: int) -> tuple[list[str], list[dict]]:
        """The next `batch` prompts (and metadata) of the run's prompt source."""
        prompts, metadata = zip(*(self.prompt_fn() for _ in range(batch)))
        return list(prompts), list(metadata)

    def ddpo_config(self):
        """The DDPO trainer's config for one sampled batch and one training pass over it (one optimizer step)."""
        from refl_ddpo.trainers.ddpo import DDPOConfig

        c = self.cfg
        return DDPOConfig(
            sample_batch_size=c.ddpo_sample_batch_size,
            sample_num_batches_per_epoch=1,
            sample_num_steps=c.ddpo_steps,
            sample_guidance_scale=c.ddpo_guidance_scale,
            sample_eta=1.0,
            train_batch_size=c.ddpo_train_batch_size,
            train_gradient_accumulation_steps=c.ddpo_sample_batch_size // c.ddpo_train_batch_size,
            train_timestep_fraction=1.0,
            train_cfg=True,
            resolution=self.resolution,
            mixed_precision=self.common.mixed_precision,
            report_to="none",
            output_dir=self.common.output_dir,
            device=self.common.device,
            allow_tf32=c.tf32,
            lora_rank=c.lora_rank,
            gradient_checkpointing=c.gradient_checkpointing,
        )


def set_checkpointing(enable: bool, unet=None, vae=None, reward=None) -> None:
    for model in (unet, vae):
        if model is not None:
            model.enable_gradient_checkpointing() if enable else model.disable_gradient_checkpointing()
    if reward is not None:
        reward.set_gradient_checkpointing(enable)


# --------------------------------------------------------------------------------------------------------------
# cases: setup(bench) -> (run, models); run() does one timed unit of work through the kit's own functions
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str  # e.g. "refl lora b1"
    bench: str  # one of CASES
    unit: str  # what one run is
    images: int  # images per run (for the per-image column)
    settings: dict
    setup: Callable[[Bench], tuple[Callable[[], torch.Tensor], dict]]


def refl_case(mode: str, batch: int) -> Case:
    """One optimizer step of refl_ddpo.trainers.refl (its inner loop without logging), k fixed."""

    def setup(b: Bench):
        from refl_ddpo.sampling import encode_prompts, initial_noise
        from refl_ddpo.trainers.refl import refl_step

        base_unet, params = b.trainable_unet(mode)
        # DDPM: the ReFL trainer's default rollout sampler (ImageReward's ReFL.py)
        pipe = b.pipeline(base_unet, scheduler="ddpm")
        reward_model = b.build("reward")
        unet, optimizer = b.prepare(base_unet, params, None)
        b.finish(unet, pipe.vae, reward_model)
        reward, acc, k = b.imagereward(reward_model), b.accelerator, b.cfg.refl_k
        unet.train()

        def run():
            prompts, metadata = b.prompts(batch)
            with acc.accumulate(unet):
                prompt_embeds, _ = encode_prompts(pipe, prompts, b.device, with_negative=False)
                noise = initial_noise(
                    batch,
                    base_unet,
                    b.resolution,
                    b.vae_scale_factor,
                    b.generator,
                    b.device,
                    prompt_embeds.dtype,
                )
                out = refl_step(
                    unet,
                    pipe.vae,
                    pipe.scheduler,
                    reward,
                    prompt_embeds,
                    None,
                    prompts,
                    metadata,
                    noise,
                    k,
                    num_inference_steps=b.cfg.refl_steps,
                    guidance_scale=1.0,
                    grad_scale=b.cfg.grad_scale,
                    generator=b.generator,
                )
                acc.backward(out.loss)
                acc.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return out.loss.detach()

        return run, {"unet": base_unet, "vae": pipe.vae, "reward": reward_model}

    return Case(
        f"refl {mode} b{batch}", "refl", "optimizer step", batch, {"mode": mode, "batch": batch}, setup
    )


def _ddpo_setup(b: Bench):
    """The DDPO trainer's models: pipeline with a DDIM scheduler, LoRA UNet prepared with its optimizer."""
    from refl_ddpo.sampling import encode_prompts
    from refl_ddpo.trainers.ddpo import num_train_timesteps

    config = b.ddpo_config()
    base_unet, params = b.trainable_unet("lora", config)
    pipe = b.pipeline(base_unet, scheduler="ddim")
    unet, optimizer = b.prepare(
        base_unet, params, config, config.train_gradient_accumulation_steps * num_train_timesteps(config)
    )
    b.finish(unet, pipe.vae)
    negative_embed, _ = encode_prompts(pipe, [""], b.device, with_negative=False)  # (1, 77, D)
    return config, pipe, unet, optimizer, params, negative_embed


def _pixel_mean_reward():
    """A stand-in reward for DDPO timing (JPEG size, aesthetic or ImageReward would add their own cost)."""
    from refl_ddpo.rewards import Reward

    return Reward("pixel_mean", lambda images, prompts, metadata: (images.mean(dim=(1, 2, 3)), {}), False)


def ddpo_sample_case(batch: int) -> Case:
    """refl_ddpo.trainers.ddpo.sample_epoch for one batch: 50 stochastic DDIM steps, CFG, log-probs, decode."""

    def setup(b: Bench):
        from refl_ddpo.trainers.ddpo import sample_epoch

        config, pipe, unet, _, _, negative_embed = _ddpo_setup(b)
        reward, prompt_fn = _pixel_mean_reward(), b.prompt_fn

        def run():
            unet.eval()
            batches = sample_epoch(
                pipe,
                unet,
                pipe.scheduler,
                prompt_fn,
                reward,
                negative_embed,
                config,
                b.generator,
                b.device,
                b.accelerator.autocast,
            )
            return batches[0].images

        return run, {"unet": pipe.unet, "vae": pipe.vae}

    return Case(f"ddpo_sample b{batch}", "ddpo_sample", "sampled batch", batch, {"batch": batch}, setup)


def ddpo_train_case(batch: int, micro: int) -> Case:
    """refl_ddpo.trainers.ddpo.train_on_samples over one sampled batch: every timestep, CFG, PPO-clip."""

    def setup(b: Bench):
        from refl_ddpo.trainers.ddpo import collect_rewards, sample_epoch, stack_samples, train_on_samples

        config, pipe, unet, optimizer, params, negative_embed = _ddpo_setup(b)
        # One sampled batch to train on (not timed); advantages random in [-5, 5] (adv_clip_max).
        batches = sample_epoch(
            pipe,
            unet,
            pipe.scheduler,
            b.prompt_fn,
            _pixel_mean_reward(),
            negative_embed,
            config,
            b.generator,
            b.device,
            b.accelerator.autocast,
        )
        collect_rewards(batches)
        advantages = torch.randn(batch, generator=b.generator).clamp(-5, 5)  # (B,)
        samples = stack_samples(batches, advantages)
        del batches

        def run():
            steps = train_on_samples(
                unet,
                pipe.scheduler,
                samples,
                negative_embed,
                config,
                b.accelerator,
                optimizer,
                params,
                b.generator,
            )
            return torch.tensor([s["loss"] for s in steps])

        return run, {"unet": pipe.unet}

    return Case(
        f"ddpo_train b{batch}",
        "ddpo_train",
        "training pass",
        batch,
        {"batch": batch, "micro_batch": micro},
        setup,
    )


def inference_case(batch: int) -> Case:
    """refl_ddpo.generate.generate_batch: text encoder, 50 DDIM steps with CFG, decode (weights in dtype)."""

    def setup(b: Bench):
        from refl_ddpo.generate import generate_batch

        pipe = b.pipeline(b.build("unet"), scheduler="ddim")
        b.finish(pipe.unet, pipe.vae)
        prompt_fn = b.prompt_fn

        def run():
            prompts = [prompt_fn()[0] for _ in range(batch)]
            seeds = torch.randint(2**31, (batch,), generator=b.generator).tolist()
            return generate_batch(
                pipe,
                prompts,
                seeds,
                b.resolution,
                b.cfg.inference_steps,
                b.cfg.inference_guidance_scale,
                eta=0.0,
            )

        return run, {"unet": pipe.unet, "vae": pipe.vae}

    return Case(f"inference b{batch}", "inference", "batch", batch, {"batch": batch}, setup)


def forward_case(name: str) -> Case:
    """One no-grad forward of one model: that the architecture builds and runs, and what it costs."""

    def setup(b: Bench):
        model = b.build(name)
        b.finish(**({name: model} if name in ("unet", "vae", "reward") else {}))
        side = b.resolution // b.vae_scale_factor
        gen, dev, dt = b.generator, b.device, b.dtype

        def run():
            with torch.no_grad():
                if name == "unet":
                    shape = (1, b.configs["unet"]["in_channels"], side, side)
                    states = torch.randn(
                        1,
                        b.configs["text_encoder"]["max_position_embeddings"],
                        b.configs["unet"]["cross_attention_dim"],
                        generator=gen,
                    )
                    return model(
                        torch.randn(shape, generator=gen).to(dev, dt),
                        999,
                        encoder_hidden_states=states.to(dev, dt),
                        return_dict=False,
                    )[0]
                if name == "vae":
                    latents = torch.randn(1, b.configs["vae"]["latent_channels"], side, side, generator=gen)
                    return model.decode(latents.to(dev, dt), return_dict=False)[0]
                if name == "text_encoder":
                    ids = b.clip_tokenizer(
                        b.prompts(1)[0],
                        padding="max_length",
                        max_length=77,
                        truncation=True,
                        return_tensors="pt",
                    ).input_ids
                    return model(ids.to(dev))[0]
                ids, mask = model.tokenize(b.prompts(1)[0])
                pixels = torch.rand(1, 3, model.image_size, model.image_size, generator=gen)
                return model(ids, mask, pixels.to(dev))

        return run, {name: model}

    return Case(f"forward {name}", "forward", "forward", 1, {"model": name}, setup)


def make_cases(cfg: BenchConfig) -> list[Case]:
    cases: list[Case] = []
    for bench in cfg.cases:
        if bench == "refl":
            cases += [refl_case(m, bs) for m in cfg.refl_modes for bs in cfg.refl_batch_sizes]
        elif bench == "ddpo_sample":
            cases.append(ddpo_sample_case(cfg.ddpo_sample_batch_size))
        elif bench == "ddpo_train":
            cases.append(ddpo_train_case(cfg.ddpo_sample_batch_size, cfg.ddpo_train_batch_size))
        elif bench == "inference":
            cases += [inference_case(bs) for bs in cfg.inference_batch_sizes]
        elif bench == "forward":
            cases += [forward_case(n) for n in ("unet", "vae", "text_encoder", "reward")]
    for case in cases:  # the step counts of this config, for the JSON
        if case.bench == "refl":
            case.settings.update(
                steps=cfg.refl_steps, k=cfg.refl_k, unet_calls=cfg.refl_k + 1, sampler="ddpm"
            )
        elif case.bench.startswith("ddpo"):
            case.settings.update(steps=cfg.ddpo_steps, guidance_scale=cfg.ddpo_guidance_scale, eta=1.0)
        elif case.bench == "inference":
            case.settings.update(
                steps=cfg.inference_steps, guidance_scale=cfg.inference_guidance_scale, eta=0.0
            )
    return cases


# --------------------------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------------------------


def time_runs(run: Callable[[], torch.Tensor], n: int, device: torch.device) -> list[float]:
    """Seconds of each of `n` runs: CUDA events around the run on a GPU (the run's device work, queued after
    everything before it), the host clock on a CPU (where every op has finished when it returns)."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return times


def flop_counter_mode():
    """torch.utils.flop_counter.FlopCounterMode that also counts the CPU SDPA kernel."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    # PyTorch's counter has formulas for the CUDA SDPA kernels only; the CPU kernel computes the same products.
    # custom_mapping passes shapes (q, k, v) / (grad_out, q, k, v) in the kernels' argument order.
    cpu_sdpa = {
        aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *args, out_shape=None, **kw: (
            flop_counter.sdpa_flop_count(q, k, v)
        ),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda g, q, k, v, *args, out_shape=None, **kw: (
            flop_counter.sdpa_backward_flop_count(g, q, k, v)
        ),
    }
    return flop_counter.FlopCounterMode(display=False, custom_mapping=cpu_sdpa)


def count_flops(
    run: Callable[[], torch.Tensor], models: dict, checkpointed: bool
) -> tuple[int, torch.Tensor]:
    """FLOPs of one run (matmuls, convolutions, attention; forward and backward), as model FLOPs: gradient
    checkpointing's recomputation is left out (switched off for this run) and compiled modules run eagerly."""
    if checkpointed:
        set_checkpointing(False, models.get("unet"), models.get("vae"), models.get("reward"))
    try:
        with torch.compiler.set_stance("force_eager"), flop_counter_mode() as counter:
            output = run()
    finally:
        if checkpointed:
            set_checkpointing(True, models.get("unet"), models.get("vae"), models.get("reward"))
    return counter.get_total_flops(), output


def count_syncs(run: Callable[[], torch.Tensor]) -> int:
    """Device->host synchronisations in one run, as torch.cuda.set_sync_debug_mode reports them (CUDA only)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def measure(b: Bench, case: Case) -> dict:
    cfg, device = b.cfg, b.device
    result = {
        "name": case.name,
        "bench": case.bench,
        "unit": case.unit,
        "images": case.images,
        "settings": case.settings,
    }
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t_build = time.perf_counter()
    run, models = None, {}
    try:
        run, models = case.setup(b)
        if cuda:
            torch.cuda.synchronize(device)
        result["setup_s"] = time.perf_counter() - t_build
        warm = time_runs(run, cfg.warmup, device)
        result["warmup_s"] = warm
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = time_runs(run, cfg.repeats, device)
        if cuda:
            result["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        else:
            result["peak_rss_bytes"] = peak_rss_bytes()
        result.update(times_s=times, median_s=statistics.median(times), min_s=min(times), max_s=max(times))
        result["per_image_s"] = result["median_s"] / case.images
        result["flops"], output = count_flops(run, models, cfg.gradient_checkpointing)
        if not torch.isfinite(output).all():  # random weights must not time NaN/inf arithmetic
            result["error"] = "non-finite output: the timing ran on NaN/inf values"
        result["tflops_per_s"] = result["flops"] / result["median_s"] / 1e12
        if cuda:
            result["mfu"] = result["tflops_per_s"] / cfg.peak_tflops
            result["host_syncs"] = count_syncs(run)
    except torch.OutOfMemoryError as e:
        result["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
    finally:
        del run, models
        b.accelerator.free_memory()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------------------------------------------
# FLOPs without running: per-sample counts of each model call on the meta device, composed per case
# --------------------------------------------------------------------------------------------------------------


def per_sample_flops(configs: dict[str, dict], resolution: int, lora_rank: int) -> dict[str, int]:
    """Model FLOPs of one sample through each model call the cases make, counted on the meta device (no memory,
    no arithmetic): forward only, or forward + backward with the gradients the trainers need."""
    from refl_ddpo.lora import add_lora, trainable_full_unet

    side = resolution // 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
    text_len = configs["text_encoder"]["max_position_embeddings"]

    def count(fn: Callable[[], object]) -> int:
        with flop_counter_mode() as counter:
            fn()
        return counter.get_total_flops()

    def unet_call(unet):
        latents = torch.randn(1, configs["unet"]["in_channels"], side, side)  # x_t: made under no grad
        states = torch.randn(1, text_len, configs["unet"]["cross_attention_dim"])
        return unet(latents, 999, encoder_hidden_states=states, return_dict=False)[0]

    flops = {}
    with torch.device("meta"):
        text_encoder, vae = (
            construct("text_encoder", configs["text_encoder"]),
            construct("vae", configs["vae"]),
        )
        reward, unet = construct("reward", configs["reward"]), construct("unet", configs["unet"])
        for model in (text_encoder, vae, reward, unet):
            model.requires_grad_(False)
        ids = torch.zeros(1, text_len, dtype=torch.long)
        with torch.no_grad():
            flops["text_encoder"] = count(lambda: text_encoder(ids))
            flops["unet"] = count(lambda: unet_call(unet))
            flops["vae_decode"] = count(lambda: vae.decode(torch.randn(1, 4, side, side)))
        # ReFL's grad path: d reward / d pixels -> VAE decoder -> UNet output -> trained weights.
        pixels = torch.randn(1, 3, reward.image_size, reward.image_size, requires_grad=True)
        reward_ids = torch.zeros(1, 35, dtype=torch.long)
        # No attention mask: transformers reads the mask's values (.all()), which meta tensors do not have; an
        # all-ones mask changes no matmul.
        flops["reward_fwd_bwd"] = count(lambda: reward(reward_ids, None, pixels).sum().backward())
        latents = torch.randn(1, 4, side, side, requires_grad=True)
        flops["vae_decode_fwd_bwd"] = count(
            lambda: vae.decode(latents, return_dict=False)[0].sum().backward()
        )
        add_lora(unet, lora_rank, float(lora_rank), ["to_q", "to_k", "to_v", "to_out.0"])
        with torch.no_grad():
            flops["unet_lora"] = count(lambda: unet_call(unet))
        flops["unet_lora_fwd_bwd"] = count(lambda: unet_call(unet).sum().backward())
        full = construct("unet", configs["unet"])
        trainable_full_unet(full)
        flops["unet_full_fwd_bwd"] = count(lambda: unet_call(full).sum().backward())
    return flops


def composed_flops(cfg: BenchConfig, case: Case, f: dict[str, int]) -> int:
    """A case's model FLOPs from per-sample counts (every count is linear in the batch). CFG doubles the UNet
    batch; ReFL has no CFG; DDPO samples with the LoRA UNet and computes the empty-prompt embedding once per
    training run, not per batch."""
    s, n = case.settings, case.images
    if case.bench == "refl":
        no_grad_unet = f["unet_lora"] if s["mode"] == "lora" else f["unet"]
        return n * (
            f["text_encoder"]
            + s["k"] * no_grad_unet
            + f[f"unet_{s['mode']}_fwd_bwd"]
            + f["vae_decode_fwd_bwd"]
            + f["reward_fwd_bwd"]
        )
    if case.bench == "ddpo_sample":
        return n * (f["text_encoder"] + 2 * s["steps"] * f["unet_lora"] + f["vae_decode"])
    if case.bench == "ddpo_train":
        return 2 * n * s["steps"] * f["unet_lora_fwd_bwd"]
    if case.bench == "inference":
        return n * (2 * f["text_encoder"] + 2 * s["steps"] * f["unet"] + f["vae_decode"])
    raise ValueError(case.bench)


def run_flops_only(cfg: BenchConfig, argv: list[str]) -> dict:
    """--flops_only: every case's model FLOPs and its time floor at --peak_tflops, without running anything."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resolution = cfg.resolution or (32 if cfg.tiny else 512)
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        configs = model_configs(cfg.tiny, Path(workdir))
    per_sample = per_sample_flops(configs, resolution, cfg.lora_rank)
    cases = [c for c in make_cases(cfg) if c.bench != "forward"]
    rows = []
    for case in cases:
        flops = composed_flops(cfg, case, per_sample)
        rows.append(
            {
                "name": case.name,
                "unit": case.unit,
                "images": case.images,
                "settings": case.settings,
                "flops": flops,
                "floor_s": flops / (cfg.peak_tflops * 1e12),
            }
        )
    results = {
        "meta": {
            "command": " ".join(["python benchmarks/bench.py", *argv]),
            "tiny": cfg.tiny,
            "resolution": resolution,
            "peak_tflops": cfg.peak_tflops,
            "parameters": parameter_counts(configs),
            "per_sample_flops": per_sample,
        },
        "cases": rows,
    }
    lines = [
        f"| case | one run | TFLOP/run | floor at {cfg.peak_tflops:g} TFLOP/s | floor per image |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {r['unit']} | {r['flops'] / 1e12:.4g} | {_fmt_s(r['floor_s'])} | "
        f"{_fmt_s(r['floor_s'] / r['images'])} |"
        for r in rows
    ]
    per = ", ".join(f"{k} {v / 1e9:.4g}" for k, v in per_sample.items())
    table = (
        "\n".join(lines)
        + f"\n\n- Model FLOPs (matmul, convolution, attention) composed from per-sample counts "
        f"on the meta device, {resolution} px; GFLOP per sample: {per}.\n- The floor is FLOPs / peak: no run "
        "can be faster; elementwise work (norms, activations, the scheduler) and launch gaps come on top.\n"
        "- Attention backward is counted as autograd of the plain products (4 matmuls); the fused SDPA kernels "
        "that the timed runs count also recompute the scores (a 5th), so their counts are ~1 % higher.\n"
    )
    for name, text in (("flops.json", json.dumps(results, indent=2) + "\n"), ("flops.md", table)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    print(table, flush=True)
    return results


# --------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict:
    import diffusers
    import peft
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / GIB, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def markdown_table(results: dict) -> str:
    meta, rows = results["meta"], results["cases"]
    cuda = meta["device"].startswith("cuda")
    mem_head = "peak mem (GiB, allocated)" if cuda else "peak RSS (GiB, process)"
    head = ["case", "one run", "median", "min-max", "per image", mem_head, "TFLOP/run", "TFLOP/s"]
    if cuda:
        head += ["MFU", "host syncs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['unit']} | {r['error']} |" + " |" * (len(head) - 3))
            continue
        mem = r.get("peak_mem_bytes", r.get("peak_rss_bytes", 0)) / GIB
        cells = [
            r["name"],
            r["unit"],
            _fmt_s(r["median_s"]),
            f"{_fmt_s(r['min_s'])} - {_fmt_s(r['max_s'])}",
            _fmt_s(r["per_image_s"]),
            f"{mem:.2f}",
            f"{r['flops'] / 1e12:.3g}",
            f"{r['tflops_per_s']:.3g}",
        ]
        if cuda:
            cells += [f"{100 * r['mfu']:.1f} %", str(r["host_syncs"])]
        lines.append("| " + " | ".join(cells) + " |")
    params = ", ".join(f"{k} {v / 1e6:.4g}M" for k, v in meta["parameters"].items())
    opts = meta["options"]
    on_off = {True: "on", False: "off"}
    models = "tiny (refl_ddpo.tiny)" if meta["tiny"] else "SD v1.5 architecture, random weights"
    machine = meta["machine"].get("gpu") or meta["machine"].get("cpu")
    tf32 = on_off[opts["tf32"]] if cuda else "n/a"
    notes = [
        f"Models: {models}; parameters: {params}.",
        (
            f"Device {meta['device']} ({machine}, CPU threads: {meta['machine']['cpu_threads']}), dtype "
            f"{meta['dtype']}, {meta['resolution']} px, attention {opts['attention']}, TF32 {tf32}, channels_last "
            f"{on_off[opts['channels_last']]}, gradient checkpointing {on_off[opts['gradient_checkpointing']]}, "
            f"compile {on_off[opts['compile']]}."
        ),
        f"Median of {opts['repeats']} runs after {opts['warmup']} warm-up run(s); "
        + ("CUDA events." if cuda else "perf_counter."),
        (
            f"ReFL: {opts['refl_steps']} DDPM steps, grad at fixed step k = {opts['refl_k']} "
            f"({opts['refl_k'] + 1} UNet calls), CFG off; DDPO: {opts['ddpo_steps']} steps, CFG "
            f"{opts['ddpo_guidance_scale']}, train micro-batch {opts['ddpo_train_batch_size']}; inference: "
            f"{opts['inference_steps']} DDIM steps, CFG {opts['inference_guidance_scale']}."
        ),
        "TFLOP/run: model FLOPs of one run (torch.utils.flop_counter; no checkpointing recomputation)."
        + (f" MFU against {opts['peak_tflops']:g} TFLOP/s." if cuda else ""),
    ]
    if not cuda:
        notes.append(
            "Peak RSS is process-wide and monotone: each row includes everything that ran before it."
        )
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


def run_benchmark(cfg: BenchConfig, argv: list[str]) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        configs = model_configs(cfg.tiny, Path(workdir))
        b = Bench(cfg, configs, Path(workdir))
        results = {
            "meta": {
                "command": " ".join(["python benchmarks/bench.py", *argv]),
                "argv": argv,
                "tiny": cfg.tiny,
                "device": str(b.device),
                "dtype": str(b.dtype).removeprefix("torch."),
                "resolution": b.resolution,
                "parameters": parameter_counts(configs),
                "options": dataclasses.asdict(cfg),
                "machine": machine_info(b.device),
            },
            "cases": [],
        }
        print(
            f"benchmark: {'tiny models' if cfg.tiny else 'SD v1.5 architecture'} on {b.device}, "
            f"{results['meta']['dtype']}, {b.resolution} px",
            flush=True,
        )
        for case in make_cases(cfg):
            t0 = time.perf_counter()
            r = measure(b, case)
            results["cases"].append(r)
            what = r.get("error") or f"median {_fmt_s(r['median_s'])}"
            print(f"  {case.name:<24} {what}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    table = markdown_table(results)
    for name, text in (("results.json", json.dumps(results, indent=2) + "\n"), ("results.md", table)):
        tmp = out / f".{name}.tmp"  # written whole, then renamed: no half-written results
        tmp.write_text(text)
        tmp.replace(out / name)
    print("\n" + table, flush=True)
    return results


# --------------------------------------------------------------------------------------------------------------
# sweep: one child process per speed option, then a before/after table
# --------------------------------------------------------------------------------------------------------------


def sweep_variants(device: torch.device) -> list[tuple[str, str, list[str]]]:
    """(folder, label, flags): a ladder where each row changes one thing from the row before it."""
    if device.type == "cuda":
        return [
            (
                "fp32_eager_notf32",
                "fp32, eager attention, no TF32",
                ["--dtype", "fp32", "--attention", "eager", "--no-tf32"],
            ),
            ("fp32_eager", "+ TF32", ["--dtype", "fp32", "--attention", "eager"]),
            ("bf16_eager", "+ bf16 weights and autocast", ["--dtype", "bf16", "--attention", "eager"]),
            ("bf16", "+ SDPA (the default)", ["--dtype", "bf16"]),
            ("fp16", "fp16 instead of bf16", ["--dtype", "fp16"]),
            ("bf16_cl", "bf16 + channels_last", ["--dtype", "bf16", "--channels_last"]),
            ("bf16_gc", "bf16 + gradient checkpointing", ["--dtype", "bf16", "--gradient_checkpointing"]),
            ("bf16_compile", "bf16 + torch.compile", ["--dtype", "bf16", "--compile"]),
        ]
    # CPU: no TF32; torch.compile is left out (minutes of C++ compilation per case on a small CPU).
    return [
        ("fp32_eager", "fp32, eager attention", ["--dtype", "fp32", "--attention", "eager"]),
        ("fp32", "+ SDPA (the default)", ["--dtype", "fp32"]),
        ("fp32_cl", "fp32 + channels_last", ["--dtype", "fp32", "--channels_last"]),
        ("fp32_gc", "fp32 + gradient checkpointing", ["--dtype", "fp32", "--gradient_checkpointing"]),
        ("bf16", "bf16 weights and autocast", ["--dtype", "bf16"]),
    ]


_VARIANT_FIELDS = {"dtype", "attention", "tf32", "channels_last", "gradient_checkpointing", "compile"}


def child_flags(cfg: BenchConfig) -> list[str]:
    """The flags of `cfg` that every variant shares (everything but the speed options, --out and --sweep)."""
    flags = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in _VARIANT_FIELDS | {"out", "sweep"} or value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{f.name}" if value else f"--no-{f.name}")
        elif isinstance(value, list):
            flags += [f"--{f.name}", *map(str, value)]
        else:
            flags += [f"--{f.name}", str(value)]
    return flags


def run_sweep(cfg: BenchConfig) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    shared = child_flags(cfg)
    done: list[tuple[str, dict]] = []
    for folder, label, flags in sweep_variants(cfg.resolved_device):
        argv = [*shared, *flags, "--out", str(out / folder)]
        results_file = out / folder / "results.json"
        if results_file.is_file():
            old = json.loads(results_file.read_text())
            if old["meta"].get("argv") == argv:
                print(f"sweep: {label}: kept {results_file}", flush=True)
                done.append((label, old))
                continue
        print(f"sweep: {label}: python benchmarks/bench.py {' '.join(argv)}", flush=True)
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], check=False)
        if proc.returncode != 0:
            raise UserError(
                f"sweep variant '{label}' failed (exit {proc.returncode}); its command is printed above."
            )
        done.append((label, json.loads(results_file.read_text())))
    table = sweep_table(done)
    (out / "sweep.md").write_text(table)
    (out / "sweep.json").write_text(json.dumps({label: r for label, r in done}, indent=2) + "\n")
    print("\n" + table, flush=True)


def sweep_table(done: list[tuple[str, dict]]) -> str:
    """Rows: cases; columns: variants; cells: median time and peak memory."""
    cuda = done[0][1]["meta"]["device"].startswith("cuda")
    names = [r["name"] for r in done[0][1]["cases"]]
    head = ["case", *(label for label, _ in done)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells = [name]
        for _, results in done:
            r = next((c for c in results["cases"] if c["name"] == name), None)
            if r is None or "error" in r:
                cells.append("OOM" if r and "memory" in r["error"] else "-")
                continue
            mem = r.get("peak_mem_bytes", r.get("peak_rss_bytes", 0)) / GIB
            cells.append(
                f"{_fmt_s(r['median_s'])}, {mem:.2f} GiB" + (f", {100 * r['mfu']:.0f} %" if cuda else "")
            )
        lines.append("| " + " | ".join(cells) + " |")
    meta = done[0][1]["meta"]
    note = (
        f"Median time per run, peak {'allocated GPU memory' if cuda else 'process RSS (monotone within a run)'}"
        + (", MFU" if cuda else "")
        + f"; {meta['device']}, {meta['resolution']} px, "
        f"{'tiny models' if meta['tiny'] else 'SD v1.5 architecture'}; each column is a separate process."
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


@cli_main
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_config(BenchConfig, argv, description=__doc__)
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    # diffusers warns on every `.to(dtype)` of a model built from a config (it has no fp32-only modules to keep).
    logging.getLogger("diffusers.models.modeling_utils").addFilter(
        lambda record: not record.getMessage().startswith("There are modules in")
    )
    if cfg.flops_only:
        run_flops_only(cfg, argv)
    elif cfg.sweep:
        run_sweep(cfg)
    else:
        run_benchmark(cfg, argv)


if __name__ == "__main__":
    main()
