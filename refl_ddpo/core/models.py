"""Loading a diffusers pipeline from a local folder or a hub id, with one-line errors when it is not there."""

from __future__ import annotations

import json
import os
from pathlib import Path

from refl_ddpo.core.errors import UserError, read_utf8

DTYPES = {
    "no": "float32",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}

WHERE_WEIGHTS_GO = "put the diffusers folder there or pass a hub id (see checkpoint/README.md)"
OFFLINE_HINT = "without network access, download it into checkpoint/ first (see checkpoint/README.md)"


def torch_dtype(name: str):
    import torch

    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise UserError(f"unknown dtype '{name}'; use one of no, fp16, bf16.") from None


def looks_local(name: str) -> bool:
    """A path (exists, absolute, relative with ./, more than one '/', or 'folder/name' where folder exists here, as
    checkpoint/ does in the repo) rather than a hub id 'org/name'."""
    return (
        os.path.exists(name)
        or "/" in name
        and os.path.isdir(name.split("/")[0])
        or os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or os.sep != "/"
        and os.sep in name
    )


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub (HF_ENDPOINT, default huggingface.co) cannot be reached now, or None when a connection opens."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e.strerror or e}"
    return None


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "model_index.json"), str)
    except ValueError:  # not a valid repo id: the loader says so
        return False


def check_pretrained_model(name: str) -> None:
    """Fail early, before anything heavy is imported or loaded, if a local model folder is missing, or if a hub id
    is neither in the local cache nor reachable (one line at once, not the hub client's retries)."""
    if not looks_local(name):
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        reason = None if offline or _in_hub_cache(name) else hub_unreachable()
        if reason is not None:
            raise UserError(
                f"--pretrained_model {name} is a hub id, but the hub cannot be reached ({reason}) and the model "
                f"is not in the local cache; {OFFLINE_HINT}."
            )
        return
    if looks_local(name):
        path = Path(name).expanduser()
        if not (path / "model_index.json").is_file():
            what = "has no model_index.json" if path.is_dir() else "does not exist"
            raise UserError(f"--pretrained_model {name} {what}: {WHERE_WEIGHTS_GO}.")
        missing = [part for part in _components(path) if not (path / part).is_dir()]
        if missing:
            raise UserError(
                f"--pretrained_model {name} lacks {', '.join(p + '/' for p in missing)} (model_index.json lists "
                f"{'it' if len(missing) == 1 else 'them'}): copy the whole diffusers folder there."
            )


# Loaded without their folder (load_pipeline passes None for them).
OPTIONAL_COMPONENTS = ("safety_checker", "feature_extractor", "image_encoder")


def _components(path: Path) -> list[str]:
    """The sub-folders model_index.json names (entries [library, class]; [null, null] and optional ones skipped)."""
    try:
        index = json.loads(read_utf8(path / "model_index.json", str(path / "model_index.json")))
    except json.JSONDecodeError as e:
        raise UserError(f"{path / 'model_index.json'} is not valid JSON ({e}).") from None
    if not isinstance(index, dict):
        raise UserError(f"{path / 'model_index.json'} must hold a JSON object.")
    return [
        key
        for key, value in index.items()
        if not key.startswith("_")
        and key not in OPTIONAL_COMPONENTS
        and isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, str) for v in value)
    ]


def _load_error(name: str, e: Exception) -> UserError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = WHERE_WEIGHTS_GO if looks_local(name) else OFFLINE_HINT
    return UserError(f"--pretrained_model {name} could not be loaded ({first}); {hint}.")


def model_index(name: str) -> dict:
    """model_index.json of a local folder or hub id."""
    check_pretrained_model(name)
    if looks_local(name):
        return json.loads((Path(name).expanduser() / "model_index.json").read_text())
    from diffusers import DiffusionPipeline

    try:
        return dict(DiffusionPipeline.load_config(name))
    except (OSError, ValueError) as e:  # hub id unreachable / unknown
        raise _load_error(name, e) from None


def pipeline_class_name(name: str) -> str:
    """model_index.json's `_class_name` of a local folder or hub id (which selects the model family)."""
    return str(model_index(name).get("_class_name", ""))


def _components_off(name: str, cls_name: str, drop_t5: bool) -> dict:
    """Components to load as None: SD's safety checker; SD3's T5 when dropped or absent from the folder (diffusers
    needs them named, and then pads the text tokens with zeros in their place); SDXL's invisible watermark (the kit
    decodes with its own loop, never through the pipeline's watermarking postprocess)."""
    if cls_name == "StableDiffusionPipeline":
        return {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    if cls_name == "StableDiffusionXLPipeline":
        return {"add_watermarker": False}
    if cls_name == "StableDiffusion3Pipeline" and (
        drop_t5 or model_index(name).get("text_encoder_3", [None])[0] is None
    ):
        return {"text_encoder_3": None, "tokenizer_3": None}
    return {}


def load_pipeline(
    name: str,
    dtype=None,
    device="cpu",
    pipeline_class: str | None = None,
    drop_t5: bool = False,
    on_host: tuple[str, ...] = (),
):
    """The pipeline of `name` (its model_index.json class unless given), no safety checker, every module frozen and
    in eval mode, in `dtype` (float32 by default) on `device`. `drop_t5`: an SD3 folder loads without its T5 text
    encoder (much less memory; a folder without one loads so anyway); SD 1.x / SDXL have none to drop, and FLUX.1
    needs its T5 (families.load_family refuses drop_t5 for it before loading). `on_host`: components (pipeline
    attribute names) left on the CPU, where from_pretrained loads them; the others go to `device`."""
    import diffusers
    import torch

    from refl_ddpo.core.progress import quiet_library_bars

    quiet_library_bars()
    cls = getattr(diffusers, pipeline_class or pipeline_class_name(name))
    extra = _components_off(name, cls.__name__, drop_t5)
    try:
        pipe = cls.from_pretrained(os.path.expanduser(name), dtype=dtype or torch.float32, **extra)
    except (OSError, ValueError) as e:  # hub id unreachable / unknown, or a broken folder
        raise _load_error(name, e) from None
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
            module.eval()
    if not on_host:
        return pipe.to(device)
    for part, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and part not in on_host:
            module.to(device)
    return pipe
