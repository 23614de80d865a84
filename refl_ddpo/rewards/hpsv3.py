"""HPSv3 as a reward: reads the hub repo MizzenAI/HPSv3's `HPSv3.safetensors` and Qwen2-VL-7B-Instruct's config and
tokenizer into refl_ddpo.rewards.hpsv3_model.HPSv3Model, and scores images by HPSv3's mu (its sigma goes to info).

--reward_model_dir holds:

    HPSv3.safetensors          the whole reward model (hub repo MizzenAI/HPSv3): `visual.*`, `model.*` (the
                               language model), `lm_head.*` (not read), `rm_head.*`
    Qwen2-VL-7B-Instruct/      the base model's config.json and tokenizer files (hub repo Qwen/Qwen2-VL-7B-Instruct;
                               its weight shards are not read)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import RewardFn
from refl_ddpo.rewards.hpsv3_model import REWARD_TOKEN, HPSv3Model, chat_text, preprocess

CHECKPOINT_FILE = "HPSv3.safetensors"
BASE_DIR = "Qwen2-VL-7B-Instruct"
HUB_REPO = "MizzenAI/HPSv3"
BASE_REPO = "Qwen/Qwen2-VL-7B-Instruct"
# checkpoint prefix -> HPSv3Model prefix; `lm_head.` (the language model's output layer) is never used.
_PREFIXES = {"visual.": "visual.", "model.": "language_model.", "rm_head.": "rm_head."}
_UNUSED_PREFIX = "lm_head."
_HELP = f"see docs/rewards.md (hpsv3) for the files: {CHECKPOINT_FILE} from {HUB_REPO}, {BASE_DIR}/ from {BASE_REPO}"


def _few(names: list[str], n: int = 3) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _resolve(model_dir: str) -> tuple[Path, Path]:
    """(HPSv3.safetensors, the base folder) in `model_dir`, or one line naming what is missing."""
    folder = Path(model_dir)
    checkpoint, base = folder / CHECKPOINT_FILE, folder / BASE_DIR
    if not checkpoint.is_file():
        raise UserError(
            f"{checkpoint} not found: download {CHECKPOINT_FILE} from the hub repo {HUB_REPO} into {folder}, or "
            f"point --reward_model_dir at the folder that has it ({_HELP})."
        )
    if not (base / "config.json").is_file():
        raise UserError(
            f"{base / 'config.json'} not found: put {BASE_REPO}'s config.json and tokenizer files in {base} ({_HELP})."
        )
    return checkpoint, base


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under HPSv3Model's names; lm_head (about 1 GB in bf16) is never read."""
    from safetensors import SafetensorError, safe_open

    out = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping: it has keys() but no __iter__)
                if key.startswith(_UNUSED_PREFIX):
                    continue
                prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
                out[_PREFIXES[prefix] + key[len(prefix) :] if prefix else key] = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"{path} is not a safetensors file ({e}); it must be {HUB_REPO}'s {CHECKPOINT_FILE}."
        ) from None
    return out


def _read_config(base: Path, vocab_size: int):
    """Qwen2-VL's config from base/config.json, with the checkpoint's vocabulary size (HPSv3 resized the
    embeddings to its tokenizer plus <|Reward|>)."""
    from transformers import Qwen2VLConfig

    try:
        config = Qwen2VLConfig.from_pretrained(base)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"cannot read {base / 'config.json'} as a Qwen2-VL config ({first_line}; {_HELP})."
        ) from None
    config.text_config.vocab_size = vocab_size
    config.text_config.attention_dropout = 0.0  # Qwen2-VL's own; checkpointing runs the towers in train mode
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    return config


