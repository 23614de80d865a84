"""Build the toy world's models from scratch, deterministically from seeds (one CPU thread,
`torch.use_deterministic_algorithms(True)`): same seeds and same CPU kind give the same weights; other CPUs may
differ in the last bits, which is why the built weights are committed (toy_world.DATA_DIR, see
refl_ddpo.toy_world.world). Slow: about 25-30 minutes on one core (VAE 6, UNet 7-8, classifier 5-9, MMDiT 6-7). The models
and their training loops are in refl_ddpo.testing.toy_train; this module builds and judges them.

    python -m refl_ddpo.testing.toy_build OUT [--report]
        # OUT/toy-sd/, OUT/toy-sd3/, OUT/toy_classifier.*, SHA256SUMS
    python -m refl_ddpo.testing.toy_build OUT --sd3_from [TOY_SD_DIR]
        # only OUT/toy-sd3/ (+ sums); default: the committed toy-sd
    python -m refl_ddpo.testing.toy_build OUT --unet_from [TOY_SD_DIR]
        # only OUT/toy-sd/ with a fresh UNet (+ sums)
    ... --confuse_p P   # a variant world: partner colours confused with probability P (docs/toy_world.md)

Models:
    VAE         AutoencoderKL, blocks (16, 32), 4 latent channels, 32 px -> 16 x 16 latents, trained as an
                autoencoder on rendered images (MSE + 1e-6 KL); `scaling_factor` = 1 / std of its training latents
    text        the tiny char-level CLIP tokenizer (refl_ddpo.testing.tiny_parts) and a random, frozen CLIPTextModel
                (64 wide)
    UNet        UNet2DConditionModel, blocks (32, 64), cross-attention at 8 x 8 and in the mid block, epsilon
                prediction on SD's schedule, trained UNET_STEPS steps on all 18 prompts with 15 % empty prompts
                (classifier-free guidance); colour words confused in pairs half of the time (CONFUSABLE), so the
                clean, trained model's colour accuracy is about 50 %.
    classifier  ToyClassifier (refl_ddpo.toy_world.world), trained on rendered images with noise, blur, colour jitter and
                VAE round trips.
  toy-sd3/ (StableDiffusion3Pipeline, the same world):
    VAE         the toy SD 1.x VAE's weights, with shift_factor 0 (SD3's pipeline decodes z / scaling + shift; it
                takes the VAE's channel count from the transformer's in_channels, so 4 channels do)
    text        two random, frozen CLIPTextModelWithProjection (32 wide, pooled projections 32), no T5 (the pipeline
                pads the context with 256 zero tokens in its place)
    MMDiT       SD3Transformer2DModel, patch 2 (8 x 8 tokens), SD3_LAYERS joint blocks 64 wide, trained by flow
                matching as SD3 (logit-normal sigmas through the scheduler's shift SD3_SHIFT, velocity z - x0) on the
                same latents, captions, colour confusion and empty prompts as the UNet; FlowMatchEulerDiscreteScheduler.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from refl_ddpo.testing.toy_train import (
    CLASSIFIER_CHANNELS,
    CONFUSE_P,
    SD3_STEPS,
    SEED,
    UNET_STEPS,
    classifier_accuracy,
    deterministic,
    make_pipeline,
    make_sd3_pipeline,
    make_text,
    make_unet,
    make_vae,
    sd3_vae,
    to_unit,
    train_classifier,
    train_transformer,
    train_unet,
    train_vae,
    vae_round_trip,
)
from refl_ddpo.toy_world import files as toy_files
from refl_ddpo.toy_world import world as tw


def _log(msg: str) -> None:
    print(f"[toy_build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def generate(
    sd_dir, prompts: list[str], seeds: list[int], steps: int = 50, guidance: float = 7.5, batch: int = 72
) -> tuple[torch.Tensor, list[str]]:
    """Images [N, 3, 32, 32] in [0, 1] from the stock pipeline of `sd_dir` (StableDiffusionPipeline with DDIM, eta 0;
    StableDiffusion3Pipeline, loaded with text_encoder_3=None, with its flow-matching Euler sampler), for every (seed,
    prompt), with one CPU generator per image seeded `seed`; and the matching prompts."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from refl_ddpo.core.models import load_pipeline

    pipe = load_pipeline(
        str(sd_dir)
    )  # the stock class of model_index.json (no safety checker; no T5 if absent)
    extra = {}
    if isinstance(pipe, StableDiffusionPipeline):
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        extra["eta"] = 0.0
    jobs = [(s, p) for s in seeds for p in prompts]
    out = []
    for i in range(0, len(jobs), batch):
        chunk = jobs[i : i + batch]
        gens = [torch.Generator().manual_seed(s) for s, _ in chunk]
        out.append(
            pipe(
                [p for _, p in chunk],
                height=tw.SIZE,
                width=tw.SIZE,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=gens,
                output_type="pt",
                **extra,
            ).images
        )
    return torch.cat(out).float().cpu(), [p for _, p in jobs]


