"""Qwen-Image's peak device memory, counted without a GPU by benchmarks/memory.py's machinery (`case_memory`: the
meta device, CUDA's autocast and attention kernels, setup, a warm-up run, the peak of a second run):

    python -m benchmarks.qwen_memory --out benchmarks/results/qwen_image_memory_1024 --refl_steps 4 --refl_k 3

(the committed results' command: see docs/benchmarks.md's Qwen-Image section for why 4 steps)

One case is one ReFL optimizer step (refl_ddpo.trainers.backprop.refl_step as the trainer calls it: --refl_steps 40 steps,
step --refl_k 35 with grad, predicted x0 decoded by the VAE, ImageReward) at batch 1, 1024 px (the pipeline's
default), bf16, LoRA rank 4 on the family's default targets, CFG off (ReFL's rollout). It is counted four times:
gradient checkpointing off / on (the transformer's and ImageReward's; diffusers' AutoencoderKLQwenImage has none),
and the text encoder on the device or offloaded (the prompt encoded once in setup, then the encoder dropped: neither
its weights nor its activations are on the device during the step).

Models: the published Qwen/Qwen-Image configs kept in benchmarks/configs (qwen_image_transformer.json,
qwen_image_vae.json, qwen_image_text_encoder.json: Qwen2.5-VL-7B-Instruct's), random weights on meta. The tokenizer
is the tiny offline one (one token per byte, refl_ddpo.testing.tiny_qwen), with the template's whole system head
dropped, so the text is the prompt's bytes and the template's tail: a few tens of tokens beside 4096 image tokens, as
with the real tokenizer. The prompt is encoded as the pipeline's `encode_prompt` does for one prompt without padding
(last hidden state, the head dropped) but without its mask-indexing, whose output shape the meta device cannot know.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.cases import Case
from benchmarks.config import BenchConfig
from benchmarks.measure import GIB
from benchmarks.memory import case_memory
from benchmarks.models import CONFIG_DIR, model_configs
from benchmarks.report import write_files

QWEN_CONFIG_FILES = {
    "transformer": "qwen_image_transformer.json",
    "vae": "qwen_image_vae.json",
    "text_encoder": "qwen_image_text_encoder.json",
}


def qwen_configs() -> dict[str, dict]:
    return {name: json.loads((CONFIG_DIR / f).read_text()) for name, f in QWEN_CONFIG_FILES.items()}


def _construct(name: str, config: dict):
    """One Qwen-Image part with random weights on the current default device."""
    if name == "transformer":
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel.from_config(config)
    if name == "vae":
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage.from_config(config)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))


def parameter_counts() -> dict[str, int]:
    """Parameters of each part (built on meta)."""
    with torch.device("meta"):
        return {
            name: sum(p.numel() for p in _construct(name, c).parameters())
            for name, c in qwen_configs().items()
        }


def _family(b, configs: dict[str, dict], text_encoder_on_device: bool, mode: str = "lora"):
    """The QwenImage family around a LoRA (`mode` "lora") or wholly trained ("full", fp32) transformer (the trainers'
    make_trainable) and its trained parameters."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from refl_ddpo.core.families.qwen_image import QwenImage
    from refl_ddpo.run.session import trainable_spec
    from refl_ddpo.run.training import make_trainable
    from refl_ddpo.testing.tiny_qwen import QWEN_IMAGE_SCHEDULER, qwen_tokenizer

    class BenchQwenImage(QwenImage):
        def _encode(self, prompts):
            """As encode_prompt for prompts without padding (see the module doc)."""
            pipe = self.pipe
            txt = [pipe.prompt_template_encode.format(p) for p in prompts]
            tokens = pipe.tokenizer(txt, return_tensors="pt").to(pipe.device)
            out = pipe.text_encoder(
                input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
            )
            embeds = out.hidden_states[-1][:, pipe.prompt_template_encode_start_idx :]
            embeds = embeds[:, : self.max_sequence_length].to(pipe.text_encoder.dtype)
            return {
                "prompt_embeds": embeds,
                "prompt_embeds_mask": torch.ones(embeds.shape[:2], dtype=torch.long),
            }

    parts = {}
    for name in ("transformer", "vae", "text_encoder"):
        with torch.device(b.device):
            model = _construct(name, configs[name])
        parts[name] = model.requires_grad_(False).eval().to(dtype=b.dtype)
    config = dataclasses.replace(
        b.common, use_lora=mode == "lora", lora_target_modules=list(QwenImage.lora_target_modules)
    )
    params = make_trainable(parts["transformer"], trainable_spec(config))
    tokenizer = qwen_tokenizer()
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        tokenizer=tokenizer,
        **parts,
    )
    head = pipe.prompt_template_encode.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(head).input_ids)
    family = BenchQwenImage(pipe)
    prompts, metadata = b.prompts(1)
    cond = None
    if not text_encoder_on_device:
        with torch.no_grad():
            cond = family.encode_prompts(prompts, with_negative=False)[0]
        pipe.text_encoder = None
    return family, params, cond, (prompts, metadata)


