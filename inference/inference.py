"""Base model: generate the evaluation prompts with fixed seeds and score them (ImageReward, or --rewards a,b,...).

    python inference/inference.py [--pretrained_model checkpoint/stable-diffusion-v1-4] [--output_dir outputs/base]

Writes one PNG per image (prompt and seed in its metadata), grid.png and scores.json to --output_dir. Run
inference/inference_lora.py with the same prompts and seed, then inference/compare.py, to see what training changed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: import refl_ddpo uninstalled

from refl_ddpo.apps.inference import main_base as main

if __name__ == "__main__":
    main()
