"""The benchmarks' harness: `Bench` (device, dtype, options, configs and tokenizers of one run; builds models and
model families as the trainers do) and gradient checkpointing on the models a case uses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from benchmarks.config import BenchConfig
from benchmarks.models import (
    construct,
    flux_configs,
    sd3_configs,
    sdxl_configs,
)
from refl_ddpo.core.errors import UserError


def set_checkpointing(enable: bool, unet=None, vae=None, reward=None) -> None:
    for model in (unet, vae):
        if model is not None and model._supports_gradient_checkpointing:  # AutoencoderKLWan has none
            model.enable_gradient_checkpointing() if enable else model.disable_gradient_checkpointing()
    if reward is not None:
        reward.set_gradient_checkpointing(enable)


class Bench:
    """Device, dtype, options, configs and tokenizers of one run; builds models and model families as the trainers
    do."""

    def __init__(self, cfg: BenchConfig, configs: dict[str, dict], workdir: Path):
        from transformers import BertTokenizer, CLIPTokenizer

        from refl_ddpo.core.prompts import get_prompt_fn
        from refl_ddpo.rewards import imagereward
        from refl_ddpo.run.config import CommonConfig
        from refl_ddpo.run.training import make_accelerator

        self.cfg = cfg
        self.workdir = workdir
        self._sd3_configs = None
        self._sdxl_configs = None
        self._flux_configs = None
        # Set by a case's setup for the memory count (the FLUX.1 cases); measure() clears them after the case, or
        # the family they hold (its transformer too) would stay on the device through the next case.
        self.text_encoder_family = None
        self.text_encoder_bytes = None
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
            lora_target_modules=["to_q", "to_k", "to_v", "to_out.0"],  # the SD family's default
            gradient_checkpointing=cfg.gradient_checkpointing,
        )
        # accelerate keeps one state per process and refuses another mixed precision: a bench (or a test before it,
        # in the same process) may have made one already
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        self.accelerator = make_accelerator(
            1,
            mixed_precision=self.common.mixed_precision,
            report_to=self.common.report_to,
            output_dir=self.common.output_dir,
            logging_dir=self.common.logging_dir,
            device=self.common.device,
            allow_tf32=self.common.allow_tf32,
        )
        self.device = self.accelerator.device
        if self.device.type == "cuda":  # make_accelerator only ever switches TF32 on
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32
            torch.backends.cuda.enable_cudnn_sdp(cfg.cudnn_attention)
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
        if name in self.configs:
            config = self.configs[name]
        elif name.startswith("sdxl_"):
            config = self.sdxl_configs[name]
        elif name.startswith("flux_"):
            config = self.flux_configs[name]
        else:
            config = self.sd3_configs[name]
        with torch.device(self.device):
            model = construct(name, config, self.cfg.attention, self.bert_tokenizer)
        model.requires_grad_(False).eval()
        model.to(dtype=self.dtype)
        if name in (
            "unet",
            "vae",
            "sd3_transformer",
            "sd3_vae",
            "sdxl_unet",
            "sdxl_vae",
            "flux_transformer",
            "flux_vae",
        ):
            if self.cfg.attention == "eager" and name != "flux_transformer":  # FLUX keeps its own processor
                from diffusers.models.attention_processor import AttnProcessor

                model.set_attn_processor(AttnProcessor())
            if self.cfg.channels_last:
                model.to(memory_format=torch.channels_last)
        if name == "reward" and self.cfg.attention == "eager":
            for module in model.modules():  # timm's Attention: explicit matmul-softmax instead of SDPA
                if hasattr(module, "fused_attn"):
                    module.fused_attn = False
        return model

    def family(self, unet):
        """The Stable Diffusion family around `unet` with a fresh VAE and text encoder: what `load_family` gives for
        an SD v1.x folder (its PNDM scheduler config; callers take DDIM / DDPM from it with `family.scheduler`)."""
        from diffusers import PNDMScheduler, StableDiffusionPipeline

        from refl_ddpo.core.families.sd import StableDiffusion
        from refl_ddpo.testing.tiny_parts import SD_SCHEDULER_CONFIG

        return StableDiffusion(
            StableDiffusionPipeline(
                unet=unet,
                vae=self.build("vae"),
                text_encoder=self.build("text_encoder"),
                tokenizer=self.clip_tokenizer,
                scheduler=PNDMScheduler.from_config(SD_SCHEDULER_CONFIG),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        )

    @property
    def sd3_configs(self) -> dict[str, dict]:
        if self._sd3_configs is None:
            self._sd3_configs = sd3_configs(self.cfg.tiny, self.workdir)
        return self._sd3_configs

    def sd3_family(self, transformer, t5: bool):
        """The Stable Diffusion 3 family around `transformer` with a fresh 16-channel VAE, CLIP-L, CLIP-G and (with
        `t5`) T5 encoder: what `load_family` gives for an SD3.5 folder (without T5: `drop_t5`)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        from refl_ddpo.core.families.sd3 import StableDiffusion3
        from refl_ddpo.testing.tiny_parts import t5_tokenizer

        return StableDiffusion3(
            StableDiffusion3Pipeline(
                transformer=transformer,
                vae=self.build("sd3_vae"),
                text_encoder=self.build("sd3_clip_l"),
                tokenizer=self.clip_tokenizer,
                text_encoder_2=self.build("sd3_clip_g"),
                tokenizer_2=self.clip_tokenizer,
                text_encoder_3=self.build("sd3_t5") if t5 else None,
                tokenizer_3=t5_tokenizer() if t5 else None,
                scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),  # SD3.5's
            )
        )

    @property
    def sdxl_configs(self) -> dict[str, dict]:
        if self._sdxl_configs is None:
            self._sdxl_configs = sdxl_configs(self.cfg.tiny, self.workdir)
        return self._sdxl_configs

    def sdxl_family(self, unet):
        """The SDXL family around `unet` with a fresh VAE, CLIP-L and CLIP-G: what `load_family` gives for an SDXL
        base folder (its Euler scheduler config; force_zeros_for_empty_prompt)."""
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        from refl_ddpo.core.families.sdxl import StableDiffusionXL
        from refl_ddpo.testing.tiny_parts import SD_SCHEDULER_CONFIG

        return StableDiffusionXL(
            StableDiffusionXLPipeline(
                unet=unet,
                vae=self.build("sdxl_vae"),
                text_encoder=self.build("sdxl_clip_l"),
                text_encoder_2=self.build("sdxl_clip_g"),
                tokenizer=self.clip_tokenizer,
                tokenizer_2=self.clip_tokenizer,
                scheduler=EulerDiscreteScheduler.from_config(
                    {**SD_SCHEDULER_CONFIG, "timestep_spacing": "leading"}
                ),
                add_watermarker=False,
            )
        )

    @property
    def flux_configs(self) -> dict[str, dict]:
        if self._flux_configs is None:
            self._flux_configs = flux_configs(self.cfg.tiny, self.workdir)
        return self._flux_configs

    def flux_family(self, transformer):
        """The FLUX.1 family around `transformer` with a fresh 16-channel VAE, CLIP-L and T5-XXL encoder: what
        `load_family` gives for a FLUX.1-dev folder (its scheduler config: dynamic shifting)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        from refl_ddpo.core.families.flux import Flux
        from refl_ddpo.testing.tiny_flux import DEV_SCHEDULER
        from refl_ddpo.testing.tiny_parts import t5_tokenizer

        return Flux(
            FluxPipeline(
                transformer=transformer,
                vae=self.build("flux_vae"),
                text_encoder=self.build("flux_clip_l"),
                tokenizer=self.clip_tokenizer,
                text_encoder_2=self.build("flux_t5"),
                tokenizer_2=t5_tokenizer(),
                scheduler=FlowMatchEulerDiscreteScheduler(**DEV_SCHEDULER),
            )
        )

    def trainable_unet(
        self, mode: str, config=None, name: str = "unet", targets: list[str] | None = None
    ) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        """The UNet (or the network `name`) as the trainers set it up (refl_ddpo.run.training.make_trainable): LoRA on
        a frozen base in dtype (adapters fp32) on `targets` (default: the SD family's), or all of it in fp32;
        gradient checkpointing if asked."""
        from refl_ddpo.run.session import trainable_spec
        from refl_ddpo.run.training import make_trainable

        unet = self.build(name)
        config = dataclasses.replace(
            config or self.common,
            use_lora=mode == "lora",
            lora_rank=self.cfg.lora_rank,
            lora_target_modules=targets or self.common.lora_target_modules,
            gradient_checkpointing=self.cfg.gradient_checkpointing,
        )
        return unet, make_trainable(unet, trainable_spec(config))

    def prepare(self, unet, params, config, gradient_accumulation_steps: int = 1):
        """The trainers' `make_optimizer` + `accelerator.prepare(unet, optimizer)`. Sharded (FSDP, the memory count's
        --fsdp_world_size): `params` becomes the sharded parameters in place, as the trainers' `run.params`."""
        from refl_ddpo.core.sharding import is_sharded, trainable_params
        from refl_ddpo.run.training import make_optimizer

        config = config or self.common
        self.accelerator.gradient_accumulation_steps = gradient_accumulation_steps
        optimizer = make_optimizer(
            params,
            learning_rate=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.adam_weight_decay,
            eps=config.adam_epsilon,
            use_8bit_adam=config.use_8bit_adam,
        )
        unet, optimizer = self.accelerator.prepare(unet, optimizer)
        if is_sharded(
            self.accelerator
        ):  # fully_shard replaced the parameters (the optimizer holds the new ones)
            params[:] = trainable_params(unet)
        return unet, optimizer

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
        prompts, metadata = zip(*(self.prompt_fn() for _ in range(batch)), strict=False)
        return list(prompts), list(metadata)

    def ddpo_config(self, eta: float = 1.0):
        """The DDPO trainer's config for one sampled batch and one training pass over it (one optimizer step);
        `eta`: the sampler's noise (DDIM eta; the flow SDE's noise level on FLUX.1)."""
        from refl_ddpo.trainers.ddpo_config import DDPOConfig

        c = self.cfg
        return DDPOConfig(
            sample_batch_size=c.ddpo_sample_batch_size,
            sample_num_batches_per_epoch=1,
            sample_num_steps=c.ddpo_steps,
            sample_guidance_scale=c.ddpo_guidance_scale,
            sample_eta=eta,
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
