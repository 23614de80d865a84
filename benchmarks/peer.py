"""The peer side by side: one DDPO epoch of refl_ddpo against one of TRL 0.23.1's `DDPOTrainer`, same weights, same
config. `bash benchmarks/peer.sh` drives it; each subcommand runs in one process, under the project's python (side
`ours`) or the side virtualenv's (side `trl`, which must not import refl_ddpo):

    python benchmarks/peer.py convert SRC DST      # copy an SD folder into the layout transformers 4.x reads
    python benchmarks/peer.py unet --side S --model DIR --out FILE   # UNet output on a fixed input, as loaded by S
    python benchmarks/peer.py check --out DIR      # DIR/unet_ours.safetensors == DIR/unet_trl.safetensors, or exit 1
    python benchmarks/peer.py epoch --side S --model DIR --prompts FILE --work DIR --out FILE
    python benchmarks/peer.py report --out DIR     # runs/*.json + unet_*.safetensors -> results.json, results.md

What one epoch is (`EPOCH`, in TRL's `DDPOConfig` field names; ours has the same names): sample 2 batches of 2
images with 10 stochastic DDIM steps (eta 1) and CFG 5 batched into one UNet call per step, score them (JPEG size at
quality 95, both sides), batch-normalised advantages, then PPO-clip on every timestep of every image (train batch 1,
CFG in the forward), one AdamW step per image: 20 + 40 = 60 UNet calls, 40 of them with gradient, 4 optimizer steps.
Both trainers run `epochs` epochs through their public entry point (`refl_ddpo.trainers.ddpo.train`,
`DDPOTrainer.train`) with a TRL-style image-samples hook, which both call once per epoch after the rewards; an
epoch's time is the time between two hook calls (so the first epoch, with its warm-up, is never timed), and a
forward hook on the UNet and a global optimizer-step hook count the work done in it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

# Run as `python benchmarks/peer.py`: the repository root on the path (refl_ddpo, for side ours), benchmarks/ off it.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import torch

EPOCH = {
    "sample_num_steps": 10,
    "sample_eta": 1.0,
    "sample_guidance_scale": 5.0,
    "sample_batch_size": 2,
    "sample_num_batches_per_epoch": 2,
    "train_batch_size": 1,
    "train_gradient_accumulation_steps": 1,
    "train_num_inner_epochs": 1,
    "train_timestep_fraction": 1.0,
    "train_cfg": True,
    "train_clip_range": 1e-4,
    "train_adv_clip_max": 5.0,
    "per_prompt_stat_tracking": False,
}
# Both sides' other defaults agree: LoRA r 4, alpha 4, gaussian init on to_q/to_k/to_v/to_out.0; AdamW lr 3e-4,
# betas (0.9, 0.999), weight decay 1e-4, eps 1e-8; gradient norm clipped at 1; fp32 (no mixed precision).
LEARNING_RATE = 3e-4
SIDES = ("ours", "trl")
UNET_PROMPT = "a red circle"  # the UNet check's conditioning


def expected_work(cfg: dict = EPOCH) -> dict[str, int]:
    """UNet calls, of them with gradient, and optimizer steps in one epoch of `cfg` (CFG batched in one call)."""
    images = cfg["sample_batch_size"] * cfg["sample_num_batches_per_epoch"]
    trained_steps = int(cfg["sample_num_steps"] * cfg["train_timestep_fraction"])
    train_calls = images // cfg["train_batch_size"] * trained_steps * cfg["train_num_inner_epochs"]
    return {
        "unet_calls": cfg["sample_num_batches_per_epoch"] * cfg["sample_num_steps"] + train_calls,
        "unet_calls_with_grad": train_calls,
        "optimizer_steps": images
        // (cfg["train_batch_size"] * cfg["train_gradient_accumulation_steps"])
        * cfg["train_num_inner_epochs"],
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "diffusers", "transformers", "accelerate", "peft", "trl"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------------------------------------------
# the model folder for the older libraries
# --------------------------------------------------------------------------------------------------------------


def convert(src: Path, dst: Path) -> None:
    """Copy the SD folder `src` (written by transformers 5) to `dst` in the layout transformers 4.x reads: the CLIP
    text encoder's keys under `text_model.` (transformers 5 drops that prefix; 4.x would silently initialise every
    weight at random), and the slow CLIP tokenizer's vocab.json and merges.txt beside tokenizer.json. The values are
    unchanged; the UNet check (`unet`) proves it."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = dst / "text_encoder" / "model.safetensors"
    state = load_file(str(weights))
    save_file(
        {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in state.items()}, str(weights)
    )
    bpe = json.loads((src / "tokenizer" / "tokenizer.json").read_text())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    (dst / "tokenizer" / "vocab.json").write_text(json.dumps(bpe["vocab"], ensure_ascii=False))
    (dst / "tokenizer" / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n")


# --------------------------------------------------------------------------------------------------------------
# loading, the UNet check
# --------------------------------------------------------------------------------------------------------------


def load_pipeline(side: str, model: str):
    """The StableDiffusionPipeline each trainer trains: ours through refl_ddpo's loader, TRL's through
    `DefaultDDPOStableDiffusionPipeline` (what its DDPO example uses)."""
    if side == "ours":
        from refl_ddpo.core.families import load_family

        return load_family(model, torch.float32, "cpu").pipe
    return trl_pipeline(model).sd_pipeline


def trl_pipeline(model: str):
    """TRL's pipeline for `model` (its warning that the folder has no LoRA goes through accelerate's logger,
    which needs accelerate's state first)."""
    from accelerate import PartialState
    from trl import DefaultDDPOStableDiffusionPipeline

    PartialState()
    sd_pipeline = DefaultDDPOStableDiffusionPipeline(model, use_lora=True)
    sd_pipeline.sd_pipeline.set_progress_bar_config(disable=True)
    return sd_pipeline


@torch.no_grad()
def unet_output(side: str, model: str, out: Path) -> None:
    """Save the prompt embeddings of UNET_PROMPT and the UNet's output on seeded latents at t = 500."""
    from safetensors.torch import save_file

    pipe = load_pipeline(side, model)
    ids = pipe.tokenizer(
        [UNET_PROMPT], padding="max_length", max_length=pipe.tokenizer.model_max_length, return_tensors="pt"
    ).input_ids
    embeds = pipe.text_encoder(ids)[0]  # (1, 77, D)
    size = pipe.unet.config.sample_size
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, pipe.unet.config.in_channels, size, size, generator=generator)
    output = pipe.unet(latents, torch.tensor([500]), embeds).sample
    save_file({"input_ids": ids, "prompt_embeds": embeds, "unet_output": output}, str(out))