def _text_encoder_bytes(family) -> int:
    """Device bytes of the text encoder's weights (each tensor a 512-byte block)."""
    from benchmarks.meta import round_block

    encoder = family.pipe.text_encoder
    return sum(round_block(t.numel() * t.element_size()) for t in (*encoder.parameters(), *encoder.buffers()))


def refl_case(configs: dict[str, dict], text_encoder_on_device: bool, mode: str = "lora") -> Case:
    """One ReFL optimizer step on Qwen-Image (see the module doc); `mode`: "lora" or "full" (the whole
    transformer trained)."""

    def setup(b):
        from refl_ddpo.trainers.backprop import refl_step

        family, params, fixed_cond, (prompts, metadata) = _family(b, configs, text_encoder_on_device, mode)
        if text_encoder_on_device:
            b.text_encoder_bytes = _text_encoder_bytes(family)
            b.text_encoder_family = (
                family  # for the count of --fsdp_shard_text_encoders (benchmarks/memory.py)
            )
        scheduler = family.rollout_scheduler("ddpm")
        reward_model = b.build("reward")
        base = family.network
        network, optimizer = b.prepare(base, params, None)
        b.finish(network, None, reward_model)  # the Qwen-Image VAE has no gradient checkpointing
        reward, acc = b.imagereward(reward_model), b.accelerator
        network.train()

        def run():
            with acc.accumulate(network):
                cond = fixed_cond or family.encode_prompts(prompts, with_negative=False)[0]
                noise = family.initial_noise(1, b.resolution, b.generator, cond["prompt_embeds"].dtype)
                out = refl_step(
                    family,
                    scheduler,
                    reward,
                    cond,
                    None,
                    prompts,
                    metadata,
                    noise,
                    b.cfg.refl_k,
                    num_inference_steps=b.cfg.refl_steps,
                    guidance_scale=1.0,
                    grad_scale=b.cfg.grad_scale,
                    generator=b.generator,
                    network=network,
                )
                acc.backward(out.loss)
                acc.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return out.loss.detach()

        return run, {"unet": base, "vae": family.vae, "reward": reward_model}

    where = "on the device" if text_encoder_on_device else "offloaded"
    name = f"qwen_image_refl {mode} b1, text encoder {where}"
    settings = {
        "mode": mode,
        "batch": 1,
        "model": "qwen-image",
        "text_encoder_on_device": text_encoder_on_device,
    }
    return Case(name, "qwen_image_refl", "optimizer step", 1, settings, setup)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--refl_steps", type=int, default=40)
    parser.add_argument("--refl_k", type=int, default=35)
    parser.add_argument("--modes", nargs="+", choices=("lora", "full"), default=["lora"])
    parser.add_argument("--checkpointing", choices=("both", "off", "on"), default="both")
    parser.add_argument(
        "--text_encoder", choices=("both", "on", "off"), default="both", help="on the device or not"
    )
    parser.add_argument(
        "--fsdp_world_size",
        type=int,
        default=0,
        help="count rank 0 of this many with the transformer sharded by the kit's FSDP2 (bench.py's flag)",
    )
    parser.add_argument(
        "--fsdp_shard_text_encoders",
        action="store_true",
        help="with --fsdp_world_size: the text encoder sharded too (the kit's flag; --text_encoder on)",
    )
    args = parser.parse_args(argv)
    if args.fsdp_shard_text_encoders and not (args.fsdp_world_size and args.text_encoder == "on"):
        parser.error("--fsdp_shard_text_encoders needs --fsdp_world_size N and --text_encoder on")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = qwen_configs()
    results = {
        "command": " ".join(
            ["python -m benchmarks.qwen_memory", *(argv if argv is not None else sys.argv[1:])]
        ),
        "parameters": parameter_counts(),
        "resolution": args.resolution,
        "dtype": "bf16",
        "fsdp_world_size": args.fsdp_world_size,
        "fsdp_shard_text_encoders": args.fsdp_shard_text_encoders,
        "cases": [],
    }
    lines = [
        (
            "| case | gradient checkpointing | weights (GiB) | peak (GiB, computed) | peak, text encoder off the "
            "device (GiB, derived) | counted in |"
        ),
        "|---|---|---|---|---|---|",
    ]
    notes = [
        (
            f"Computed on the meta device, not measured: Qwen-Image architecture, bf16, {args.resolution} px, a "
            f"ReFL rollout of {args.refl_steps} steps with grad at step {args.refl_k}. Weights: what is live before "
            "the counted run (weights and AdamW states). Text encoder off the device (derived, not counted): the "
            "peak less its weights (it runs before the rollout, whose backward holds the peak)."
        )
    ]
    if args.fsdp_world_size:
        notes.append(
            f"Per rank, rank 0 of {args.fsdp_world_size}: the transformer sharded with the kit's FSDP2 (--fsdp; see "
            "benchmarks/memory.py); the VAE and ImageReward whole on every rank, the text encoder "
            + (
                "sharded too (--fsdp_shard_text_encoders: fully_shard per block and the root, counted)."
                if args.fsdp_shard_text_encoders
                else "whole."
            )
        )
    footer = "\n" + "".join(f"- {n}\n" for n in notes)
    checkpointing = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
    on_device = {"both": (True, False), "on": (True,), "off": (False,)}[args.text_encoder]
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        sd_configs = model_configs(False, Path(workdir))  # ImageReward's config; the SD ones are not used
        for gc in checkpointing:
            cfg = BenchConfig(
                dtype="bf16",
                device="cpu",
                resolution=args.resolution,
                refl_steps=args.refl_steps,
                refl_k=args.refl_k,
                gradient_checkpointing=gc,
                memory_only=True,
                fsdp_world_size=args.fsdp_world_size,
                fsdp_shard_text_encoders=args.fsdp_shard_text_encoders,
            )
            for mode in args.modes:
                for te in on_device:
                    r = case_memory(cfg, sd_configs, Path(workdir), refl_case(configs, te, mode))
                    r["gradient_checkpointing"] = gc
                    if r.get("text_encoders_sharded"):
                        r["name"] = r["name"].replace("on the device", "sharded")
                    results["cases"].append(r)
                    off = r.get("peak_text_encoders_offloaded_bytes")
                    lines.append(
                        f"| {r['name']} | {'on' if gc else 'off'} | {r['steady_bytes'] / GIB:.2f} | "
                        f"{r['peak_bytes'] / GIB:.2f} | {'-' if off is None else f'{off / GIB:.2f}'} | "
                        f"{r['seconds']:.0f} s |"
                    )
                    print(lines[-1], flush=True)
                    write_files(
                        out,
                        {
                            "memory.json": json.dumps(results, indent=2) + "\n",
                            "memory.md": "\n".join(lines) + "\n" + footer,
                        },
                    )
    return results


if __name__ == "__main__":
    main()
