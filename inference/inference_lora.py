"""Base model + trained LoRA: the same prompts and seeds as inference/inference.py, scored as it is (--rewards).

    python inference/inference_lora.py [--lora_dir checkpoint/refl_lora] [--lora_scale 1.0] [--output_dir outputs/lora]

The base model and resolution default to those recorded in --lora_dir/config.json by the trainer, so a run that
matches training needs no flags. Works with checkpoint/refl_lora, checkpoint/ddpo_lora and any diffusers-format LoRA
(pytorch_lora_weights.safetensors). Then: python inference/compare.py outputs/base outputs/lora
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: import refl_ddpo uninstalled

from refl_ddpo.apps.inference import main_lora as main

if __name__ == "__main__":
    main()
