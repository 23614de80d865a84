"""LAION aesthetic score: the improved-aesthetic-predictor MLP on L2-normalised CLIP ViT-L/14 image embeddings.

The reward of ddpo-pytorch's aesthetic experiment (`ddpo_pytorch/aesthetic_scorer.py`): CLIP
`openai/clip-vit-large-patch14` image features (the projected pooled output), divided by their L2 norm, scored by
the head `sac+logos+ava1-l14-linearMSE.pth` of christophschuhmann/improved-aesthetic-predictor:

    Linear(768, 1024) Dropout(0.2) Linear(1024, 128) Dropout(0.2) Linear(128, 64) Dropout(0.1) Linear(64, 16)
    Linear(16, 1)                                       (state-dict keys layers.{0,2,4,6,7}.{weight,bias})

Unlike the reference, which goes through uint8 PIL images and the CLIP processor, the preprocessing here is tensor
operations (bicubic resize of the short side, centre crop, CLIP mean/std), so the score is differentiable with
respect to the images and runs on batches [B, 3, H, W] in [0, 1].

Files, under `<reward_model_dir>/aesthetic/`:
    clip/                             a CLIP folder (CLIPModel.save_pretrained of openai/clip-vit-large-patch14);
                                      without it the hub id is tried
    sac+logos+ava1-l14-linearMSE.pth  the head as released (loaded with weights_only=True), or the same
                                      tensors as sac+logos+ava1-l14-linearMSE.safetensors
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import RewardFn

SUBDIR = "aesthetic"
CLIP_DIR = "clip"
CLIP_HUB_ID = "openai/clip-vit-large-patch14"
HEAD_NAME = "sac+logos+ava1-l14-linearMSE"
HEAD_URL = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
    "sac+logos+ava1-l14-linearMSE.pth"
)
# CLIP's image normalisation (CLIPImageProcessor defaults for the OpenAI checkpoints).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Linear layers of the head in nn.Sequential order; the indices between them are the dropouts.
HEAD_LINEAR_INDICES = (0, 2, 4, 6, 7)
HEAD_DROPOUTS = (0.2, 0.2, 0.1)


def _where(model_dir: str | os.PathLike) -> str:
    d = Path(model_dir) / SUBDIR
    return (
        f"put a CLIP ViT-L/14 folder at {d / CLIP_DIR} (save_pretrained of {CLIP_HUB_ID}) and {HEAD_NAME}.pth "
        f"({HEAD_URL}) in {d}"
    )


class AestheticHead(nn.Module):
    """The improved-aesthetic-predictor MLP; widths come from `dims` (768, 1024, 128, 64, 16, 1 for the release)."""

    def __init__(self, dims: tuple[int, ...]):
        super().__init__()
        d = dims
        self.layers = nn.Sequential(
            nn.Linear(d[0], d[1]),
            nn.Dropout(HEAD_DROPOUTS[0]),
            nn.Linear(d[1], d[2]),
            nn.Dropout(HEAD_DROPOUTS[1]),
            nn.Linear(d[2], d[3]),
            nn.Dropout(HEAD_DROPOUTS[2]),
            nn.Linear(d[3], d[4]),
            nn.Linear(d[4], d[5]),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


def _head_dims(state_dict: dict[str, torch.Tensor], source: str) -> tuple[int, ...]:
    """Layer widths read from the state dict; a file of another layout is a one-line error."""
    expected = {f"layers.{i}.{p}" for i in HEAD_LINEAR_INDICES for p in ("weight", "bias")}
    if set(state_dict) != expected:
        odd = sorted(set(state_dict) ^ expected)[:3]
        raise UserError(
            f"{source} is not the LAION aesthetic head (keys layers.{{0,2,4,6,7}}.weight/bias expected; "
            f"differs at {', '.join(odd)})."
        )
    weights = [state_dict[f"layers.{i}.weight"] for i in HEAD_LINEAR_INDICES]
    dims = (weights[0].shape[1], *(w.shape[0] for w in weights))
    chained = all(w.ndim == 2 and w.shape[1] == dims[k] for k, w in enumerate(weights))
    if not chained or dims[-1] != 1:
        raise UserError(
            f"{source}: layer shapes {[tuple(w.shape) for w in weights]} do not chain into one score."
        )
    return dims


def _read_head(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    # Not a pickle, a pickle of other objects, a broken or truncated file: say which and what was expected.
    except (pickle.UnpicklingError, SafetensorError, RuntimeError, EOFError, ValueError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{path} could not be read ({first}); it must be {HEAD_NAME}.pth from {HEAD_URL}."
        ) from None
    if not isinstance(state_dict, dict) or not all(torch.is_tensor(v) for v in state_dict.values()):
        raise UserError(
            f"{path} holds a {type(state_dict).__name__}, not a state dict of tensors; it must be "
            f"{HEAD_NAME}.pth from {HEAD_URL}."
        )
    return state_dict


def _load_clip_vision(model_dir: Path):
    """CLIPVisionModelWithProjection from `<dir>/clip` (a full CLIPModel folder is fine) or from the hub id."""
    import transformers
    from transformers import AutoConfig, CLIPVisionModelWithProjection

    local = model_dir / SUBDIR / CLIP_DIR
    source = str(local) if (local / "config.json").is_file() else CLIP_HUB_ID
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a CLIPModel folder's text-tower keys are expected to be unused
    try:
        config = AutoConfig.from_pretrained(source)
        if config.model_type == "clip":  # a full CLIPModel: keep its vision tower and projection width
            vision_config = config.vision_config
            vision_config.projection_dim = config.projection_dim
        else:
            vision_config = config
        model = CLIPVisionModelWithProjection.from_pretrained(source, config=vision_config)
    except (OSError, ValueError) as e:  # not on disk and the hub is unreachable, or a broken folder
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"aesthetic reward: CLIP not found at {local} and {CLIP_HUB_ID} could not be loaded "
            f"({first}); {_where(model_dir)}."
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model


def preprocess(images: torch.Tensor, size: int) -> torch.Tensor:
    """CLIP preprocessing as tensor ops: images [B, 3, H, W] in [0, 1] -> [B, 3, size, size] normalised.

    As CLIPImageProcessor: bicubic resize of the short side to `size` (antialiased, like PIL when shrinking),
    centre crop to `size` x `size`, then (x - mean) / std. Differentiable.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise UserError(f"the aesthetic reward takes images [B, 3, H, W], got shape {tuple(images.shape)}.")
    h, w = images.shape[-2:]
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    x = F.interpolate(images, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    x = x[..., top : top + size, left : left + size]
    mean = torch.tensor(CLIP_MEAN, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


class AestheticScorer(nn.Module):
    """CLIP vision tower + projection, L2 normalisation, MLP head: images [B, 3, H, W] in [0, 1] -> scores [B]."""

    def __init__(self, clip_vision, head: AestheticHead):
        super().__init__()
        self.clip = clip_vision
        self.head = head
        self.image_size = clip_vision.config.image_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        dtype = next(self.head.parameters()).dtype
        pixel_values = preprocess(images.to(dtype), self.image_size)
        embeds = self.clip(pixel_values=pixel_values).image_embeds  # (B, projection_dim)
        embeds = embeds / embeds.norm(dim=-1, keepdim=True)
        return self.head(embeds).squeeze(1).float()  # (B,)


def load(
    model_dir: str | os.PathLike = "checkpoint",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> AestheticScorer:
    """The scorer from `<model_dir>/aesthetic/`, frozen, in eval mode (dropouts off), on `device` in `dtype`."""
    model_dir = Path(model_dir)
    folder = model_dir / SUBDIR
    candidates = [folder / f"{HEAD_NAME}.safetensors", folder / f"{HEAD_NAME}.pth"]
    head_path = next((p for p in candidates if p.is_file()), None)
    if head_path is None:  # checked first: it needs no network, and without it CLIP alone is of no use
        raise UserError(f"aesthetic reward: {candidates[1]} not found; {_where(model_dir)}.")
    state_dict = _read_head(head_path)
    head = AestheticHead(_head_dims(state_dict, str(head_path)))
    head.load_state_dict(state_dict)
    clip = _load_clip_vision(model_dir)
    if clip.config.projection_dim != head.layers[0].in_features:
        raise UserError(
            f"{head_path} takes {head.layers[0].in_features}-d embeddings but the CLIP model gives "
            f"{clip.config.projection_dim}-d; the head belongs to CLIP ViT-L/14 ({CLIP_HUB_ID})."
        )
    scorer = AestheticScorer(clip, head).to(device=device, dtype=dtype).eval()
    scorer.requires_grad_(False)
    return scorer


def aesthetic(device: torch.device, dtype: torch.dtype, model_dir: str) -> RewardFn:
    scorer = load(model_dir, device, dtype)

    def reward_fn(
        images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> tuple[torch.Tensor, dict]:
        return scorer(images.to(device)), {}

    return reward_fn