def report(sd_dir, seeds=(1000, 1001, 1002, 1003), steps: int = 50, guidance: float = 7.5) -> dict:
    """Judge's accuracy and dirty fraction on TRAIN_PROMPTS / HELDOUT_PROMPTS / all for the given seeds."""
    images, prompts = generate(sd_dir, list(tw.PROMPTS), list(seeds), steps, guidance)
    res = tw.judge(images, prompts)
    held = torch.tensor([p in tw.HELDOUT_PROMPTS for p in prompts])
    ok, dirty = res["colour_ok"].float(), res["dirty"]
    return {
        "model": Path(sd_dir).name,
        "steps": steps,
        "guidance": guidance,
        "n": len(prompts),
        "accuracy": ok.mean().item(),
        "accuracy_train": ok[~held].mean().item(),
        "accuracy_heldout": ok[held].mean().item(),
        "dirty": dirty.mean().item(),
    }


def build_toy_sd(
    out: str | Path,
    sd_dir: str | Path,
    seed: int = SEED,
    steps: int = UNET_STEPS,
    confuse_p: float = CONFUSE_P,
) -> Path:
    """Train a fresh toy UNet on the VAE and text encoder of the toy SD 1.x folder `sd_dir` and write OUT/toy-sd/;
    returns it. With the committed folder and the defaults this is the committed UNet again."""
    from diffusers import StableDiffusionPipeline

    deterministic()
    t0 = time.time()
    base = StableDiffusionPipeline.from_pretrained(str(sd_dir))
    pipe = make_pipeline(base.vae, base.tokenizer, base.text_encoder, make_unet(seed))
    train_unet(pipe, steps, seed, confuse_p=confuse_p)
    pipe.save_pretrained(Path(out) / tw.SD_DIRNAME, safe_serialization=True)
    _log(f"UNet trained {steps} steps, confusion {confuse_p} ({time.time() - t0:.0f} s)")
    return Path(out) / tw.SD_DIRNAME


def build_toy_sd3(
    out: str | Path,
    sd_dir: str | Path,
    seed: int = SEED,
    steps: int = SD3_STEPS,
    confuse_p: float = CONFUSE_P,
) -> Path:
    """Train the SD3 toy model on the toy SD 1.x VAE of `sd_dir` (its weights, shift_factor 0) and write
    OUT/toy-sd3/; returns it."""
    deterministic()
    t0 = time.time()
    pipe = make_sd3_pipeline(sd3_vae(Path(sd_dir)), seed)
    train_transformer(pipe, steps, seed, confuse_p=confuse_p)
    pipe.save_pretrained(Path(out) / tw.SD3_DIRNAME, safe_serialization=True)
    _log(f"MMDiT trained {steps} steps ({time.time() - t0:.0f} s)")
    return Path(out) / tw.SD3_DIRNAME


