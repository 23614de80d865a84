"""compare.png: a header with each shared reward's means, difference, 95 % CI and win rate (and, on the toy world,
the judge's numbers before -> after), then before | after per pair (source | before | after for an edit) with the
prompt, seed and each reward's before -> after and delta (and the pair's judgement) under it (refl_ddpo.apps.compare
writes it)."""

from __future__ import annotations

import math

from refl_ddpo.apps.compare_judge import judge_caption, judge_header
from refl_ddpo.apps.inference_config import reward_label
from refl_ddpo.core.images import fmt_score, font, wrap_words


def header_lines(result: dict) -> list[str]:
    """compare.png's header: the toy judge's numbers when the runs were judged, then one line per shared reward (both
    means, the difference, its 95 % CI, the win rate)."""
    lines = [judge_header(result["toy_judge"], result["count"])] if "toy_judge" in result else []
    for name in result["rewards"]:
        r = result["per_reward"][name]
        if "mean_difference" not in r:
            lines.append(f"{reward_label(name)}: no comparison ({r['score_error']})")
            continue
        lo, hi = r["bootstrap_ci95"]
        lines.append(
            f"{reward_label(name)}: before {r['mean_before']:.3f}, after {r['mean_after']:.3f}, difference "
            f"{r['mean_difference']:+.3f} (95% CI [{lo:+.3f}, {hi:+.3f}]), after wins {r['win_rate']:.0%} of "
            f"{result['count']} pairs"
        )
    return lines


def caption_lines(pair: dict, width: float, measure, max_lines: int = 3) -> list[tuple[str, str]]:
    """(text, colour) lines under a pair's images: the prompt and seed wrapped at words in `width` (by `measure`) on
    up to `max_lines` lines, one line per reward: before -> after and the delta (green up, red down), and the toy
    judge's judgement of each side when the comparison was judged."""
    text = f"{pair['prompt']} (seed {pair['seed']})"
    lines = [(t, "black") for t in wrap_words(text, width, measure, max_lines)]
    for name, sc in pair["scores"].items():
        delta = sc["delta"]
        colour = "black" if not delta else ("#08722a" if delta > 0 else "#b3141c")
        text = f"{reward_label(name)}: {fmt_score(sc['before'])} -> {fmt_score(sc['after'])}"
        lines.append((text + (f"  ({fmt_score(delta, sign=True)})" if delta is not None else ""), colour))
    return lines + (judge_caption(pair) if "judge" in pair else [])


def pairs_per_row(count: int) -> int:
    """Pairs side by side in compare.png: near square, 2 to 4 (a pair is two images wide)."""
    return min(4, max(2, round(math.sqrt(count / 2))))


def cell_labels(pairs: list[dict]) -> tuple[str, ...]:
    """The images of a pair in compare.png: before, after; an edit's source first."""
    return ("source", "before", "after") if pairs and "source_image" in pairs[0] else ("before", "after")


def compare_picture(
    result: dict,
    cells: list,
    title: str,
    pairs: list[dict] | None = None,
    cell: int = 192,
    per_row: int | None = None,
    max_caption_lines: int = 3,
):
    """compare.png as a PIL image: a header (title, the toy judge's line, one line per reward), then for each pair
    of `pairs` (default: `result["pairs"]`) before | after (`cells`: PIL images, two per pair; three, source first,
    when the pairs are edits, with a "source_image"; `per_row` pairs side by side, by default `pairs_per_row`) with
    `caption_lines` under them."""
    from PIL import Image, ImageDraw

    pairs = result["pairs"] if pairs is None else pairs
    labels = cell_labels(pairs)
    pairs = pairs[: len(cells) // len(labels)]
    per_row = max(1, min(per_row or pairs_per_row(len(pairs)), len(pairs)))
    pad, pair_w = 8, len(labels) * cell
    width = per_row * pair_w
    title_font, body_font = font(16), font(13)
    line_h, title_h = 17, 21

    header = [
        (line, title_font, title_h) for line in wrap_words(title, width - 2 * pad, title_font.getlength, 2)
    ]
    for i, line in enumerate(header_lines(result)):
        # the toy judge's line, the demo's result, as large as the title
        face, h = (title_font, title_h) if i == 0 and "toy_judge" in result else (body_font, line_h)
        header += [(part, face, h) for part in wrap_words(line, width - 2 * pad, face.getlength, 2)]
    header_h = pad + sum(h for _, _, h in header) + pad

    captions = [
        caption_lines(pair, pair_w - 2 * pad, body_font.getlength, max_caption_lines) for pair in pairs
    ]
    rows = [captions[i : i + per_row] for i in range(0, len(captions), per_row)]
    row_h = [cell + pad // 2 + max(len(lines) for lines in row) * line_h + pad for row in rows]

    canvas = Image.new("RGB", (width, header_h + sum(row_h)), "white")
    draw = ImageDraw.Draw(canvas)
    y = pad
    for text, face, h in header:
        draw.text((pad, y), text, fill="black", font=face)
        y += h
    y = header_h
    draw.line([(0, y - 1), (width, y - 1)], fill="#888888")
    for r, row in enumerate(rows):
        for c, lines in enumerate(row):
            k, x = r * per_row + c, c * pair_w
            for side, label in enumerate(labels):
                canvas.paste(
                    cells[len(labels) * k + side].convert("RGB").resize((cell, cell)), (x + side * cell, y)
                )
                draw.text(
                    (x + side * cell + 4, y + 2),
                    label,
                    fill="white",
                    font=body_font,
                    stroke_width=2,
                    stroke_fill="black",
                )
            ty = y + cell + pad // 2
            for text, colour in lines:
                draw.text((x + pad, ty), text, fill=colour, font=body_font)
                ty += line_h
            if c:  # a light rule between two pairs of a row
                draw.line([(x, y), (x, y + row_h[r] - 1)], fill="#cccccc")
        y += row_h[r]
    return canvas
