"""Rewards of an edit: they read the source image from the metadata (`metadata["source_images"]`, a list of
(3, H, W) tensors in [0, 1]: refl_ddpo.core.edit_data; the first is the one compared).

    edit_clip_direction  CLIP directional similarity (Gal et al. 2022, "StyleGAN-NADA", eq. 3's direction; the edit
                         metric of InstructPix2Pix, Brooks et al. 2023, §5, and of diffusers' evaluation guide):
                         cos(E_img(result) - E_img(source), E_txt(target caption) - E_txt(source caption)), each
                         embedding L2-normalised before the differences. The captions come from the metadata,
                         "target_caption" and "source_caption" (InstructPix2Pix's data has both); without them the
                         instruction stands for the target and the empty caption for the source. On the CLIP of
                         clip_score (`<reward_model_dir>/clip_score/`, else openai/clip-vit-large-patch14).
                         Differentiable. In [-1, 1].
    edit_preserve        how much of the source survives: 1 - mean |result - source| over pixels and channels, the
                         source resized to the result's size (bilinear, antialiased) where they differ. No model.
                         Differentiable. In [0, 1]; weigh it against the edit
                         (`edit_clip_direction:1,edit_preserve:0.5`).
    edit_judge           a VLM judge of the edit over an OpenAI-compatible server (EditReward / UnifiedReward-Edit
                         style): one request with the instruction, the source image and the edited image, answered
                         with reasons and 'Final Score: X' for X in 0..10; the reward is the last X / score_max (10).
                         Not differentiable. `edit_judge:URL`, else $OPENAI_BASE_URL (refl_ddpo.rewards.vlm_client).
A sample without a source image is a one-line error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refl_ddpo.core.errors import UserError

EDIT_JUDGE_QUESTION = (
    "You are given an editing instruction, a source image and the image edited from it. Judge how well the edit "
    "follows the instruction, how much of the source that the instruction does not touch is kept, and the edited "
    "image's quality. Reason briefly, then end with 'Final Score: X' where X is a score from 0 to 10.\n"
    "Instruction: [{prompt}]"
)


def first_sources(metadata: list[dict], reward: str) -> list[torch.Tensor]:
    """Each sample's first source image (3, H, W); one line when a sample has none."""
    from refl_ddpo.core.edit_data import source_tensors

    out = []
    for m in metadata:
        sources = source_tensors(m)
        if not sources:
            raise UserError(
                f"--reward {reward} compares the result with its source image, and a sample has none; train on "
                "--edit_data (or a prompt_fn whose metadata has 'source_images')."
            )
        out.append(sources[0])
    return out


def stacked_sources(metadata: list[dict], reward: str, like: torch.Tensor) -> torch.Tensor:
    """The first sources (B, 3, H, W) at the size of `like` (B, 3, H, W): resized bilinearly where they differ."""
    out = []
    for source in first_sources(metadata, reward):
        source = source.to(like.device, like.dtype)[None]
        if source.shape[-2:] != like.shape[-2:]:
            source = F.interpolate(
                source, like.shape[-2:], mode="bilinear", align_corners=False, antialias=True
            )
        out.append(source)
    return torch.cat(out)


def preservation(images: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """1 - mean |images - sources| per sample (B,), both (B, 3, H, W) in [0, 1]."""
    return 1 - (images - sources).abs().flatten(1).mean(1)


def directional_similarity(
    result: torch.Tensor, source: torch.Tensor, target_text: torch.Tensor, source_text: torch.Tensor
) -> torch.Tensor:
    """cos(result - source, target_text - source_text) per sample (B,) of L2-normalised embeddings (B, D)."""
    return F.cosine_similarity(result - source, target_text - source_text, dim=-1)


def edit_preserve(device: torch.device, dtype: torch.dtype, model_dir: str, **options):
    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        images = images.to(device)
        return preservation(images, stacked_sources(metadata, "edit_preserve", images)).float(), {}

    return reward_fn


def edit_clip_direction(device: torch.device, dtype: torch.dtype, model_dir: str, **options):
    from refl_ddpo.rewards.clip import load, preprocess

    scorer = load("clip_score", model_dir, device, dtype)
    model, processor = scorer.model, scorer.processor.image_processor

    def image_embeds(images: torch.Tensor) -> torch.Tensor:
        pixels = preprocess(images.to(device, model.logit_scale.dtype), processor)
        embeds = model.get_image_features(pixel_values=pixels).pooler_output
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        with torch.no_grad():  # the source and the captions carry no gradient
            sources = torch.stack(first_sources(metadata, "edit_clip_direction"))
            source = image_embeds(sources)
            targets = [m.get("target_caption") or p for p, m in zip(prompts, metadata, strict=True)]
            target_text = scorer.text_embeds(targets, device)
            source_text = scorer.text_embeds([m.get("source_caption") or "" for m in metadata], device)
        cos = directional_similarity(image_embeds(images), source, target_text, source_text)
        return cos.float(), {}

    return reward_fn


def edit_judge(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    url: str | None = None,
    model: str | None = None,
    question: str | None = None,
    max_tokens: int = 512,
    score_max: float = 10.0,
    **client_options,
):
    from refl_ddpo.rewards.vlm_client import VLM, answer_text, fill_prompt
    from refl_ddpo.rewards.vlm_scores import final_score

    vlm = VLM(url, model, **client_options)
    template = question or EDIT_JUDGE_QUESTION

    def reward_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        sources = first_sources(metadata, "edit_judge")
        messages = [
            [fill_prompt(template, p), "Source image:", s, "Edited image:", images[i].detach().float().cpu()]
            for i, (p, s) in enumerate(zip(prompts, sources, strict=True))
        ]
        choices = vlm.chat(messages, max_tokens)
        scores = [final_score(answer_text(c), score_max, vlm.base_url) for c in choices]
        return torch.tensor(scores, dtype=torch.float32, device=device), {}

    return reward_fn
