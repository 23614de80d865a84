"""Z-Image's peak device memory, counted without a GPU by benchmarks/memory.py's machinery (`case_memory`: the meta
device, CUDA's autocast and attention kernels, setup, a warm-up run, the peak of a second run):

    python -m benchmarks.z_image_memory --out benchmarks/results/z_image_memory --refl_steps 4 --refl_k 3

At batch 1, bf16, LoRA rank 4 on the family's default targets, at each --resolutions, the text encoder on the device
(the peak with it offloaded, --offload_text_encoders, is derived from the count, as benchmarks/qwen_memory.py's),
three passes (--phases; family_memory.PHASES):
- "refl": one ReFL optimizer step (refl_ddpo.trainers.backprop.refl_step as the trainer calls it: --refl_steps steps,
  step --refl_k with grad, predicted x0 decoded by the VAE, ImageReward), CFG off (ReFL's rollout; Z-Image-Turbo's
  sampling). Z-Image and Z-Image-Turbo have the same parts: one count serves both.
- "grpo_sample" and "grpo_train": GRPO's sampling of one image (--grpo_steps flow-SDE steps, log-probs, decode) and
  its training pass over it (every step, PPO-clip), as benchmarks/cases.py counts FLUX.1's; Z-Image with CFG (the
  pipeline's default guidance), Z-Image-Turbo without.
Gradient checkpointing off and on (the transformer's, the VAE's and ImageReward's); GRPO's sampling only off (no grad).

Models: the published Tongyi-MAI/Z-Image(-Turbo) configs kept in benchmarks/configs (z_image_transformer.json, the
6.15B single-stream DiT; z_image_text_encoder.json, Qwen3-4B's, built as the pipeline's Qwen3Model; the VAE is
FLUX.1's, flux1dev_vae.json), random weights on meta. The tokenizer is the tiny offline one (one token per byte,
refl_ddpo.testing.tiny_zimage), so the text is the prompt's bytes in the chat template: a few tens of tokens beside
4096 image tokens at 1024 px, as with the real tokenizer. The prompt is encoded as the pipeline's `encode_prompt`
does for one prompt without padding (the second-to-last hidden state) but without its mask-indexing, whose output
shape the meta device cannot know; likewise the transformer gets each prompt's tokens whole.
"""

from __future__ import annotations

import argparse

from benchmarks import family_memory as fm
from benchmarks.cases import Case

Z_IMAGE_CONFIG_FILES = {
    "transformer": "z_image_transformer.json",
    "vae": "flux1dev_vae.json",  # Z-Image's VAE config is FLUX.1's
    "text_encoder": "z_image_text_encoder.json",
}


def z_image_configs() -> dict[str, dict]:
    return fm.load_configs(Z_IMAGE_CONFIG_FILES)


def _construct(name: str, config: dict):
    """One Z-Image part with random weights on the current default device."""
    if name == "transformer":
        from diffusers import ZImageTransformer2DModel

        return ZImageTransformer2DModel.from_config(config)
    if name == "vae":
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_config(config)
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(**config))


def parameter_counts() -> dict[str, int]:
    """Parameters of each part (built on meta)."""
    return fm.parameter_counts(_construct, z_image_configs())


def _family(b, configs: dict[str, dict]):
    """The ZImage family around a LoRA transformer (the trainers' make_trainable) and its trained parameters."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from refl_ddpo.core.families.z_image import ZImage
    from refl_ddpo.testing.tiny_qwen import QWEN3_CHAT_TEMPLATE, qwen_tokenizer
    from refl_ddpo.testing.tiny_zimage import BASE_SCHEDULER

    class BenchZImage(ZImage):
        def run_text_encoders(self, prompts, with_negative):
            """As encode_prompt for prompts without padding (see the module doc)."""
            pipe = self.pipe
            tokens = pipe.tokenizer([self._templated(p) for p in prompts], return_tensors="pt").to(
                pipe.device
            )
            out = pipe.text_encoder(
                input_ids=tokens.input_ids,
                attention_mask=tokens.attention_mask.bool(),
                output_hidden_states=True,
            )
            embeds = out.hidden_states[-2]
            return {"prompt_embeds": embeds, "prompt_embeds_mask": tokens.attention_mask}, None

        def texts(self, cond):
            return list(cond["prompt_embeds"].unbind(0))  # every token kept: no mask-indexing on meta

    parts = fm.build_parts(b, _construct, configs)
    params = fm.trainable(b, parts["transformer"], ZImage)
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**BASE_SCHEDULER), tokenizer=tokenizer, **parts
    )
    return BenchZImage(pipe), params


# variant -> GRPO's guidance scale (the kit's s: the base's pipeline default g = 5 is s = 6; the Turbo: CFG off)
GRPO_GUIDANCE = {"z_image": 6.0, "z_image_turbo": 1.0}


def case(configs: dict[str, dict], phase: str, variant: str = "z_image") -> Case:
    """One count on Z-Image (see the module doc): `phase` one of family_memory.PHASES."""

    def setup(b):
        family, params = _family(b, configs)
        b.text_encoder_bytes = fm.text_encoder_bytes(family)
        b.text_encoder_family = family
        return fm.phase_run(b, family, params, phase)

    model = "z-image" if phase == "refl" else variant.replace("_", "-")
    settings = {"mode": "lora", "batch": 1, "model": model, "phase": phase, "text_encoder_on_device": True}
    if phase != "refl":
        settings["guidance_scale"] = GRPO_GUIDANCE[variant]
    bench = f"{variant}_{phase}"
    return Case(f"{bench} lora b1", bench, "optimizer step" if phase == "refl" else phase, 1, settings, setup)


def _jobs(args: argparse.Namespace, configs: dict[str, dict]):
    """(bench config, case, fields) of every count: ReFL once for both models (the same parts, CFG off), GRPO's
    passes for each (the base with CFG, the Turbo without)."""
    for res in args.resolutions:
        for phase in args.phases:
            for variant in ("z_image",) if phase == "refl" else tuple(GRPO_GUIDANCE):
                for gc in fm.checkpointing(args, phase):
                    guidance = {} if phase == "refl" else {"ddpo_guidance_scale": GRPO_GUIDANCE[variant]}
                    fields = {"gradient_checkpointing": gc, "resolution": res, "phase": phase}
                    yield fm.bench_config(args, res, gc, **guidance), case(configs, phase, variant), fields


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fm.add_common_args(parser)
    args = parser.parse_args(argv)
    configs = z_image_configs()
    results = fm.new_results("benchmarks.z_image_memory", argv, parameter_counts(), dtype="bf16")
    lines = fm.table_head(["model", "pass", "resolution"], derived_offload=True)
    footer = (
        f"\n- Computed on the meta device, not measured: Z-Image architecture, bf16, batch 1, LoRA rank 4; ReFL: a "
        f"rollout of {args.refl_steps} steps with grad at step {args.refl_k}, CFG off (one count for both models); "
        f"GRPO: {args.grpo_steps} flow-SDE steps, the base with CFG (guidance {GRPO_GUIDANCE['z_image']}), the "
        "Turbo without. Weights: what is live before the counted run (weights and AdamW states). Text encoder off "
        "the device (derived, not counted): the peak less its weights.\n"
    )
    for r in fm.counts(_jobs(args, configs)):
        results["cases"].append(r)
        model = r["settings"]["model"] if r["phase"] != "refl" else "z-image, z-image-turbo"
        cells = [model, r["phase"], str(r["resolution"]), *fm.gib_cells(r, True)]
        fm.record(args.out, results, lines, cells, footer)
    return results


if __name__ == "__main__":
    main()
