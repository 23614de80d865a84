"""FLUX.2 [dev] and [klein] 4B / 9B: peak device memory of a ReFL LoRA step, counted without a GPU by
benchmarks/memory.py's machinery (`case_memory`: the meta device, CUDA's autocast and attention kernels, setup, a
warm-up run, the peak of a second run):

    python -m benchmarks.flux2_memory --out benchmarks/results/flux2_memory --refl_steps 4 --refl_k 3

One case is one ReFL optimizer step (refl_ddpo.trainers.backprop.refl_step as the trainer calls it: --refl_steps
steps, step --refl_k with grad, predicted x0 decoded by the VAE, ImageReward) at batch 1, bf16, LoRA rank 4 on the
family's default targets, no CFG ([dev]: the embedded guidance 4; [klein]: CFG off, ReFL's rollout default), at 512
and 1024 px, with gradient checkpointing off and on (the transformer's, the VAE decoder's and ImageReward's: the
trainer's --gradient_checkpointing --vae_gradient_checkpointing).

Models: the transformer configs of diffusers' scripts/convert_flux2_to_diffusers.py (`get_flux2_transformer_config`:
flux2-dev, klein-4b, klein-9b; kept in benchmarks/configs/flux2*_transformer.json) and the VAE it converts into,
AutoencoderKLFlux2's defaults (benchmarks/configs/flux2_vae.json); random weights on meta. The text encoders
(Mistral-Small-3.2-24B for [dev], Qwen3 4B / 8B for [klein]) are not built: their published configs were not at
hand here. So every case is counted with the text encoder off the device (the kit's --offload_text_encoders after
its encode), the prompt's embeddings on the device as the encode leaves them: (1, 512, 3 x the text encoder's width),
the transformer's joint_attention_dim. With the encoder on the device add its bf16 weights (not counted here).
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

# name -> (transformer config file, pipeline class, is_distilled or None for [dev])
FLUX2_MODELS = {
    "flux2_dev": ("flux2dev_transformer.json", "Flux2Pipeline", None),
    "flux2_klein_4b": ("flux2_klein_4b_transformer.json", "Flux2KleinPipeline", True),
    "flux2_klein_9b": ("flux2_klein_9b_transformer.json", "Flux2KleinPipeline", True),
}
VAE_CONFIG = "flux2_vae.json"


def _config(file: str) -> dict:
    return json.loads((CONFIG_DIR / file).read_text())


def parameter_counts() -> dict[str, int]:
    """Parameters of each model's transformer and of the VAE (built on meta)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    with torch.device("meta"):
        counts = {
            name: sum(p.numel() for p in Flux2Transformer2DModel.from_config(_config(f)).parameters())
            for name, (f, _, _) in FLUX2_MODELS.items()
        }
        counts["vae"] = sum(
            p.numel() for p in AutoencoderKLFlux2.from_config(_config(VAE_CONFIG)).parameters()
        )
    return counts


def _family(b, model: str):
    """The FLUX.2 family of `model` around a LoRA transformer (the trainers' make_trainable), its trained
    parameters and the prompt's embeddings (on the device, as the encode leaves them)."""
    import diffusers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from refl_ddpo.core.families import family_class
    from refl_ddpo.run.session import trainable_spec
    from refl_ddpo.run.training import make_trainable
    from refl_ddpo.testing.tiny_flux2 import FLUX2_SCHEDULER

    file, pipeline, distilled = FLUX2_MODELS[model]
    with torch.device(b.device):
        transformer = Flux2Transformer2DModel.from_config(_config(file))
        vae = AutoencoderKLFlux2.from_config(_config(VAE_CONFIG))
    transformer.requires_grad_(False).eval().to(dtype=b.dtype)
    vae.requires_grad_(False).eval().to(dtype=b.dtype)
    cls = family_class(pipeline)
    config = dataclasses.replace(b.common, use_lora=True, lora_target_modules=list(cls.lora_target_modules))
    params = make_trainable(transformer, trainable_spec(config))
    kwargs = {} if distilled is None else {"is_distilled": distilled}
    pipe = getattr(diffusers, pipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        **kwargs,
    )
    width = transformer.config.joint_attention_dim
    cond = {"prompt_embeds": torch.zeros(1, 512, width, device=b.device, dtype=b.dtype)}
    return cls(pipe), params, cond


