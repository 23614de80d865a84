"""What every trainer shares around its loop: the main/preflight shape, the accelerator, the trainable model family,
the optimizer, seeded random streams, checkpoints, weight digests, trackers and logging."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.images import caption_grid
from refl_ddpo.core.lora import add_lora, trainable_full_unet
from refl_ddpo.run.checkpoints import register_network_hooks
from refl_ddpo.run.config import CommonConfig
from refl_ddpo.run.launch import PREFLIGHT_ENV
from refl_ddpo.run.outputs import log_grid

# ---- the main / preflight shape ----


def run_or_preflight(train_fn, cfg, preflight_fn) -> None:
    """Run `train_fn(cfg)`; with REFL_DDPO_PREFLIGHT set (launch.sh, before starting several processes) run only
    `preflight_fn(cfg)`, the checks that need no model. A user error in a worker of launch.sh goes to the launcher,
    which prints the first one (refl_ddpo.run.launch); under another launcher only rank 0 says it. One of several
    processes that trained leaves by `launch.end_worker`."""
    import sys

    from refl_ddpo.run.launch import die_with_launcher, end_worker, report_user_error

    die_with_launcher()  # a worker of launch.sh stops when its launcher dies, even by kill -9
    try:
        if os.environ.get(PREFLIGHT_ENV):
            preflight_fn(cfg)
            return
        train_fn(cfg)
    except UserError as e:
        from refl_ddpo.run.runs import release_run

        release_run(getattr(cfg, "output_dir", None))
        if report_user_error(str(e), e.exit_code):  # launch.sh prints the first process' error, once
            sys.exit(e.exit_code)
        if int(os.environ.get("RANK", "0")) > 0:
            sys.exit(e.exit_code)
        raise
    end_worker()  # one of several processes, done: leave without the interpreter's teardown


# ---- seeded random streams and weight digests ----


def stream_seed(seed: int, *stream: int) -> int:
    """A 32-bit seed for (seed, stream...), e.g. (seed, epoch, process, purpose), independent of the others."""
    import numpy as np

    return int(np.random.SeedSequence([seed, *stream]).generate_state(1)[0])


def seeded_generator(seed: int, *stream: int) -> torch.Generator:
    """A CPU generator for (seed, stream...), independent of the other streams."""
    import numpy as np

    state = np.random.SeedSequence([seed, *stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def weights_digest(params: list[torch.nn.Parameter]) -> str:
    """SHA-256 over the bytes of the trainable tensors, in order (equal digests = bit-identical weights)."""
    import hashlib

    from refl_ddpo.core.sharding import full

    h = hashlib.sha256()
    for p in params:  # sharded (FSDP): the whole tensor, gathered (every process calls this)
        h.update(full(p.detach()).to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def check_identical_weights(accelerator, params: list[torch.nn.Parameter]) -> None:
    """Ranks must hold the same weights (DDP averages the gradients): compare digests, a cheap exact check. Sharded
    (FSDP) there is one copy of each tensor, split over the processes: nothing to compare."""
    from accelerate.utils import gather_object

    from refl_ddpo.core.sharding import is_sharded

    if is_sharded(accelerator):
        accelerator.print(f"weights sharded over {accelerator.num_processes} process(es) (FSDP2): one copy")
        return

    digests = gather_object([weights_digest(params)])
    if len(set(digests)) != 1:
        raise RuntimeError(f"processes diverged: weight digests {digests}")
    accelerator.print(f"weights identical on all {len(digests)} process(es) (sha256 {digests[0][:16]})")


# ---- accelerator and model ----


def make_accelerator(
    gradient_accumulation_steps: int,
    *,
    mixed_precision: str,
    report_to: str,
    output_dir: str,
    logging_dir: str,
    device: str | None = None,
    allow_tf32: bool = False,
    fsdp: bool = False,
    fsdp_cpu_offload: bool = False,
    deepspeed: dict | None = None,
    find_unused_parameters: bool = False,
):
    """The run's Accelerator: `mixed_precision` ("no", "fp16", "bf16"), the trackers of `report_to` (a --report_to
    choice) logging under output_dir/logging_dir, on `device` ("cpu", "cuda"; None: accelerate's choice), TF32
    matmuls on CUDA if `allow_tf32`; `fsdp`: the network that `prepare` gets is sharded with FSDP2
    (refl_ddpo.core.sharding), its shards on the CPU between uses with `fsdp_cpu_offload`; `deepspeed`: a DeepSpeed config
    (refl_ddpo.run.zero.deepspeed_config) for accelerate's DeepSpeed plugin, the network run in DeepSpeed's engine;
    `find_unused_parameters`: DDP finds the trained tensors a backward did not reach (Wan 2.2's pair of experts:
    each step runs one), which then keep no gradient, as on one process."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import ProjectConfiguration

    from refl_ddpo.run.config import TRACKERS
    from refl_ddpo.run.threads import set_cpu_threads

    set_cpu_threads()  # unless OMP_NUM_THREADS says otherwise (refl_ddpo.run.threads)
    log_with = TRACKERS[report_to] or None
    plugin = None
    if fsdp:
        from refl_ddpo.core.sharding import fsdp_plugin

        plugin = fsdp_plugin(mixed_precision, fsdp_cpu_offload)
    # accelerate keeps its settings per process: a run started in a process that made an Accelerator before (a second
    # run in a notebook, the test suite) must not inherit that one's mixed precision (the processes' group is kept)
    from refl_ddpo.core.sharding import release_fsdp_state

    release_fsdp_state()  # an earlier --fsdp run in this process
    AcceleratorState._reset_state()
    handlers, ds_plugin = [], None
    if find_unused_parameters:
        from accelerate.utils import DistributedDataParallelKwargs

        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    if deepspeed is not None:
        from accelerate.utils import InitProcessGroupKwargs

        if (
            int(os.environ.get("WORLD_SIZE", "1")) < 2
        ):  # the launcher's; accelerate would fail without a group
            raise UserError(
                "--deepspeed_zero partitions the optimizer state over several processes but this run has 1: launch "
                "2 or more (NUM_PROCESSES=2 in train_scripts/, or GPUS=0,1), or drop --deepspeed_zero."
            )

        from refl_ddpo.run.zero import deepspeed_plugin, without_cpu_comm_op

        ds_plugin = deepspeed_plugin(deepspeed)
        # on the CPU: gloo, else DeepSpeed counts each process as alone
        if device == "cpu" or not torch.cuda.is_available():
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
            without_cpu_comm_op()
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
        log_with=log_with,
        project_config=ProjectConfiguration(
            project_dir=output_dir, logging_dir=os.path.join(output_dir, logging_dir)
        ),
        cpu=device == "cpu" and deepspeed is None,  # accelerate leaves DeepSpeed out with cpu=True
        fsdp_plugin=plugin,
        deepspeed_plugin=ds_plugin,
        kwargs_handlers=handlers,
    )
    if plugin is not None:
        from refl_ddpo.core.sharding import hold_fsdp_state

        if accelerator.num_processes < 2:
            raise UserError(
                "--fsdp shards the network over several processes but this run has 1: launch 2 or more "
                "(NUM_PROCESSES=2 in train_scripts/, or GPUS=0,1), or drop --fsdp."
            )

        hold_fsdp_state(accelerator, plugin)
    if device is not None and accelerator.device.type != device:  # honoured, or said so
        raise UserError(
            f"--device {device}: accelerate placed this process on {accelerator.device} (your accelerate "
            "config?); run `accelerate config` again or leave --device out."
        )
    if allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return accelerator


