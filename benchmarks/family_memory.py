"""What the per-family memory scripts (qwen_memory.py, z_image_memory.py, flux2_memory.py) share: their models built
from the configs in benchmarks/configs with random weights, one ReFL LoRA optimizer step as a `Case` for
benchmarks/memory.py's `case_memory` (the meta device, CUDA's autocast and attention kernels, setup, a warm-up run,
the peak of a second run), the command line's common flags, and the loop that counts each case and writes
memory.json and memory.md after every one. Each script holds only its model's parts, encode and table columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from benchmarks.config import BenchConfig
from benchmarks.measure import GIB
from benchmarks.memory import case_memory
from benchmarks.models import CONFIG_DIR, model_configs
from benchmarks.report import write_files

CHECKPOINTING = {
    "both": (False, True),
    "off": (False,),
    "on": (True,),
}  # --checkpointing -> the counts' settings


def load_config(file: str) -> dict:
    """One config of benchmarks/configs."""
    return json.loads((CONFIG_DIR / file).read_text())


def load_configs(files: dict[str, str]) -> dict[str, dict]:
    """Each part's config: part name -> file in benchmarks/configs."""
    return {name: load_config(f) for name, f in files.items()}


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_counts(
    construct: Callable[[str, dict], torch.nn.Module], configs: dict[str, dict]
) -> dict[str, int]:
    """Parameters of each part, built by `construct(name, config)` on meta."""
    with torch.device("meta"):
        return {name: count_parameters(construct(name, c)) for name, c in configs.items()}


