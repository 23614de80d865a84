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

import torch

from benchmarks import family_memory as fm
from benchmarks.cases import Case

QWEN_CONFIG_FILES = {
    "transformer": "qwen_image_transformer.json",
    "vae": "qwen_image_vae.json",
    "text_encoder": "qwen_image_text_encoder.json",
}


def qwen_configs() -> dict[str, dict]:
    return fm.load_configs(QWEN_CONFIG_FILES)


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
    return fm.parameter_counts(_construct, qwen_configs())


def _family(b, configs: dict[str, dict], text_encoder_on_device: bool, mode: str = "lora"):
    """The QwenImage family around a LoRA (`mode` "lora") or wholly trained ("full", fp32) transformer (the trainers'
    make_trainable) and its trained parameters."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from refl_ddpo.core.families.qwen_image import QwenImage
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

    parts = fm.build_parts(b, _construct, configs)
    params = fm.trainable(b, parts["transformer"], QwenImage, mode)
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


def refl_case(configs: dict[str, dict], text_encoder_on_device: bool, mode: str = "lora") -> Case:
    """One ReFL optimizer step on Qwen-Image (see the module doc); `mode`: "lora" or "full" (the whole
    transformer trained)."""

    def setup(b):
        family, params, fixed_cond, (prompts, metadata) = _family(b, configs, text_encoder_on_device, mode)
        if text_encoder_on_device:
            b.text_encoder_bytes = fm.text_encoder_bytes(family)
            b.text_encoder_family = (
                family  # for the count of --fsdp_shard_text_encoders (benchmarks/memory.py)
            )
        # the Qwen-Image VAE has no gradient checkpointing
        return fm.refl_run(b, family, params, prompts, metadata, cond=fixed_cond, vae=None)

    where = "on the device" if text_encoder_on_device else "offloaded"
    name = f"qwen_image_refl {mode} b1, text encoder {where}"
    settings = {
        "mode": mode,
        "batch": 1,
        "model": "qwen-image",
        "text_encoder_on_device": text_encoder_on_device,
    }
    return Case(name, "qwen_image_refl", "optimizer step", 1, settings, setup)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fm.add_common_args(parser)
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", choices=("lora", "full"), default=["lora"])
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
    return parser


def _footer(args: argparse.Namespace) -> str:
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
    return "\n" + "".join(f"- {n}\n" for n in notes)


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.fsdp_shard_text_encoders and not (args.fsdp_world_size and args.text_encoder == "on"):
        parser.error("--fsdp_shard_text_encoders needs --fsdp_world_size N and --text_encoder on")
    configs = qwen_configs()
    fsdp = {
        "fsdp_world_size": args.fsdp_world_size,
        "fsdp_shard_text_encoders": args.fsdp_shard_text_encoders,
    }
    results = fm.new_results(
        "benchmarks.qwen_memory", argv, parameter_counts(), resolution=args.resolution, dtype="bf16", **fsdp
    )
    lines = fm.table_head(["case"], derived_offload=True)
    footer = _footer(args)
    on_device = {"both": (True, False), "on": (True,), "off": (False,)}[args.text_encoder]
    jobs = (
        (
            fm.bench_config(args, args.resolution, gc, **fsdp),
            refl_case(configs, te, mode),
            {"gradient_checkpointing": gc},
        )
        for gc in fm.CHECKPOINTING[args.checkpointing]
        for mode in args.modes
        for te in on_device
    )
    for r in fm.counts(jobs):
        if r.get("text_encoders_sharded"):
            r["name"] = r["name"].replace("on the device", "sharded")
        results["cases"].append(r)
        fm.record(args.out, results, lines, [r["name"], *fm.gib_cells(r, True)], footer)
    return results


if __name__ == "__main__":
    main()
