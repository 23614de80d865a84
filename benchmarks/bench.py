#!/usr/bin/env python
"""Speed and memory of ReFL, DDPO and inference on the real Stable Diffusion v1.5 architecture, or on tiny models.

    python benchmarks/bench.py --device cuda --dtype bf16 --out benchmarks/results/h200
    python benchmarks/bench.py --tiny --device cpu --out benchmarks/results/cpu_tiny
    python benchmarks/bench.py --sweep --device cuda --out benchmarks/results/h200_sweep   # before/after table
    python benchmarks/bench.py --flops_only     # FLOPs of every case, counted on the meta device (no GPU)
    python benchmarks/bench.py --memory_only    # peak device memory of every case, counted on meta (no GPU)
    python benchmarks/bench.py --ops_only       # ops and casts per network call, counted on meta (no GPU)

The models are built from config files with random weights (speed and memory do not depend on the values):
benchmarks/configs/ holds SD v1.5's unet/vae/text_encoder configs and BLIP's med_config.json of ImageReward (its
ViT-L/16 is the default of refl_ddpo.rewards.imagereward); `--tiny` takes the configs of refl_ddpo.testing.tiny's
models. Tokenizers are built offline (refl_ddpo.testing; no hub); they pad to the real lengths (77 CLIP, 35 BERT tokens).
The timed regions call the kit's own functions, set up as the trainers set them up (make_trainable, make_optimizer,
make_accelerator + prepare, the trainers' defaults: LoRA rank 4 on to_q/to_k/to_v/to_out.0, AdamW, clipping at 1):

  refl         refl_ddpo.trainers.refl.refl_step + accelerator.backward + clip + AdamW: one ReFL optimizer step,
               40 DDPM steps, 0..k-1 without grad, k with grad (k fixed by --refl_k), predicted x0 -> VAE decode ->
               ImageReward -> relu(2 - r) * grad_scale; LoRA and full UNet (--refl_modes) at each batch size
               (--refl_batch_sizes); CFG off (as the reference). The trainer's logging (.item(), gather) is left out.
  ddpo_sample  refl_ddpo.trainers.rollouts.sample_epoch for one batch: 50 stochastic DDIM steps (eta 1), CFG,
               log-probs, VAE decode; the reward is a stand-in pixel mean (JPEG / aesthetic / ImageReward excluded)
  ddpo_train   refl_ddpo.trainers.ppo.train_on_samples over that batch: every timestep (timestep_fraction 1),
               CFG in the forward, PPO-clip, backward per timestep, one optimizer step for the whole batch
  inference    refl_ddpo.core.generate.generate_batch: CLIP text encoder, 50 DDIM steps (eta 0), CFG, VAE decode;
               weights in --dtype without autocast (as the inference scripts); reported per image too
  forward      one no-grad forward of each model (UNet at batch 1 without CFG, VAE decoder, text encoder,
               ImageReward): the check that the real architecture builds and runs (cheap on CPU at --resolution 64)

Per case: median and spread of --repeats runs after --warmup runs (CUDA events on a GPU, perf_counter on a CPU,
where nothing is asynchronous); peak memory (torch.cuda.max_memory_allocated after reset_peak_memory_stats on a
GPU; on a CPU the process's peak RSS, which is process-wide and never goes down, so a case's number includes every
case before it); FLOPs of one run counted with torch.utils.flop_counter (model FLOPs: gradient checkpointing is
switched off and torch.compile bypassed for the counting run) and, on a GPU, the model FLOPs utilisation against
--peak_tflops; on a GPU also the device->host syncs of one run (torch.cuda.set_sync_debug_mode).
Writes results.json and results.md in --out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

# The script runs as `python benchmarks/bench.py` from a checkout: make the repository (refl_ddpo and the benchmarks
# package) importable without installing, and keep benchmarks/ itself off the path so that its modules (config,
# models ...) cannot shadow top-level modules of the same name.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import torch

from benchmarks.cases import make_cases
from benchmarks.config import BenchConfig
from benchmarks.flops import run_flops_only
from benchmarks.harness import Bench
from benchmarks.measure import machine_info, measure
from benchmarks.memory import run_memory_only
from benchmarks.models import architectures, model_configs, parameter_counts, run_configs
from benchmarks.ops import run_ops_only
from benchmarks.report import fmt_s, markdown_table, write_files
from benchmarks.sweep import run_sweep
from refl_ddpo.core.errors import cli_main
from refl_ddpo.run.flags import parse_config


def run_benchmark(cfg: BenchConfig, argv: list[str]) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_") as workdir:
        configs = model_configs(cfg.tiny, Path(workdir))
        b = Bench(cfg, configs, Path(workdir))
        results = {
            "meta": {
                "command": " ".join(["python benchmarks/bench.py", *argv]),
                "argv": argv,
                "tiny": cfg.tiny,
                "device": str(b.device),
                "dtype": str(b.dtype).removeprefix("torch."),
                "resolution": b.resolution,
                "models": "tiny models" if cfg.tiny else architectures(cfg.cases),
                "parameters": parameter_counts(run_configs(b, cfg.cases)),
                "options": dataclasses.asdict(cfg),
                "machine": machine_info(b.device),
            },
            "cases": [],
        }
        print(
            f"benchmark: {results['meta']['models']} on {b.device}, "
            f"{results['meta']['dtype']}, {b.resolution} px",
            flush=True,
        )
        for case in make_cases(cfg):
            t0 = time.perf_counter()
            r = measure(b, case)
            if "profile" in r:
                (out / f"profile_{case.name.replace(' ', '_')}.txt").write_text(r.pop("profile"))
            results["cases"].append(r)
            what = r.get("error") or f"median {fmt_s(r['median_s'])}"
            print(f"  {case.name:<24} {what}  ({time.perf_counter() - t0:.1f} s)", flush=True)
            # after every case, so that a run stopped by a time limit keeps what it measured
            table = markdown_table(results)
            write_files(out, {"results.json": json.dumps(results, indent=2) + "\n", "results.md": table})
    print("\n" + table, flush=True)
    return results


@cli_main
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_config(BenchConfig, argv, description=__doc__)
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    # diffusers warns on every `.to(dtype)` of a model built from a config (it has no fp32-only modules to keep).
    logging.getLogger("diffusers.models.modeling_utils").addFilter(
        lambda record: not record.getMessage().startswith("There are modules in")
    )
    if cfg.flops_only:
        run_flops_only(cfg, argv)
    elif cfg.memory_only:
        run_memory_only(cfg, argv)
    elif cfg.ops_only:
        run_ops_only(cfg, argv)
    elif cfg.sweep:
        run_sweep(cfg)
    else:
        run_benchmark(cfg, argv)


if __name__ == "__main__":
    main()