# --------------------------------------------------------------------------------------------------------------
# one timed run of a trainer
# --------------------------------------------------------------------------------------------------------------


class WorkCounter:
    """Counts UNet forward calls (and those with gradient) through a forward hook, and the optimizer steps taken
    (torch's global step hook: the inner AdamW's steps, not accelerate's skipped ones)."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.counts = {"unet_calls": 0, "unet_calls_with_grad": 0, "optimizer_steps": 0}
        self.hooks = [register_optimizer_step_post_hook(self._step)]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def watch(self, unet: torch.nn.Module) -> None:
        self.hooks.append(unet.register_forward_hook(self._forward))

    def _forward(self, module, args, output) -> None:
        self.counts["unet_calls"] += 1
        self.counts["unet_calls_with_grad"] += torch.is_grad_enabled()

    def _step(self, optimizer, args, kwargs) -> None:
        self.counts["optimizer_steps"] += 1


class EpochClock:
    """The image-samples hook of both trainers: wall time, this process' CPU time and the work counts at each call
    (once per epoch, after the rewards)."""

    def __init__(self, counter: WorkCounter):
        self.counter, self.marks = counter, []

    def __call__(self, prompt_image_data, global_step, tracker) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)  # context switches: waits (voluntary), preemptions
        switches = {"voluntary_switches": usage.ru_nvcsw, "involuntary_switches": usage.ru_nivcsw}
        self.marks.append((time.perf_counter(), time.process_time(), dict(self.counter.counts) | switches))

    def epochs(self) -> list[dict]:
        """One record per epoch between two hook calls, the first one left out (it holds the first backward pass
        and the optimizer's state allocation): wall and CPU seconds and the work done in it."""
        return [
            {"wall_s": w1 - w0, "cpu_s": c1 - c0, **{k: n1[k] - n0[k] for k in n1}}
            for (w0, c0, n0), (w1, c1, n1) in list(zip(self.marks, self.marks[1:], strict=False))[1:]
        ]


def read_prompts(path: str) -> list[str]:
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def run_ours(cfg: dict, model: str, prompts: str, work: Path, epochs: int, clock: EpochClock) -> None:
    import refl_ddpo.run.training
    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers.ddpo import train
    from refl_ddpo.trainers.ddpo_config import DDPOConfig

    load = refl_ddpo.run.training.load_trainable_family

    def load_and_watch(*args, **kwargs):  # the trainer's own loader, the counting hook on its UNet
        family, params, dtype = load(*args, **kwargs)
        clock.counter.watch(family.network)
        return family, params, dtype

    flags = [f"--{k}={v}" for k, v in cfg.items() if not isinstance(v, bool)]
    flags += [f"--{k}" if v else f"--no-{k}" for k, v in cfg.items() if isinstance(v, bool)]
    argv = [
        *flags,
        f"--pretrained_model={model}",
        f"--prompts_file={prompts}",
        "--reward=jpeg_compressibility",
        f"--learning_rate={LEARNING_RATE}",
        f"--num_epochs={epochs}",
        f"--save_freq={epochs}",
        f"--output_dir={work / 'ours'}",
        "--mixed_precision=no",
        "--device=cpu",
        "--report_to=none",
        "--seed=0",
    ]
    refl_ddpo.run.training.load_trainable_family = load_and_watch
    try:
        train(parse_config(DDPOConfig, argv), image_samples_hook=clock)
    finally:
        refl_ddpo.run.training.load_trainable_family = load


def run_trl(cfg: dict, model: str, prompts: str, work: Path, epochs: int, clock: EpochClock) -> None:
    import random

    from accelerate.tracking import GeneralTracker
    from trl import DDPOConfig, DDPOTrainer

    class NoTracker(GeneralTracker):
        """TRL hands `accelerator.trackers[0]` to the image hook, so it needs one tracker: this one logs nothing."""

        name, requires_logging_directory, main_process_only = "none", False, True

        @property
        def tracker(self):
            return None

        def store_init_configuration(self, values) -> None:
            pass

        def log(self, values, step=None, **kwargs) -> None:
            pass

    texts, rng = read_prompts(prompts), random.Random(0)
    config = DDPOConfig(
        **cfg,
        train_learning_rate=LEARNING_RATE,
        num_epochs=epochs,
        save_freq=10**9,  # TRL saves when epoch % save_freq == 0 (epoch > 0)
        mixed_precision="no",
        log_with=[NoTracker()],
        project_kwargs={"project_dir": str(work / "trl")},
        seed=0,
    )
    sd_pipeline = trl_pipeline(model)
    clock.counter.watch(sd_pipeline.unet)
    trainer = DDPOTrainer(
        config,
        lambda images, prompts, metadata: (-jpeg_size_kb(images), {}),
        lambda: (rng.choice(texts), {}),
        sd_pipeline,
        image_samples_hook=clock,
    )
    trainer.train()


def jpeg_size_kb(images: torch.Tensor) -> torch.Tensor:
    """(B,) JPEG sizes in kB at quality 95 of images (B, 3, H, W) in [0, 1]: the TRL side's copy of
    refl_ddpo.rewards.jpeg.jpeg_size_kb (the side venv cannot import refl_ddpo)."""
    import io

    from PIL import Image

    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    sizes = []
    for img in arr:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000)
    return torch.tensor(sizes)


