"""Tiny random reward models in the layouts their loaders read, for tests and demos without the real weights:
seeded, a few MB, seconds to build (refl_ddpo.testing.tiny.write_tiny_models writes them all).

    write_imagereward   ImageReward.pt, med_config.json, bert-base-uncased/   (refl_ddpo.rewards.imagereward)
    write_aesthetic     clip/ + the LAION-style head                          (refl_ddpo.rewards.aesthetic)
    write_clip          pickscore/ and clip_score/                            (refl_ddpo.rewards.clip)
    write_hpsv2         hpsv2/, an open_clip 'local-dir' folder               (refl_ddpo.rewards.hpsv2)
    write_bertscore     bertscore/, a BERT for vlm_bertscore                  (refl_ddpo.rewards.vlm)
    write_hpsv3         hpsv3/, HPSv3.safetensors + Qwen2-VL-7B-Instruct/     (refl_ddpo.rewards.hpsv3)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn
from transformers import BertTokenizer

from refl_ddpo.rewards import aesthetic, clip, hpsv2, vlm
from refl_ddpo.rewards.imagereward import (
    _POSITION_IDS_KEY,
    CHECKPOINT_FILE,
    MED_CONFIG_FILE,
    TOKENIZER_DIR,
    ImageRewardModel,
    _read_tokenizer,
)
from refl_ddpo.testing.tiny_parts import clip_tokenizer, tiny_clip_config

# BERT-uncased style vocabulary for `write_imagereward`: ids 0/100-103 are [PAD]/[UNK]/[CLS]/[SEP]/[MASK] as in
# bert-base-uncased, then characters, prompt words, common suffixes and every letter/digit as a `##` piece, so
# that any lowercase ASCII prompt tokenizes to real tokens.
_TINY_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_TINY_WORDS = """
the a an of in on at with and or to from by for is are as it its this that his her their under over near above
behind beside between into through while during after before very more most not no up down out off one two three
four five many some all small big large little tall long short old young new beautiful cute happy sad funny scary
red orange yellow green blue purple pink brown black white gray grey golden silver dark light bright colorful
cat dog horse bird fish cow pig sheep goat chicken duck rabbit mouse rat fox wolf bear lion tiger leopard cheetah
elephant giraffe zebra monkey ape panda koala kangaroo deer camel frog snake turtle lizard shark whale dolphin
octopus owl eagle parrot penguin butterfly bee spider ant animal animals man woman boy girl child people person
king queen knight wizard robot astronaut soldier dragon unicorn monster alien ghost car truck bus train bike boat
ship plane rocket house castle tower city street road bridge park garden forest tree trees flower flowers grass
mountain mountains river lake sea ocean beach island desert snow rain sky cloud clouds sun moon star stars space
planet fire water ice stone wood glass metal gold table chair bed book cup hat sword apple banana cake pizza food
room window door wall floor field farm village night day morning evening sunset sunrise winter summer spring autumn
photo photograph picture image painting drawing sketch portrait landscape illustration poster render art artwork
style oil watercolor digital concept realistic photorealistic detailed highly intricate sharp focus cinematic
lighting studio dramatic soft epic fantasy surreal abstract anime cartoon 3d 4k 8k hd unreal engine octane
trending artstation by greg rutkowski van gogh monet vintage retro modern futuristic cyberpunk steampunk
sitting standing running walking flying swimming playing eating drinking riding holding wearing looking sleeping
jumping reading dancing singing fighting smiling
"""
_TINY_SUFFIXES = "##s ##es ##ed ##ing ##er ##est ##ly ##y ##ion ##al ##ful ##ness"
# write_imagereward's model: BLIP's layout at toy width (the same dimensions as shared/fixtures/imagereward_tiny).
_TINY_VISION = {"img_size": 224, "patch_size": 16, "embed_dim": 64, "depth": 2, "num_heads": 4}
_TINY_TEXT = {
    "hidden_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
}
_BLIP_PROJ_DIM = 256


def _tiny_vocab() -> list[str]:
    specials = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [f"##{c}" for c in _TINY_CHARS if c.isalnum()]
    return list(
        dict.fromkeys([*specials, *_TINY_CHARS, *_TINY_WORDS.split(), *_TINY_SUFFIXES.split(), *pieces])
    )


@torch.no_grad()
def _redraw(model: nn.Module, generator: torch.Generator) -> None:
    """Fresh weights that make every parameter matter (shared/fixtures/imagereward_tiny/recipe.json's rule):
    cls/pos tokens N(0, 0.5²), embeddings N(0, 1), matrices N(0, 1/fan_in), LayerNorm weights N(1, 0.2²),
    biases N(0, 0.1²). BLIP's own init gives a nearly constant reward."""
    for name, p in model.named_parameters():
        if name.endswith(("cls_token", "pos_embed")):
            mean, std = 0.0, 0.5
        elif name.endswith(("word_embeddings.weight", "position_embeddings.weight")):
            mean, std = 0.0, 1.0
        elif name.endswith("bias"):
            mean, std = 0.0, 0.1
        elif p.ndim == 1:  # the only 1-D weights are LayerNorm scales
            mean, std = 1.0, 0.2
        else:
            mean, std = 0.0, p[0].numel() ** -0.5
        p.copy_(mean + std * torch.randn(p.shape, generator=generator))


def _with_prefix(state_dict: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state_dict.items() if k.startswith(prefix)}


def write_imagereward(out_dir: str | os.PathLike, seed: int = 0) -> None:
    """A tiny random ImageReward in the official layout (ImageReward.pt, med_config.json with a
    `vision_config` entry, bert-base-uncased/) into `out_dir`: seeded, about 2 MB, a second to build."""
    out = Path(out_dir)
    tokenizer_dir = out / TOKENIZER_DIR
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    vocab = _tiny_vocab()
    (tokenizer_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, model_max_length=512).save_pretrained(
        tokenizer_dir
    )
    # BLIP's med_config.json with toy sizes; + 2 for [DEC] and [ENC], as 30522 + 2 in the official file.
    med_config = {
        "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, **_TINY_TEXT, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
        "model_type": "bert", "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": len(vocab) + 2,
        "encoder_width": _TINY_VISION["embed_dim"], "add_cross_attention": True, "vision_config": _TINY_VISION,
    }  # fmt: skip
    (out / MED_CONFIG_FILE).write_text(json.dumps(med_config, indent=2) + "\n")

    model = ImageRewardModel(med_config, _read_tokenizer(str(tokenizer_dir), med_config["vocab_size"]))
    generator = torch.Generator().manual_seed(seed)
    _redraw(model, generator)
    own = model.state_dict()
    projections = {
        f"blip.{name}_proj.{p}": torch.randn(shape, generator=generator) * std
        for name, width in (("vision", _TINY_VISION["embed_dim"]), ("text", _TINY_TEXT["hidden_size"]))
        for p, shape, std in (
            ("weight", (_BLIP_PROJ_DIM, width), width**-0.5),
            ("bias", (_BLIP_PROJ_DIM,), 0.1),
        )
    }
    position_ids = torch.arange(_TINY_TEXT["max_position_embeddings"])[None]  # [1, max_positions]
    vision, text = _with_prefix(own, "blip.visual_encoder."), _with_prefix(own, "blip.text_encoder.")
    # The official key order: ViT, text encoder (position_ids first), projections, MLP.
    state_dict = {
        **vision,
        _POSITION_IDS_KEY: position_ids,
        **text,
        **projections,
        **_with_prefix(own, "mlp."),
    }
    torch.save(state_dict, out / CHECKPOINT_FILE)


def write_aesthetic(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random CLIP (32 px, 32-d projection) in `out_dir/clip/` and a tiny head in `out_dir` (safetensors)."""
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed + 10)
    config = CLIPConfig(
        text_config={
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        },
        vision_config={
            "image_size": 32,
            "patch_size": 8,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        },
        projection_dim=32,
    )
    CLIPModel(config).save_pretrained(out_dir / aesthetic.CLIP_DIR, safe_serialization=True)
    torch.manual_seed(seed + 11)
    head = aesthetic.AestheticHead((config.projection_dim, 64, 32, 16, 8, 1))
    save_file(
        {k: v.contiguous() for k, v in head.state_dict().items()},
        str(out_dir / f"{aesthetic.HEAD_NAME}.safetensors"),
    )
    return out_dir


def write_clip(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random CLIP (48 px input resized to 32, 16-d projection) with its processor, in the layout `clip.load`
    reads, at `out_dir/pickscore/` and `out_dir/clip_score/` (different seeds)."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    out_dir = Path(out_dir)
    tokenizer = clip_tokenizer()
    for i, kind in enumerate(clip.SOURCES):
        torch.manual_seed(seed + 20 + i)
        config = CLIPConfig(
            text_config=tiny_clip_config(tokenizer, hidden=16).to_dict(),
            vision_config={
                "image_size": 32,
                "patch_size": 8,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
            },
            projection_dim=16,
        )
        folder = out_dir / clip.SOURCES[kind][0]
        CLIPModel(config).save_pretrained(folder, safe_serialization=True)
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return out_dir


def write_hpsv2(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random open_clip ViT (32 px, 8 px patches) with open_clip's BPE text tower (49408 tokens, 8 wide) in
    the 'local-dir' layout at `out_dir/hpsv2/`, with HPSv2's preprocessing (longest side, pad, OpenAI mean / std)."""
    import open_clip
    from safetensors.torch import save_file

    folder = Path(out_dir) / hpsv2.SUBDIR
    folder.mkdir(parents=True, exist_ok=True)
    model_cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 8, "heads": 2, "layers": 1},
    }
    preprocess_cfg = {
        "mean": list(hpsv2.OPENAI_MEAN),
        "std": list(hpsv2.OPENAI_STD),
        "interpolation": "bicubic",
        "resize_mode": "longest",
    }
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
    (folder / hpsv2.OPEN_CLIP_CONFIG).write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed + 30)
    model = open_clip.CLIP(**model_cfg)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "open_clip_model.safetensors"),
    )
    return folder


