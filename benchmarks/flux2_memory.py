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

import torch

from benchmarks import family_memory as fm
from benchmarks.cases import Case

# name -> (transformer config file, pipeline class, is_distilled or None for [dev])
FLUX2_MODELS = {
    "flux2_dev": ("flux2dev_transformer.json", "Flux2Pipeline", None),
    "flux2_klein_4b": ("flux2_klein_4b_transformer.json", "Flux2KleinPipeline", True),
    "flux2_klein_9b": ("flux2_klein_9b_transformer.json", "Flux2KleinPipeline", True),
}
VAE_CONFIG = "flux2_vae.json"


def parameter_counts() -> dict[str, int]:
    """Parameters of each model's transformer and of the VAE (built on meta)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    with torch.device("meta"):
        counts = {
            name: fm.count_parameters(Flux2Transformer2DModel.from_config(fm.load_config(f)))
            for name, (f, _, _) in FLUX2_MODELS.items()
        }
        counts["vae"] = fm.count_parameters(AutoencoderKLFlux2.from_config(fm.load_config(VAE_CONFIG)))
    return counts


def _family(b, model: str):
    """The FLUX.2 family of `model` around a LoRA transformer (the trainers' make_trainable), its trained
    parameters and the prompt's embeddings (on the device, as the encode leaves them)."""
    import diffusers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from refl_ddpo.core.families import family_class
    from refl_ddpo.testing.tiny_flux2 import FLUX2_SCHEDULER

    file, pipeline, distilled = FLUX2_MODELS[model]
    with torch.device(b.device):
        transformer = Flux2Transformer2DModel.from_config(fm.load_config(file))
        vae = AutoencoderKLFlux2.from_config(fm.load_config(VAE_CONFIG))
    fm.frozen(transformer, b.dtype)
    fm.frozen(vae, b.dtype)
    cls = family_class(pipeline)
    params = fm.trainable(b, transformer, cls)
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
        family, params, cond = _family(b, model)
        prompts, metadata = b.prompts(1)
        guidance = family.default_guidance_scale(1.0)  # [dev]: the pipeline's embedded 4; [klein]: CFG off
        return fm.refl_run(b, family, params, prompts, metadata, cond=cond, guidance_scale=guidance)

    settings = {"mode": "lora", "batch": 1, "model": model, "text_encoder_on_device": False}
    return Case(f"{model}_refl lora b1", f"{model}_refl", "optimizer step", 1, settings, setup)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fm.add_common_args(parser)
    parser.add_argument("--models", nargs="+", choices=list(FLUX2_MODELS), default=list(FLUX2_MODELS))
    parser.add_argument("--resolutions", nargs="+", type=int, default=[512, 1024])
    args = parser.parse_args(argv)
    results = fm.new_results("benchmarks.flux2_memory", argv, parameter_counts(), dtype="bf16")
    lines = fm.table_head(["model", "resolution"], derived_offload=False)
    footer = (
        f"\n- Computed on the meta device, not measured: bf16, batch 1, a ReFL rollout of {args.refl_steps} steps "
        f"with grad at step {args.refl_k}, LoRA r 4, ImageReward; the text encoder off the device (not built). "
        "Weights: what is live before the counted run (weights, the prompt's embeddings and AdamW states).\n"
    )
    jobs = (
        (fm.bench_config(args, res, gc), refl_case(model), {"gradient_checkpointing": gc, "resolution": res})
        for model in args.models
        for res in args.resolutions
        for gc in fm.CHECKPOINTING[args.checkpointing]
    )
    for r in fm.counts(jobs):
        results["cases"].append(r)
        cells = [r["settings"]["model"], str(r["resolution"]), *fm.gib_cells(r, False)]
        fm.record(args.out, results, lines, cells, footer)
    return results


if __name__ == "__main__":
    main()
