"""DeepSpeed ZeRO stage 2 through accelerate (--deepspeed_zero 2): the optimizer state and the gradients partitioned
over the processes, the weights whole on every process.

accelerate's `DeepSpeedPlugin` gets a DeepSpeed config built from the run's flags (`deepspeed_config`): the micro
batch (--train_batch_size), the accumulation, `gradient_clipping` = --max_grad_norm (0: none) and bf16 / fp16 from
--mixed_precision (DeepSpeed then casts the whole network, LoRA included, to that dtype and keeps fp32 master weights
in its optimizer). `prepare` wraps the network in DeepSpeed's engine; the loops keep their shape:

- `accelerator.backward(loss)` runs the engine's backward and, on the last micro-batch of an optimizer step, its
  step: the reduce-scatter of the gradients, the clipping and the update of each process' partition, then the
  all-gather of the weights. `optimizer.step()` / `zero_grad()` are then no-ops, and `accelerator.clip_grad_norm_`
  clips nothing: it returns the engine's gradient norm of that step (before clipping).
- A non-finite gradient: ZeRO-2 checks the all-reduced norm before it updates (fp32 and bf16 alike, fp16 through its
  loss scaler) and skips the update; the norm is then inf, and the loops' guard stops the run as without the engine
  (the weights are those before the step, nothing is saved).
- The network called outside the engine (the samplers, validation) and the LoRA switched off (KL) work as without it:
  the weights are whole.

Checkpoints are ours, not DeepSpeed's pickles (`save_state`, `load_state`): the trained weights from the fp32 master
copy (LoRA in diffusers format, or the full network's folder), the optimizer state gathered per parameter with
DeepSpeed's tensor-fragment API (`deepspeed.utils.safe_get_full_optimizer_state`) as safetensors, its param_groups and
the engine's counters as JSON; every process reads them back into its partition, so a resume is bit-exact. The final
weights are the network's own (as without the engine).

Not supported: ZeRO-3 (--deepspeed_zero 3 is refused): it empties every parameter outside a forward, and the loops
read the weights directly (NFT / AWM's old-policy copy, ReFL's --use_ema, the weight digests, the LoRA save). --fsdp
shards the network instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer_zero.safetensors"  # the gathered optimizer state (tensors)
OPTIMIZER_GROUPS = "optimizer_zero.json"  # its param_groups, state keys and the engine's counters
_ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def deepspeed_config(
    stage: int, *, micro_batch: int, accumulation: int, max_grad_norm: float, mixed_precision: str
) -> dict:
    """The DeepSpeed config of a run: ZeRO `stage`, `micro_batch` images per process and backward pass,
    `accumulation` backward passes per optimizer step, clipping at `max_grad_norm` (0: none), bf16 / fp16 weights
    per `mixed_precision` ("no", "fp16", "bf16"). DeepSpeed derives train_batch_size from the process count."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": mixed_precision == "fp16"},
        "bf16": {"enabled": mixed_precision == "bf16"},
        "zero_allow_untested_optimizer": True,  # torch's AdamW (and bitsandbytes')
        "steps_per_print": 2**31 - 1,  # the trainers log
    }


def deepspeed_plugin(config: dict):
    """accelerate's DeepSpeedPlugin for `config` (deepspeed_config)."""
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=config)


def without_cpu_comm_op() -> None:
    """On the CPU (processes over gloo, as in the tests): keep DeepSpeed from building its shared-memory collectives at
    start-up, a g++ compile of minutes on 2 cores at the first start on a machine (then cached in
    ~/.cache/torch_extensions) and a probe of every op's compiler at each start; gloo carries our tensors. DeepSpeed
    reads its table of compatible ops only there (`deepspeed.comm.torch.build_shm_op`), so a table that lists the op
    as unavailable leaves it out. Not used with GPUs."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def is_zero(accelerator) -> bool:
    """Whether the network runs in DeepSpeed's engine (--deepspeed_zero)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def unwrap(accelerator, network: torch.nn.Module) -> torch.nn.Module:
    """The network inside accelerate's wrapper: DeepSpeed's engine under --deepspeed_zero, else DDP's (FSDP2 wraps
    nothing). accelerate's unwrap_model imports DeepSpeed whenever it is installed, 1.4 s and a log line in every
    process of a run that does not use it; only a ZeRO run asks it here."""
    if is_zero(accelerator):
        return accelerator.unwrap_model(network)
    return network.module if isinstance(network, torch.nn.parallel.DistributedDataParallel) else network


def _engine(accelerator):
    if len(accelerator._models) != 1:
        raise RuntimeError(
            f"--deepspeed_zero checkpoints hold one network; accelerate prepared {len(accelerator._models)}"
        )
    return accelerator._models[0]


