"""Wan text-to-video (2.1 1.3B and 14B, 2.2 TI2V-5B): peak device memory of a ReFL LoRA step and of GRPO's two
passes on videos, counted without a GPU by benchmarks/memory.py's machinery (`case_memory`: the meta device, CUDA's
autocast and attention kernels, setup, a warm-up run, the peak of a second run):

    python -m benchmarks.wan_memory --out benchmarks/results/wan_memory --refl_steps 4 --refl_k 3

At batch 1, bf16, LoRA rank 4 on the family's default targets, square videos of --resolutions px and --frames frames
(latents (1, C, (frames - 1) / 4 + 1, side / s, side / s): C 16 and s 8 for Wan 2.1's VAE, 48 and 16 for Wan 2.2's),
CFG off, three passes (--phases; family_memory.PHASES): "refl", one ReFL optimizer step (--refl_steps steps, step
--refl_k with grad, the predicted x0 decoded by the 3-D VAE, ImageReward on frames chosen by --video_reduction, as
the trainers' flag: mean:4, four evenly spaced, by default; first:K decodes the first K frames alone); "grpo_sample"
and "grpo_train", GRPO's sampling of one video (--grpo_steps flow-SDE steps, log-probs, decode) and its training
pass over it (every step, PPO-clip). Gradient checkpointing off and on (the transformer's and ImageReward's:
`AutoencoderKLWan` has none, so its decode keeps every activation for the backward); GRPO's sampling only off.

The text encoder on the device (the peak with it off the device derived: the peak less its weights), or with
--offload_text_encoders the kit's flag counted (memory.py: its weights on the device only while it encodes). Sharded
(--fsdp_world_size N, the kit's --fsdp): rank 0's count, the transformer sharded by the kit's FSDP2, the VAE and
ImageReward whole, the text encoder whole or (--fsdp_shard_text_encoders, the kit's flag) sharded.

Models: the configs of diffusers' scripts/convert_wan_to_diffusers.py (`get_transformer_config`: Wan-T2V-1.3B,
Wan-T2V-14B and Wan2.2-TI2V-5B, kept in benchmarks/configs/wan2*_transformer.json; the VAEs it converts into:
`AutoencoderKLWan()`'s defaults for Wan 2.1, wan21_vae.json, and its `vae22_diffusers_config` for Wan 2.2's,
wan22_vae.json: z_dim 48, residual blocks, patch 2, 16x in space), the pipeline it writes for TI2V-5B
(`expand_timesteps`, flow_shift 5 where the others have 3), and UMT5-XXL's encoder as Wan's own `umt5_xxl` builds it
(Wan-Video/Wan2.1 wan/modules/t5.py: vocabulary 256384, width 4096, 24 layers of 64 heads, FFN 10240, 32 position
buckets; umt5_xxl_text_encoder.json as a `UMT5Config`); random weights on meta. No tokenizer: the pipeline pads every
prompt to 512 tokens, so the encoder runs on 512 token ids. Wan 2.2 A14B's experts are each a Wan-T2V-14B-sized
transformer (the frozen one adds its weights, whole on every rank under --fsdp: the kit shards only the trained one).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import family_memory as fm
from benchmarks.cases import Case

WAN_MODELS = {
    "wan21_1_3b": "wan21_1_3b_transformer.json",
    "wan21_14b": "wan21_14b_transformer.json",
    "wan22_ti2v_5b": "wan22_ti2v_5b_transformer.json",
}
VAE_CONFIGS = {"vae": "wan21_vae.json", "wan22_vae": "wan22_vae.json"}  # parameter_counts' keys -> configs
TI2V = {
    "wan22_ti2v_5b"
}  # the Wan 2.2 VAE, expand_timesteps and flow_shift 5 (the conversion script's pipeline)
TEXT_ENCODER_CONFIG = "umt5_xxl_text_encoder.json"


def _text_encoder(config: dict) -> torch.nn.Module:
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(**config))


def parameter_counts() -> dict[str, int]:
    """Parameters of each transformer, of the text encoder and of the two VAEs (built on meta)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    with torch.device("meta"):
        counts = {
            n: fm.count_parameters(WanTransformer3DModel.from_config(fm.load_config(f)))
            for n, f in WAN_MODELS.items()
        }
        counts["text_encoder"] = fm.count_parameters(_text_encoder(fm.load_config(TEXT_ENCODER_CONFIG)))
        for name, f in VAE_CONFIGS.items():
            counts[name] = fm.count_parameters(AutoencoderKLWan.from_config(fm.load_config(f)))
    return counts


