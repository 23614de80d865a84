"""Before | after: pair two inference runs by (prompt, seed) and compare their ImageReward scores.

    python inference/compare.py outputs/base outputs/lora [--out outputs/compare]

Writes compare.png (before | after for each prompt and seed, score under each) and compare.json, and prints a table:
mean score before and after, per-prompt deltas, the win rate of after over before, and a paired bootstrap 95%
interval of the mean difference.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: import refl_ddpo uninstalled

from refl_ddpo.compare import main

if __name__ == "__main__":
    main()
