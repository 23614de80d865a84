"""Z-Image's peak device memory, counted without a GPU by benchmarks/memory.py's machinery (`case_memory`: the meta
device, CUDA's autocast and attention kernels, setup, a warm-up run, the peak of a second run):

    python -m benchmarks.z_image_memory --out benchmarks/results/z_image_memory --refl_steps 4 --refl_k 3

One case is one ReFL optimizer step (refl_ddpo.trainers.backprop.refl_step as the trainer calls it: --refl_steps
steps, step --refl_k with grad, predicted x0 decoded by the VAE, ImageReward) at batch 1, bf16, LoRA rank 4 on the
family's default targets, CFG off (ReFL's rollout; Z-Image-Turbo's sampling), counted at each --resolutions with
gradient checkpointing off and on (the transformer's, the VAE's and ImageReward's), the text encoder on the device;
the peak with it offloaded (--offload_text_encoders) is derived from the count, as benchmarks/qwen_memory.py's.
Z-Image and Z-Image-Turbo have the same parts: one count serves both.

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
    return BenchZImage(pipe), params, b.prompts(1)


def refl_case(configs: dict[str, dict]) -> Case:
    """One ReFL optimizer step on Z-Image (see the module doc)."""

    def setup(b):
        family, params, (prompts, metadata) = _family(b, configs)
        b.text_encoder_bytes = fm.text_encoder_bytes(family)
        b.text_encoder_family = family
        return fm.refl_run(b, family, params, prompts, metadata)

    settings = {"mode": "lora", "batch": 1, "model": "z-image", "text_encoder_on_device": True}
    return Case("z_image_refl lora b1", "z_image_refl", "optimizer step", 1, settings, setup)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fm.add_common_args(parser)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[512, 1024])
    args = parser.parse_args(argv)
    configs = z_image_configs()
    results = fm.new_results("benchmarks.z_image_memory", argv, parameter_counts(), dtype="bf16")
    lines = fm.table_head(["resolution"], derived_offload=True)
    footer = (
        f"\n- Computed on the meta device, not measured: Z-Image architecture, bf16, a ReFL rollout of "
        f"{args.refl_steps} steps with grad at step {args.refl_k}, LoRA rank 4. Weights: what is live before the "
        "counted run (weights and AdamW states). Text encoder off the device (derived, not counted): the peak less "
        "its weights (it runs before the rollout, whose backward holds the peak).\n"
    )
    jobs = (
        (
            fm.bench_config(args, res, gc),
            refl_case(configs),
            {"gradient_checkpointing": gc, "resolution": res},
        )
        for res in args.resolutions
        for gc in fm.CHECKPOINTING[args.checkpointing]
    )
    for r in fm.counts(jobs):
        results["cases"].append(r)
        fm.record(args.out, results, lines, [str(r["resolution"]), *fm.gib_cells(r, True)], footer)
    return results


if __name__ == "__main__":
    main()
