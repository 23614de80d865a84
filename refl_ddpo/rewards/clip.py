"""CLIP-based prompt-image rewards on transformers' CLIPModel: PickScore and CLIP score. Differentiable.

    pickscore    PickScore (Kirstain et al. 2023, "Pick-a-Pic"): a CLIP ViT-H/14 fine-tuned on human preferences;
                 score = logit_scale.exp() * cos(image embedding, text embedding), as the authors' example
                 (`yuvalkirstain/PickScore_v1` with the processor of `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`).
                 About 21-23 for good SD images (logit scale exp = 100).
    clip_score   100 * cos(image embedding, text embedding) of `openai/clip-vit-large-patch14` (the CLIPScore of
                 torchmetrics without its clamp at 0, so that the gradient never vanishes).

Files: `<reward_model_dir>/pickscore/` and `<reward_model_dir>/clip_score/`, each a CLIPModel folder
(save_pretrained) holding its processor's files too (CLIPProcessor.save_pretrained: preprocessor_config.json and the
tokenizer); without a config.json there, the hub ids above are tried.

The processor's image steps (resize of the short side, centre crop, rescale, normalise) are done here as tensor
operations on images [B, 3, H, W] in [0, 1], with the processor's own settings (size, crop size, resampling, mean,
std), so the score carries gradient to the pixels (ReFL, DRaFT). They equal the processor run on PIL images up to
the uint8 rounding the PIL path does after its resize (tests/test_clip_rewards.py measures it).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from refl_ddpo.core.errors import UserError

# kind -> (sub-folder of --reward_model_dir, model hub id, processor hub id)
SOURCES: dict[str, tuple[str, str, str]] = {
    "pickscore": ("pickscore", "yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
    "clip_score": ("clip_score", "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14"),
}
# PIL resampling codes (PIL.Image.Resampling) -> torch interpolation modes
_MODES = {2: "bilinear", 3: "bicubic"}


def _size_of(size: dict | int, square: bool = False) -> int | tuple[int, int]:
    """A processor's size: an int (the short side) or (height, width)."""
    if isinstance(size, int):
        return (size, size) if square else size
    if "shortest_edge" in size:
        return (size["shortest_edge"],) * 2 if square else size["shortest_edge"]
    return (size["height"], size["width"])


def pil_resize(x: torch.Tensor, height: int, width: int, mode: str = "bicubic") -> torch.Tensor:
    """PIL's resize as tensor ops: x [B, C, H, W] in [0, 1] -> [B, C, height, width]. Differentiable.

    torch's antialias=True path uses PIL's kernels (cubic a = -0.5, support scaled when shrinking) in both
    directions. PIL resizes the width first and stores that pass as uint8, clipping the cubic's overshoot, then
    the height: two passes with a clamp to [0, 1] after each do the same, so what is left is PIL's uint8 rounding
    (within 1/255 per pixel, measured on noise images, the worst case for overshoot)."""
    h, w = x.shape[-2:]
    if w != width:
        x = F.interpolate(x, size=(h, width), mode=mode, align_corners=False, antialias=True).clamp(0, 1)
    if h != height:
        x = F.interpolate(x, size=(height, width), mode=mode, align_corners=False, antialias=True).clamp(0, 1)
    return x


