"""GRPO's config: DDPO's fields (the same PPO-clip trainer) plus group sampling and the SDE window; Flow-GRPO's SD3.5-M
and FLUX.1-dev recipes (and its Fast window), DanceGRPO's FLUX.1-dev recipe and the toy world as presets."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards.pairwise import parse_pairwise_spec
from refl_ddpo.run.parts import field_
from refl_ddpo.trainers.ddpo_config import EPOCH_PARTS, PPOPart
from refl_ddpo.trainers.ddpo_presets import TOY_VALIDATION, TOY_WORLD_DIR
from refl_ddpo.trainers.edit_presets import EDIT_GRPO_PRESETS
from refl_ddpo.trainers.flux2_presets import FLOW_FACTORY_GRPO, FLUX2_GRPO_PRESETS
from refl_ddpo.trainers.groups import GroupConfig, check_group_arithmetic, check_pairwise_groups, group_sizes
from refl_ddpo.trainers.wan_presets import WAN_GRPO_PRESETS

__all__ = ["GRPO_PRESETS", "GRPOConfig", "check_group_arithmetic", "check_pairwise_groups", "group_sizes"]


GRPO_PRESETS: dict[str, dict[str, Any]] = {
    # The toy world's GRPO recipe: DDPO's on toy-sd in 8 groups of 8 sharing an x_T, the colour word green ("a green
    # triangle" held out), toy_clean beside the colour reward against filling the frame (docs/toy_world.md).
    "toy_world": {
        "pretrained_model": str(TOY_WORLD_DIR / "toy-sd"),
        "reward_model_dir": str(TOY_WORLD_DIR),
        "reward": "toy_color_match:1,toy_clean:1",
        "prompt_fn": "toy_world_green",
        "resolution": 32,
        "sample_num_steps": 6,
        "sample_guidance_scale": 7.5,
        "sample_batch_size": 16,
        "sample_num_batches_per_epoch": 4,
        "group_size": 8,
        "same_noise_per_group": True,
        "train_batch_size": 16,
        "train_gradient_accumulation_steps": 2,
        "train_skip_last_steps": 2,
        "train_clip_range": 0.2,
        "lora_target_modules": ["attn2.to_k", "attn2.to_v"],
        "learning_rate": 3e-3,
        "num_epochs": 16,
        "save_freq": 8,
        "checkpoints_total_limit": 1,
        **TOY_VALIDATION,
    },
    # Flow-GRPO on SD3.5-M (yifan123/flow_grpo config/grpo.py): 10 SDE steps at noise level 0.7 with CFG 4.5 for
    # training (their evaluation samples 40 deterministic steps), lr 3e-4, clip 1e-4, beta 0.04, global std, groups
    # of 24, LoRA r 32 / alpha 64 on the joint attention; 2 optimizer steps per epoch. Their rewards (PickScore,
    # GenEval, OCR) are not shipped here: ImageReward stands in.
    "flow_grpo_sd35m": {
        "pretrained_model": "stabilityai/stable-diffusion-3.5-medium",
        "reward": "imagereward",
        "resolution": 512,
        "sample_num_steps": 10,
        "sample_eta": 0.7,
        "sample_guidance_scale": 4.5,
        "sample_batch_size": 8,
        "sample_num_batches_per_epoch": 6,
        "group_size": 24,
        "global_std": True,
        "train_batch_size": 8,
        "train_gradient_accumulation_steps": 3,
        "train_timestep_fraction": 0.99,
        "train_clip_range": 1e-4,
        "train_adv_clip_max": 5.0,
        "kl_weight": 0.04,
        "learning_rate": 3e-4,
        "lora_rank": 32,
        "lora_alpha": 64,
        "lora_target_modules": [
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
        ],
        "mixed_precision": "bf16",
        "num_epochs": 1000,
        "save_freq": 20,
        "validation_guidance_scale": 4.5,  # Flow-GRPO evaluates with 40 deterministic steps at CFG 4.5
        "validation_num_steps": 40,
    },
}

# The same on toy-sd3 (flow matching; Flow-GRPO's SDE at noise level 0.7): the colour word cyan ("a cyan circle"
# held out), LoRA on the text stream's keys / values, 8 epochs (docs/toy_world.md).
GRPO_PRESETS["toy_world_sd3"] = {
    **GRPO_PRESETS["toy_world"],
    "pretrained_model": str(TOY_WORLD_DIR / "toy-sd3"),
    "prompt_fn": "toy_world_cyan",
    "reward": "toy_color_match",
    "num_epochs": 8,
    "sample_eta": 0.7,
    "lora_target_modules": ["add_k_proj", "add_v_proj"],
}

# FLUX.1-dev. Batch sizes are per GPU; the sources ran on 16 or 32 GPUs, so the groups per epoch here are theirs
# divided by the GPUs. Flow-GRPO trains LoRA on the double blocks' attention and feed-forward layers (the single
# blocks' attn.to_q / to_k / to_v match too, as peft matches the names in their script), not the kit's FLUX default.
FLOW_GRPO_FLUX_LORA = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]

# Flow-GRPO on FLUX.1-dev (yifan123/flow_grpo config/grpo.py pickscore_flux, LoRA and optimizer from
# scripts/train_flux.py and config/base.py): 6 SDE steps at noise level 0.9 with the embedded guidance 3.5 (no CFG;
# evaluation: 28 deterministic steps at 3.5), 512 px, groups of 24, global std, 99 % of the steps trained, clip
# 1e-4, no KL (beta 0), lr 3e-4, LoRA r 64 / alpha 128, bf16, 2 optimizer steps per epoch. Their 32 GPUs sample 3 x
# 12 images each (48 groups); one GPU here samples one group, 3 x 8. Their prompts are encoded with T5 at 128
# tokens for sampling; the kit encodes at the pipeline's 512. Their reward PickScore is the kit's pickscore.
GRPO_PRESETS["flow_grpo_flux"] = {
    "pretrained_model": "black-forest-labs/FLUX.1-dev",
    "reward": "pickscore",
    "resolution": 512,
    "sample_num_steps": 6,
    "sample_eta": 0.9,
    "sample_guidance_scale": 3.5,
    "sample_batch_size": 3,
    "sample_num_batches_per_epoch": 8,
    "group_size": 24,
    "global_std": True,
    "train_batch_size": 3,
    "train_gradient_accumulation_steps": 4,
    "train_timestep_fraction": 0.99,
    "train_clip_range": 1e-4,
    "train_adv_clip_max": 5.0,
    "kl_weight": 0.0,
    "learning_rate": 3e-4,
    "adam_weight_decay": 1e-4,
    "max_grad_norm": 1.0,
    "lora_rank": 64,
    "lora_alpha": 128,
    "lora_target_modules": FLOW_GRPO_FLUX_LORA,
    "mixed_precision": "bf16",
    "num_epochs": 1000,  # theirs runs until stopped by hand
    "save_freq": 30,
    "validation_num_steps": 28,
    "validation_guidance_scale": 3.5,
}

# Flow-GRPO-Fast on FLUX.1-dev (config/grpo.py pickscore_flux_fast): the same, but the SDE (noise level 0.8) and the
# training only in a window of 3 steps, deterministic steps elsewhere; their window starts in sde_window_range
# (0, num_steps // 2) = (0, 3) and must end inside it (flux_pipeline_with_logprob_fast: start = randint(0, 3 - 3)),
# so it is always steps 0-2; every window step trained (timestep_fraction 1.0, base.py), clip 1e-5, per-group std.
# Their window samples with the CPS SDE (sde_type "cps"); the kit has Flow-GRPO's original SDE step only.
GRPO_PRESETS["flow_grpo_fast_flux"] = {
    **GRPO_PRESETS["flow_grpo_flux"],
    "sample_eta": 0.8,
    "sde_window": 3,
    "sde_window_start": 0,
    "train_timestep_fraction": 1.0,
    "train_clip_range": 1e-5,
    "global_std": False,
}

# DanceGRPO on FLUX.1-dev with HPSv2.1 (XueZeyue/DanceGRPO scripts/finetune/finetune_flux_grpo.sh, guidance and
# sampling from fastvideo/train_grpo_flux.py): 16 SDE steps at 720 px, the embedded guidance 3.5 in sampling and
# training, groups of 12 sharing one x_T (--init_same_noise), each group's own std (--use_group), 60 % of the steps
# trained in random order, the last step never (its samples drop the last transition), clip 1e-4, advantages
# clipped to 5, lr 1e-5, weight decay 1e-4, one sample per micro-batch and 4 per optimizer step, gradient
# checkpointing, bf16. They fine-tune the whole transformer (FSDP over 16 GPUs, fp32 master weights): so does this
# preset (--no-use_lora), which needs a sharded multi-GPU launch, not one GPU. Their SDE step is not the kit's: its
# noise eta sqrt(-dt) (eta 0.3) equals the kit's Flow-GRPO noise level a sqrt(sigma / (1 - sigma)) sqrt(-dt) at
# sigma 0.5 with a = 0.3; their sigmas are linspace(1, 0, 17) shifted by 3, the kit's the pipeline's
# resolution-dependent shift. 300 prompts per GPU (max_train_steps), saved every 40.
GRPO_PRESETS["dance_grpo_flux"] = {
    "pretrained_model": "black-forest-labs/FLUX.1-dev",
    "reward": "hpsv2",
    "resolution": 720,
    "sample_num_steps": 16,
    "sample_eta": 0.3,
    "sample_guidance_scale": 3.5,
    "sample_batch_size": 4,
    "sample_num_batches_per_epoch": 3,
    "group_size": 12,
    "same_noise_per_group": True,
    "global_std": False,
    "train_batch_size": 1,
    "train_gradient_accumulation_steps": 4,
    "train_timestep_fraction": 0.6,
    "train_skip_last_steps": 1,
    "train_clip_range": 1e-4,
    "train_adv_clip_max": 5.0,
    "kl_weight": 0.0,
    "learning_rate": 1e-5,
    "adam_weight_decay": 1e-4,
    "max_grad_norm": 1.0,
    "use_lora": False,
    "gradient_checkpointing": True,
    "mixed_precision": "bf16",
    "num_epochs": 300,
    "save_freq": 40,
}

# Flow-GRPO on Qwen-Image with PickScore (yifan123/flow_grpo config/grpo.py pickscore_qwenimage, per GPU): 10 SDE
# steps at noise level 1.2 with true CFG 4, stochastic and trained only in a window of 2 steps starting in steps 0-4
# (their sde_window_range (0, 5): here the windows that end before the last 4 steps), groups of 16 from 4 batches of
# 4, 2 optimizer steps per epoch, beta 0, global std, lr 3e-4, clip 1e-4 (their base config), bf16, activation
# checkpointing; they evaluate with 50 deterministic steps at CFG 4. LoRA r 64 / alpha 128 on the joint attention and
# both streams' MLPs, as verl's Flow-GRPO Qwen-Image example (examples/flowgrpo_trainer/run_flowgrpo.sh): the
# family's default targets, so --lora_target_modules stays unset.
GRPO_PRESETS["flow_grpo_qwen_image"] = {
    "pretrained_model": "Qwen/Qwen-Image",
    "reward": "pickscore",
    "resolution": 512,
    "sample_num_steps": 10,
    "sample_eta": 1.2,
    "sample_guidance_scale": 4.0,
    "sde_window": 2,
    "train_skip_last_steps": 4,
    "sample_batch_size": 4,
    "sample_num_batches_per_epoch": 4,
    "group_size": 16,
    "global_std": True,
    "train_batch_size": 4,
    "train_gradient_accumulation_steps": 2,
    "train_clip_range": 1e-4,
    "train_adv_clip_max": 5.0,
    "kl_weight": 0.0,
    "learning_rate": 3e-4,
    "lora_rank": 64,
    "lora_alpha": 128,
    "mixed_precision": "bf16",
    "gradient_checkpointing": True,
    "num_epochs": 1000,
    "save_freq": 30,
    "validation_guidance_scale": 4.0,
    "validation_num_steps": 50,
}
GRPO_PRESETS.update(FLUX2_GRPO_PRESETS)  # Flow-Factory's FLUX.2 [dev] and [klein] recipes
GRPO_PRESETS.update(EDIT_GRPO_PRESETS)  # Flow-Factory's FLUX.1 Kontext recipe (with --edit_data)
GRPO_PRESETS.update(WAN_GRPO_PRESETS)  # Flow-Factory's Wan 2.1 / 2.2 text-to-video recipe


# Flow-GRPO on Z-Image with PickScore (X-GenGroup/Flow-Factory examples/grpo/lora/z_image/default.yaml, per GPU): 10
# steps at 512 px with CFG 4 in the pipeline's terms (text + 4 (text - uncond): the kit's 5), Flow-GRPO's SDE at noise
# level 0.7 on one step per rollout drawn from steps 1-3 (their sde_steps; here the window start is drawn from steps
# 0-3, the windows that end before the last 6 steps), groups of 16, 2 optimizer steps per epoch, each group's own std,
# clip 1e-4, advantages clipped to 5, beta 0, lr 3e-4, weight decay 1e-4, LoRA r 64 / alpha 128 on their default
# targets (the family's: every block's attention and MLP), bf16; evaluation 40 steps at CFG 4 (their 1024 px). Their
# 8 GPUs sample 48 prompts x 16 per epoch; one GPU here samples one group. Their EMA of the weights (decay 0.9) is
# not the kit's.
GRPO_PRESETS["flow_grpo_z_image"] = {
    **FLOW_FACTORY_GRPO,
    "pretrained_model": "Tongyi-MAI/Z-Image",
    "reward": "pickscore",
    "resolution": 512,
    "sample_num_steps": 10,
    "sample_eta": 0.7,
    "sample_guidance_scale": 5.0,
    "train_skip_last_steps": 6,
    "save_freq": 40,
    "validation_num_steps": 40,
    "validation_guidance_scale": 5.0,
}

# The same on Z-Image-Turbo (Flow-Factory examples/grpo/lora/z_image_turbo/default.yaml): 6 steps without CFG (their
# guidance 0: the kit's 1), the SDE step drawn from steps 0-3 (the windows that end before the last 2), evaluation 10
# steps without CFG at 512 px; the rest as above.
GRPO_PRESETS["flow_grpo_z_image_turbo"] = {
    **GRPO_PRESETS["flow_grpo_z_image"],
    "pretrained_model": "Tongyi-MAI/Z-Image-Turbo",
    "sample_num_steps": 6,
    "sample_guidance_scale": 1.0,
    "train_skip_last_steps": 2,
    "validation_num_steps": 10,
    "validation_guidance_scale": 1.0,
}


@dataclass(frozen=True)
class GRPOConfig(GroupConfig, PPOPart, *EPOCH_PARTS):
    """GRPO with LoRA (Flow-GRPO, Liu et al. 2025; DanceGRPO, Xue et al. 2025): each prompt of an epoch is sampled
    --group_size times and a sample's advantage is its reward against its group's. Defaults: DDPO's, with group
    advantages in place of the per-prompt buffer and two groups of 8 per epoch."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = GRPO_PRESETS

    sample_batch_size: int = field_(8, "Images per sampling batch, per GPU.")
    sample_num_batches_per_epoch: int = field_(
        2,
        "Sampling batches per epoch, per GPU: an epoch has sample_batch_size x this x processes images, "
        "in groups of --group_size.",
    )
    sde_window: int = field_(
        0,
        "Stochastic-and-trained steps only in a window of this many consecutive sampler steps, deterministic "
        "steps (DDIM eta 0, the flow ODE step) elsewhere (Flow-GRPO-Fast, MixGRPO); 0 = every step stochastic.",
    )
    sde_window_start: int | None = field_(
        None,
        "First step of the window (0 = the first sampler step); None draws it per epoch, uniformly among the "
        "windows that end before the last --train_skip_last_steps steps, the same on every process.",
    )
    pairwise_reward: str | None = field_(
        None,
        "Train on pairwise preferences (Pref-GRPO): each sample's reward is its win rate against the other members "
        "of its group, judged by this judge: toy_pairwise (the toy world: the right colour wins), or your own "
        "judge_fn(prompts, images_a, images_b, metadata) -> P(a beats b) in [0, 1] as pkg.module:function. "
        "--reward is still scored and logged beside it; a group's samples must be on one process.",
        group="reward and prompts",
    )
    pairwise_opponents: int = field_(
        0,
        "With --pairwise_reward: compare each sample with this many members of its group, drawn per epoch (0: "
        "with all of them, group_size - 1; a pair is judged once and counts for both).",
    )
    per_prompt_stat_tracking: bool = field_(
        False,
        "Not used by GRPO (its advantages are normalised within groups); must stay off.",
        group="advantages",
    )
    output_dir: str = field_(
        "checkpoint/grpo_lora",
        "Where the final LoRA, its config.json and checkpoint-N/ go. A folder that already holds a run is refused "
        "unless --resume_from_checkpoint continues it or --overwrite_output_dir replaces it.",
        group="data and output",
    )

    def check(self) -> None:
        super().check()
        if self.per_prompt_stat_tracking:
            raise UserError(
                "--per_prompt_stat_tracking is DDPO's; GRPO normalises each reward within its group "
                "(--group_size, --global_std): drop the flag."
            )
        self._check_pairwise()
        if self.sde_window < 0:
            raise UserError(f"--sde_window must be >= 0 (got {self.sde_window}); 0 = every step stochastic.")
        if self.sde_window:
            # the window ends at or before step `last`
            last = self.sample_num_steps - self.train_skip_last_steps
            steps = super().trainable_steps_name()
            if self.sde_window > last:
                raise UserError(
                    f"--sde_window {self.sde_window} is longer than the {steps} "
                    f"= {last} steps it may cover: shorten it (or --train_skip_last_steps)."
                )
            if self.sde_window_start is not None and not 0 <= self.sde_window_start <= last - self.sde_window:
                raise UserError(
                    f"--sde_window_start {self.sde_window_start} with --sde_window {self.sde_window} leaves "
                    f"the {last} trainable steps ({steps}): use a start in "
                    f"[0, {last - self.sde_window}], or None to draw it per epoch."
                )
        elif self.sde_window_start is not None:
            raise UserError("--sde_window_start needs --sde_window W > 0 (the window's length).")

    def _check_pairwise(self) -> None:
        """The judge's name, the opponents, no GDPO beside it, and each group on one process."""
        if self.pairwise_opponents < 0:
            raise UserError(f"--pairwise_opponents must be >= 0 (got {self.pairwise_opponents}); 0 = all.")
        if not self.pairwise_reward:
            if self.pairwise_opponents:
                raise UserError(
                    "--pairwise_opponents needs --pairwise_reward JUDGE (whose verdicts it bounds)."
                )
            return
        parse_pairwise_spec(self.pairwise_reward)
        if self.reward_aggregation == "gdpo":
            raise UserError(
                "--reward_aggregation gdpo normalises each reward of --reward apart, but with --pairwise_reward "
                "the trained reward is the win rate alone: drop one of them."
            )
        check_pairwise_groups(self, int(os.environ.get("WORLD_SIZE", "1")))

    def trainable_steps(self) -> int:
        return self.sde_window or super().trainable_steps()

    def trainable_steps_name(self) -> str:
        return "--sde_window" if self.sde_window else super().trainable_steps_name()
