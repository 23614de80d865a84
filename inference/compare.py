"""Before | after: pair two inference runs by (prompt, seed) and compare every reward both scored.

    python inference/compare.py outputs/base outputs/lora [--out outputs/compare]

Writes compare.png (a header with each reward's means, difference, 95% CI and win rate, then before | after for
each prompt and seed with the scores and delta under each pair) and compare.json, and prints per reward a table:
mean score before and after, per-prompt deltas, the win rate of after over before, and a paired bootstrap 95%
interval of the mean difference.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: import refl_ddpo uninstalled

from refl_ddpo.apps.compare import main

if __name__ == "__main__":
    main()
