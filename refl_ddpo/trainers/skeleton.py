"""The run every trainer shares: an algorithm supplies its parts, `run_training` calls them at fixed points.

    checks before any model loads    Algorithm.preflight (the shared checks, the algorithm's, claiming output_dir)
    accelerator, hub repo            make_accelerator(accumulation), create_hub_repo
    models                           set_seed; family + trainable weights; Algorithm.setup (sampler, reward, ...);
                                     the optimizer; Algorithm.setup_optimizer (lr schedule, EMA); accelerate.prepare
    start                            trackers; the resolved config printed; resume from checkpoint-N
                                     (Algorithm.load_state); the baseline validation
    loop, i = start .. iterations-1  Algorithm.iteration(run, i): one ReFL step, one DDPO / GRPO epoch (sampling,
                                     training, logging and the non-finite guards inside); then validation when due
                                     (with Algorithm.validation_weights) and checkpoint-N when due (Algorithm.state)
    end                              Algorithm.finish; the final weights, config.json and model card; the hub; a
                                     check that every process holds the same weights

An algorithm is a subclass of `Algorithm` in its trainer module (refl.py, ddpo.py, grpo.py): adding one is a module
with its config and parts, and a line in train_scripts/.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from refl_ddpo.core.families import ModelFamily
from refl_ddpo.run.config import CommonConfig
from refl_ddpo.run.runs import RunInfo

if TYPE_CHECKING:
    from refl_ddpo.run.training import TrainableSpec
    from refl_ddpo.run.validation import ValidationSpec


@dataclass
class Run:
    """What the skeleton built, handed to every part of the algorithm."""

    cfg: CommonConfig  # resolved (frozen): the same object from the set-up to the final save
    accelerator: Any
    family: ModelFamily
    params: list[torch.nn.Parameter]  # the trainable tensors (LoRA, or the whole network)
    dtype: torch.dtype  # of the frozen weights
    info: RunInfo  # the run's id and the checkpoint it resumes from (refl_ddpo.run.runs.start_run)
    network: Any = (
        None  # the prepared (DDP-wrapped on several processes) network: every forward with grad calls it
    )
    optimizer: Any = None  # the prepared optimizer
    reward: Any = None  # refl_ddpo.rewards: (images, prompts, metadata) -> (rewards, parts)
    extras: dict[str, Any] = field(default_factory=dict)  # for print_config

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def rank(self) -> int:
        return self.accelerator.process_index


class Algorithm(ABC):
    """The parts of one training algorithm. Subclasses set the class attributes, implement the abstract parts and
    override the others where they need to."""

    name: ClassVar[str]  # metric prefix, tracker project, run records: "refl", "ddpo", "grpo"
    unit: ClassVar[str]  # what one iteration is: "step" or "epoch"
    iterations_field: ClassVar[str]  # the config field that counts iterations: max_train_steps, num_epochs

    def __init__(self, cfg: CommonConfig):
        self.cfg = cfg

    # ---- before any model loads ----

    def preflight(self) -> RunInfo:
        """Everything checkable before a model is loaded, the config resolved as far as it can be without the model;
        claims output_dir; returns the run's RunInfo (`.resume`: the checkpoint to resume from, or None)."""
        from refl_ddpo.run.runs import start_run

        self.cfg = shared_checks(self.cfg)
        self.check()
        return start_run(self.cfg, self.name, self.iterations_field)

    def check(self) -> None:  # noqa: B027 (optional: nothing by default)
        """The algorithm's own checks before any model loads (after the shared ones, before output_dir is claimed);
        it may resolve more of the config (`self.cfg = dataclasses.replace(...)`): nothing changes it later."""

    @abstractmethod
    def accumulation_steps(self) -> int:
        """Backward passes per optimizer step on one process (accelerate's gradient_accumulation_steps)."""

    def check_processes(self, num_processes: int) -> None:  # noqa: B027 (optional: nothing by default)
        """Refuse a process count the config's arithmetic does not fit (the launcher's, now known)."""

    # ---- models ----

    def setup(self, run: Run) -> None:  # noqa: B027 (optional: nothing by default)
        """The sampler, the reward (run.reward) and anything else the loop needs, before the optimizer is made."""

    def setup_optimizer(self, run: Run) -> None:  # noqa: B027 (optional: nothing by default)
        """Anything built on the optimizer (an lr schedule) or the trainable weights (EMA), before prepare."""

    def describe(self, run: Run) -> dict[str, Any]:
        """Derived sizes to print beside the config."""
        return {}

    # ---- the loop ----

    @property
    def iterations(self) -> int:
        return int(getattr(self.cfg, self.iterations_field))

    @property
    @abstractmethod
    def validation_every(self) -> int:
        """Validate every N iterations (0: only before the first and after the last)."""

    def begin(self, run: Run, start: int) -> None:  # noqa: B027 (optional: nothing by default)
        """Before the first iteration of this start (progress bars, executors)."""

    @abstractmethod
    def iteration(self, run: Run, index: int) -> None:
        """Iteration `index` (0-based): sample, score, update, log."""

    def log_step(self, done: int) -> int:
        """The tracker step at which a validation after `done` iterations is logged."""
        return done

    def validation_weights(self, run: Run) -> AbstractContextManager:
        """The weights validation sees (EMA's, in an EMA run), for the duration of the context."""
        return nullcontext()

    @abstractmethod
    def checkpoint_due(self, done: int) -> bool:
        """Whether to save checkpoint-N after `done` iterations."""

    @abstractmethod
    def state(self, run: Run, done: int) -> tuple[dict, dict[str, torch.Tensor]]:
        """(counters as JSON, tensors) that checkpoint-N keeps beside accelerate's state."""

    @abstractmethod
    def load_state(self, run: Run, counters: dict, tensors: dict[str, torch.Tensor]) -> int:
        """Restore `state`'s output; returns the iterations already done."""

    def resumed(self, start: int) -> str:
        """What the 'resumed from checkpoint-N' line says after the path."""
        return f": {start} {self.unit}(s) done"

    def end(self, run: Run) -> None:  # noqa: B027 (optional: nothing by default)
        """After the last iteration of this start, or on the way out of an error."""

    def finish(self, run: Run) -> dict[str, int]:
        """After the loop, before the final save (EMA's weights in place); returns the progress for the model card."""
        return {}


