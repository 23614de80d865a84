"""FLUX.2 [dev] and [klein] 4B / 9B: peak device memory of a ReFL LoRA step and of GRPO's two passes, counted
without a GPU by benchmarks/memory.py's machinery (`case_memory`: the meta device, CUDA's autocast and attention
kernels, setup, a warm-up run, the peak of a second run):

    python -m benchmarks.flux2_memory --out benchmarks/results/flux2_memory --refl_steps 4 --refl_k 3

At batch 1, bf16, LoRA rank 4 on the family's default targets, no CFG ([dev]: the embedded guidance 4; [klein]: the
distilled model, CFG off), at each --resolutions, the text encoder on the device (the peak with it off the device
derived: the peak less its weights), three passes (--phases; family_memory.PHASES): "refl", one ReFL optimizer step
(refl_ddpo.trainers.backprop.refl_step as the trainer calls it: --refl_steps steps, step --refl_k with grad,
predicted x0 decoded by the VAE, ImageReward); "grpo_sample" and "grpo_train", GRPO's sampling of one image
(--grpo_steps flow-SDE steps, log-probs, decode) and its training pass over it (every step, PPO-clip), as
benchmarks/cases.py counts FLUX.1's. Gradient checkpointing off and on (the transformer's, the VAE decoder's and
ImageReward's: the trainer's --gradient_checkpointing --vae_gradient_checkpointing); GRPO's sampling only off.

Models: the transformer configs of diffusers' scripts/convert_flux2_to_diffusers.py (`get_flux2_transformer_config`:
flux2-dev, klein-4b, klein-9b; kept in benchmarks/configs/flux2*_transformer.json) and the VAE it converts into,
AutoencoderKLFlux2's defaults (benchmarks/configs/flux2_vae.json); the text encoders as the pipelines' classes build
them: [dev]'s Mistral-Small-3.1-24B (Mistral3ForConditionalGeneration, its vision tower included;
flux2dev_text_encoder.json, the published config as a FLUX.2 trainer vendors it), [klein] 4B's Qwen3-4B
(z_image_text_encoder.json, Z-Image's) and 9B's Qwen3-8B (flux2_klein_9b_text_encoder.json), as Qwen3ForCausalLM;
random weights on meta. No tokenizer: the pipelines pad every prompt to 512 tokens, so the encoder runs on 512 token
ids and the hidden states of the pipeline's layers are stacked as its encode_prompt does: (1, 512, 3 x width).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import family_memory as fm
from benchmarks.cases import Case

# name -> (transformer config file, pipeline class, is_distilled or None for [dev], text encoder config file)
FLUX2_MODELS = {
    "flux2_dev": ("flux2dev_transformer.json", "Flux2Pipeline", None, "flux2dev_text_encoder.json"),
    "flux2_klein_4b": (
        "flux2_klein_4b_transformer.json",
        "Flux2KleinPipeline",
        True,
        "z_image_text_encoder.json",
    ),
    "flux2_klein_9b": (
        "flux2_klein_9b_transformer.json",
        "Flux2KleinPipeline",
        True,
        "flux2_klein_9b_text_encoder.json",
    ),
}
VAE_CONFIG = "flux2_vae.json"
# the encoder's hidden states the pipeline stacks: Flux2Pipeline's / Flux2KleinPipeline's encode_prompt defaults
HIDDEN_STATES_LAYERS = {"Flux2Pipeline": (10, 20, 30), "Flux2KleinPipeline": (9, 18, 27)}


def text_encoder(pipeline: str, config: dict) -> torch.nn.Module:
    """The pipeline's text encoder class built from `config` on the current default device: [dev]'s
    Mistral3ForConditionalGeneration (with its vision tower), [klein]'s Qwen3ForCausalLM."""
    if pipeline == "Flux2Pipeline":
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        return Mistral3ForConditionalGeneration(Mistral3Config(**config))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**config))


