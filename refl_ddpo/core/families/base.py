"""What a model family provides to the core: the loop, the LoRA core, the trainers and inference call only this.

A family wraps one loaded diffusers pipeline. Prompt conditioning travels as a dict of batch-first tensors
(`Cond`), so that a family with more than one text tensor (SD3's pooled embeddings) fits the same loop, the same
DDPO sample buffers (indexed and concatenated key by key) and the same CFG batching.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import ClassVar

import torch

Cond = dict[str, torch.Tensor]  # e.g. {"prompt_embeds": (B, L, D)}; every tensor batch-first

# The pipeline attributes of the text encoders (absent or None where a family or a folder has fewer).
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")


def cond_expand(cond: Cond, batch_size: int) -> Cond:
    """A conditioning of batch 1 (the empty prompt) repeated to `batch_size` (views, no copy)."""
    return {k: v.expand(batch_size, *v.shape[1:]) for k, v in cond.items()}


def cond_cat(conds: list[Cond]) -> Cond:
    """The conditionings side by side (batch dim). Sequences of unequal length (Qwen-Image's text, padded to each
    batch's longest prompt) are right-padded with zeros first, which its mask marks as padding."""
    out = {}
    for k in conds[0]:
        parts = [c[k] for c in conds]
        n = max(p.shape[1] for p in parts) if parts[0].ndim > 1 else None
        if n is not None and any(p.shape[1] != n for p in parts):
            pad = [(0, 0) * (p.ndim - 2) + (0, n - p.shape[1]) for p in parts]
            parts = [torch.nn.functional.pad(p, padding) for p, padding in zip(parts, pad, strict=True)]
        out[k] = torch.cat(parts)
    return out


def pooled_conds(embeds, negative, pooled, negative_pooled, with_negative: bool) -> tuple[Cond, Cond | None]:
    """(cond, uncond or None) from what SDXL's and SD3's `encode_prompt` return: the text and pooled embeddings of
    the prompts and of the negative."""
    cond = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    uncond = {"prompt_embeds": negative, "pooled_prompt_embeds": negative_pooled} if with_negative else None
    return cond, uncond


def cfg_inputs(
    latents: torch.Tensor, timesteps: torch.Tensor, cond: Cond, uncond: Cond | None, guidance_scale: float
) -> tuple[torch.Tensor, torch.Tensor, Cond, bool]:
    """The network's inputs (latents, timesteps, conditioning, doubled) with CFG as the pipelines batch it: the
    doubled batch [uncond, text] when guidance_scale > 1 and `uncond` is given (doubled True), else the inputs as
    they are. `timesteps` is a scalar or one per sample (B,). The caller calls the network on them and hands its
    output to `cfg_combine`."""
    if guidance_scale > 1.0 and uncond is not None:
        if timesteps.ndim == 1:
            timesteps = torch.cat([timesteps, timesteps])
        return torch.cat([latents, latents]), timesteps, cond_cat([uncond, cond]), True
    return latents, timesteps, cond, False


def cfg_combine(out: torch.Tensor, guidance_scale: float, doubled: bool) -> torch.Tensor:
    """The network's output on `cfg_inputs`' batch guided: uncond + s (text - uncond) from the doubled batch's two
    halves, or `out` itself when it was not doubled."""
    if not doubled:
        return out
    out_uncond, out_text = out.chunk(2)
    return out_uncond + guidance_scale * (out_text - out_uncond)


class ModelFamily(ABC):
    """One model family (SD 1.x/2.x, SD3 ...): a loaded, frozen pipeline and the maths that differ by family."""

    name: ClassVar[str]  # e.g. "sd"
    pipeline_class: ClassVar[str]  # model_index.json's _class_name that selects this family
    network_name: ClassVar[str]  # the pipeline attribute of the denoising network ("unet", "transformer")
    lora_target_modules: ClassVar[list[str]]  # default LoRA targets (module names inside the network)
    # Samplers the inference scripts offer, name -> diffusers class; the first is the default.
    schedulers: ClassVar[dict[str, str]]
    # The guidance a guidance-distilled network takes as an input (FLUX.1-dev's embedded guidance), as its pipeline
    # sets it by default; None for a family that guides with classifier-free guidance (see default_guidance_scale).
    embedded_guidance_default: ClassVar[float | None] = None
    # Whether the family conditions on source images (an edit family: `encode_conditioning` reads them), so that
    # --edit_data is refused before loading for one that would ignore them.
    edits_images: ClassVar[bool] = False

    @classmethod
    def default_guidance_scale(cls, cfg_default: float) -> float:
        """The guidance scale of a guidance flag the user left unset (`refl_ddpo.core.families.resolve_guidance`).

        With classifier-free guidance (SD 1.x/2.x, SDXL, SD3) the scale weighs (text - uncond) and each flag keeps
        its own `cfg_default`, the trainer's or the script's choice (ReFL's rollout 1 = off, DDPO's sampler 5,
        inference 7.5 ...). Where the network takes the guidance as an input, 1 or 7.5 mean something else there (a
        weak or an oversaturated image): every unset flag takes the pipeline's default, `embedded_guidance_default`."""
        return cfg_default if cls.embedded_guidance_default is None else cls.embedded_guidance_default

    @classmethod
    def variant(cls, name: str) -> type[ModelFamily]:
        """The family of the model at `name` (local folder or hub id), read from its configs before any weights
        load, where one pipeline class covers more than one (Z-Image and the distilled Z-Image-Turbo): here `cls`."""
        return cls

    def __init__(self, pipe):
        import logging

        self.pipe = pipe
        # --offload_text_encoders: the device the text encoders visit while they encode (they live on the CPU);
        # None: they stay where they were loaded, with the rest of the pipeline. Set by `load_family`.
        self.text_encoder_device: torch.device | str | None = None
        self._prompts_checked: set[str] = set()
        self._truncation_said = False
        self._constants: dict[tuple, torch.Tensor] = {}
        # The pipeline's encode_prompt warns about a truncated prompt at every call (every batch of a run);
        # `check_prompt_lengths` says it once instead.
        logging.getLogger(type(pipe).__module__).setLevel(logging.ERROR)

    def constant(self, key: tuple, make) -> torch.Tensor:
        """The tensor `make()` builds, built once per `key` (which names its shape, device and dtype) and kept. For the
        network call's inputs that the pipeline builds on the host and copies to the device at every call (position
        ids, micro-conditioning): on a GPU each such copy from pageable memory waits for the stream to drain. Built
        outside inference mode, so that no inference tensor (which autograd refuses to save for backward) made while
        sampling reaches a later step with gradient."""
        if key not in self._constants:
            with torch.inference_mode(False):
                self._constants[key] = make()
        return self._constants[key]

    def check_prompt_lengths(self, prompts: list[str]) -> None:
        """Say once per run (this family object) that a prompt is longer than the text encoder of `prompt_reader`
        reads and is truncated; the pipeline's own warning at every batch is silenced."""
        import sys

        reader = self.prompt_reader()
        if self._truncation_said or reader is None:
            return
        tokenizer, limit = reader
        for prompt in dict.fromkeys(prompts):
            if prompt in self._prompts_checked:
                continue
            self._prompts_checked.add(prompt)
            n = len(tokenizer(prompt, truncation=False).input_ids)  # with the begin / end tokens
            if n > limit:
                shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
                print(
                    f"warning: the prompt '{shown}' is {n} tokens and the text encoder reads {limit}: it and any "
                    "other prompt this long are truncated (said once per run).",
                    file=sys.stderr,
                    flush=True,
                )
                self._truncation_said = True
                return

    def prompt_reader(self):
        """(the tokenizer of the text encoder that reads the prompt's text sequence, how many tokens it reads), or
        None: the first CLIP and its model_max_length here."""
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return None if tokenizer is None else (tokenizer, tokenizer.model_max_length)

    # ---- parts ----
    @property
    def network(self) -> torch.nn.Module:
        return getattr(self.pipe, self.network_name)

    @property
    def vae(self) -> torch.nn.Module:
        return self.pipe.vae

    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vae_scale_factor

    @property
    def native_resolution(self) -> int:
        """The image side the network was built for (sample_size x vae_scale_factor)."""
        return int(self.network.config.sample_size) * self.vae_scale_factor

    def scheduler(self, kind: str):
        """A fresh scheduler of class `kind` (a diffusers class name) from the model's own scheduler config."""
        import diffusers

        return getattr(diffusers, kind).from_config(self.pipe.scheduler.config)

    def policy_scheduler(self):
        """The sampler of the policy-gradient trainers, whose `step_with_logprob` is the stochastic step: the
        family's first (default) sampler (DDIM for SD 1.x, flow-matching Euler for SD3)."""
        return self.scheduler(next(iter(self.schedulers.values())))

    def rollout_scheduler(self, kind: str):
        """The sampler of a reward-backprop rollout (ReFL's --scheduler): "ddpm" (stochastic, ImageReward's) or
        "ddim" (eta 0: deterministic), from the model's scheduler config."""
        return self.scheduler({"ddpm": "DDPMScheduler", "ddim": "DDIMScheduler"}[kind])

    def set_timesteps(self, scheduler, num_inference_steps: int, latents: torch.Tensor) -> torch.Tensor:
        """`scheduler.set_timesteps` as the stock pipeline calls it for these latents; returns the timesteps.

        The scheduler's state stays on the host (the pipeline puts it on the GPU): its `step` indexes its tables with
        the timestep, and with a GPU timestep every such index waits for the GPU to catch up."""
        scheduler.set_timesteps(num_inference_steps, device="cpu")
        return scheduler.timesteps

    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders (CLIPs, T5, Qwen2.5-VL), those it has."""
        modules = (getattr(self.pipe, name, None) for name in TEXT_ENCODER_NAMES)
        return [m for m in modules if isinstance(m, torch.nn.Module)]

    @contextmanager
    def text_encoders_on_device(self):
        """With --offload_text_encoders (`text_encoder_device` set) the text encoders are moved from the CPU to that
        device for the block and back to the CPU after it, so that their weights are not resident while the
        network denoises, backpropagates and the rewards score; without it, nothing is moved. The encode itself
        then holds them beside every other weight, so the flag lowers the peak only by what the rest of the step
        holds above the encode (docs/benchmarks.md counts it for FLUX.1-dev).

        A plain `.to` there and back rather than accelerate's `cpu_offload_with_hook` or diffusers'
        `enable_model_cpu_offload`: those move a module on its first forward and move it back only when the next
        hooked module runs (diffusers chains every component, the network included, which must stay on the
        device), while here the encoding is one known block of code. The cost is one host-to-device copy of the
        encoders per encoded batch (and the copy back frees their device memory). The kit caches no prompt
        embeddings: every batch is encoded afresh; only the empty prompt's (`empty_cond`) is encoded once, at the
        setup of DDPO / GRPO / NFT, and kept."""
        if self.text_encoder_device is None:
            yield
            return
        modules = self.text_encoders()
        try:
            for module in modules:
                module.to(self.text_encoder_device)
            yield
        finally:
            for module in modules:
                module.to("cpu")

    # ---- the data path ----
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """(conditioning of the prompts, of the empty prompt or None), no grad; the text encoders on the device for
        the call (`text_encoders_on_device`). Every path that runs a text encoder comes here (the trainers' prompts,
        the empty prompt of `empty_cond`, validation and inference through `generate`)."""
        self.check_prompt_lengths(prompts)
        with self.text_encoders_on_device():
            return self.run_text_encoders(prompts, with_negative)

    def encode_conditioning(
        self, prompts: list[str], metadata: list[dict] | None, with_negative: bool
    ) -> tuple[Cond, Cond | None]:
        """`encode_prompts` and whatever else of the samples the family conditions on: an edit family adds its
        source images' latents (each sample's `metadata["source_images"]`, refl_ddpo.core.edit_data) to the
        conditioning; a text-to-image family reads the prompts alone."""
        return self.encode_prompts(prompts, with_negative)

    @abstractmethod
    def run_text_encoders(self, prompts: list[str], with_negative: bool) -> tuple[Cond, Cond | None]:
        """`encode_prompts` with the text encoders where they are: the family's call of the pipeline's
        `encode_prompt`."""

    def empty_cond(self) -> Cond:
        """The conditioning (batch 1) the stock pipeline guides away from when no negative prompt is given: the
        empty prompt's encoding here; SDXL's zeros where its config says `force_zeros_for_empty_prompt`."""
        return self.encode_prompts([""], with_negative=False)[0]

    @abstractmethod
    def initial_noise(self, batch_size: int, resolution: int, generator, dtype: torch.dtype) -> torch.Tensor:
        """Gaussian latents x_T as the stock pipeline draws them (before `init_noise_sigma`)."""

    @abstractmethod
    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        scheduler,
        cond: Cond,
        uncond: Cond | None,
        guidance_scale: float,
        network=None,
    ) -> torch.Tensor:
        """The network's output (noise, velocity ...) at (latents, timesteps), with CFG batched as the pipeline
        (`cfg_inputs`, `cfg_combine`). It calls the network itself, with no function of the kit in between, so
        that `denoise` reaches the network in two of the kit's frames (tests/test_family_conformance.py counts)."""

    @abstractmethod
    def step(self, scheduler, model_output, timestep, latents, eta: float, generator):
        """The scheduler's own step: (next latents, predicted x0 or None)."""

    @abstractmethod
    def step_with_logprob(
        self, scheduler, model_output, timestep, latents, eta: float, generator=None, prev_sample=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stochastic step of the policy-gradient trainers: (next latents, log-prob (B,), predicted x0)."""

    @abstractmethod
    def step_mean(
        self, scheduler, model_output, timestep, latents, eta: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gaussian of `step_with_logprob` from `latents`: (its mean (B, ...), its std (B,)), float32; the std
        is 0 on a deterministic step. GRPO-Guard's RatioNorm (--ratio_norm) needs both."""

    def add_noise(self, scheduler, x0: torch.Tensor, noise: torch.Tensor, timestep) -> torch.Tensor:
        """The forward process q(x_t | x0) at `timestep` (a value of `scheduler.timesteps`) with this `noise`:
        sqrt(a_t) x0 + sqrt(1 - a_t) noise (the scheduler's `add_noise`) for DDIM / DDPM."""
        t = torch.as_tensor(timestep, device=x0.device).reshape(-1).expand(x0.shape[0])
        return scheduler.add_noise(x0, noise, t)

    # ---- the forward process (DiffusionNFT, AWM): per-sample timesteps (B,), values of `scheduler.timesteps` ----
    @abstractmethod
    def pred_x0(
        self, scheduler, model_output, timesteps: torch.Tensor, latents: torch.Tensor
    ) -> torch.Tensor:
        """The x0 the network's output predicts at x_t = `latents`; affine in the output (float32)."""

    @abstractmethod
    def training_target(self, scheduler, x0: torch.Tensor, noise: torch.Tensor, timesteps) -> torch.Tensor:
        """What pretraining regresses the network's output on at add_noise(x0, noise, t) (float32)."""

    @abstractmethod
    def noise_level(self, scheduler, timesteps: torch.Tensor) -> torch.Tensor:
        """The noise's share of x_t (B,): sigma on flow models, sqrt(1 - abar_t) on DDPM-trained ones."""

    @abstractmethod
    def step_kl(self, scheduler, model_output, ref_model_output, timesteps, eta: float) -> torch.Tensor:
        """KL (B,) between the stochastic steps of two model outputs at the same state, per dimension."""

    @abstractmethod
    def x0_kl_weight(self, scheduler, timestep) -> float:
        """w such that w * mse(x0, x0_ref) is ReFL's KL term (the model-output MSE) at `timestep`."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> images (B, 3, H, W) in [0, 1], differentiable where grad is enabled."""