def write_bertscore(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random BERT (2 layers, 32 wide) with the tiny BERT tokenizer at `out_dir/bertscore/` (the layout
    BERTScorer reads); needs `out_dir/bert-base-uncased/` (written by `write_imagereward`)."""
    from transformers import BertConfig, BertModel, BertTokenizer

    out_dir = Path(out_dir)
    tokenizer = BertTokenizer.from_pretrained(out_dir / "bert-base-uncased")
    torch.manual_seed(seed + 40)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    folder = out_dir / vlm.BERTSCORE_DIR
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


# Qwen2-VL's special tokens, in the order of its tokenizer; <|endoftext|> pads.
_QWEN2_VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def write_hpsv3(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny random HPSv3 at `out_dir/hpsv3/` in the layout refl_ddpo.rewards.hpsv3 reads: HPSv3.safetensors (the
    checkpoint's keys: visual.*, model.*, lm_head.*, rm_head.*) and Qwen2-VL-7B-Instruct/ (config.json and a
    byte-level Qwen2 tokenizer built offline). Qwen2-VL at width 32, 2 layers; the same sizes as
    tests/fixtures/hpsv3_tiny; every weight redrawn as `_redraw` does, so that each one matters."""
    from safetensors.torch import save_file
    from transformers import Qwen2Tokenizer, Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
        Qwen2VLTextModel,
    )

    from refl_ddpo.rewards import hpsv3
    from refl_ddpo.rewards.hpsv3_model import HPSv3Model
    from refl_ddpo.testing.tiny_parts import byte_chars

    folder = Path(out_dir) / "hpsv3"
    base = folder / hpsv3.BASE_DIR
    base.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(byte_chars())}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": _QWEN2_VL_SPECIALS[1:]})
    tokenizer.save_pretrained(base)
    ids = tokenizer.convert_tokens_to_ids(_QWEN2_VL_SPECIALS)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer) + 1,  # + <|Reward|>, which HPSv3 adds
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},  # sums to head_dim / 2
            "bos_token_id": ids[0],
            "eos_token_id": ids[2],
            "pad_token_id": ids[0],
        },
        vision_config={"depth": 2, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2},
        vision_start_token_id=ids[3],
        vision_end_token_id=ids[4],
        image_token_id=ids[5],
        video_token_id=ids[6],
    )
    config.save_pretrained(base)
    with torch.random.fork_rng(devices=[]):
        model = HPSv3Model(
            Qwen2VisionTransformerPretrainedModel._from_config(config.vision_config),
            Qwen2VLTextModel._from_config(config.text_config),
            len(tokenizer),
            config.image_token_id,
        )
    generator = torch.Generator().manual_seed(seed + 50)
    _redraw(model, generator)
    lm_head = torch.randn(len(tokenizer) + 1, 32, generator=generator)  # in the file, never read
    state_dict = {
        {"language_model": "model"}.get(k.split(".")[0], k.split(".")[0]) + k[k.index(".") :]: v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_file({**state_dict, "lm_head.weight": lm_head}, folder / hpsv3.CHECKPOINT_FILE)
    return folder