def preprocess(images: torch.Tensor, image_processor) -> torch.Tensor:
    """CLIPImageProcessor's steps as tensor ops: images [B, 3, H, W] in [0, 1] -> pixel_values [B, 3, h, w].

    As the processor (PIL backend): resize the short side to `size["shortest_edge"]` (the long side to
    int(size * long / short)) with its resampling (bicubic or bilinear, as PIL: `pil_resize`), centre crop to
    `crop_size` (top = (H - h) // 2), then (x - mean) / std. Differentiable.
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise UserError(f"CLIP rewards take images [B, 3, H, W], got shape {tuple(images.shape)}.")
    p = image_processor
    x = images
    if p.do_resize:
        mode = _MODES.get(int(p.resample))
        if mode is None:
            raise UserError(
                f"the CLIP processor's resample {p.resample} is not bilinear (2) or bicubic (3); save a processor "
                "with one of them."
            )
        h, w = x.shape[-2:]
        target = _size_of(p.size)
        if isinstance(target, int):
            short, long = min(h, w), max(h, w)
            new_short, new_long = target, int(target * long / short)
            new_h, new_w = (new_short, new_long) if h <= w else (new_long, new_short)
        else:
            new_h, new_w = target
        x = pil_resize(x, new_h, new_w, mode)
    if p.do_center_crop:
        ch, cw = _size_of(p.crop_size, square=True)
        h, w = x.shape[-2:]
        if ch > h or cw > w:  # the processor pads with zeros first; never needed after a shortest-edge resize
            x = F.pad(
                x, ((cw - w + 1) // 2 if cw > w else 0,) * 2 + ((ch - h + 1) // 2 if ch > h else 0,) * 2
            )
            h, w = x.shape[-2:]
        top, left = (h - ch) // 2, (w - cw) // 2
        x = x[..., top : top + ch, left : left + cw]
    if p.do_normalize:
        mean = torch.tensor(p.image_mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        std = torch.tensor(p.image_std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        x = (x - mean) / std
    return x


class ClipScorer(nn.Module):
    """images [B, 3, H, W] in [0, 1] + B prompts -> scores [B]: scale * cos(image, text) of a CLIPModel."""

    def __init__(self, model, processor, kind: str):
        super().__init__()
        self.model = model
        self.processor = processor
        self.kind = kind

    def text_embeds(self, prompts: list[str], device) -> torch.Tensor:
        tokens = self.processor.tokenizer(
            list(prompts),
            padding="max_length",
            truncation=True,
            max_length=self.processor.tokenizer.model_max_length,
            return_tensors="pt",
        ).to(device)
        embeds = self.model.get_text_features(**tokens).pooler_output  # (B, projection_dim)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def forward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if len(prompts) != len(images):
            raise UserError(f"{self.kind}: {len(images)} images but {len(prompts)} prompts.")
        dtype = self.model.logit_scale.dtype
        pixel_values = preprocess(images.to(dtype), self.processor.image_processor)
        image_embeds = self.model.get_image_features(pixel_values=pixel_values).pooler_output  # (B, D)
        image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
        cos = (image_embeds * self.text_embeds(prompts, pixel_values.device)).sum(-1)  # (B,)
        scale = self.model.logit_scale.exp() if self.kind == "pickscore" else 100.0
        return (scale * cos).float()


def _where(kind: str, model_dir: str | os.PathLike) -> str:
    sub, model_id, processor_id = SOURCES[kind]
    return (
        f"put a CLIPModel folder with its processor's files at {Path(model_dir) / sub} (save_pretrained of "
        f"{model_id} and of CLIPProcessor {processor_id}), or let the hub ids load"
    )


def load(
    kind: str,
    model_dir: str | os.PathLike = "checkpoint",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ClipScorer:
    """The scorer `kind` (pickscore, clip_score) from `<model_dir>/<kind>/` or the hub, frozen, in eval mode."""
    import transformers
    from transformers import CLIPModel, CLIPProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    sub, model_id, processor_id = SOURCES[kind]
    local = Path(model_dir) / sub
    model_src, processor_src = (
        (str(local), str(local)) if (local / "config.json").is_file() else (model_id, processor_id)
    )
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = CLIPModel.from_pretrained(model_src)
        # the PIL backend reads the same settings as the default one; only its attributes are used here
        processor = CLIPProcessor.from_pretrained(
            processor_src, image_processor=CLIPImageProcessorPil.from_pretrained(processor_src)
        )
    except (OSError, ValueError) as e:  # not on disk and the hub is unreachable, or a broken folder
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"{kind} reward: could not load {model_src} ({first}); {_where(kind, model_dir)}."
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    scorer = ClipScorer(model, processor, kind).to(device=device, dtype=dtype).eval()
    scorer.requires_grad_(False)
    return scorer


def _factory(kind: str):
    def make(device: torch.device, dtype: torch.dtype, model_dir: str, **options):
        scorer = load(kind, model_dir, device, dtype)

        def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
            return scorer(images.to(device), list(prompts)), {}

        return reward_fn

    make.__name__ = kind
    return make


pickscore = _factory("pickscore")
clip_score = _factory("clip_score")
