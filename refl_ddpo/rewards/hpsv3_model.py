"""HPSv3's network (Ma et al. 2025, MizzenAI/HPSv3, pip `hpsv3`) on the pinned transformers: Qwen2-VL's vision
tower and language model, and HPSv3's reward head on the hidden state of its `<|Reward|>` token.

    images [B,3,H,W] in [0,1] -> bicubic resize to HPSv3's pixel bounds (256 * 28 * 28 pixels, sides multiples of
        28) -> CLIP mean/std -> Qwen2-VL patches [B*h*w/196, 1176] -> vision tower -> [B*h*w/784, D] image embeds
    chat text (system turn, the image, HPSv3's instruction with the prompt, then `<|Reward|>`) -> token embeds,
        the image embeds scattered into the <|image_pad|> slots -> Qwen2-VL language model -> hidden [B, L, D]
    hidden at <|Reward|> -> Linear(D,1024) ReLU Linear(1024,16) ReLU Linear(16,2) in float32 -> (mu, sigma) [B, 2]

The package calls the language model with no position ids, so all three multimodal rotary sections get the plain
positions 0..L-1 (not Qwen2-VL's 2-D image positions); so does this module. Batches are right-padded and attention
is causal, so an image's score does not depend on the rest of its batch. The reward is mu; HPSv3's training loss
reads sigma as a log standard deviation (exp(sigma)).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from refl_ddpo.core.errors import UserError

# HPSv3's inference: every image is resized to this many pixels (its min_pixels = max_pixels), sides multiples of
# 28 (Qwen2-VL's 14 px patches, merged 2 x 2).
PIXELS = 256 * 28 * 28
PATCH = 14
MERGE = 2
TEMPORAL_PATCH = 2
MAX_ASPECT_RATIO = 200
# Qwen2-VL's image processor normalises with CLIP's mean/std.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RANGE_TOLERANCE = 1e-3
REWARD_TOKEN = "<|Reward|>"

# HPSv3's prompt (hpsv3/dataset/data_collator_qwen.py, MIT licence), verbatim: the model was trained on this text,
# and its scores are only HPSv3's with it. `{text_prompt}` is the image's prompt.
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""
RATING_REQUEST = f"""
Please provide the overall ratings of this image: {REWARD_TOKEN}

END
"""


def chat_text(prompt: str, image_tokens: int) -> str:
    """Qwen2-VL's chat format of HPSv3's one user turn (the image, then the instruction) with the generation prompt;
    the image is `image_tokens` <|image_pad|> tokens, as Qwen2-VL's processor expands it."""
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|>{'<|image_pad|>' * image_tokens}<|vision_end|>"
        f"{INSTRUCTION.format(text_prompt=prompt)}{RATING_REQUEST}<|im_end|>\n<|im_start|>assistant\n"
    )


