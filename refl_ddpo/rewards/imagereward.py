"""ImageReward (Xu et al. 2023, THUDM/ImageReward) rebuilt from maintained parts.

The PyPI `image-reward` package no longer imports with current transformers, so this module carries the model:

    pixel_values [B,3,224,224] -> timm VisionTransformer (BLIP ViT-L/16)  -> image_embeds [B,197,1024]
    input_ids [B,35] ---------> transformers BlipTextModel (BLIP's med.py BERT, cross-attending to image_embeds)
                             -> CLS feature [B,768] -> 5 Linear layers, no activations -> raw [B,1]
    reward = (raw - 0.16717...) / 1.03333...

It reads the official files unchanged: `ImageReward.pt` (keys `blip.visual_encoder.*`, `blip.text_encoder.*`,
`mlp.layers.*` map onto the submodules by name, no renaming), `med_config.json` and the `bert-base-uncased`
tokenizer. `med_config.json` may carry an extra `vision_config` entry (keys of `VIT_L16`) for a smaller ViT; without
it the ViT is BLIP's ViT-L/16 at 224 px. BLIP itself ignores `encoder_width` in that file and uses the ViT width, and
so do we.

Attention: the ViT uses PyTorch SDPA (timm's fused attention). transformers' BlipTextModel has no SDPA path (its
attention is an explicit matmul-softmax), so the text tower runs eager attention.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import torch
from PIL import Image
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torchvision import transforms
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF
from transformers import BertTokenizer, BlipTextConfig, BlipTextModel

from refl_ddpo.errors import UserError
from refl_ddpo.rewards import RewardFn

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

HUB_REPO = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
TOKENIZER_DIR = "bert-base-uncased"
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
_TEXT_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
_TEXT_OPTIONAL = {"layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0}
# Keys of the official file that the reward never uses: BLIP's contrastive projections and a constant buffer.
_UNUSED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
_POSITION_IDS_KEY = "blip.text_encoder.embeddings.position_ids"
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_HELP = "see checkpoint/README.md for where to get the files"


def _is_unused(key: str) -> bool:
    return key.startswith(_UNUSED_PREFIXES) or key == _POSITION_IDS_KEY


def _few(names: list[str], n: int = 3) -> str:
    """'a, b, c and 7 more' for one-line errors."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _to_rgb(image: Image.Image) -> Image.Image:
    return image.convert("RGB")