def run_epochs(
    side: str, model: str, prompts: str, work: Path, epochs: int, out: Path, cfg: dict = EPOCH
) -> dict:
    """Run `epochs` epochs of `side`'s trainer with `cfg` on one thread; write (and return) the timed epochs, the
    config and the versions."""
    torch.set_num_threads(1)
    clock = EpochClock(WorkCounter())
    load_before = os.getloadavg()[0]
    try:
        (run_ours if side == "ours" else run_trl)(cfg, model, prompts, work, epochs, clock)
    finally:
        clock.counter.close()
    record = {
        "side": side,
        "config": cfg,
        "epochs": clock.epochs(),
        "versions": versions(),
        "threads": torch.get_num_threads(),
        "load_average_1min": [load_before, os.getloadavg()[0]],
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


# --------------------------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p = sub.add_parser("unet")
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("epoch")
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=4, help="Epochs to run; all but the first two are timed.")
    p.add_argument(
        "--sample_num_steps", type=int, default=EPOCH["sample_num_steps"], help="Fewer for a quick test run."
    )
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("check")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("report")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--command_line", default="bash benchmarks/peer.sh")
    args = parser.parse_args(argv)
    if args.command == "convert":
        convert(args.src, args.dst)
    elif args.command == "unet":
        unet_output(args.side, args.model, args.out)
    elif args.command == "epoch":
        cfg = EPOCH | {"sample_num_steps": args.sample_num_steps}
        run_epochs(args.side, args.model, args.prompts, args.work, args.epochs, args.out, cfg)
    elif args.command == "check":
        from benchmarks.peer_report import unet_check

        check = unet_check(args.out)
        print(json.dumps(check))
        if not check["identical"]:
            raise SystemExit("error: the two sides' UNet outputs differ on the same input (see above)")
    else:
        from benchmarks.peer_report import markdown, report

        print(markdown(report(args.out, args.command_line)), end="")


if __name__ == "__main__":
    main()