def resized_size(height: int, width: int) -> tuple[int, int]:
    """HPSv3's size for an image of height x width: sides multiples of 28, about PIXELS pixels, the aspect kept
    (qwen-vl-utils' smart_resize with min_pixels = max_pixels = PIXELS)."""
    factor = PATCH * MERGE
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise UserError(
            f"HPSv3 takes images with an aspect ratio up to {MAX_ASPECT_RATIO}, got {height} x {width}."
        )
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > PIXELS:
        beta = math.sqrt(height * width / PIXELS)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < PIXELS:
        beta = math.sqrt(PIXELS / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def check_images(images: torch.Tensor) -> None:
    """Float [B, 3, H, W] in [0, 1], or one line saying what came instead."""
    if images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
        raise UserError(
            f"HPSv3 takes float images [B, 3, H, W] in [0, 1], got {images.dtype} {list(images.shape)}."
        )
    lo, hi = torch.stack(torch.aminmax(images.detach())).tolist()  # one device->host sync per batch
    if not (lo >= -RANGE_TOLERANCE and hi <= 1 + RANGE_TOLERANCE):
        raise UserError(
            f"HPSv3 takes images in [0, 1], got values in [{lo:.4g}, {hi:.4g}]; map decoded images with "
            "(x / 2 + 0.5).clamp(0, 1)."
        )


def preprocess(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HPSv3's differentiable preprocessing: [B,3,H,W] in [0,1] -> (pixel_values [B*gh*gw, 1176], grid_thw [B,3]).

    Bicubic antialiased resize to `resized_size` (the package resizes tensors with torchvision's), CLIP mean/std,
    each image repeated over Qwen2-VL's 2 temporal frames and cut into 14 x 14 patches in its merge order."""
    check_images(images)
    b, c, height, width = images.shape
    h, w = resized_size(height, width)
    x = TF.resize(images, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)
    x = TF.normalize(x, list(CLIP_MEAN), list(CLIP_STD))  # [B, 3, h, w]
    gh, gw = h // PATCH, w // PATCH
    x = x[:, None].expand(b, TEMPORAL_PATCH, c, h, w)  # [B, T, C, h, w]
    x = x.reshape(b, TEMPORAL_PATCH, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [B, gh/2, gw/2, 2, 2, C, T, 14, 14]
    pixel_values = x.reshape(b * gh * gw, c * TEMPORAL_PATCH * PATCH * PATCH)
    grid_thw = torch.tensor([[1, gh, gw]] * b, device=images.device)
    return pixel_values, grid_thw


def reward_head(width: int) -> nn.Sequential:
    """HPSv3's `ranknet` head (its default sizes): the checkpoint's `rm_head.{0,3,5}`."""
    return nn.Sequential(
        nn.Linear(width, 1024), nn.ReLU(), nn.Dropout(0.05),
        nn.Linear(1024, 16), nn.ReLU(),
        nn.Linear(16, 2),
    )  # fmt: skip


class HPSv3Model(nn.Module):
    """Qwen2-VL (`visual`, `language_model`) + `rm_head`, frozen and in eval mode; `reward_token_id` is the id of
    `<|Reward|>`, `image_token_id` Qwen2-VL's <|image_pad|>."""

    def __init__(
        self, visual: nn.Module, language_model: nn.Module, reward_token_id: int, image_token_id: int
    ):
        super().__init__()
        self.visual = visual
        self.language_model = language_model
        self.rm_head = reward_head(language_model.config.hidden_size)
        self.reward_token_id = reward_token_id
        self.image_token_id = image_token_id
        self._checkpointing = False
        self.requires_grad_(False)
        self.train()

    def train(self, mode: bool = True) -> HPSv3Model:
        """The reward is frozen: it stays in eval mode whatever `mode` says.

        Exception: with gradient checkpointing on, the two towers are in train mode, because transformers only
        checkpoints a training module; they have no dropout (attention_dropout is 0), so the numbers do not change.
        """
        super().train(False)
        if self._checkpointing:
            self.visual.train(True)
            self.language_model.train(True)
        return self

    def set_gradient_checkpointing(self, enable: bool = True) -> None:
        """Recompute each vision block and each decoder layer in backward instead of keeping their activations."""
        for tower in (self.visual, self.language_model):
            if enable:
                tower.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
                # That call may hook the embeddings to require grad (only reentrant checkpointing needs it); undo
                # it so that rewards of images without grad carry no graph.
                tower.disable_input_require_grads()
            elif self._checkpointing:
                tower.activation_checkpointing_disable()
        self._checkpointing = enable
        self.train()

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
    ) -> torch.Tensor:
        """(mu, sigma) per image [B, 2] in float32; input_ids/attention_mask [B, L] right-padded, one <|Reward|> and
        the image's <|image_pad|> tokens in each row; pixel_values/grid_thw as `preprocess` returns them."""
        embeds = self.language_model.embed_tokens(input_ids)  # [B, L, D]
        image_embeds = self.visual(pixel_values.to(self.dtype), grid_thw=grid_thw).pooler_output  # [N, D]
        image_mask = (input_ids == self.image_token_id)[..., None].expand_as(embeds)
        if int(image_mask[..., 0].sum()) != image_embeds.shape[0]:
            raise UserError(
                f"HPSv3: the text has {int(image_mask[..., 0].sum())} image tokens for {image_embeds.shape[0]} "
                "image embeddings; the tokenizer does not belong to this model."
            )
        embeds = embeds.masked_scatter(image_mask, image_embeds.to(embeds.dtype))
        b, length = input_ids.shape
        # The package's positions: 0..L-1 in all three rotary sections.
        position_ids = torch.arange(length, device=input_ids.device).view(1, 1, -1).expand(3, b, -1)
        hidden = self.language_model(
            inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [B, L, D]
        at_reward = input_ids == self.reward_token_id  # [B, L]
        if not bool((at_reward.sum(1) == 1).all()):
            raise UserError(
                f"HPSv3: each text must hold {REWARD_TOKEN} exactly once (a prompt may not contain it)."
            )
        return self.rm_head(hidden[at_reward].float())  # [B, 2]
