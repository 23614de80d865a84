"""The one LoRA core: add adapters to the denoising network (peft), list the trainable params, save/load in
diffusers format.

A LoRA saved here is `pytorch_lora_weights.safetensors` (diffusers key names under the pipeline's prefix, `unet.`
for SD 1.x/2.x and SDXL, `transformer.` for SD3 and FLUX.1, the LoRA config in its metadata) and loads into a stock
pipeline with `StableDiffusionPipeline.from_pretrained(base).load_lora_weights(DIR)` (or `StableDiffusionXLPipeline`,
`StableDiffusion3Pipeline`, `FluxPipeline`, `QwenImagePipeline`, `ZImagePipeline`).
Pattern of diffusers' examples/text_to_image/train_text_to_image_lora.py. A network made of parts that each carry
a LoRA (Wan 2.2's two experts, `refl_ddpo.core.families.wan_experts`) says where each part's file goes
(`lora_parts`): the first at the top of the folder, the others in their subfolders, each in its own format.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch

from refl_ddpo.core.errors import UserError

# Wan 2.2's low-noise expert's LoRA, a subfolder beside the high-noise one's file (core.families.wan_experts)
EXPERT_2_DIR = "transformer_2"

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
FULL_UNET_DIR = "unet"  # full fine-tune: the UNet is saved in diffusers format under this subfolder
CONFIG_NAME = "config.json"  # the resolved training config, saved beside the weights

_PEFT_INIT = {"gaussian": "gaussian", "default": True, "random": False}

# network class -> (the pipeline class whose `save_lora_weights` writes its LoRA, the key prefix = pipeline attribute,
# whether the keys are converted to diffusers' old `lora.down` / `lora.up` names). As diffusers' own training examples
# write them: train_text_to_image_lora.py converts the UNet's, train_dreambooth_lora_sd3.py keeps peft's `lora_A` /
# `lora_B` (the SD3 loader reads those; converted names would be partly dropped, as the conversion only knows the
# attention processors' `to_q` ... and not `add_q_proj` ...).
_LORA_FORMATS = {
    "UNet2DConditionModel": ("StableDiffusionPipeline", "unet", True),
    "SD3Transformer2DModel": ("StableDiffusion3Pipeline", "transformer", False),
    "FluxTransformer2DModel": ("FluxPipeline", "transformer", False),
    "QwenImageTransformer2DModel": ("QwenImagePipeline", "transformer", False),
    "ZImageTransformer2DModel": ("ZImagePipeline", "transformer", False),
    # FLUX.2 [dev] and [klein]: both pipelines load it with the same Flux2LoraLoaderMixin
    "Flux2Transformer2DModel": ("Flux2Pipeline", "transformer", False),
    # Wan 2.1 / 2.2: a LoRA of Wan 2.2's transformer_2 has the same keys, loaded with load_into_transformer_2=True
    "WanTransformer3DModel": ("WanPipeline", "transformer", False),
}


def lora_parts(network) -> list[tuple[str, torch.nn.Module, str]]:
    """(its name in `network`, network, its folder in a LoRA folder) for each network that carries a LoRA of its
    own: the network itself at the top, or the parts a compound network names (Wan 2.2's two experts: the second
    in transformer_2/)."""
    parts = getattr(network, "lora_parts", None)
    return [("", network, "")] if parts is None else parts()


def _compound(network) -> bool:
    """Whether `network` is made of parts that carry the LoRA (Wan 2.2's pair, one or both of them trained)."""
    return hasattr(network, "lora_parts")


def _lora_format(network) -> tuple[str, str, bool]:
    from refl_ddpo.core.sharding import unsharded_class

    name = unsharded_class(network).__name__
    if name not in _LORA_FORMATS:
        raise UserError(f"no LoRA file format known for a {name}; known: {', '.join(_LORA_FORMATS)}.")
    return _LORA_FORMATS[name]


def add_lora(
    unet, rank: int, alpha: float, target_modules: list[str], init: str = "gaussian", dropout: float = 0.0
) -> list[torch.nn.Parameter]:
    """Add a peft LoRA adapter to `unet` (base frozen), cast the LoRA params to fp32, return them as a list."""
    from peft import LoraConfig

    unet.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        init_lora_weights=_PEFT_INIT[init],
        target_modules=list(target_modules),
        lora_dropout=dropout,
    )
    try:
        unet.add_adapter(config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise UserError(
            f"--lora_target_modules {' '.join(target_modules)}: {str(e).splitlines()[0]}"
        ) from None
    params = [p for n, p in unet.named_parameters() if "lora_" in n]
    for p in params:  # trainable params in fp32 even when the frozen base is fp16/bf16
        p.data = p.data.float()
        p.requires_grad_(True)
    _no_input_casts(unet)
    return params


def _no_input_casts(network) -> None:
    """A 16-bit base: peft's cast of each LoRA layer's input to the adapter's float32 off (a cast and its
    backward per layer and call); the trainers call the network under autocast, whose matmuls take the 16-bit
    input as it is. A float32 base is left as it is (peft's cast is then none)."""
    from peft.tuners.lora import LoraLayer

    for module in network.modules():
        if isinstance(module, LoraLayer) and module.get_base_layer().weight.dtype in (
            torch.float16,
            torch.bfloat16,
        ):
            module.cast_input_dtype_enabled = False


def trainable_full_unet(unet) -> list[torch.nn.Parameter]:
    """Full fine-tune: every UNet param trainable, in fp32."""
    unet.to(torch.float32)
    unet.requires_grad_(True)
    return list(unet.parameters())


def lora_state_dict(unet, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors with the key names this network's `save_lora_weights` expects (see _LORA_FORMATS);
    `state`: the network's tensors to take them from (gathered from FSDP shards) instead of its own."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(unet, state_dict=state)
    return convert_state_dict_to_diffusers(state) if _lora_format(unet)[2] else state


def _adapter_metadata(unet) -> dict:
    cfg = unet.peft_config["default"].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


def save_lora(
    unet, out_dir: str | Path, config: dict | None = None, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write the LoRA (or, without adapters, the full UNet) and the resolved config to `out_dir`; `state`: the
    network's whole tensors gathered from its FSDP shards (refl_ddpo.core.sharding.gathered_state), written in its place
    in the same format."""
    import diffusers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if _compound(unet):  # each part's LoRA in its folder (a compound network is never sharded: no `state`)
        for _, part, folder in lora_parts(unet):
            save_lora(part, out_dir / folder)
    elif getattr(unet, "peft_config", None):
        state = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in lora_state_dict(unet, state).items()
        }
        pipeline_class, prefix, _ = _lora_format(unet)
        getattr(diffusers, pipeline_class).save_lora_weights(
            out_dir,
            safe_serialization=True,
            **{f"{prefix}_lora_layers": state, f"{prefix}_lora_adapter_metadata": _adapter_metadata(unet)},
        )
    elif state is not None:  # a sharded network's gathered tensors: the folder save_pretrained would write
        from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
        from safetensors.torch import save_file

        from refl_ddpo.core.sharding import unsharded_class

        (out_dir / FULL_UNET_DIR).mkdir(exist_ok=True)
        unet.save_config(out_dir / FULL_UNET_DIR)
        conf = out_dir / FULL_UNET_DIR / "config.json"  # the class fully_shard derived is no diffusers class
        saved = json.loads(conf.read_text())
        saved["_class_name"] = unsharded_class(unet).__name__
        conf.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(tensors, str(out_dir / FULL_UNET_DIR / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        unet.save_pretrained(out_dir / FULL_UNET_DIR, safe_serialization=True)
    if config is not None:
        (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def read_lora_state(unet, lora_dir: str | Path) -> dict[str, torch.Tensor]:
    """A LoRA saved by `save_lora` for this network, in peft's names (`x.lora_A.weight`; a compound network's with
    its part's name in front, as peft's `get_peft_model_state_dict` of it names them)."""
    from diffusers.utils import convert_unet_state_dict_to_peft
    from safetensors.torch import load_file

    if _compound(unet):
        return {
            f"{name}.{k}": v
            for name, part, folder in lora_parts(unet)
            for k, v in read_lora_state(part, Path(lora_dir) / folder).items()
        }

    state = load_file(str(Path(lora_dir) / LORA_WEIGHTS_NAME))
    prefix = _lora_format(unet)[1]
    return convert_unet_state_dict_to_peft({k.removeprefix(f"{prefix}."): v for k, v in state.items()})


def load_lora_into_unet(unet, lora_dir: str | Path) -> None:
    """Restore a LoRA saved by `save_lora` into a UNet that already has the same adapter (resume)."""
    from peft.utils import set_peft_model_state_dict

    for _, part, folder in lora_parts(unet):
        where = Path(lora_dir) / folder
        if not (where / LORA_WEIGHTS_NAME).is_file():
            raise UserError(
                f"{lora_dir}: no {Path(folder) / LORA_WEIGHTS_NAME} to restore (another --wan_expert?)."
            )
        result = set_peft_model_state_dict(part, read_lora_state(part, where))
        if getattr(result, "unexpected_keys", None):
            raise UserError(f"{lora_dir}: LoRA keys do not fit this UNet (e.g. {result.unexpected_keys[0]}).")


def load_lora_into_pipeline(
    pipe, lora_dir: str | Path, scale: float = 1.0, expert: str | None = None
) -> None:
    """Inference: apply a saved LoRA (or full UNet) from `lora_dir` to `pipe`, with one-line errors. `expert`
    "transformer_2": a LoRA of Wan 2.2's low-noise expert, loaded there; "both": the top file into `transformer`,
    transformer_2/'s into `transformer_2` (as `save_lora` writes a `WanExperts` pair)."""
    lora_dir = Path(lora_dir)
    if (lora_dir / FULL_UNET_DIR / "config.json").is_file():
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(lora_dir / FULL_UNET_DIR, torch_dtype=pipe.unet.dtype)
        pipe.unet = unet.to(pipe.device).requires_grad_(False).eval()
        _check_finite(pipe.unet, lora_dir, lambda name: True)
        return
    if not (lora_dir / LORA_WEIGHTS_NAME).is_file():
        raise UserError(
            f"--lora_dir {lora_dir} has no {LORA_WEIGHTS_NAME} (train first, or point at a LoRA folder)."
        )
    from diffusers.utils import logging as diffusers_logging

    # diffusers logs a size mismatch as a multi-line error and keys it cannot place only as a warning; quiet it and
    # raise one line ourselves instead.
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity(diffusers_logging.CRITICAL)
    # (the network it goes into, the file's subfolder, the loader's arguments)
    to_2 = {"load_into_transformer_2": True}
    loads = {
        "transformer_2": [("transformer_2", "", to_2)],
        "both": [("transformer", "", {}), ("transformer_2", EXPERT_2_DIR, to_2)],
    }.get(expert or "", [("unet" if hasattr(pipe, "unet") else "transformer", "", {})])
    try:
        for name, folder, kwargs in loads:
            _load_one_lora(pipe, lora_dir, folder, kwargs)
            network = getattr(pipe, name)
            _check_all_unet_keys_loaded(network, lora_dir / folder)
            _check_finite(network, lora_dir, lambda name: "lora_" in name)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    if scale != 1.0:
        pipe.set_adapters(["default"], adapter_weights=[scale])


def _load_one_lora(pipe, lora_dir: Path, folder: str, kwargs: dict) -> None:
    """The stock `load_lora_weights` of lora_dir's file (in `folder`, "" for the top) as adapter "default"."""
    try:
        where = {"subfolder": folder} if folder else {}
        pipe.load_lora_weights(str(lora_dir), adapter_name="default", **where, **kwargs)
    except (RuntimeError, ValueError, KeyError) as e:
        msg = " ".join(str(e).split())[:300]
        raise UserError(
            f"--lora_dir {lora_dir} does not fit --pretrained_model (another architecture?): {msg}"
        ) from None


def _check_finite(unet, lora_dir: Path, trained) -> None:
    """Weights with NaN or inf (a run that diverged) would give NaN images: refuse them in one line."""
    bad = [n for n, p in unet.named_parameters() if trained(n) and not bool(torch.isfinite(p).all())]
    if bad:
        raise UserError(
            f"--lora_dir {lora_dir}: {len(bad)} trained tensor(s) hold NaN or inf (e.g. {bad[0]}); the run that "
            "wrote them diverged: use an earlier checkpoint-N or train again with a lower --learning_rate."
        )


_FILE_LORA_MATRIX = r"^{prefix}\..*\.(lora\.(down|up)|lora_[AB])\.weight$"  # diffusers / peft key names
_UNET_LORA_MATRIX = re.compile(r"\.lora_[AB]\.default\.weight$")


def _check_all_unet_keys_loaded(unet, lora_dir: Path) -> None:
    """A LoRA for another UNet layout (e.g. more blocks) loads partially with only a warning: refuse it.

    Counts the UNet LoRA matrices in the file (keys `unet.*`, as `save_lora` and diffusers write them) against the
    LoRA matrices the adapter now has; files in other key formats (kohya ...) are left to diffusers' conversion.
    """
    from safetensors import safe_open

    file_matrix = re.compile(_FILE_LORA_MATRIX.format(prefix=_lora_format(unet)[1]))
    with safe_open(str(lora_dir / LORA_WEIGHTS_NAME), "pt") as f:
        in_file = sum(1 for k in f.keys() if file_matrix.match(k))  # noqa: SIM118 (safe_open is no dict)
    loaded = sum(1 for n, _ in unet.named_parameters() if _UNET_LORA_MATRIX.search(n))
    # more is fine: Wan 2.1 I2V's loader adds zero LoRA matrices to the image cross-attention (add_k/v_proj)
    if in_file and loaded < in_file:
        raise UserError(
            f"--lora_dir {lora_dir} does not fit --pretrained_model (another architecture?): only "
            f"{loaded} of its {in_file} UNet LoRA matrices have a matching layer."
        )


def check_lora_dir(lora_dir: str | Path, flag: str = "--lora_dir") -> None:
    """Before loading a model: the LoRA file (or the full fine-tune's unet/) reads, else one line naming the file.
    The header and size are checked (safetensors stores no checksum of the tensors' bytes)."""
    from safetensors import SafetensorError, safe_open

    lora_dir = Path(lora_dir)
    if (lora_dir / FULL_UNET_DIR / "config.json").is_file():
        files = sorted((lora_dir / FULL_UNET_DIR).glob("*.safetensors"))
        try:
            json.loads((lora_dir / FULL_UNET_DIR / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(
                f"{flag} {lora_dir}: {lora_dir / FULL_UNET_DIR / 'config.json'} is not JSON ({e})."
            ) from None
    else:  # and Wan 2.2's low-noise expert's, where --wan_expert both wrote one
        files = [lora_dir / LORA_WEIGHTS_NAME, *lora_dir.glob(f"{EXPERT_2_DIR}/{LORA_WEIGHTS_NAME}")]
    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                keys = list(f.keys())
        except (OSError, SafetensorError) as e:
            problem = " ".join(str(e).split())[:200]
            raise UserError(
                f"{flag} {lora_dir}: {path} is not a readable safetensors file ({problem}); train again or point "
                f"{flag} at an intact copy (a checkpoint-N folder holds one too)."
            ) from None
        if not keys:
            raise UserError(f"{flag} {lora_dir}: {path} holds no tensors.")


def read_saved_config(lora_dir: str | Path) -> dict:
    path = Path(lora_dir) / CONFIG_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


@contextlib.contextmanager
def adapters_off(network):
    """The base model: the same network with its LoRA adapter switched off, under no grad (diffusers'
    `disable_adapters` / `enable_adapters`: `add_adapter` leaves no peft `PeftModel` whose `disable_adapter()` we
    could use). `enable_adapters` makes the LoRA weights trainable again on the way out."""
    with torch.no_grad():
        network.disable_adapters()
        try:
            yield network
        finally:
            network.enable_adapters()