def build_toy_world(
    out: str | Path,
    seed: int = SEED,
    unet_steps: int = UNET_STEPS,
    sums: bool = False,
    sd3_steps: int = SD3_STEPS,
    confuse_p: float = CONFUSE_P,
) -> Path:
    """Train everything and write OUT/toy-sd/, OUT/toy-sd3/, OUT/toy_classifier.{safetensors,json} (and with `sums`
    OUT/SHA256SUMS of every file under OUT, as committed in toy_world.DATA_DIR). Returns OUT/toy-sd."""
    deterministic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    vae = train_vae(make_vae(seed), seed=seed)
    g = torch.Generator().manual_seed(seed + 900)
    imgs, prompts = tw.random_batch(256, g)
    _log(
        f"VAE trained ({time.time() - t0:.0f} s), scaling_factor {vae.config.scaling_factor:.4f}, round-trip "
        f"accuracy {tw.colour_accuracy(vae_round_trip(vae, to_unit(imgs)), prompts):.3f}"
    )
    tokenizer, text_encoder = make_text(seed)
    pipe = make_pipeline(vae, tokenizer, text_encoder, make_unet(seed))
    t1 = time.time()
    train_unet(pipe, unet_steps, seed, confuse_p=confuse_p)
    _log(f"UNet trained {unet_steps} steps ({time.time() - t1:.0f} s)")
    pipe.save_pretrained(out / tw.SD_DIRNAME, safe_serialization=True)
    t2 = time.time()
    clf = train_classifier(vae, seed=seed)
    tw.save_classifier(clf, out, CLASSIFIER_CHANNELS)
    _log(
        f"classifier trained ({time.time() - t2:.0f} s), accuracy (colour, shape) on rendered images "
        f"{classifier_accuracy(clf, to_unit(imgs), prompts)}"
    )
    build_toy_sd3(out, out / tw.SD_DIRNAME, seed, sd3_steps, confuse_p)
    if sums:
        toy_files.write_sums(out)
    _log(f"toy world written to {out} in {time.time() - t0:.0f} s")
    return out / tw.SD_DIRNAME


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--unet_steps", type=int, default=UNET_STEPS)
    parser.add_argument("--sd3_steps", type=int, default=SD3_STEPS)
    parser.add_argument(
        "--confuse_p",
        type=float,
        default=CONFUSE_P,
        help="How often a training caption names the partner colour (the base's imperfection; docs/toy_world.md).",
    )
    committed = str(tw.DATA_DIR / tw.SD_DIRNAME)
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--sd3_from",
        metavar="TOY_SD_DIR",
        nargs="?",
        const=committed,
        help="Build only OUT/toy-sd3/, on the VAE of this toy SD 1.x folder (without a value: the committed one, "
        "toy_world.DATA_DIR/toy-sd); OUT/SHA256SUMS is rewritten over what OUT then holds.",
    )
    only.add_argument(
        "--unet_from",
        metavar="TOY_SD_DIR",
        nargs="?",
        const=committed,
        help="Build only OUT/toy-sd/: a fresh UNet on the VAE and text encoder of this toy SD 1.x folder (without a "
        "value: the committed one); OUT/SHA256SUMS is rewritten over what OUT then holds.",
    )
    parser.add_argument("--report", action="store_true", help="Also print the base models' judged accuracy.")
    args = parser.parse_args(argv)
    if not 0 <= args.confuse_p <= 1:
        parser.error(f"--confuse_p must be a probability in [0, 1], got {args.confuse_p}")
    if args.sd3_from:
        models = [build_toy_sd3(args.out, args.sd3_from, args.seed, args.sd3_steps, args.confuse_p)]
        toy_files.write_sums(Path(args.out))
    elif args.unet_from:
        models = [build_toy_sd(args.out, args.unet_from, args.seed, args.unet_steps, args.confuse_p)]
        toy_files.write_sums(Path(args.out))
    else:
        sd = build_toy_world(
            args.out,
            args.seed,
            args.unet_steps,
            sums=True,
            sd3_steps=args.sd3_steps,
            confuse_p=args.confuse_p,
        )
        models = [sd, Path(args.out) / tw.SD3_DIRNAME]
    if args.report:
        for model in models:
            for steps in (50, 20):
                print(json.dumps(report(model, steps=steps)))


if __name__ == "__main__":
    main()
