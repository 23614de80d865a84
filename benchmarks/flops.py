"""FLOPs without running anything: per-sample model FLOPs of each model call, counted on the meta device with the
timed runs' counter, composed per case, and the time floor they set at --peak_tflops (`--flops_only`)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.cases import Case, make_cases
from benchmarks.config import BenchConfig
from benchmarks.measure import flop_counter_mode
from benchmarks.models import construct, model_configs, parameter_counts
from benchmarks.report import fmt_s, write_files


def per_sample_flops(configs: dict[str, dict], resolution: int, lora_rank: int) -> dict[str, int]:
    """Model FLOPs of one sample through each model call the cases make, counted on the meta device (no memory,
    no arithmetic): forward only, or forward + backward with the gradients the trainers need."""
    from refl_ddpo.core.lora import add_lora, trainable_full_unet

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
    sd15 = ("refl", "ddpo_sample", "ddpo_train", "inference")
    cases = [c for c in make_cases(cfg) if c.bench in sd15]  # SD v1.5 counts only
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
        f"| {r['name']} | {r['unit']} | {r['flops'] / 1e12:.4g} | {fmt_s(r['floor_s'])} | "
        f"{fmt_s(r['floor_s'] / r['images'])} |"
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
    write_files(out, {"flops.json": json.dumps(results, indent=2) + "\n", "flops.md": table})
    print(table, flush=True)
    return results