def frozen(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` without gradients, in eval mode and `dtype`, as the trainers hold a part they do not train."""
    return model.requires_grad_(False).eval().to(dtype=dtype)


def build_parts(b, construct: Callable[[str, dict], torch.nn.Module], configs: dict[str, dict]) -> dict:
    """Each part built by `construct(name, config)` on the bench's device, frozen in its dtype."""
    parts = {}
    for name, config in configs.items():
        with torch.device(b.device):
            model = construct(name, config)
        parts[name] = frozen(model, b.dtype)
    return parts


def trainable(b, transformer: torch.nn.Module, family_cls, mode: str = "lora") -> list:
    """The trainers' make_trainable on `transformer`: a LoRA on the family's default targets (`mode` "lora") or the
    whole of it ("full", fp32); returns the trained parameters."""
    from refl_ddpo.run.session import trainable_spec
    from refl_ddpo.run.training import make_trainable

    config = dataclasses.replace(
        b.common, use_lora=mode == "lora", lora_target_modules=list(family_cls.lora_target_modules)
    )
    return make_trainable(transformer, trainable_spec(config))


def text_encoder_bytes(family) -> int:
    """Device bytes of the text encoder's weights (each tensor a 512-byte block)."""
    from benchmarks.meta import round_block

    encoder = family.pipe.text_encoder
    return sum(round_block(t.numel() * t.element_size()) for t in (*encoder.parameters(), *encoder.buffers()))


def refl_run(b, family, params, prompts: list[str], metadata: list[dict], **step) -> tuple[Callable, dict]:
    """The rest of a ReFL case's setup once its family and trained parameters are built, and its run: one ReFL
    optimizer step at batch 1 (refl_ddpo.trainers.backprop.refl_step as the trainer calls it). `step`: `cond` (the
    prompt's conditioning, fixed; default: encoded in each run), `vae` (the VAE given gradient checkpointing, or
    None; default: the family's) and `guidance_scale` (default 1.0: CFG off)."""
    from refl_ddpo.trainers.backprop import Rollout, refl_step

    fixed_cond, guidance_scale = step.get("cond"), step.get("guidance_scale", 1.0)
    scheduler = family.rollout_scheduler("ddpm")
    reward_model = b.build("reward")
    base = family.network
    network, optimizer = b.prepare(base, params, None)
    b.finish(network, step.get("vae", family.vae), reward_model)
    reward, acc = b.imagereward(reward_model), b.accelerator
    network.train()

    def run():
        with acc.accumulate(network):
            cond = fixed_cond or family.encode_prompts(prompts, with_negative=False)[0]
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
                guidance_scale=guidance_scale,
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


PHASES = ("refl", "grpo_sample", "grpo_train")  # what a count counts: refl_run's step, grpo_run's two passes


def grpo_run(b, family, params, phase: str) -> tuple[Callable, dict]:
    """The rest of a GRPO case's setup once its family and trained parameters are built, and its run, as
    benchmarks/cases.py counts FLUX.1's: `phase` "grpo_sample" (one sampled batch: the flow SDE's steps, CFG where
    the bench config's --ddpo_guidance_scale and the family turn it on, log-probs, decode) or "grpo_train" (one
    training pass over it: every timestep, PPO-clip)."""
    from benchmarks.cases import FLUX_GRPO_ETA, policy_setup, sample_run, train_run

    config = b.ddpo_config(eta=FLUX_GRPO_ETA)
    setup = policy_setup(b, config, family, family.policy_scheduler(), params)
    return (sample_run if phase == "grpo_sample" else train_run)(b, setup)


def phase_run(b, family, params, phase: str, **step) -> tuple[Callable, dict]:
    """`phase`'s run (one of PHASES): refl_run with `step`, or grpo_run."""
    if phase == "refl":
        prompts, metadata = b.prompts(1)
        return refl_run(b, family, params, prompts, metadata, **step)
    return grpo_run(b, family, params, phase)


def checkpointing(args: argparse.Namespace, phase: str) -> tuple[bool, ...]:
    """The gradient checkpointing settings `phase` is counted at: GRPO's sampling once, off (no grad: checkpointing
    changes nothing)."""
    return (False,) if phase == "grpo_sample" else CHECKPOINTING[args.checkpointing]


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """--out, --resolutions, --phases, --refl_steps, --refl_k, --grpo_steps and --checkpointing, as every family's
    script takes them."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--refl_steps", type=int, default=40)
    parser.add_argument("--refl_k", type=int, default=35)
    parser.add_argument(
        "--grpo_steps", type=int, default=6, help="GRPO's sampling steps (Flow-GRPO's FLUX.1 6)."
    )
    parser.add_argument("--checkpointing", choices=tuple(CHECKPOINTING), default="both")


def new_results(module: str, argv: list[str] | None, parameters: dict[str, int], **fields) -> dict:
    """memory.json's head: the command that wrote it, the parameter counts, `fields` in order, then the cases (none
    yet)."""
    command = " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])
    return {"command": command, "parameters": parameters, **fields, "cases": []}


def bench_config(args: argparse.Namespace, resolution: int, gc: bool, **fields) -> BenchConfig:
    """The count's settings: bf16 on meta (as CUDA would allocate), `args`' ReFL rollout and GRPO steps (one image
    sampled and trained per batch), gradient checkpointing `gc`; `fields` (e.g. ddpo_guidance_scale) as given."""
    return BenchConfig(
        dtype="bf16",
        device="cpu",
        resolution=resolution,
        refl_steps=args.refl_steps,
        refl_k=args.refl_k,
        ddpo_steps=args.grpo_steps,
        ddpo_sample_batch_size=1,
        ddpo_train_batch_size=1,
        gradient_checkpointing=gc,
        memory_only=True,
        **fields,
    )


def counts(jobs: Iterable[tuple[BenchConfig, object, dict]]) -> Iterator[dict]:
    """Each job's count: `(cfg, case, fields)` -> case_memory's result with `fields` added."""
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        sd_configs = model_configs(False, Path(workdir))  # ImageReward's config; the SD ones are not used
        for cfg, case, fields in jobs:
            r = case_memory(cfg, sd_configs, Path(workdir), case)
            r.update(fields)
            yield r


def table_head(first: list[str], derived_offload: bool) -> list[str]:
    """memory.md's table head: the columns `first`, then those of `gib_cells`."""
    columns = [*first, "gradient checkpointing", "weights (GiB)", "peak (GiB, computed)"]
    if derived_offload:
        columns.append("peak, text encoder off the device (GiB, derived)")
    columns.append("counted in")
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def gib_cells(r: dict, derived_offload: bool) -> list[str]:
    """A count's table cells: gradient checkpointing, weights and peak in GiB, (with `derived_offload`) the peak
    with the text encoder off the device, and the seconds it took."""
    cells = ["on" if r["gradient_checkpointing"] else "off", f"{r['steady_bytes'] / GIB:.2f}"]
    cells.append(f"{r['peak_bytes'] / GIB:.2f}")
    if derived_offload:
        off = r.get("peak_text_encoders_offloaded_bytes")
        cells.append("-" if off is None else f"{off / GIB:.2f}")
    return [*cells, f"{r['seconds']:.0f} s"]


def record(out: str, results: dict, lines: list[str], cells: list[str], footer: str) -> None:
    """Adds a count's row to the table, prints it and writes memory.json and memory.md into `out` (`results` holds
    the count)."""
    lines.append("| " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    write_files(
        Path(out),
        {"memory.json": json.dumps(results, indent=2) + "\n", "memory.md": "\n".join(lines) + "\n" + footer},
    )
