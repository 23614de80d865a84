"""A training run's plumbing as plain functions. A trainer's `train(cfg)` calls them in this order:

cfg = shared_checks(cfg)                     before any model loads (the trainer's own checks follow), then
info = start_run(cfg, name, steps_field)     refl_ddpo.run.runs: output_dir claimed, the checkpoint to resume
accelerator = open_accelerator(cfg, gas)     accelerate (DDP, FSDP, DeepSpeed ZeRO, trackers' folder)
run = load_run(cfg, info, accelerator, ...)  the hub repo, the seed, the family with its trainable weights
  ... the trainer's sampler and reward
add_optimizer(run)                           AdamW (or 8-bit) over run.params
  ... what rests on the optimizer or the weights (lr schedule, EMA, the old policy)
prepare(run)                                 accelerate's prepare: run.network, run.optimizer
saved = begin_run(run, sizes)                trackers, the config printed; the checkpoint's (counters, tensors)
validate = validation(run, every, ...)       validate(done, step) -> stop: the baseline, every N, the last; best/
save_run_checkpoint(run, done, ...)          output_dir/checkpoint-N
finish_run(run, progress)                    final weights, config.json, model card, hub; one set of weights
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refl_ddpo.core.families import ModelFamily
from refl_ddpo.run.config import CommonConfig
from refl_ddpo.run.runs import RunInfo
from refl_ddpo.run.training import TrainableSpec
from refl_ddpo.run.validation import ValidationSpec


@dataclass
class Run:
    """What the plumbing built, handed to the trainer's loop and its functions."""

    cfg: CommonConfig  # resolved (frozen): the same object from the set-up to the final save
    name: str  # metric prefix, tracker project, run records: "refl", "ddpo", "grpo", "nft", "awm"
    unit: str  # what one iteration is: "step" or "epoch"
    accelerator: Any
    family: ModelFamily
    params: list[torch.nn.Parameter]  # the trainable tensors (LoRA, or the whole network)
    dtype: torch.dtype  # of the frozen weights
    info: RunInfo  # the run's id and the checkpoint it resumes from (refl_ddpo.run.runs.start_run)
    repo_id: str | None = None  # --push_to_hub's repo, created before the models load
    network: Any = None  # prepared (DDP-wrapped on several processes): every forward with grad calls it
    optimizer: Any = None  # prepared
    reward: Any = None  # refl_ddpo.rewards: (images, prompts, metadata) -> (rewards, parts)
    judge: Any = (
        None  # GRPO's --pairwise_reward (refl_ddpo.rewards.pairwise): (prompts, a, b, metadata) -> P(a wins)
    )
    guard: Any = None  # refl_ddpo.run.guard.Guard with --early_stop_metric
    guard_state: dict | None = None  # the guard's counters in the checkpoint this run resumes from

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def rank(self) -> int:
        return self.accelerator.process_index


def shared_checks(cfg: CommonConfig) -> CommonConfig:
    """The checks every trainer makes before a model loads: the base model, the LoRA targets, the unset guidance flags
    (resolved from the model's family), the reward's files, the edits, validation, the hub. Returns the config."""
    from refl_ddpo.core.families import check_edit_data, resolve_guidance, resolve_lora_targets
    from refl_ddpo.core.models import check_pretrained_model
    from refl_ddpo.rewards import check_reward_files
    from refl_ddpo.run.guard import check_guard
    from refl_ddpo.run.hub import check_push
    from refl_ddpo.run.validation import check_validation_prompts

    check_pretrained_model(cfg.pretrained_model)
    cfg = resolve_guidance(resolve_lora_targets(cfg))
    check_reward_files(cfg.reward, cfg.reward_model_dir)
    check_edit_data(cfg.pretrained_model, cfg.edit_data)
    check_validation_prompts(cfg)
    check_guard(cfg)
    check_push(cfg)
    return cfg


def trainable_spec(cfg: CommonConfig) -> TrainableSpec:
    """Which weights the run trains (--use_lora, --lora_*, --gradient_checkpointing)."""
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
    return ValidationSpec(
        prompts_file=cfg.validation_prompts_file,
        num_images=cfg.num_validation_images,
        seed=cfg.seed,
        num_steps=cfg.validation_num_steps,
        guidance_scale=cfg.validation_guidance_scale,
        batch_size=cfg.validation_batch_size,
        resolution=cfg.resolution,
        edits=bool(cfg.edit_data),
    )