def shared_checks(cfg: CommonConfig) -> CommonConfig:
    """The checks every trainer makes before a model is loaded: the base model, the LoRA targets and the unset
    guidance flags (resolved here from the model's family: the run records them), the reward's files, the validation
    prompts, the hub settings. Returns the resolved config."""
    from refl_ddpo.core.families import resolve_guidance, resolve_lora_targets
    from refl_ddpo.core.models import check_pretrained_model
    from refl_ddpo.rewards import check_reward_files
    from refl_ddpo.run.hub import check_push
    from refl_ddpo.run.validation import check_validation_prompts

    check_pretrained_model(cfg.pretrained_model)
    cfg = resolve_guidance(resolve_lora_targets(cfg))
    check_reward_files(cfg.reward, cfg.reward_model_dir)
    check_validation_prompts(cfg)
    check_push(cfg)
    return cfg


def trainable_spec(cfg: CommonConfig) -> TrainableSpec:
    """Which weights the run trains (--use_lora, --lora_*, --gradient_checkpointing)."""
    from refl_ddpo.run.training import TrainableSpec

    return TrainableSpec(
        use_lora=cfg.use_lora,
        rank=cfg.lora_rank,
        alpha=cfg.resolved_lora_alpha,
        target_modules=tuple(cfg.lora_target_modules) if cfg.lora_target_modules else None,
        init=cfg.lora_init,
        gradient_checkpointing=cfg.gradient_checkpointing,
    )


def validation_spec(cfg: CommonConfig) -> ValidationSpec:
    """How the run validates (--validation_*, --num_validation_images, --seed, the resolved --resolution)."""
    from refl_ddpo.run.validation import ValidationSpec

    return ValidationSpec(
        prompts_file=cfg.validation_prompts_file,
        num_images=cfg.num_validation_images,
        seed=cfg.seed,
        num_steps=cfg.validation_num_steps,
        guidance_scale=cfg.validation_guidance_scale,
        batch_size=cfg.validation_batch_size,
        resolution=cfg.resolution,
    )


