"""The README's picture: the toy world's held-out prompts before and after training, from two or more inference runs.

    python docs/make_picture.py BASE_RUN LORA_RUN [LORA_RUN ...] [--labels before,after]
        [--out docs/images/toy_world_before_after.png] [--per_prompt 4] [--title TEXT]

BASE_RUN and LORA_RUN are output folders of inference/inference.py and inference/inference_lora.py on the same
prompts and seeds (train_scripts/demo.sh writes them as outputs/demo/base and outputs/demo/refl). Every image is judged
by the toy world's judge (refl_ddpo.toy_world.world); the picture shows, per prompt, the first `--per_prompt` seeds of
each run side by side, each marked with whether its colour is the prompt's, and a header with each run's colour
accuracy over all its images.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SCALE = 3  # 32 px toy images, drawn 96 px


def judged(run: Path) -> list[dict]:
    """The run's records (scores.json), each with its image and the judge's colour verdict."""
    import numpy as np
    import torch
    from PIL import Image

    from refl_ddpo.toy_world import world as toy_world

    records = json.loads((run / "scores.json").read_text())["records"]
    for r in records:
        pixels = np.array(Image.open(run / r["file"]).convert("RGB"))
        image = torch.from_numpy(pixels).permute(2, 0, 1)[None]  # (1, 3, H, W) uint8
        r["image"] = Image.fromarray(pixels)
        r["colour_ok"] = bool(toy_world.judge(image, [r["prompt"]])["colour_ok"][0])
    return records


def picture(runs: list[list[dict]], labels: list[str], per_prompt: int, title: str):
    """Rows of prompts; per prompt `per_prompt` seeds of each run, side by side (the runs' order, each headed by its
    label); a green or red bar under each image."""
    from PIL import Image, ImageDraw

    from refl_ddpo.core.images import font

    first = runs[0]
    by_key = [{(r["prompt"], r["seed"]): r for r in run} for run in runs]
    prompts = list(dict.fromkeys(r["prompt"] for r in first))
    side, pad, bar, label_w = 32 * SCALE, 6, 5, 150
    col_w = side + pad
    width = label_w + len(runs) * (per_prompt * col_w + pad) + 2 * pad
    head_h, row_h = 58, side + bar + 2 * pad
    canvas = Image.new("RGB", (width, head_h + row_h * len(prompts)), "white")
    draw = ImageDraw.Draw(canvas)
    accuracy = [sum(k[(r["prompt"], r["seed"])]["colour_ok"] for r in first) / len(first) for k in by_key]
    named = ", ".join(f"{name} {a:.0%}" for name, a in zip(labels, accuracy, strict=True))
    head = f"colour accuracy {named} ({len(first)} images each; green bar: the colour is the prompt's)"
    draw.text((pad, pad), title, fill="black", font=font(16))
    draw.text((pad, pad + 22), head, fill="black", font=font(13))
    for side_i, name in enumerate(labels):
        x = label_w + side_i * (per_prompt * col_w + pad)
        draw.text((x, head_h - 16), name, fill="black", font=font(13))
    for row, prompt in enumerate(prompts):
        y = head_h + row * row_h
        draw.text((pad, y + side // 2 - 8), prompt, fill="black", font=font(13))
        seeds = [r for r in first if r["prompt"] == prompt][:per_prompt]
        for side_i, keyed in enumerate(by_key):
            for i, r in enumerate([keyed[(r["prompt"], r["seed"])] for r in seeds]):
                x = label_w + side_i * (per_prompt * col_w + pad) + i * col_w
                canvas.paste(r["image"].resize((side, side), Image.NEAREST), (x, y))
                colour = (40, 160, 60) if r["colour_ok"] else (200, 50, 40)
                draw.rectangle([x, y + side + 1, x + side - 1, y + side + bar], fill=colour)
    return canvas


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", type=Path, nargs="+", help="the base's run first, then one or more runs to compare"
    )
    parser.add_argument("--labels", default=None, help="comma-separated, one per run (default: before,after)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "images" / "toy_world_before_after.png"
    )
    parser.add_argument("--per_prompt", type=int, default=4)
    parser.add_argument("--title", default="ReFL with LoRA on the toy world: prompts it never trained on")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else ["before", "after"]
    if len(args.runs) < 2 or len(labels) != len(args.runs):
        parser.error(f"give 2 or more runs and one label per run ({len(args.runs)} runs, labels {labels})")
    image = picture([judged(run) for run in args.runs], labels, args.per_prompt, args.title)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