def open_accelerator(cfg: CommonConfig, accumulation: int):
    """accelerate's Accelerator for `accumulation` backward passes per optimizer step on one process."""
    from refl_ddpo.run.training import make_accelerator
    from refl_ddpo.run.zero import zero_config

    return make_accelerator(
        accumulation,
        mixed_precision=cfg.mixed_precision,
        report_to=cfg.report_to,
        output_dir=cfg.output_dir,
        logging_dir=cfg.logging_dir,
        device=cfg.device,
        allow_tf32=cfg.allow_tf32,
        fsdp=cfg.fsdp,
        fsdp_cpu_offload=cfg.fsdp_cpu_offload,
        deepspeed=zero_config(cfg, accumulation),
        find_unused_parameters=pairs_experts(cfg),  # DDP: a step that ran one of Wan 2.2's two experts
    )


def pairs_experts(cfg: CommonConfig) -> bool:
    """Whether the trained network is Wan 2.2's pair of experts (`core.families.wan_experts`): LoRA on a model with
    two experts, its network neither sharded (--fsdp) nor run by DeepSpeed (those train one expert itself)."""
    from refl_ddpo.core.video import has_two_experts

    if not cfg.use_lora or cfg.fsdp or cfg.deepspeed_zero:
        return False
    return cfg.wan_expert == "both" or has_two_experts(cfg.pretrained_model)


def load_run(cfg: CommonConfig, info: RunInfo, accelerator, name: str, unit: str) -> Run:
    """The hub repo (before loading: a wrong token or id fails at once), the seed, the family with its trainable
    weights, and the config's resolution resolved from the model (the run's `cfg` from here on)."""
    from accelerate.utils import set_seed

    from refl_ddpo.run.training import load_trainable_family, resolve_resolution

    repo_id = None
    if cfg.push_to_hub and accelerator.is_main_process:
        from refl_ddpo.run.hub import create_hub_repo, repo_name

        repo_id = create_hub_repo(repo_name(cfg.hub_model_id, cfg.output_dir), cfg.hub_token)
    set_seed(cfg.seed)  # the same LoRA init on every process and in every run with this seed
    family, params, dtype = load_trainable_family(
        accelerator,
        cfg.pretrained_model,
        trainable_spec(cfg),
        drop_t5=cfg.drop_t5,
        offload_text_encoders=cfg.offload_text_encoders,
        shard_text_encoders=cfg.fsdp_shard_text_encoders,
        expert=cfg.wan_expert,
        pair_experts=pairs_experts(cfg),
    )
    cfg = resolve_resolution(cfg, family, info)
    return Run(cfg, name, unit, accelerator, family, params, dtype, info, repo_id)


def add_optimizer(run: Run) -> None:
    """run.optimizer: AdamW (--use_8bit_adam: bitsandbytes') over run.params with the --adam_* settings."""
    from refl_ddpo.run.training import make_optimizer

    cfg = run.cfg
    run.optimizer = make_optimizer(
        run.params,
        learning_rate=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.adam_weight_decay,
        eps=cfg.adam_epsilon,
        use_8bit_adam=cfg.use_8bit_adam,
    )


def prepare(run: Run) -> None:
    """accelerate's `prepare` of the family's network and run.optimizer into run.network and run.optimizer.

    Sharded (--fsdp), the network comes from the host (training.load_trainable_family) and fully_shard puts each
    parameter's shard in its place; a reference to the unsharded parameters kept through `prepare` would keep each
    whole on the device, so run.params lets go of them first (accelerate swaps the optimizer's for placeholders;
    EMA and the old-policy copy are refused with --fsdp) and holds the sharded ones after."""
    from refl_ddpo.core.sharding import is_sharded, trainable_params

    sharded = is_sharded(run.accelerator)
    if sharded:
        run.params = []
    run.family.fold_lora = run.cfg.fold_lora  # refl_ddpo.core.lean: the no-grad calls with the LoRA folded
    if run.cfg.channels_last:  # in place: the optimizer keeps the same parameters
        run.family.network.to(memory_format=torch.channels_last)
    run.network, run.optimizer = run.accelerator.prepare(run.family.network, run.optimizer)
    if run.cfg.compile:  # --compile: the module itself, under any wrapper accelerate put around it
        run.family.network.compile()
    if sharded:  # fully_shard replaced the parameters by sharded ones (the optimizer holds those)
        run.params = trainable_params(run.network)


