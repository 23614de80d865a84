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
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF
from transformers import BertTokenizer

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import RewardFn
from refl_ddpo.rewards.imagereward_model import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGE_SIZE,
    RANGE_TOLERANCE,
    TEXT_REQUIRED,
    VIT_L16,
    ImageRewardModel,
)

HUB_REPO = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
TOKENIZER_DIR = "bert-base-uncased"
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
    missing = [k for k in TEXT_REQUIRED if k not in config]
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
