"""Before | after: pair two inference runs by (prompt, seed) and compare their ImageReward scores.

    python inference/compare.py outputs/base outputs/lora [--out outputs/compare]

Writes compare.png (before | after for each prompt and seed, score under each) and compare.json, and prints a table:
mean score before and after, per-prompt deltas, the win rate of after over before, and a paired bootstrap 95%
interval of the mean difference.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: import refl_ddpo uninstalled

from refl_ddpo.errors import cli_main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="Run folder of the base model (holds scores.json), e.g. outputs/base.")
    parser.add_argument("after", help="Run folder of the base + LoRA, e.g. outputs/lora.")
    parser.add_argument("--out", default=None, help="Where compare.png / compare.json go (default: AFTER/../compare).")
    parser.add_argument("--num_bootstrap", type=int, default=10_000, help="Paired bootstrap resamples (default 10000).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the bootstrap resampling (default 0).")
    parser.add_argument("--max_pairs", type=int, default=32,
                        help="compare.png shows the first this-many pairs (default 32; 0: no image).")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from refl_ddpo.generate import run_compare

    run_compare(args.before, args.after, args.out, args.num_bootstrap, args.seed, args.max_pairs)


if __name__ == "__main__":
    main()