def _read_tokenizer(base: Path, vocab_size: int):
    """Qwen2-VL's tokenizer with HPSv3's <|Reward|> added, as the package does; its size must be the checkpoint's."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load the tokenizer from {base} ({first_line}; {_HELP}).") from None
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    if len(tokenizer) != vocab_size:
        raise UserError(
            f"the tokenizer in {base} has {len(tokenizer)} tokens with {REWARD_TOKEN} but {CHECKPOINT_FILE} "
            f"embeds {vocab_size}: the tokenizer and the checkpoint do not belong together ({_HELP})."
        )
    tokenizer.padding_side = "right"
    return tokenizer


def _check_keys(model: HPSv3Model, state_dict: dict[str, torch.Tensor], source: Path) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    wrong = [
        f"{k} {list(v.shape)} vs {list(own[k].shape)}"
        for k, v in state_dict.items()
        if k in own and v.shape != own[k].shape
    ]
    problems = [
        f"{what}: {len(keys)} ({_few(keys)})"
        for what, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("wrong shapes", wrong),
        )
        if keys
    ]
    if problems:
        raise UserError(
            f"{source} does not match the HPSv3 model of {BASE_DIR}/config.json: {'; '.join(problems)} ({_HELP})."
        )


def _build(config, reward_token_id: int) -> HPSv3Model:
    """HPSv3Model on the meta device (no memory, no init): the checkpoint's tensors are assigned afterwards."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
        Qwen2VLTextModel,
    )

    with torch.device("meta"):
        visual = Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config)
        language_model = Qwen2VLTextModel._from_config(config.text_config)
        return HPSv3Model(visual, language_model, reward_token_id, config.image_token_id)


def _rebuild_rotary(model: HPSv3Model) -> None:
    """The rotary modules' inverse frequencies are buffers outside the checkpoint: compute them on the CPU."""
    for parent in (model.visual, model.language_model):
        for name, module in list(parent.named_children()):
            if "rotary" in name:
                setattr(parent, name, type(module)(module.config))


def load(
    model_dir: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[HPSv3Model, object]:
    """(model, tokenizer) from --reward_model_dir: Qwen2-VL in `dtype` (as the package casts it), the reward head in
    float32 (as the package keeps it); frozen, in eval mode, on `device`."""
    checkpoint, base = _resolve(str(model_dir))
    state_dict = _read_state_dict(checkpoint)
    embeds = state_dict.get("language_model.embed_tokens.weight")
    if embeds is None:
        raise UserError(
            f"{checkpoint} has no model.embed_tokens.weight: it must be {HUB_REPO}'s {CHECKPOINT_FILE}."
        )
    config = _read_config(base, embeds.shape[0])
    tokenizer = _read_tokenizer(base, embeds.shape[0])
    model = _build(config, tokenizer.convert_tokens_to_ids(REWARD_TOKEN))
    _check_keys(model, state_dict, checkpoint)
    model.load_state_dict(state_dict, assign=True)
    _rebuild_rotary(model)
    model.visual.to(device=device, dtype=dtype)
    model.language_model.to(device=device, dtype=dtype)
    model.rm_head.to(device=device, dtype=torch.float32)
    return model, tokenizer


def tokenize(tokenizer, prompts: list[str], image_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, L], right-padded to the longest: each prompt's chat text with `image_tokens`
    image slots."""
    enc = tokenizer([chat_text(p, image_tokens) for p in prompts], padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


# ---- the reward ----


def hpsv3(
    device: torch.device, dtype: torch.dtype, model_dir: str, gradient_checkpointing: bool = False
) -> RewardFn:
    """HPSv3's mu of each image for its prompt (sigma in info["sigma"]); keeps the graph back to `images`.
    `gradient_checkpointing` recomputes both towers' activations in backward."""
    model, tokenizer = load(model_dir, device, dtype)
    if gradient_checkpointing:
        model.set_gradient_checkpointing(True)
    return reward_from_model(model, tokenizer)


def reward_from_model(model: HPSv3Model, tokenizer) -> RewardFn:
    """The reward function around a loaded model: preprocessing as tensor ops, the text tokenized per call."""

    def reward_fn(
        images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> tuple[torch.Tensor, dict]:
        pixel_values, grid_thw = preprocess(images)
        image_tokens = int(grid_thw[0].prod()) // 4  # the 2 x 2 merge
        input_ids, attention_mask = tokenize(tokenizer, prompts, image_tokens)
        device = images.device
        out = model(input_ids.to(device), attention_mask.to(device), pixel_values, grid_thw)  # [B, 2]
        return out[:, 0], {"sigma": out[:, 1].detach()}

    return reward_fn