def weight_dtype(accelerator) -> torch.dtype:
    """Dtype of the frozen weights: the mixed-precision dtype (fp32 without it)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


@dataclass(frozen=True)
class TrainableSpec:
    """Which weights train: LoRA adapters (`use_lora`, of `rank`, `alpha` and `init` on `target_modules`; None:
    the family's default targets) or the whole network; and gradient checkpointing."""

    use_lora: bool
    rank: int
    alpha: float  # resolved (scale alpha / rank)
    target_modules: tuple[str, ...] | None
    init: str
    gradient_checkpointing: bool


def make_trainable(
    network, spec: TrainableSpec, targets: list[str] | None = None
) -> list[torch.nn.Parameter]:
    """LoRA adapters on `targets` (default: spec.target_modules), or the whole network, trainable in fp32;
    gradient checkpointing if asked."""
    if spec.use_lora:
        targets = targets or list(spec.target_modules or ())
        params = add_lora(network, spec.rank, spec.alpha, targets, spec.init)
    else:
        params = trainable_full_unet(network)
    if spec.gradient_checkpointing:
        network.enable_gradient_checkpointing()
    return params


def load_trainable_family(
    accelerator,
    pretrained_model: str,
    trainable: TrainableSpec,
    *,
    drop_t5: bool = False,
    offload_text_encoders: bool = False,
    shard_text_encoders: bool = False,
    expert: str | None = None,
    pair_experts: bool = True,
):
    """(family, trainable params, weight dtype): the model `pretrained_model` in the mixed-precision dtype on the
    accelerator's device, `trainable`'s weights trainable (LoRA on the family's default targets where the spec leaves
    them unset), and accelerate's save/load hooks registered for the network.

    Sharded (--fsdp), the network stays on the CPU through loading, LoRA and the fp32 upcast of a full fine-tune:
    `accelerator.prepare` (FSDP2's fully_shard, block by block) moves it to the device and keeps only this process'
    shard there, so no GPU ever holds the whole network; the frozen parts go to the device as without sharding.
    `offload_text_encoders` (--offload_text_encoders): the text encoders stay on the CPU and visit the device only
    while they encode (`ModelFamily.text_encoders_on_device`). `shard_text_encoders` (--fsdp_shard_text_encoders):
    they come from the host sharded per block like the network (`refl_ddpo.core.sharding.shard_frozen`), 1/N on each
    device. `expert`, `pair_experts`: the Wan expert(s) trained, and whether as the pair (`Wan.train_expert`)."""
    from refl_ddpo.core.families import load_family
    from refl_ddpo.core.sharding import is_sharded

    dtype = weight_dtype(accelerator)
    family = load_family(
        pretrained_model,
        dtype,
        accelerator.device,
        drop_t5=drop_t5,
        network_on_host=is_sharded(accelerator),
        offload_text_encoders=offload_text_encoders,
        shard_text_encoders=shard_text_encoders,
        expert=expert,
        pair_experts=pair_experts,
    )
    targets = list(trainable.target_modules or family.lora_target_modules)
    params = make_trainable(family.network, trainable, targets)
    register_network_hooks(accelerator, family.network)
    return family, params, dtype


def resolve_resolution(cfg: CommonConfig, family, info=None) -> CommonConfig:
    """The config with an unset --resolution resolved to the model's native one (a copy), checked against the VAE
    and, when resuming (`info`, start_run's RunInfo), against the resolution the checkpoint was trained at."""
    import dataclasses

    from refl_ddpo.run.resume_fit import check_resumed_resolution

    if cfg.resolution is None:
        cfg = dataclasses.replace(cfg, resolution=family.native_resolution)
    if hasattr(family, "num_frames"):  # a video model: its frame count, resolved alike
        family.num_frames = cfg.num_frames or family.num_frames
        cfg = dataclasses.replace(cfg, num_frames=family.num_frames)
    if hasattr(
        family, "video_resolution"
    ):  # image-to-video: the first frames are resized to the videos' size
        family.video_resolution = cfg.resolution
    if cfg.resolution % family.vae_scale_factor:
        raise UserError(
            f"--resolution {cfg.resolution} must be a multiple of the VAE scale factor "
            f"{family.vae_scale_factor}."
        )
    check_resumed_resolution(cfg, info)
    return cfg


LOG_RUN_PREFIX = "run-"  # output_dir/logging_dir/run-N/: one log run per start of a trainer into the folder


def next_log_run(logs: Path) -> str:
    """'run-N' with N one past the highest run-N already in `logs` ('run-1' in a new folder)."""
    taken = [
        int(p.name[len(LOG_RUN_PREFIX) :])
        for p in (logs.iterdir() if logs.is_dir() else [])
        if p.name.startswith(LOG_RUN_PREFIX) and p.name[len(LOG_RUN_PREFIX) :].isdigit()
    ]
    return f"{LOG_RUN_PREFIX}{max(taken, default=0) + 1}"


def start_trackers(
    accelerator, project: str, config: dict, *, report_to: str, output_dir: str, logging_dir: str
) -> str | None:
    """Start the trackers of `report_to` (a --report_to choice) with `config` (the resolved config, `to_dict`) as
    hyperparameters (scalars and strings only); returns the log run's name.

    Each start is a new log run, `output_dir/logging_dir/run-N/` (TensorBoard writes `run-N/<project>/`; wandb keeps
    its run files in `output_dir/logging_dir/wandb/` and names the run `<project>-run-N`), so a resumed or repeated
    run into the same folder never draws over the curves of the one before."""
    from refl_ddpo.run.config import TRACKERS

    if report_to == "none":
        return None
    hparams = {  # to_dict leaves secrets (--hub_token) out
        k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()
    }
    logs = Path(output_dir) / logging_dir
    run = next_log_run(logs) if accelerator.is_main_process else None
    init_kwargs = {}
    if run is not None:
        accelerator.project_configuration.logging_dir = str(logs / run)
        if "wandb" in TRACKERS[report_to]:
            logs.mkdir(parents=True, exist_ok=True)
            init_kwargs["wandb"] = {
                "dir": str(logs),
                "name": f"{project}-{run}",
            }  # its run files beside tensorboard's
    accelerator.init_trackers(project, config=hparams, init_kwargs=init_kwargs)
    return run


def make_optimizer(
    params: list[torch.nn.Parameter],
    *,
    learning_rate: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
    use_8bit_adam: bool = False,
) -> torch.optim.Optimizer:
    """AdamW on `params` (bitsandbytes' 8-bit AdamW with `use_8bit_adam`); torch's fused kernel when every
    parameter is a plain CUDA tensor (one launch per step instead of one per op and tensor group; the CPU's and
    sharded parameters' updates are the multi-tensor ones, as before)."""
    if use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise UserError(
                "--use_8bit_adam needs bitsandbytes: pip install bitsandbytes (or drop the flag)."
            ) from None
        cls = bnb.optim.AdamW8bit
    else:
        cls = torch.optim.AdamW
    kwargs = {"lr": learning_rate, "betas": betas, "weight_decay": weight_decay, "eps": eps}
    if not use_8bit_adam and params and all(type(p) is torch.nn.Parameter and p.is_cuda for p in params):
        kwargs["fused"] = True
    return cls(params, **kwargs)


def nonfinite_step_error(output_dir: str, what: str, fix: str) -> UserError:
    """The error that stops a run at a non-finite reward, loss or gradient, before the update and before any save:
    what happened, that the newest checkpoint in `output_dir` stays the last good state, and what to change."""
    from refl_ddpo.run.runs import list_checkpoints

    found = list_checkpoints(output_dir)
    newest = f"{found[-1]} stays the newest checkpoint" if found else "no checkpoint was written"
    return UserError(f"{what}; stopped before the update, nothing of it was saved ({newest}): {fix}.")


# ---- logging ----


def log_image_grid(accelerator, tag: str, images: torch.Tensor, captions: list[str], step: int) -> None:
    """A captioned grid of images (B, 3, H, W) in [0, 1] to every tracker (main process only)."""
    if not accelerator.is_main_process or accelerator.trackers == []:
        return
    images = images[:, 0] if images.ndim == 5 else images  # videos (B, T, 3, H, W): their first frames
    log_grid(accelerator, tag, caption_grid(images, captions), step)


def print_config(cfg: CommonConfig, extra: dict | None = None) -> None:
    print(f"{type(cfg).__name__}:\n{cfg.pretty()}", flush=True)
    for k, v in (extra or {}).items():
        print(f"  {k}: {v}", flush=True)