def _text_config(med_config: dict, encoder_hidden_size: int) -> BlipTextConfig:
    """BlipTextConfig from BLIP's med_config.json; cross-attention width = the ViT width, as BLIP sets it."""
    return BlipTextConfig(
        **{k: med_config[k] for k in _TEXT_REQUIRED},
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


def preprocess(images: torch.Tensor, antialias: bool = True, size: int = IMAGE_SIZE) -> torch.Tensor:
    """ImageReward's ReFL preprocessing as differentiable tensor ops: [B,3,H,W] in [0,1] -> [B,3,size,size].

    Bicubic resize of the short side to `size`, centre crop, CLIP mean/std, as torchvision's
    `Compose([Resize(224, BICUBIC), CenterCrop(224), Normalize(...)])` in ImageReward's ReFL.py. `antialias=True`
    is current torchvision's default; `antialias=False` is what torchvision < 0.17 did in the 2023 ReFL runs (they
    differ even when upsampling: torch's antialiased bicubic uses a=-0.5, the plain one a=-0.75).
    """
    if images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
        raise UserError(
            f"ImageReward takes float images [B, 3, H, W] in [0, 1], got {images.dtype} {list(images.shape)}."
        )
    lo, hi = torch.stack(torch.aminmax(images.detach())).tolist()  # one device->host sync per batch
    if not (lo >= -RANGE_TOLERANCE and hi <= 1 + RANGE_TOLERANCE):
        raise UserError(
            f"ImageReward takes images in [0, 1], got values in [{lo:.4g}, {hi:.4g}]; map decoded "
            "images with (x / 2 + 0.5).clamp(0, 1)."
        )
    x = TF.resize(images, [size], interpolation=InterpolationMode.BICUBIC, antialias=antialias)
    x = TF.center_crop(x, [size, size])
    return TF.normalize(x, list(CLIP_MEAN), list(CLIP_STD))  # [B, 3, size, size]


# ---- loading ----


def _resolve(path: str) -> tuple[str, str, str]:
    """(ImageReward.pt, med_config.json, tokenizer folder or hub id) for a folder or a hub repo id."""
    if not os.path.exists(path) and _HUB_ID.fullmatch(path):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            files = [hf_hub_download(path, name) for name in (CHECKPOINT_FILE, MED_CONFIG_FILE)]
        # No network, an unknown repo or a missing file: the same to the user.
        except (OSError, EntryNotFoundError) as e:
            raise UserError(
                f"could not fetch {CHECKPOINT_FILE} and {MED_CONFIG_FILE} from the hub repo {path} "
                f"({type(e).__name__}); put them and {TOKENIZER_DIR}/ in a local folder and pass "
                f"that instead ({_HELP})."
            ) from None
        return files[0], files[1], TOKENIZER_DIR
    folder = Path(path)
    checkpoint = folder / CHECKPOINT_FILE
    med_config = folder / MED_CONFIG_FILE
    tokenizer = folder / TOKENIZER_DIR
    if not checkpoint.is_file():
        raise UserError(
            f"{checkpoint} not found: download {CHECKPOINT_FILE} from the hub repo {HUB_REPO} into "
            f"{folder} or point --reward_model_dir at the folder that has it ({_HELP})."
        )
    if not med_config.is_file():
        raise UserError(
            f"{med_config} not found: download {MED_CONFIG_FILE} from the hub repo {HUB_REPO} into "
            f"{folder} ({_HELP})."
        )
    if not tokenizer.is_dir():
        raise UserError(
            f"tokenizer folder {tokenizer} not found: save the {TOKENIZER_DIR} tokenizer there "
            f"(BertTokenizer.from_pretrained('{TOKENIZER_DIR}').save_pretrained(...); {_HELP})."
        )
    return str(checkpoint), str(med_config), str(tokenizer)


def _read_med_config(path: str) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(
            f"{path} is not readable JSON ({e}); it must be BLIP's med_config.json ({_HELP})."
        ) from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object (BLIP's med_config.json; {_HELP}).")
    missing = [k for k in _TEXT_REQUIRED if k not in config]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it must be BLIP's med_config.json ({_HELP}).")
    vision = config.get("vision_config", {})
    if not isinstance(vision, dict) or set(vision) - set(VIT_L16):
        raise UserError(f"{path}: vision_config may only set {', '.join(VIT_L16)}, got {json.dumps(vision)}.")
    return config


def _read_tokenizer(source: str, vocab_size: int) -> BertTokenizer:
    """BLIP's `init_tokenizer`: bert-base-uncased plus [DEC] as bos token and [ENC] as an extra special token."""
    try:
        tokenizer = BertTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:  # which one depends on what is missing
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"cannot load the BERT tokenizer from {source} ({first_line}); it must hold "
            f"{TOKENIZER_DIR}'s vocab.txt or tokenizer.json ({_HELP})."
        ) from None
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    if len(tokenizer) > vocab_size:
        raise UserError(
            f"the tokenizer at {source} has {len(tokenizer)} tokens with [DEC]/[ENC] but med_config.json "
            f"says vocab_size {vocab_size}: the tokenizer and the checkpoint do not belong together."
        )
    return tokenizer


def _read_state_dict(path: str) -> dict[str, torch.Tensor]:
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    # Not a pickle, a pickle of other objects, a broken or truncated zip: the messages say little more than the type.
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise UserError(
            f"{path} is not a PyTorch checkpoint (torch.load failed with {type(e).__name__}); "
            f"it must be the official {CHECKPOINT_FILE} ({_HELP})."
        ) from None
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise UserError(
            f"{path} holds a {type(state_dict).__name__}, not a state dict of tensors; it must be the "
            f"official {CHECKPOINT_FILE} ({_HELP})."
        )
    return state_dict


def _load_weights(model: ImageRewardModel, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Strict load: only the unused keys (`_is_unused`) may be extra; anything else wrong is a UserError."""
    own = model.state_dict()
    kept = {k: v for k, v in state_dict.items() if not _is_unused(k)}
    missing = [k for k in own if k not in kept]
    unexpected = [k for k in kept if k not in own]
    wrong_shape = [
        f"{k} {list(kept[k].shape)} vs {list(own[k].shape)}"
        for k in own
        if k in kept and kept[k].shape != own[k].shape
    ]
    problems = [
        f"{what}: {len(keys)} ({_few(keys)})"
        for what, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("wrong shapes", wrong_shape),
        )
        if keys
    ]
    if problems:
        raise UserError(
            f"{source} does not match the ImageReward layout of med_config.json: {'; '.join(problems)}. "
            f"Use the official {CHECKPOINT_FILE} with its med_config.json; a smaller ViT needs its size in "
            f"med_config.json's vision_config ({_HELP})."
        )
    model.load_state_dict(kept)


def load(
    path: str | os.PathLike = "checkpoint",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ImageRewardModel:
    """Load ImageReward from a folder (ImageReward.pt, med_config.json, bert-base-uncased/) or the hub id
    THUDM/ImageReward. Frozen, in eval mode, on `device` in `dtype`."""
    checkpoint, med_config_path, tokenizer_source = _resolve(str(path))
    med_config = _read_med_config(med_config_path)
    tokenizer = _read_tokenizer(tokenizer_source, med_config["vocab_size"])
    state_dict = _read_state_dict(checkpoint)
    model = ImageRewardModel(med_config, tokenizer)
    _load_weights(model, state_dict, checkpoint)
    return model.to(device=device, dtype=dtype)


# ---- the reward ----


def imagereward(
    device: torch.device,
    dtype: torch.dtype,
    model_dir: str,
    antialias: bool = True,
    gradient_checkpointing: bool = False,
) -> RewardFn:
    """ImageReward of each image for its prompt; keeps the graph back to `images` (ReFL backpropagates it).

    `antialias` is `preprocess`'s (False reproduces ImageReward's 2023 ReFL resize); `gradient_checkpointing`
    recomputes both towers' activations in backward."""
    model = load(model_dir, device, dtype)
    if gradient_checkpointing:
        model.set_gradient_checkpointing(True)
    return reward_from_model(model, antialias)


def reward_from_model(model: ImageRewardModel, antialias: bool = True) -> RewardFn:
    """The reward function around a loaded model: tokens cached by prompt, preprocessing as tensor ops."""
    # prompt -> (input_ids [35], attention_mask [35]), tokenized once
    tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def reward_fn(
        images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> tuple[torch.Tensor, dict]:
        new = [p for p in dict.fromkeys(prompts) if p not in tokens]
        if new:
            input_ids, attention_mask = model.tokenize(new)
            tokens.update(zip(new, zip(input_ids, attention_mask, strict=True), strict=True))
        input_ids = torch.stack([tokens[p][0] for p in prompts])  # [B, 35]
        attention_mask = torch.stack([tokens[p][1] for p in prompts])  # [B, 35]
        pixel_values = preprocess(images, antialias=antialias, size=model.image_size)  # [B, 3, 224, 224]
        return model(input_ids, attention_mask, pixel_values), {}

    return reward_fn
