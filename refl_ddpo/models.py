"""Loading Stable Diffusion from a local diffusers folder or a hub id, with one-line errors when it is not there."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from refl_ddpo.errors import UserError

DTYPES = {"no": torch.float32, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

WHERE_WEIGHTS_GO = "put the diffusers folder there or pass a hub id (see checkpoint/README.md)"


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype '{name}'; use one of no, fp16, bf16.") from None


def looks_local(name: str) -> bool:
    """A path (exists, absolute, relative with ./, or more than one '/') rather than a hub id 'org/name'."""
    return (os.path.exists(name) or os.path.isabs(name) or name.startswith((".", "~"))
            or name.count("/") > 1 or os.sep != "/" and os.sep in name)


def check_pretrained_model(name: str) -> None:
    """Fail early, before anything heavy is imported or loaded, if a local model folder is missing."""
    if looks_local(name):
        path = Path(name).expanduser()
        if not (path / "model_index.json").is_file():
            what = "has no model_index.json" if path.is_dir() else "does not exist"
            raise UserError(f"--pretrained_model {name} {what}: {WHERE_WEIGHTS_GO}.")


def load_pipeline(name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """`StableDiffusionPipeline` from a local folder or hub id, no safety checker, frozen, in `dtype` on `device`."""
    from diffusers import StableDiffusionPipeline

    check_pretrained_model(name)
    try:
        pipe = StableDiffusionPipeline.from_pretrained(
            os.path.expanduser(name), dtype=dtype, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False,
        )
    except (OSError, ValueError) as e:  # hub id unreachable / unknown, or a broken folder
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = WHERE_WEIGHTS_GO if looks_local(name) else (
            "without network access, download it into checkpoint/ first (see checkpoint/README.md)")
        raise UserError(f"--pretrained_model {name} could not be loaded ({first}); {hint}.") from None
    pipe.set_progress_bar_config(disable=True)
    for module in (pipe.unet, pipe.vae, pipe.text_encoder):
        module.requires_grad_(False)
        module.eval()
    return pipe.to(device)