def _family(b, model: str, frames: int):
    """The Wan family around a LoRA transformer of `model` (the trainers' make_trainable), `frames` frames, its text
    encoder on the device; and its trained parameters."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    from refl_ddpo.core.families.wan import Wan

    class BenchWan(Wan):
        def check_prompt_lengths(self, prompts):
            """No tokenizer here: every prompt is counted at the 512 tokens the pipeline pads it to."""

        def run_text_encoders(self, prompts, with_negative):
            encoder = self.pipe.text_encoder
            ids = torch.zeros(len(prompts), self.max_sequence_length, dtype=torch.long, device=b.device)
            embeds = encoder(ids, torch.ones_like(ids)).last_hidden_state
            return {"prompt_embeds": embeds}, ({"prompt_embeds": embeds} if with_negative else None)

    with torch.device(b.device):
        transformer = WanTransformer3DModel.from_config(fm.load_config(WAN_MODELS[model]))
        vae = AutoencoderKLWan.from_config(
            fm.load_config(VAE_CONFIGS["wan22_vae" if model in TI2V else "vae"])
        )
        encoder = _text_encoder(fm.load_config(TEXT_ENCODER_CONFIG))
    for part in (transformer, vae, encoder):
        fm.frozen(part, b.dtype)
    params = fm.trainable(b, transformer, Wan)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=5.0 if model in TI2V else 3.0
        ),  # the conversion script's
        expand_timesteps=model in TI2V,
    )
    family = BenchWan(pipe)
    family.num_frames = frames
    return family, params


def case(model: str, phase: str, frames: int, reduction: str) -> Case:
    """One count on `model` at `frames` frames (see the module doc): `phase` one of family_memory.PHASES, ImageReward
    on the frames `reduction` (--video_reduction) chooses."""

    def setup(b):
        from refl_ddpo.core.video import leading_frames
        from refl_ddpo.rewards import Reward
        from refl_ddpo.rewards.video import frames_reward

        family, params = _family(b, model, frames)
        b.text_encoder_bytes = fm.text_encoder_bytes(family)
        b.text_encoder_family = family
        image_reward = b.imagereward  # as build_reward makes it under --video_reduction
        b.imagereward = lambda m: Reward(
            "imagereward",
            frames_reward(image_reward(m).fn, reduction),
            True,
            frames=leading_frames(reduction),
        )
        # AutoencoderKLWan has no gradient checkpointing: the VAE decodes with grad kept whole (vae None)
        return fm.phase_run(b, family, params, phase, **({"vae": None} if phase == "refl" else {}))

    settings = {"mode": "lora", "batch": 1, "model": model, "phase": phase, "frames": frames}
    settings["text_encoder_on_device"] = True
    bench = f"{model}_{phase}_{frames}f"
    if phase == "refl":
        settings["video_reduction"] = reduction
        bench += f"_{reduction.replace(':', '')}"
    return Case(f"{bench} lora b1", bench, "optimizer step" if phase == "refl" else phase, 1, settings, setup)


def _jobs(args: argparse.Namespace):
    for model in args.models:
        for res in args.resolutions:
            for frames in args.frames:
                for phase in args.phases:
                    for gc in fm.checkpointing(args, phase):
                        fields = {
                            "gradient_checkpointing": gc,
                            "resolution": res,
                            "phase": phase,
                            "frames": frames,
                        }
                        cfg = fm.bench_config(args, res, gc, ddpo_guidance_scale=1.0, **_flags(args))
                        yield cfg, case(model, phase, frames, args.video_reduction), fields


def _flags(args: argparse.Namespace) -> dict:
    """The kit's flags counted: --fsdp_world_size, --fsdp_shard_text_encoders, --offload_text_encoders."""
    keys = ("fsdp_world_size", "fsdp_shard_text_encoders", "offload_text_encoders")
    return {k: getattr(args, k) for k in keys}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fm.add_common_args(parser)
    parser.set_defaults(resolutions=[480])
    parser.add_argument("--models", nargs="+", choices=list(WAN_MODELS), default=list(WAN_MODELS))
    parser.add_argument("--frames", type=int, nargs="+", default=[17, 33, 81])
    parser.add_argument(
        "--video_reduction",
        default="mean:4",
        help="the frames ImageReward scores in the ReFL step (the kit's flag)",
    )
    parser.add_argument("--fsdp_world_size", type=int, default=0, help="count rank 0 of this many (--fsdp)")
    parser.add_argument(
        "--fsdp_shard_text_encoders", action="store_true", help="the kit's flag, with --fsdp_world_size"
    )
    parser.add_argument("--offload_text_encoders", action="store_true", help="the kit's flag, counted")
    args = parser.parse_args(argv)
    from refl_ddpo.core.video import parse_reduction

    parse_reduction(args.video_reduction)
    results = fm.new_results("benchmarks.wan_memory", argv, parameter_counts(), dtype="bf16", **_flags(args))
    lines = fm.table_head(["model", "pass", "resolution", "frames"], derived_offload=True)
    footer = "\n" + "".join(f"- {n}\n" for n in _notes(args))
    for r in fm.counts(_jobs(args)):
        results["cases"].append(r)
        phase = r["phase"] + (f" {args.video_reduction}" if r["phase"] == "refl" else "")
        cells = [r["settings"]["model"], phase, str(r["resolution"]), str(r["frames"])]
        fm.record(args.out, results, lines, [*cells, *fm.gib_cells(r, True)], footer)
    return results


def _notes(args: argparse.Namespace) -> list[str]:
    """memory.md's footnotes: what was counted and how."""
    where = "on the device; off the device (derived, not counted): the peak less its weights"
    if args.offload_text_encoders:
        where = "offloaded (--offload_text_encoders, counted: on the device only while it encodes)"
    elif args.fsdp_shard_text_encoders:
        where = "sharded (--fsdp_shard_text_encoders, counted)"
    notes = [
        (
            f"Computed on the meta device, not measured: bf16, batch 1, LoRA r 4, square videos, CFG off; ReFL: a "
            f"rollout of {args.refl_steps} steps with grad at step {args.refl_k}, ImageReward on the frames of "
            f"--video_reduction {args.video_reduction}; GRPO: {args.grpo_steps} flow-SDE steps. The text encoder "
            f"(UMT5-XXL) {where}. Weights: what is live before the counted run (weights and AdamW states)."
        )
    ]
    if args.fsdp_world_size:
        notes.append(
            f"Per rank, rank 0 of {args.fsdp_world_size}: the transformer sharded with the kit's FSDP2 (--fsdp; "
            "benchmarks/memory.py), the VAE and ImageReward whole on every rank."
        )
    return notes


if __name__ == "__main__":
    main()