def begin_run(run: Run, sizes: dict[str, Any]) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """Trackers; the config printed with the derived `sizes`; the (counters, tensors) of the checkpoint this run
    resumes from (refl_ddpo.run.checkpoints.load_checkpoint restores accelerate's state too), or None."""
    from refl_ddpo.run.checkpoints import load_checkpoint
    from refl_ddpo.run.training import print_config, start_trackers

    cfg, accelerator, resume = run.cfg, run.accelerator, run.info.resume
    start_trackers(
        accelerator,
        run.name,
        cfg.to_dict(),
        report_to=cfg.report_to,
        output_dir=cfg.output_dir,
        logging_dir=cfg.logging_dir,
    )
    if accelerator.is_main_process:
        print_config(cfg, {**sizes, "processes": accelerator.num_processes, "resume from": resume})
    if resume is not None:
        counters, tensors = load_checkpoint(accelerator, resume)
        run.guard_state = counters.pop("guard", None)
        return counters, tensors
    if cfg.resume_from_checkpoint:
        accelerator.print(f"no checkpoint-N in {cfg.output_dir} yet: starting at {run.unit} 0")
    return None


def validation(
    run: Run,
    every: int,
    last: int,
    first: int,
    weights: Callable[[], AbstractContextManager] = nullcontext,
) -> Callable[[int, int], bool]:
    """`validate(done, step)`: validates the weights `weights()` holds (an EMA run's average) after `done`
    iterations, logged at tracker step `step`, when due (0: the baseline, every `every`, the `last`) and not already
    done by the run this one resumes (`first`); returns whether the run stops there (--early_stop_*, with best/
    written by the guard: refl_ddpo.run.guard). Without --validation_prompts_file it does nothing."""
    from refl_ddpo.run.guard import guarded, make_guard, start_guard, validation_scorers
    from refl_ddpo.run.validation import make_validator

    cfg = run.cfg
    validator = make_validator(
        run.accelerator,
        run.family,
        run.reward,
        cfg.reward,
        validation_spec(cfg),
        cfg.output_dir,
        every=every,
        unit=run.unit,
        last=last,
        start=first,
        scorers=validation_scorers(cfg, run.accelerator.device, run.dtype),
    )
    run.guard = make_guard(cfg, run.unit, run.guard_state)
    if run.guard is not None and run.main:
        start_guard(cfg.output_dir, run.guard, first)

    def validate(done: int, step: int) -> bool:
        if validator is None or not validator.due(done) or (done == first and first > 0):
            return False
        with weights():
            result = validator(done, step)
            return run.guard is not None and guarded(run, result, done, step, save_weights)

    return validate