def set_up(algo: Algorithm) -> tuple[Run, str | None]:
    """The checks, the accelerator, the hub repo and the models: (run, hub repo id). The config is resolved here
    once (the preflight, then the model's native resolution) and handed on; nothing writes to it afterwards."""
    from accelerate.utils import set_seed

    from refl_ddpo.run.training import (
        load_trainable_family,
        make_accelerator,
        make_optimizer,
        resolve_resolution,
    )

    info = algo.preflight()
    cfg = algo.cfg  # as the preflight resolved it
    accelerator = make_accelerator(
        algo.accumulation_steps(),
        mixed_precision=cfg.mixed_precision,
        report_to=cfg.report_to,
        output_dir=cfg.output_dir,
        logging_dir=cfg.logging_dir,
        device=cfg.device,
        allow_tf32=cfg.allow_tf32,
        fsdp=cfg.fsdp,
        fsdp_cpu_offload=cfg.fsdp_cpu_offload,
        deepspeed=zero_config(cfg, algo.accumulation_steps()),
    )
    algo.check_processes(accelerator.num_processes)
    repo_id = None
    if cfg.push_to_hub and accelerator.is_main_process:
        from refl_ddpo.run.hub import create_hub_repo, repo_name

        # before loading: a wrong token or id fails at once
        repo_id = create_hub_repo(repo_name(cfg.hub_model_id, cfg.output_dir), cfg.hub_token)
    set_seed(cfg.seed)  # the same LoRA init on every process and in every run with this seed
    family, params, dtype = load_trainable_family(
        accelerator,
        cfg.pretrained_model,
        trainable_spec(cfg),
        drop_t5=cfg.drop_t5,
        offload_text_encoders=cfg.offload_text_encoders,
        shard_text_encoders=cfg.fsdp_shard_text_encoders,
    )
    cfg = algo.cfg = resolve_resolution(cfg, family, info)
    run = Run(cfg, accelerator, family, params, dtype, info)
    del params  # run.params holds them (let go of before a sharded prepare: see `prepare`)
    algo.setup(run)
    run.optimizer = make_optimizer(
        run.params,
        learning_rate=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.adam_weight_decay,
        eps=cfg.adam_epsilon,
        use_8bit_adam=cfg.use_8bit_adam,
    )
    algo.setup_optimizer(run)
    prepare(run)
    return run, repo_id


def zero_config(cfg: CommonConfig, accumulation: int) -> dict | None:
    """The DeepSpeed config of --deepspeed_zero (refl_ddpo.run.zero), or None without it."""
    if cfg.deepspeed_zero is None:
        return None
    from refl_ddpo.run.zero import deepspeed_config

    return deepspeed_config(
        cfg.deepspeed_zero,
        micro_batch=cfg.train_batch_size,
        accumulation=accumulation,
        max_grad_norm=cfg.max_grad_norm,
        mixed_precision=cfg.mixed_precision,
    )


def prepare(run: Run) -> None:
    """accelerate's `prepare` of the family's network and run.optimizer into run.network and run.optimizer.

    Sharded (--fsdp), the network comes from the host (training.load_trainable_family): fully_shard moves each
    parameter whole to the device, copies this process' shard out of it and puts the sharded parameter in its place.
    A reference to the unsharded parameters kept through `prepare` would keep each one whole on the device (a full
    fine-tune: the whole fp32 network), so run.params lets go of them first (accelerate swaps the optimizer's for
    placeholders; EMA and the old-policy copy are refused with --fsdp) and holds the sharded ones after."""
    from refl_ddpo.core.sharding import is_sharded, trainable_params

    sharded = is_sharded(run.accelerator)
    if sharded:
        run.params = []
    run.network, run.optimizer = run.accelerator.prepare(run.family.network, run.optimizer)
    if sharded:  # fully_shard replaced the parameters by sharded ones (the optimizer holds those)
        run.params = trainable_params(run.network)


