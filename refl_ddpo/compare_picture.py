"""compare.png: a header with each shared reward's means, difference, 95 % CI and win rate, then before | after per
pair with the prompt, seed and each reward's before -> after and delta (refl_ddpo.compare writes it)."""

from __future__ import annotations

from refl_ddpo.images import fmt_score, font, wrap_words
from refl_ddpo.inference_config import reward_label


def header_lines(result: dict) -> list[str]:
    """compare.png's header: one line per shared reward (both means, the difference, its 95 % CI, the win rate)."""
    lines = []
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


def compare_picture(
    result: dict, cells: list, title: str, cell: int = 192, pairs_per_row: int = 2, max_caption_lines: int = 3
):
    """compare.png as a PIL image: a header (title, one line per reward), then for each pair of `result["pairs"]`
    before | after (`cells`: PIL images, two per pair; `pairs_per_row` pairs side by side) with the prompt and seed
    wrapped at words under them and one line per reward: before -> after and the delta (green up, red down)."""
    from PIL import Image, ImageDraw

    pairs = result["pairs"][: len(cells) // 2]
    per_row = max(1, min(pairs_per_row, len(pairs)))
    pad, pair_w = 8, 2 * cell
    width = per_row * pair_w
    title_font, body_font = font(16), font(13)
    line_h, title_h = 17, 21

    header = [
        (line, title_font, title_h) for line in wrap_words(title, width - 2 * pad, title_font.getlength, 2)
    ]
    for line in header_lines(result):
        wrapped = wrap_words(line, width - 2 * pad, body_font.getlength, 2)
        header += [(part, body_font, line_h) for part in wrapped]
    header_h = pad + sum(h for _, _, h in header) + pad

    captions = []  # per pair: [(text, colour)]
    for pair in pairs:
        text = f"{pair['prompt']} (seed {pair['seed']})"
        lines = [
            (t, "black") for t in wrap_words(text, pair_w - 2 * pad, body_font.getlength, max_caption_lines)
        ]
        for name, sc in pair["scores"].items():
            delta = sc["delta"]
            colour = "black" if not delta else ("#08722a" if delta > 0 else "#b3141c")
            text = f"{reward_label(name)}: {fmt_score(sc['before'])} -> {fmt_score(sc['after'])}"
            lines.append((text + (f"  ({fmt_score(delta, sign=True)})" if delta is not None else ""), colour))
        captions.append(lines)
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
            for side in (0, 1):
                canvas.paste(cells[2 * k + side].convert("RGB").resize((cell, cell)), (x + side * cell, y))
                label = ("before", "after")[side]
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