def save_run_checkpoint(run: Run, done: int, counters: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """output_dir/checkpoint-N after `done` iterations: accelerate's, the trainer's (`counters`, `tensors`) state."""
    from refl_ddpo.run.checkpoints import save_checkpoint
    from refl_ddpo.run.resume_fit import settings

    cfg = run.cfg
    if run.guard is not None:  # the best so far and the patience: a resumed run stops where this one would
        counters = {**counters, "guard": run.guard.state()}
    path = save_checkpoint(
        run.accelerator,
        cfg.output_dir,
        done,
        counters,
        tensors,
        run.info,
        settings=settings(cfg),
        total_limit=cfg.checkpoints_total_limit,
        shards=cfg.fsdp_checkpoint == "sharded",
    )
    if run.main:  # the one process that wrote it (the other machines hold no copy)
        from tqdm.auto import tqdm

        tqdm.write(f"saved {path}")
    return path


def saved_config(cfg: CommonConfig) -> dict:
    """config.json beside the weights: the resolved config, a local base model by its absolute path (so that
    inference_lora.py finds it from any working directory)."""
    import os

    saved = cfg.to_dict()
    if os.path.exists(saved["pretrained_model"]):
        saved["pretrained_model"] = os.path.abspath(saved["pretrained_model"])
    return saved


def save_weights(run: Run, folder: str | Path) -> None:
    """The trained weights as the final save writes them (the LoRA in diffusers format, or the network) and
    config.json, to `folder`: every process calls it (a sharded network is gathered), the main one writes."""
    from refl_ddpo.core.lora import save_lora
    from refl_ddpo.core.sharding import gathered_state, is_sharded
    from refl_ddpo.run.zero import unwrap

    network, state = run.network, None
    if is_sharded(run.accelerator):  # gathered from the shards by every process, written once by the main one
        state = gathered_state(network, trainable_only=bool(getattr(network, "peft_config", None)))
    if run.main:
        save_lora(unwrap(run.accelerator, network), folder, config=saved_config(run.cfg), state=state)


def final_weights(run: Run) -> str:
    """The final weights at the top of output_dir: best/'s copied (--final_weights best, refl_ddpo.run.guard), or
    the trained ones written (every process calls it). Returns which, for the log line."""
    from refl_ddpo.run.checkpoints import check_finite_weights
    from refl_ddpo.run.guard import best_folder, copy_best
    from refl_ddpo.run.zero import unwrap

    output_dir, best = Path(run.cfg.output_dir), None
    if run.guard is not None:  # the main process reads best/ (on its machine), every process takes its answer
        from accelerate.utils import broadcast_object_list

        best = broadcast_object_list([best_folder(output_dir, run.guard) if run.main else None])[0]
        if best is None and run.guard.keep_best and run.main:
            print(
                f"{output_dir}/best/ does not hold this run's best: the final folder holds the last weights"
            )
    if best is None:
        where = f"not saving the final weights to {output_dir}"
        check_finite_weights(unwrap(run.accelerator, run.network), where)
        save_weights(run, output_dir)
        return "final weights"
    if run.main:
        copy_best(best, output_dir)
    return f"the best weights ({run.unit} {run.guard.best_count}, from {best.name}/)"


def finish_run(run: Run, progress: dict[str, int]) -> Path:
    """The final LoRA (diffusers format; best/'s with --final_weights best), the resolved config (config.json) and
    the model card README.md (refl_ddpo.run.model_card) at the top of output_dir; then, with --push_to_hub, the
    upload (main process); a check that every process holds the same weights. `progress` ("optimizer steps": N,
    ...) goes to the card. Returns output_dir."""
    from refl_ddpo.run.training import check_identical_weights

    cfg, accelerator, output_dir = run.cfg, run.accelerator, run.cfg.output_dir
    accelerator.wait_for_everyone()
    held = final_weights(run)
    if accelerator.is_main_process:
        from refl_ddpo.run.model_card import CARD_NAME, model_card

        family = run.family
        card = model_card(
            output_dir,
            cfg.to_dict(),
            validation_spec(cfg),
            run.name,
            family.name,
            type(family.network).__name__,
            family.network_name,
            progress,
            run.repo_id,
            notes=run.guard.card_lines() if run.guard is not None else (),
        )
        card.save(Path(output_dir) / CARD_NAME)
        print(f"saved {held}, config.json and {CARD_NAME} to {output_dir}", flush=True)
    accelerator.wait_for_everyone()
    if run.repo_id is not None and accelerator.is_main_process:  # after the barrier: the others may finish
        from refl_ddpo.run.hub_push import push_run

        done = ", ".join(f"{v} {k}" for k, v in progress.items())
        url = push_run(run.repo_id, output_dir, f"{run.name}: {done}", run.info.run_id, token=cfg.hub_token)
        print(f"pushed to the hub repo {run.repo_id}: {url}", flush=True)
    check_identical_weights(accelerator, run.params)
    accelerator.end_training()
    return Path(output_dir)


def main_for(
    train: Callable, preflight: Callable, config_cls: type, argv: list[str] | None, doc: str
) -> None:
    """A trainer's command line: parse the layered flags, then `train(cfg)` (or, under launch.sh's preflight, only
    `preflight(cfg)`, the checks that need no model)."""
    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.run.training import run_or_preflight

    run_or_preflight(train, parse_config(config_cls, argv, description=doc), preflight)
