"""The toy world's judge on a paired comparison (refl_ddpo.apps.compare): when both runs scored `toy_color_match`, the
toy world's colour reward, compare.json and compare.png carry the judge's colour accuracy, grey, dirty and ragged
fractions before -> after (refl_ddpo.toy_world.world.judge, as the learning proofs and `python -m refl_ddpo.toy_world.world`
compute them) and each pair's judgement: the colour drawn, right or wrong, its grey and dirty fractions."""

from __future__ import annotations

from pathlib import Path

JUDGED_REWARD = "toy_color_match"  # a comparison with this reward is of the toy world


def judged(rewards: list[str]) -> bool:
    """Whether a comparison of runs that share `rewards` is judged by the toy world's judge."""
    return JUDGED_REWARD in rewards


def toy_judgement(before_dir: str | Path, after_dir: str | Path, pairs: list[dict]) -> dict[str, dict]:
    """The judge's means over every pair, {"before": {...}, "after": {...}} (accuracy, dirty, grey, ragged), and
    each pair's judgement under pair["judge"][side]: the colour drawn (None: no shape), right, grey, dirty."""
    from refl_ddpo.toy_world.world import COLOURS, judge_files, judge_means

    names = list(COLOURS)
    prompts = [pair["prompt"] for pair in pairs]
    means = {}
    for side, run_dir in (("before", before_dir), ("after", after_dir)):
        result = judge_files([Path(run_dir) / pair[f"{side}_file"] for pair in pairs], prompts)
        means[side] = judge_means(result)
        rows = zip(
            pairs,
            result["nearest"].tolist(),
            result["colour_ok"].tolist(),
            result["grey"].tolist(),
            result["dirty"].tolist(),
            strict=True,
        )
        for pair, nearest, right, grey, dirty in rows:
            pair.setdefault("judge", {})[side] = {
                "colour": names[nearest] if nearest >= 0 else None,
                "right": bool(right),
                "grey": grey,
                "dirty": dirty,
            }
    return means


def judge_header(means: dict[str, dict], count: int) -> str:
    """compare.png's header line of the judge: every mean before -> after, over `count` pairs."""
    b, a = means["before"], means["after"]
    return (
        f"toy judge over {count} pairs: colour accuracy {b['accuracy']:.1%} -> {a['accuracy']:.1%}, "
        f"grey {b['grey']:.3f} -> {a['grey']:.3f}, dirty {b['dirty']:.3f} -> {a['dirty']:.3f}, "
        f"ragged {b['ragged']:.3f} -> {a['ragged']:.3f}"
    )


def judge_caption(pair: dict) -> list[tuple[str, str]]:
    """A pair's judgement under its images, one line per side with its colour (green right, red wrong)."""
    lines = []
    for side in ("before", "after"):
        j = pair["judge"][side]
        drawn = f"{j['colour']}, {'right' if j['right'] else 'wrong'}" if j["colour"] else "no shape, wrong"
        text = f"judge {side}: {drawn}; grey {j['grey']:.2f}, dirty {j['dirty']:.2f}"
        lines.append((text, "#08722a" if j["right"] else "#b3141c"))
    return lines