def parameter_counts() -> dict[str, int]:
    """Parameters of each model's transformer and text encoder, and of the VAE (built on meta)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    with torch.device("meta"):
        counts = {}
        for name, (f, pipeline, _, te) in FLUX2_MODELS.items():
            counts[name] = fm.count_parameters(Flux2Transformer2DModel.from_config(fm.load_config(f)))
            counts[f"{name}_text_encoder"] = fm.count_parameters(text_encoder(pipeline, fm.load_config(te)))
        counts["vae"] = fm.count_parameters(AutoencoderKLFlux2.from_config(fm.load_config(VAE_CONFIG)))
    return counts


def _bench_class(cls, layers: tuple[int, ...]):
    """`cls` encoding as its pipeline's encode_prompt does after the tokenizer (see the module doc)."""

    class BenchFlux2(cls):
        def check_prompt_lengths(self, prompts):
            """No tokenizer here: every prompt is counted at the 512 tokens the pipeline pads it to."""

        def _encode(self, prompts):
            """Every prompt padded to max_sequence_length (512) tokens, as the pipeline pads them; the hidden
            states of `layers` stacked along the width: (B, 512, 3 x width)."""
            encoder = self.pipe.text_encoder
            device = next(encoder.parameters()).device
            ids = torch.zeros(len(prompts), self.max_sequence_length, dtype=torch.long, device=device)
            out = encoder(input_ids=ids, output_hidden_states=True, use_cache=False)
            stacked = torch.stack([out.hidden_states[k] for k in layers], dim=1)  # (B, 3, 512, width)
            batch, channels, length, width = stacked.shape
            return {"prompt_embeds": stacked.permute(0, 2, 1, 3).reshape(batch, length, channels * width)}

    return BenchFlux2


def _family(b, model: str):
    """The FLUX.2 family of `model` around a LoRA transformer (the trainers' make_trainable), with its text encoder
    on the device, and its trained parameters."""
    import diffusers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from refl_ddpo.core.families import family_class
    from refl_ddpo.testing.tiny_flux2 import FLUX2_SCHEDULER

    file, pipeline, distilled, te = FLUX2_MODELS[model]
    with torch.device(b.device):
        transformer = Flux2Transformer2DModel.from_config(fm.load_config(file))
        vae = AutoencoderKLFlux2.from_config(fm.load_config(VAE_CONFIG))
        encoder = text_encoder(pipeline, fm.load_config(te))
    for part in (transformer, vae, encoder):
        fm.frozen(part, b.dtype)
    cls = family_class(pipeline)
    params = fm.trainable(b, transformer, cls)
    kwargs = {} if distilled is None else {"is_distilled": distilled}
    pipe = getattr(diffusers, pipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=encoder,
        tokenizer=None,
        transformer=transformer,
        **kwargs,
    )
    return _bench_class(cls, HIDDEN_STATES_LAYERS[pipeline])(pipe), params


def case(model: str, phase: str) -> Case:
    """One count on `model` (see the module doc): `phase` one of family_memory.PHASES."""

    def setup(b):
        family, params = _family(b, model)
        b.text_encoder_bytes = fm.text_encoder_bytes(family)
        b.text_encoder_family = family
        guidance = family.default_guidance_scale(1.0)  # [dev]: the pipeline's embedded 4; [klein]: CFG off
        return fm.phase_run(b, family, params, phase, guidance_scale=guidance)

    settings = {"mode": "lora", "batch": 1, "model": model, "phase": phase, "text_encoder_on_device": True}
    bench = f"{model}_{phase}"
    return Case(f"{bench} lora b1", bench, "optimizer step" if phase == "refl" else phase, 1, settings, setup)


def _jobs(args: argparse.Namespace):
    """(bench config, case, fields) of every count; GRPO's guidance: [dev]'s embedded 4, [klein] (distilled) none."""
    for model in args.models:
        guidance = 1.0 if FLUX2_MODELS[model][2] else 4.0
        for res in args.resolutions:
            for phase in args.phases:
                for gc in fm.checkpointing(args, phase):
                    cfg = fm.bench_config(args, res, gc, ddpo_guidance_scale=guidance)
                    yield (
                        cfg,
                        case(model, phase),
                        {"gradient_checkpointing": gc, "resolution": res, "phase": phase},
                    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fm.add_common_args(parser)
    parser.add_argument("--models", nargs="+", choices=list(FLUX2_MODELS), default=list(FLUX2_MODELS))
    args = parser.parse_args(argv)
    results = fm.new_results("benchmarks.flux2_memory", argv, parameter_counts(), dtype="bf16")
    lines = fm.table_head(["model", "pass", "resolution"], derived_offload=True)
    footer = (
        f"\n- Computed on the meta device, not measured: bf16, batch 1, LoRA r 4; ReFL: a rollout of "
        f"{args.refl_steps} steps with grad at step {args.refl_k}, ImageReward; GRPO: {args.grpo_steps} flow-SDE "
        "steps; [dev] with its embedded guidance 4, [klein] without CFG. The text encoder on the device; off the "
        "device (derived, not counted): the peak less its weights. Weights: what is live before the counted run "
        "(weights and AdamW states).\n"
    )
    for r in fm.counts(_jobs(args)):
        results["cases"].append(r)
        cells = [r["settings"]["model"], r["phase"], str(r["resolution"]), *fm.gib_cells(r, True)]
        fm.record(args.out, results, lines, cells, footer)
    return results


if __name__ == "__main__":
    main()
