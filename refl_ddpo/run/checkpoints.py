"""checkpoint-N: what accelerate keeps (the LoRA or network, the optimizer) through hooks that write only the trained
weights, our own counters and generator states beside it, written under a temporary name and renamed; loading it
back; and the guard that no weights with NaN or inf are ever written or resumed."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.lora import FULL_UNET_DIR, load_lora_into_unet, save_lora
from refl_ddpo.run.zero import unwrap

TRAIN_STATE_JSON = "train_state.json"  # our own counters, JSON
TRAIN_STATE_TENSORS = "train_state.safetensors"  # our own generator states and tensors (no pickle)


def register_network_hooks(accelerator, network) -> None:
    """accelerate save/load_state keep only the LoRA (diffusers format) or the full network, not a pickled model."""

    def save_hook(models, weights, output_dir):
        for model in models:  # on every process (their weights are identical), before any file is written
            check_finite_weights(
                unwrap(accelerator, model),
                f"not saving {Path(output_dir).name.lstrip('.').removesuffix('.tmp')}",
            )
        if accelerator.is_main_process:
            for model in models:
                save_lora(unwrap(accelerator, model), output_dir)
        weights.clear()  # nothing else of the model is written by accelerate

    def load_hook(models, input_dir):
        while models:
            model = unwrap(accelerator, models.pop())
            if getattr(model, "peft_config", None):
                load_lora_into_unet(model, input_dir)
            else:
                loaded = type(model).from_pretrained(Path(input_dir) / FULL_UNET_DIR)
                model.load_state_dict(loaded.state_dict())
            check_finite_weights(
                model,
                f"not resuming from {input_dir}",
                "resume from an earlier checkpoint-N (--resume_from_checkpoint)",
            )

    del network  # the hooks act on the models accelerate hands them
    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def check_finite_weights(
    model,
    what: str,
    fix: str = "the newest checkpoint-N in --output_dir is the last good state: resume from it with a lower "
    "--learning_rate",
) -> None:
    """A UserError if a trained tensor holds NaN or inf, so that no checkpoint or final LoRA is ever written (nor a
    run resumed) with one. Every process checks (their weights are identical), so every process stops."""
    from torch.distributed.tensor import DTensor

    from refl_ddpo.core.sharding import any_process, local

    bad = [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and not bool(torch.isfinite(local(p)).all())
    ]
    # sharded (FSDP): each process sees its own shards, so they agree on the verdict (every process calls this)
    shards = [p for p in model.parameters() if isinstance(p, DTensor)]
    if shards and any_process(bool(bad), local(shards[0]).device) and not bad:
        bad = ["a shard held by another process"]
    if bad:
        raise UserError(f"{what}: {len(bad)} trained tensor(s) hold NaN or inf (e.g. {bad[0]}); {fix}.")


def save_checkpoint(
    accelerator,
    output_dir: str,
    step: int,
    counters: dict,
    tensors: dict[str, torch.Tensor],
    info,
    *,
    settings: dict,
    total_limit: int | None = None,
    shards: bool = False,
) -> Path:
    """output_dir/checkpoint-N: accelerate state (LoRA, optimizer, lr scheduler) + our counters and generators, and
    checkpoint.json last (refl_ddpo.run.runs: the run, the `settings` a resume must match (resume_fit.settings), every
    file's size). Under DeepSpeed (--deepspeed_zero), the network and optimizer as refl_ddpo.run.zero writes them. Under
    FSDP, `shards` (--fsdp_checkpoint sharded): the network and optimizer as each process' shards
    (DCP) instead of gathered.

    The folder is written under a temporary name and renamed, so a run killed mid-save leaves no half checkpoint.
    With a `total_limit` (--checkpoints_total_limit) the oldest checkpoints of this run only are then deleted.
    """
    from refl_ddpo.core.sharding import is_sharded
    from refl_ddpo.run.runs import rotate_checkpoints, write_marker
    from refl_ddpo.run.zero import is_zero, trained_network
    from refl_ddpo.run.zero import save_state as save_zero_state

    final = Path(output_dir) / f"checkpoint-{step}"
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    sharded, zero = is_sharded(accelerator), is_zero(accelerator)
    try:
        if sharded:
            _save_sharded_network(accelerator, tmp, shards)
        if zero:  # ours as safetensors, not DeepSpeed's pickles
            check_finite_weights(trained_network(accelerator), f"not saving checkpoint-{step}")
            save_zero_state(accelerator, tmp)
        with _without_network(accelerator, sharded or zero):
            accelerator.save_state(str(tmp))
    except UserError:  # non-finite weights (the save hook): leave no temporary folder behind
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()  # every process' random states are in tmp before it is listed and renamed
    if accelerator.is_main_process:
        from safetensors.torch import save_file

        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / TRAIN_STATE_TENSORS)
        )
        (tmp / TRAIN_STATE_JSON).write_text(json.dumps(counters, indent=2) + "\n")
        write_marker(tmp, settings, step, accelerator.num_processes, info)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        if total_limit:
            rotate_checkpoints(output_dir, info.run_id, total_limit)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore accelerate state from `path` (checked by refl_ddpo.run.runs.start_run); return our (counters, tensors).
    A file that still fails to load is one line naming the checkpoint."""
    import pickle

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from refl_ddpo.core.sharding import is_sharded
    from refl_ddpo.run.zero import is_zero, trained_network
    from refl_ddpo.run.zero import load_state as load_zero_state

    sharded, zero = is_sharded(accelerator), is_zero(accelerator)
    try:
        with _without_network(accelerator, sharded or zero):
            accelerator.load_state(str(path))
        if sharded:
            _load_sharded_network(accelerator, path)
        if zero:
            load_zero_state(accelerator, path)
            check_finite_weights(
                trained_network(accelerator),
                f"not resuming from {path}",
                "resume from an earlier checkpoint-N (--resume_from_checkpoint)",
            )
        counters = json.loads((path / TRAIN_STATE_JSON).read_text())
        tensors = load_file(str(path / TRAIN_STATE_TENSORS)) if (path / TRAIN_STATE_TENSORS).is_file() else {}
    except (
        OSError,
        EOFError,
        ValueError,
        RuntimeError,
        KeyError,
        pickle.UnpicklingError,
        CheckpointException,
    ) as e:
        first = " ".join(str(e).split())[:200] or type(e).__name__
        raise UserError(
            f"--resume_from_checkpoint {path} could not be loaded ({type(e).__name__}: {first}); resume another "
            "checkpoint-N."
        ) from None
    return counters, tensors


# ---- under FSDP (--fsdp): the network and its optimizer gathered (or as shards), written and read back by us ----


@contextmanager
def _without_network(accelerator, hide: bool):
    """accelerate's save_state / load_state without the prepared network and optimizer (`hide`): under FSDP they
    would be written as a pickled state dict; `_save_sharded_network` writes them gathered as safetensors instead,
    and accelerate keeps the rest (lr scheduler, random states, the grad scaler)."""
    if not hide:
        yield
        return
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def _sharded_parts(accelerator):
    if len(accelerator._models) != 1 or len(accelerator._optimizers) != 1:
        raise RuntimeError(
            f"--fsdp checkpoints hold one network and its optimizer; accelerate prepared "
            f"{len(accelerator._models)} model(s) and {len(accelerator._optimizers)} optimizer(s)"
        )
    return accelerator._models[0], accelerator._optimizers[0]


def _save_sharded_network(accelerator, folder: Path, shards: bool) -> None:
    """The trained weights gathered from their shards (LoRA in diffusers format, or the full network's folder) and
    the optimizer's state (safetensors + JSON) in `folder`; every process takes part, the main one writes. With
    `shards`: every process writes its own shards of both (sharding.save_shards), nothing gathered."""
    from refl_ddpo.core.sharding import gathered_state, save_optimizer, save_shards

    network, optimizer = _sharded_parts(accelerator)
    check_finite_weights(network, f"not saving {folder.name.lstrip('.').removesuffix('.tmp')}")
    if shards:
        save_shards(network, optimizer, folder)
    else:
        state = gathered_state(network, trainable_only=bool(getattr(network, "peft_config", None)))
        if accelerator.is_main_process:
            folder.mkdir(parents=True, exist_ok=True)
            save_lora(network, folder, state=state)
        save_optimizer(network, optimizer, folder, accelerator.is_main_process)
    accelerator.wait_for_everyone()


def _load_sharded_network(accelerator, folder: Path) -> None:
    """_save_sharded_network's files back into every process' shards: the form the checkpoint holds (DCP shards or
    gathered files), whatever this run's --fsdp_checkpoint."""
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    from refl_ddpo.core.lora import read_lora_state
    from refl_ddpo.core.sharding import (
        SHARDS_DIR,
        load_full_state,
        load_optimizer,
        load_shards,
        peft_keys_to_model,
    )

    network, optimizer = _sharded_parts(accelerator)
    if (folder / SHARDS_DIR).is_dir():  # written with --fsdp_checkpoint sharded
        load_shards(network, optimizer, folder)
    else:
        if getattr(network, "peft_config", None):
            state = peft_keys_to_model(read_lora_state(network, folder))
        else:
            state = load_file(str(folder / FULL_UNET_DIR / SAFETENSORS_WEIGHTS_NAME))
        load_full_state(network, state)
        load_optimizer(network, optimizer, folder)
    check_finite_weights(
        network,
        f"not resuming from {folder}",
        "resume from an earlier checkpoint-N (--resume_from_checkpoint)",
    )