def start(algo: Algorithm, run: Run) -> int:
    """Trackers, the config printed, the resumed state; returns the iterations already done."""
    from refl_ddpo.run.checkpoints import load_checkpoint
    from refl_ddpo.run.training import print_config, start_trackers

    cfg, accelerator, resume = run.cfg, run.accelerator, run.info.resume
    start_trackers(
        accelerator,
        algo.name,
        cfg.to_dict(),
        report_to=cfg.report_to,
        output_dir=cfg.output_dir,
        logging_dir=cfg.logging_dir,
    )
    if accelerator.is_main_process:
        print_config(
            cfg, {**algo.describe(run), "processes": accelerator.num_processes, "resume from": resume}
        )
    if resume is not None:
        done = algo.load_state(run, *load_checkpoint(accelerator, resume))
        accelerator.print(f"resumed from {resume}{algo.resumed(done)}")
        return done
    if cfg.resume_from_checkpoint:
        accelerator.print(f"no checkpoint-N in {cfg.output_dir} yet: starting at {algo.unit} 0")
    return 0


def run_training(algo: Algorithm) -> Path:
    """Train with `algo`'s parts (see the module doc); returns the output folder (final weights at its top)."""
    from refl_ddpo.run.training import check_identical_weights, save_final
    from refl_ddpo.run.validation import make_validator

    run, repo_id = set_up(algo)
    cfg, accelerator = run.cfg, run.accelerator
    validation = validation_spec(cfg)
    first = start(algo, run)
    validator = make_validator(
        accelerator,
        run.family,
        run.reward,
        cfg.reward,
        validation,
        cfg.output_dir,
        every=algo.validation_every,
        unit=algo.unit,
        last=algo.iterations,
        start=first,
    )

    def validate(done: int) -> None:
        with algo.validation_weights(run):
            validator(done, algo.log_step(done))

    if validator is not None and first == 0:
        validate(0)  # the baseline: the base model (LoRA starts at zero)
    algo.begin(run, first)
    try:
        for index in range(first, algo.iterations):
            algo.iteration(run, index)
            done = index + 1
            if validator is not None and validator.due(done):
                validate(done)
            if algo.checkpoint_due(done):
                checkpoint(algo, run, done)
    finally:
        algo.end(run)
    # the result: always, at the top of output_dir
    progress = algo.finish(run)
    save_final(
        accelerator,
        run.network,
        run.family,
        algo.name,
        progress,
        output_dir=cfg.output_dir,
        config=cfg.to_dict(),
        validation=validation,
        repo_id=repo_id,
        hub_token=cfg.hub_token,
        run_id=run.info.run_id,
    )
    check_identical_weights(accelerator, run.params)
    accelerator.end_training()
    return Path(cfg.output_dir)


def checkpoint(algo: Algorithm, run: Run, done: int) -> Path:
    """output_dir/checkpoint-N after `done` iterations: accelerate's state, the algorithm's, the run's record."""
    from refl_ddpo.run.checkpoints import save_checkpoint
    from refl_ddpo.run.resume_fit import settings

    cfg = run.cfg
    path = save_checkpoint(
        run.accelerator,
        cfg.output_dir,
        done,
        *algo.state(run, done),
        run.info,
        settings=settings(cfg),
        total_limit=cfg.checkpoints_total_limit,
        shards=cfg.fsdp_checkpoint == "sharded",
    )
    if run.accelerator.is_main_process:  # the one process that wrote it (the other machines hold no copy)
        from tqdm.auto import tqdm

        tqdm.write(f"saved {path}")
    return path


def main_for(algorithm: type[Algorithm], config_cls: type, argv: list[str] | None, description: str) -> None:
    """A trainer's command line: parse the layered flags, then train (or, under launch.sh's preflight, only check)."""
    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.run.training import run_or_preflight

    def train(cfg):
        return run_training(algorithm(cfg))

    def preflight(cfg):
        algorithm(cfg).preflight()

    run_or_preflight(train, parse_config(config_cls, argv, description=description), preflight)
