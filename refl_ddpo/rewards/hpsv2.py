"""HPSv2.1 (Human Preference Score v2.1, Wu et al. 2023) on open_clip. Differentiable.

An open_clip ViT-H-14 fine-tuned on human preferences; the score is the cosine of the L2-normalised image and text
features (no logit scale), as the authors' `score.py` (`diag(image_features @ text_features.T)`): about 0.25-0.35 for
SD images. Their validation transform resizes the longest side to 224 (bicubic), pads the square with black (0),
converts to a tensor and normalises with the OpenAI CLIP mean / std; here that is done as tensor operations on
images [B, 3, H, W] in [0, 1] (refl_ddpo.rewards.clip.pil_resize), so the score carries gradient to the pixels.

Files, under `<reward_model_dir>/hpsv2/`, the first found:
    open_clip_config.json + open_clip_model.safetensors   an open_clip folder ('local-dir:' layout; the tiny model)
    HPS_v2.1_compressed.pt                               the released weights (from the hub repo xswu/HPSv2),
                                                          on the built-in ViT-H-14 config; read with
                                                          weights_only=True
and without either, HPS_v2.1_compressed.pt is fetched from the hub repo xswu/HPSv2.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards.clip import pil_resize

SUBDIR = "hpsv2"
HUB_REPO = "xswu/HPSv2"
WEIGHTS = "HPS_v2.1_compressed.pt"
ARCH = "ViT-H-14"
OPEN_CLIP_CONFIG = "open_clip_config.json"
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def preprocess(images: torch.Tensor, size: int, mean=OPENAI_MEAN, std=OPENAI_STD) -> torch.Tensor:
    """HPSv2's validation transform as tensor ops: images [B, 3, H, W] in [0, 1] -> [B, 3, size, size].

    Resize so that the longest side is `size` (the other round(side * size / longest)), bicubic as PIL; pad to a
    centred square with 0 (left / top (size - side) // 2); (x - mean) / std. Differentiable."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise UserError(f"the hpsv2 reward takes images [B, 3, H, W], got shape {tuple(images.shape)}.")
    h, w = images.shape[-2:]
    ratio = max(h, w) / size
    new_h, new_w = round(h / ratio), round(w / ratio)
    x = pil_resize(images, new_h, new_w, "bicubic")
    pad_w, pad_h = size - new_w, size - new_h
    x = F.pad(x, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2), value=0.0)
    mean_t = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean_t) / std_t


class HPSv2Scorer(nn.Module):
    """images [B, 3, H, W] in [0, 1] + B prompts -> HPS [B] (cosine of normalised open_clip features)."""

    def __init__(self, model, tokenizer):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        size = model.visual.image_size
        self.image_size = size[0] if isinstance(size, tuple | list) else int(size)
        cfg = getattr(model.visual, "preprocess_cfg", {}) or {}
        self.mean, self.std = tuple(cfg.get("mean", OPENAI_MEAN)), tuple(cfg.get("std", OPENAI_STD))

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if len(prompts) != len(images):
            raise UserError(f"hpsv2: {len(images)} images but {len(prompts)} prompts.")
        dtype = next(self.model.parameters()).dtype
        pixels = preprocess(images.to(dtype), self.image_size, self.mean, self.std)
        image_features = self.model.encode_image(pixels, normalize=True)  # (B, D)
        text = self.tokenizer(list(prompts)).to(pixels.device)
        text_features = self.model.encode_text(text, normalize=True)  # (B, D)
        return (image_features * text_features).sum(-1).float()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def load(
    model_dir: str | os.PathLike = "checkpoint",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    arch: str = ARCH,
) -> HPSv2Scorer:
    """The HPSv2.1 scorer from `<model_dir>/hpsv2/` (or the hub), frozen, in eval mode, on `device` in `dtype`;
    `arch` is the open_clip config the released .pt weights go into."""
    import open_clip

    folder = Path(model_dir) / SUBDIR
    where = f"put {WEIGHTS} (hub repo {HUB_REPO}) or an open_clip folder ({OPEN_CLIP_CONFIG} + weights) in {folder}"
    try:
        if (folder / OPEN_CLIP_CONFIG).is_file():
            name = f"local-dir:{folder}"
            model = open_clip.create_model(name)
        else:
            weights = folder / WEIGHTS
            if not weights.is_file():
                from huggingface_hub import hf_hub_download

                weights = hf_hub_download(HUB_REPO, WEIGHTS)
            name = arch
            model = open_clip.create_model(arch, pretrained=None)
            open_clip.load_checkpoint(model, str(weights), strict=True, weights_only=True)
        tokenizer = open_clip.get_tokenizer(name)
    except UserError:
        raise
    # hub unreachable, a broken file, keys of another model: open_clip raises many kinds; one line, no traceback
    except Exception as e:  # noqa: BLE001
        raise UserError(f"hpsv2 reward: could not load the model ({_first_line(e)}); {where}.") from None
    scorer = HPSv2Scorer(model, tokenizer).to(device=device, dtype=dtype).eval()
    scorer.requires_grad_(False)
    return scorer


def hpsv2(device: torch.device, dtype: torch.dtype, model_dir: str, **options):
    scorer = load(model_dir, device, dtype)

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        return scorer(images.to(device), list(prompts)), {}

    return reward_fn