def refl_case(model: str) -> Case:
    """One ReFL optimizer step on `model` (see the module doc)."""

    def setup(b):
        from refl_ddpo.trainers.backprop import Rollout, refl_step

        family, params, cond = _family(b, model)
        prompts, metadata = b.prompts(1)
        scheduler = family.rollout_scheduler("ddpm")
        reward_model = b.build("reward")
        base = family.network
        network, optimizer = b.prepare(base, params, None)
        b.finish(network, family.vae, reward_model)
        reward, acc = b.imagereward(reward_model), b.accelerator
        guidance = family.default_guidance_scale(1.0)  # [dev]: the pipeline's embedded 4; [klein]: CFG off
        network.train()

        def run():
            with acc.accumulate(network):
                noise = family.initial_noise(1, b.resolution, b.generator, cond["prompt_embeds"].dtype)
                rollout = Rollout(
                    family,
                    scheduler,
                    cond,
                    None,
                    prompts,
                    metadata,
                    noise,
                    b.cfg.refl_steps,
                    guidance_scale=guidance,
                    generator=b.generator,
                    network=network,
                )
                out = refl_step(rollout, reward, b.cfg.refl_k, grad_scale=b.cfg.grad_scale)
                acc.backward(out.loss)
                acc.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return out.loss.detach()

        return run, {"unet": base, "vae": family.vae, "reward": reward_model}

    settings = {"mode": "lora", "batch": 1, "model": model, "text_encoder_on_device": False}
    return Case(f"{model}_refl lora b1", f"{model}_refl", "optimizer step", 1, settings, setup)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", choices=list(FLUX2_MODELS), default=list(FLUX2_MODELS))
    parser.add_argument("--resolutions", nargs="+", type=int, default=[512, 1024])
    parser.add_argument("--refl_steps", type=int, default=40)
    parser.add_argument("--refl_k", type=int, default=35)
    parser.add_argument("--checkpointing", choices=("both", "off", "on"), default="both")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": " ".join(
            ["python -m benchmarks.flux2_memory", *(argv if argv is not None else sys.argv[1:])]
        ),
        "parameters": parameter_counts(),
        "dtype": "bf16",
        "cases": [],
    }
    lines = [
        "| model | resolution | gradient checkpointing | weights (GiB) | peak (GiB, computed) | counted in |",
        "|---|---|---|---|---|---|",
    ]
    footer = (
        f"\n- Computed on the meta device, not measured: bf16, batch 1, a ReFL rollout of {args.refl_steps} steps "
        f"with grad at step {args.refl_k}, LoRA r 4, ImageReward; the text encoder off the device (not built). "
        "Weights: what is live before the counted run (weights, the prompt's embeddings and AdamW states).\n"
    )
    checkpointing = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        sd_configs = model_configs(False, Path(workdir))  # ImageReward's config; the SD ones are not used
        for model in args.models:
            for resolution in args.resolutions:
                for gc in checkpointing:
                    cfg = BenchConfig(
                        dtype="bf16",
                        device="cpu",
                        resolution=resolution,
                        refl_steps=args.refl_steps,
                        refl_k=args.refl_k,
                        gradient_checkpointing=gc,
                        memory_only=True,
                    )
                    r = case_memory(cfg, sd_configs, Path(workdir), refl_case(model))
                    r.update(gradient_checkpointing=gc, resolution=resolution)
                    results["cases"].append(r)
                    lines.append(
                        f"| {model} | {resolution} | {'on' if gc else 'off'} | {r['steady_bytes'] / GIB:.2f} | "
                        f"{r['peak_bytes'] / GIB:.2f} | {r['seconds']:.0f} s |"
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
