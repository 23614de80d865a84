"""ImageReward's network (BLIP ViT + BLIP text encoder + MLP head) on timm + transformers, with the constants of
ImageReward.py; refl_ddpo.rewards.imagereward reads the official files into it and makes the reward."""

from __future__ import annotations

import os

import torch
from PIL import Image
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torchvision import transforms
from torchvision.transforms import InterpolationMode
from transformers import BertTokenizer, BlipTextConfig, BlipTextModel

from refl_ddpo.core.errors import UserError

# ImageReward.py: the normalisation of the MLP output, the prompt length and the image size.
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
MAX_PROMPT_TOKENS = 35
IMAGE_SIZE = 224
# CLIP's mean/std, which ImageReward's preprocessing uses.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Images may leave [0, 1] by this much (rounding in low precision); anything further is a caller's bug.
RANGE_TOLERANCE = 1e-3

# BLIP's create_vit('large', 224); the keys a `vision_config` entry in med_config.json may set.
VIT_L16 = {
    "img_size": 224,
    "patch_size": 16,
    "embed_dim": 1024,
    "depth": 24,
    "num_heads": 16,
    "mlp_ratio": 4.0,
}
# The BERT fields of med_config.json that shape the text tower, with BertConfig's defaults for the optional ones.
TEXT_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
_TEXT_OPTIONAL = {"layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0}


def _to_rgb(image: Image.Image) -> Image.Image:
    return image.convert("RGB")


def _text_config(med_config: dict, encoder_hidden_size: int) -> BlipTextConfig:
    """BlipTextConfig from BLIP's med_config.json; cross-attention width = the ViT width, as BLIP sets it."""
    return BlipTextConfig(
        **{k: med_config[k] for k in TEXT_REQUIRED},
        **{k: med_config.get(k, v) for k, v in _TEXT_OPTIONAL.items()},
        encoder_hidden_size=encoder_hidden_size,
        # The reward is only ever evaluated, so dropout is 0 (this also makes train mode equal eval mode).
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        # is_decoder=True only makes BlipTextLayer build its cross-attention; forward runs bidirectionally.
        is_decoder=True,
        use_cache=False,
        # BlipTextConfig's defaults point at the 30524-token vocab; these ids are unused here.
        bos_token_id=None,
        eos_token_id=None,
        sep_token_id=None,
    )


def _vision_config(med_config: dict) -> dict:
    """ViT-L/16 at 224 px, or what med_config.json's optional `vision_config` entry says."""
    return {**VIT_L16, **med_config.get("vision_config", {})}


class ImageRewardModel(nn.Module):
    """ImageReward's `ImageReward` module (ImageReward.py): BLIP ViT + BLIP text encoder + MLP head, frozen.

    Submodule names follow the official state dict: `blip.visual_encoder`, `blip.text_encoder`, `mlp.layers`.
    The ViT skips timm's init (the checkpoint overwrites every weight): use `load`, or call
    `blip.visual_encoder.init_weights()` before using a model built without a checkpoint.
    """

    def __init__(self, med_config: dict, tokenizer: BertTokenizer):
        super().__init__()
        vision = _vision_config(med_config)
        text_config = _text_config(med_config, vision["embed_dim"])
        # Construction draws init weights that the checkpoint replaces; keep the caller's RNG stream untouched.
        with torch.random.fork_rng(devices=[]):
            # All tokens out (no pooling, no head); timm's defaults match BLIP's ViT: qkv bias, LayerNorm eps 1e-6.
            visual_encoder = VisionTransformer(**vision, num_classes=0, global_pool="", weight_init="skip")
            text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
            hidden = text_config.hidden_size
            # ImageReward's MLP: Linear layers at 0, 2, 4, 6, 7 (Dropouts between, inactive), no activations.
            layers = nn.Sequential(
                nn.Linear(hidden, 1024), nn.Dropout(0.2),
                nn.Linear(1024, 128), nn.Dropout(0.2),
                nn.Linear(128, 64), nn.Dropout(0.1),
                nn.Linear(64, 16),
                nn.Linear(16, 1),
            )  # fmt: skip
        self.blip = nn.ModuleDict({"visual_encoder": visual_encoder, "text_encoder": text_encoder})
        self.mlp = nn.ModuleDict({"layers": layers})
        self.tokenizer = tokenizer
        self.image_size: int = vision["img_size"]
        self._pil_transform = transforms.Compose([
            transforms.Resize(self.image_size, interpolation=InterpolationMode.BICUBIC),
            transforms.CenterCrop(self.image_size),
            _to_rgb,
            transforms.ToTensor(),
            transforms.Normalize(CLIP_MEAN, CLIP_STD),
        ])  # fmt: skip
        self._checkpointing = False
        self.requires_grad_(False)
        self.train()

    @property
    def device(self) -> torch.device:
        return self.mlp.layers[0].weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.mlp.layers[0].weight.dtype

    def train(self, mode: bool = True) -> ImageRewardModel:
        """The reward is frozen: it stays in eval mode whatever `mode` says.

        Exception: with gradient checkpointing on, the text tower is in train mode, because transformers only
        checkpoints a training module; its dropout is 0, so the numbers do not change.
        """
        super().train(False)
        if self._checkpointing:
            self.blip.text_encoder.train(True)
        return self

    def set_gradient_checkpointing(self, enable: bool = True) -> None:
        """Recompute each ViT block and each text layer in backward instead of keeping their activations."""
        self.blip.visual_encoder.set_grad_checkpointing(enable)
        text_encoder = self.blip.text_encoder
        if enable:
            # BlipTextLayer is a GradientCheckpointingLayer, but BlipTextPreTrainedModel does not declare support.
            text_encoder.supports_gradient_checkpointing = True
            text_encoder.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
            # That call also hooks the embeddings to require grad (only reentrant checkpointing needs it); undo it
            # so that rewards of images without grad carry no graph.
            text_encoder.disable_input_require_grads()
        elif self._checkpointing:
            text_encoder.activation_checkpointing_disable()
        self._checkpointing = enable
        self.train()

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> (input_ids [B,35], attention_mask [B,35]) on the model's device, as ImageReward's `score`."""
        enc = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """ImageReward's `score_gard` with its intermediates; pixel_values as `preprocess` returns them."""
        image_embeds = self.blip.visual_encoder.forward_features(pixel_values.to(self.dtype))  # [B, 1+N, Dv]
        # The cross-attention mask is all ones in ImageReward, the same as none.
        text_last_hidden_state = self.blip.text_encoder(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds
        ).last_hidden_state  # [B, L, Dt]
        txt_features = text_last_hidden_state[:, 0]  # [B, Dt], the [CLS] token
        raw_mlp = self.mlp.layers(txt_features)  # [B, 1]
        rewards = ((raw_mlp - REWARD_MEAN) / REWARD_STD).squeeze(-1)  # [B]
        # fp16/bf16 -> fp32; fp64 stays fp64
        rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
        return {
            "image_embeds": image_embeds,
            "text_last_hidden_state": text_last_hidden_state,
            "txt_features": txt_features,
            "raw_mlp": raw_mlp,
            "rewards": rewards,
        }

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor
    ) -> torch.Tensor:
        """Rewards [B] (float32; float64 for a float64 model), differentiable w.r.t. pixel_values."""
        return self.features(input_ids, attention_mask, pixel_values)["rewards"]

    @torch.no_grad()
    def score(self, prompt: str, images: Image.Image | str | os.PathLike | list) -> float | list[float]:
        """ImageReward's `score`/`inference_rank`: a PIL image or path gives a float, a list gives a list."""
        single = not isinstance(images, (list, tuple))
        pixel_values = torch.stack(
            [self._pil_transform(_open_image(x)) for x in ([images] if single else images)]
        )
        input_ids, attention_mask = self.tokenize([prompt] * len(pixel_values))
        rewards = self(input_ids, attention_mask, pixel_values.to(self.device)).tolist()
        return rewards[0] if single else rewards


def _open_image(image: Image.Image | str | os.PathLike) -> Image.Image:
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (str, os.PathLike)):
        if not os.path.isfile(image):
            raise UserError(f"image file {image} not found.")
        return Image.open(image)
    raise TypeError(f"score() takes PIL images or image paths, not {type(image).__name__}")