def trained_network(accelerator):
    """The network inside DeepSpeed's engine (the one accelerate prepared)."""
    return accelerator.unwrap_model(_engine(accelerator))


def _trained(module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _flat_states(engine) -> list[tuple[dict, torch.Tensor, dict]]:
    """(param group, this process' fp32 partition, its optimizer state) of the torch optimizer inside ZeRO's."""
    inner = engine.optimizer.optimizer
    return [(g, flat, inner.state[flat]) for g in inner.param_groups for flat in g["params"]]


# ---- checkpoint-N ----


def save_state(accelerator, folder: Path) -> None:
    """The trained weights (fp32 masters) and the optimizer state, gathered, into `folder`; every process takes part
    (DeepSpeed's gathers are all-reduces), the main one writes. The caller checks that the weights are finite."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    from refl_ddpo.core.lora import save_lora

    engine = _engine(accelerator)
    module = accelerator.unwrap_model(engine)
    trained = _trained(module)
    weights = {n: safe_get_full_fp32_param(p).cpu() for n, p in trained}
    groups = _flat_states(engine)
    keys = sorted(k for k, v in groups[0][2].items() if torch.is_tensor(v) and v.shape == groups[0][1].shape)
    tensors = {f"{n}/{k}": safe_get_full_optimizer_state(p, k).cpu() for n, p in trained for k in keys}
    for i, (_, _, state) in enumerate(groups):  # the others (AdamW's step): alike on every process
        tensors |= {
            f"group{i}/{k}": v.cpu() for k, v in state.items() if torch.is_tensor(v) and k not in keys
        }
    if not accelerator.is_main_process:
        return
    folder.mkdir(parents=True, exist_ok=True)
    save_lora(module, folder, state={**module.state_dict(), **weights})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / OPTIMIZER_FILE))
    saved = {
        "state_keys": keys,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g, _, _ in groups],
        "engine": {k: getattr(engine, k) for k in _ENGINE_COUNTERS},
        "loss_scaler": {
            k: v for k, v in vars(engine.optimizer.loss_scaler).items() if isinstance(v, (int, float, bool))
        },
    }
    (folder / OPTIMIZER_GROUPS).write_text(json.dumps(saved, indent=1) + "\n")


def load_state(accelerator, folder: Path) -> None:
    """save_state's files back into the network, DeepSpeed's master weights and every process' optimizer
    partition."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import load_file

    from refl_ddpo.core.lora import FULL_UNET_DIR, read_lora_state
    from refl_ddpo.core.sharding import peft_keys_to_model

    engine = _engine(accelerator)
    module = accelerator.unwrap_model(engine)
    if getattr(module, "peft_config", None):
        weights = peft_keys_to_model(read_lora_state(module, folder))
    else:
        weights = load_file(str(folder / FULL_UNET_DIR / SAFETENSORS_WEIGHTS_NAME))
    tensors = load_file(str(folder / OPTIMIZER_FILE))
    saved = json.loads((folder / OPTIMIZER_GROUPS).read_text())
    trained = _trained(module)
    missing = [n for n, _ in trained if n not in weights]
    if missing:
        raise KeyError(f"{len(missing)} trained tensor(s) missing, e.g. {missing[0]}")
    with torch.no_grad():
        for n, p in trained:
            p.copy_(weights[n])  # the network's copy (in its dtype), then the fp32 master
            safe_set_full_fp32_param(p, weights[n].to(p.device, torch.float32))
    # the optimizer state exists from the first step on: make it (zeros) and link DeepSpeed's per-parameter views
    groups = _flat_states(engine)
    for i, (group, flat, state) in enumerate(groups):
        group.update(saved["param_groups"][i])
        state.update({k: torch.zeros_like(flat) for k in saved["state_keys"]})
        prefix = f"group{i}/"
        state.update({k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)})
    zero = engine.optimizer
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    for n, p in trained:
        for k in saved["state_keys"]:
            safe_set_full_optimizer_state(p, tensors[f"{n}/{k}"].to(p.device), k)
    for k, v in saved["engine"].items():
        setattr(engine, k, v)
    for k, v in saved["loss_scaler"].items():
        setattr(zero.loss_scaler, k, v)


def zero_config(cfg, accumulation: int) -> dict | None:
    """The DeepSpeed config of --deepspeed_zero for a run's config `cfg` with `accumulation` micro-batches per
    optimizer step (`deepspeed_config`), or None without it."""
    if cfg.deepspeed_zero is None:
        return None
    return deepspeed_config(
        cfg.deepspeed_zero,
        micro_batch=cfg.train_batch_size,
        accumulation=accumulation,
        max_grad_norm=cfg.max_grad_norm,
        mixed_precision=cfg.mixed_precision,
    )
