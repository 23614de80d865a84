"""The benchmark's flags (`BenchConfig`): what to run, the workloads, and every speed option, so that a sweep can
switch each one on and off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.run.config import ConfigBase
from refl_ddpo.run.parts import field_

CASES = (
    "refl",
    "ddpo_sample",
    "ddpo_train",
    "inference",
    "forward",
    "sd35m_refl",
    "sdxl_refl",
    "flux_refl",
    "flux_grpo_sample",
    "flux_grpo_train",
)
DEFAULT_CASES = "refl,ddpo_sample,ddpo_train,inference"


@dataclass
class BenchConfig(ConfigBase):
    """What to benchmark and how; every speed option is a flag so that a sweep can switch it on and off."""

    # ---- what ----
    tiny: bool = field_(
        False,
        "Use the tiny random models of refl_ddpo.testing.tiny instead of the real architectures.",
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
    refl_backprop_steps: int = field_(
        0,
        "0: ReFL (one grad step, --refl_k); K >= 1: DRaFT-K on the ReFL case (all --refl_steps steps, the last K "
        "with grad, each network call checkpointed when K > 1: the trainer's --backprop_steps K).",
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
    cudnn_attention: bool = field_(
        True,
        "Let SDPA use cuDNN's attention kernels where torch picks them (CUDA only). Off: "
        "torch.backends.cuda.enable_cudnn_sdp(False), so flash or memory-efficient attention instead; torch "
        "2.11.0+cu130's cuDNN attention backward failed in FLUX.1-dev's ReFL step on an H200 (illegal memory access).",
    )
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
    profile: bool = field_(
        False,
        "Also run each case once under torch.profiler and write its op table (with the wall and device-busy "
        "times) to --out/profile_<case>.txt.",
    )
    flops_only: bool = field_(
        False,
        "Run nothing: count every case's model FLOPs on the meta device (per-sample "
        "counts of each model call, composed) and write flops.md with the time floor "
        "at --peak_tflops. Needs no GPU and no memory.",
    )
    memory_only: bool = field_(
        False,
        "Run nothing on a device: count every case's peak device memory on fake CUDA tensors (the kit's code "
        "runs on shapes only, as an H100 would allocate; see benchmarks/memory.py) and write memory.md. Needs "
        "no GPU; dtype default bf16.",
    )
    ops_only: bool = field_(
        False,
        "Run nothing on a device: count the ops and casts per network call of each family's contexts on the meta "
        "device with CUDA's autocast emulated, against the stock network's floor (see benchmarks/ops.py); writes "
        "results.json and results.md. Needs no GPU; dtype default bf16.",
    )
    ops_families: list[str] = field_(
        ["sd15", "sd35m", "sdxl", "flux1"],
        "With --ops_only: the families counted (sd15, sd35m, sdxl, flux1).",
    )
    ops_contexts: list[str] = field_(
        ["ddpo_rollout", "refl_nograd", "refl_grad", "nft_rollout", "inference"],
        "With --ops_only: the contexts counted (ddpo_rollout, refl_nograd, refl_grad, nft_rollout, inference).",
    )
    fsdp_world_size: int = field_(
        0,
        "With --memory_only: count the trained network sharded with the kit's FSDP2 (--fsdp: accelerate's "
        "fully_shard per block, bf16 compute, fp32 master weights and gradient reduction) over this many ranks, "
        "as rank 0 of a fake process group in this one process (0: not sharded). Frozen parts stay whole.",
    )
    offload_text_encoders: bool = field_(
        False,
        "With --memory_only: count the kit's --offload_text_encoders on the FLUX.1 cases: the text encoders' "
        "weights count on the device only while the prompts are encoded (see benchmarks/memory.py).",
    )
    fsdp_shard_text_encoders: bool = field_(
        False,
        "With --fsdp_world_size: count the kit's --fsdp_shard_text_encoders on the FLUX.1 cases: the text "
        "encoders sharded per block with fully_shard as the kit does, 1/N of them per rank.",
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
        self.check_positive(
            "repeats",
            "refl_steps",
            "ddpo_sample_batch_size",
            "ddpo_train_batch_size",
            "ddpo_steps",
            "inference_steps",
            "lora_rank",
        )
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0 (got {self.warmup}).")
        if self.compile and self.warmup < 1:
            raise UserError(
                "--compile needs --warmup >= 1: compilation happens in the first run and must not be timed."
            )
        self._check_refl()
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
        self._check_fsdp()
        self._check_ops()
        if self.cpu_threads < 0:
            raise UserError(f"--cpu_threads must be >= 0 (got {self.cpu_threads}; 0 keeps torch's default).")
        if self.peak_tflops <= 0:
            raise UserError(f"--peak_tflops must be > 0 (got {self.peak_tflops}).")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: CUDA is not available here; use --device cpu.")

    def _check_refl(self) -> None:
        if not 0 <= self.refl_backprop_steps <= self.refl_steps:
            raise UserError(
                f"--refl_backprop_steps {self.refl_backprop_steps} must be in 0..--refl_steps ({self.refl_steps})."
            )
        if not 0 <= self.refl_k < self.refl_steps:
            raise UserError(f"--refl_k {self.refl_k} must be in 0..--refl_steps-1 ({self.refl_steps - 1}).")
        bad = [m for m in self.refl_modes if m not in ("lora", "full")]
        if bad:
            raise UserError(f"--refl_modes {' '.join(bad)}: use lora and/or full.")

    def _check_fsdp(self) -> None:
        if self.fsdp_world_size < 0 or self.fsdp_world_size == 1:
            raise UserError(
                f"--fsdp_world_size must be 0 (not sharded) or >= 2 (got {self.fsdp_world_size})."
            )
        if self.fsdp_world_size and not self.memory_only:
            raise UserError("--fsdp_world_size counts memory only: add --memory_only.")
        if self.fsdp_shard_text_encoders and not self.fsdp_world_size:
            raise UserError("--fsdp_shard_text_encoders counts them sharded: add --fsdp_world_size N.")
        if self.fsdp_shard_text_encoders and self.offload_text_encoders:
            raise UserError("--fsdp_shard_text_encoders and --offload_text_encoders: pick one.")

    def _check_ops(self) -> None:
        from benchmarks.ops import CONTEXTS, FAMILIES

        for name, known in (("ops_families", FAMILIES), ("ops_contexts", CONTEXTS)):
            bad = [v for v in getattr(self, name) if v not in known]
            if bad:
                raise UserError(f"--{name} {' '.join(bad)}: choose from {', '.join(known)}.")

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
