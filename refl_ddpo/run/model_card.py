"""The model card `README.md` written beside every final LoRA (or full fine-tune), with huggingface_hub's `ModelCard`:
metadata (library, base model, tags) as the hub reads it, then what a person needs: base model and family, the method
and its key settings, the reward(s), how long it trained, the validation numbers and the last validation grid, and how
to load it with diffusers or this kit."""

from __future__ import annotations

from pathlib import Path

from refl_ddpo.run.validation import VALIDATION_DIR, ValidationSpec, validation_files

CARD_NAME = "README.md"
CARD_TAG = (
    "refl_ddpo"  # every card we write carries it: `--overwrite_output_dir` deletes only such a README.md
)

# trainer -> (the method in words, its reference, the config fields shown as its key settings)
_COMMON = ("learning_rate", "resolution", "seed", "mixed_precision")
_LORA = ("lora_rank", "lora_alpha", "lora_target_modules")
_POLICY = (
    "reward",
    "prompt_fn",
    "prompts_file",
    "sample_num_steps",
    "sample_eta",
    "sample_guidance_scale",
    "sample_batch_size",
    "sample_num_batches_per_epoch",
    "train_batch_size",
    "train_gradient_accumulation_steps",
    "train_num_inner_epochs",
    "train_timestep_fraction",
    "train_skip_last_steps",
    "train_clip_range",
    "kl_weight",
)
_FORWARD = (
    "reward",
    "prompt_fn",
    "prompts_file",
    "sample_num_steps",
    "sample_guidance_scale",
    "sample_batch_size",
    "sample_num_batches_per_epoch",
    "group_size",
    "global_std",
    "train_batch_size",
    "train_gradient_accumulation_steps",
    "train_num_inner_epochs",
    "train_timestep_fraction",
    "train_timesteps",
    "kl_weight",
    "old_decay_flat",
    "old_decay_rate",
    "old_decay_max",
    "old_decay_clock",
    "release_weights",
)
NAMES = {"refl": "ReFL", "ddpo": "DDPO", "grpo": "GRPO", "nft": "DiffusionNFT", "awm": "AWM"}
METHODS = {
    "refl": (
        "ReFL (Reward Feedback Learning): the reward's gradient through one late denoising step",
        "Xu et al. 2023, ImageReward, arXiv 2304.05977",
        (
            "reward",
            "prompts_file",
            "grad_scale",
            "margin",
            "k_lo",
            "k_hi",
            "num_inference_steps",
            "scheduler",
            "guidance_scale",
            "train_batch_size",
            "gradient_accumulation_steps",
            "kl_weight",
            "pretrain_loss_weight",
            "backprop_steps",
            "draft_lv",
        ),
    ),
    "ddpo": (
        "DDPO (Denoising Diffusion Policy Optimization): PPO-clip on the sampler's step log-probabilities",
        "Black et al. 2023, arXiv 2305.13301",
        _POLICY,
    ),
    "grpo": (
        "GRPO: group-relative advantages and PPO-clip on the sampler's step log-probabilities",
        "Flow-GRPO, Liu et al. 2025, arXiv 2505.05470; DanceGRPO, Xue et al. 2025",
        (*_POLICY, "group_size", "global_std", "same_noise_per_group", "sde_window"),
    ),
    "nft": (
        "DiffusionNFT: the denoising loss of implicit positive and negative policies on forward-noised clean samples",
        "Zheng et al. 2025, arXiv 2509.16117",
        (*_FORWARD, "nft_beta", "ema_decay_max"),
    ),
    "awm": (
        "AWM (Advantage Weighted Matching): PPO-clip on the weighted matching loss of forward-noised clean samples",
        "Xue et al. 2025; X-GenGroup/Flow-Factory",
        (*_FORWARD, "awm_weighting", "train_clip_range", "old_kl_weight"),
    ),
}
DRAFT_METHOD = (
    "DRaFT-K / AlignProp: the reward's gradient through the last K denoising steps of a full sampling run",
    "Clark et al. 2023, arXiv 2309.17400; Prabhudesai et al. 2023, arXiv 2310.03739",
)
FAMILIES = {
    "sd": "Stable Diffusion 1.x / 2.x (UNet)",
    "sd3": "Stable Diffusion 3 / 3.5 (MMDiT, flow matching)",
    "sdxl": "Stable Diffusion XL (UNet, two CLIP text encoders)",
    "flux": "FLUX.1 (rectified-flow transformer, CLIP + T5)",
    "flux_kontext": "FLUX.1 Kontext (FLUX.1 editing a source image: its latents appended to the sequence)",
    "qwen_image_edit_plus": "Qwen-Image-Edit-Plus (Qwen-Image editing source images read by Qwen2.5-VL)",
    "qwen_image": "Qwen-Image (MMDiT, flow matching, Qwen2.5-VL text encoder)",
    "z_image": "Z-Image / Z-Image-Turbo (single-stream DiT, flow matching, Qwen3 text encoder)",
    "flux2": "FLUX.2 [dev] (rectified-flow transformer, Mistral-Small-3.1 text encoder, embedded guidance)",
    "flux2_klein": "FLUX.2 [klein] (rectified-flow transformer, Qwen3 text encoder)",
    "wan": "Wan 2.1 / 2.2 text-to-video (video DiT, flow matching, UMT5 text encoder)",
    "wan_i2v": "Wan 2.1 / 2.2 image-to-video (Wan animating a first frame: its latents on the channels)",
}
TAGS = {
    "sd": "stable-diffusion",
    "sd3": "stable-diffusion-3",
    "sdxl": "stable-diffusion-xl",
    "flux": "flux",
    "flux_kontext": "flux-kontext",
    "qwen_image_edit_plus": "qwen-image-edit",
    "qwen_image": "qwen-image",
    "z_image": "z-image",
    "flux2": "flux2",
    "flux2_klein": "flux2-klein",
    "wan": "wan",
    "wan_i2v": "wan-i2v",
}


def _value(v) -> str:
    if isinstance(v, list):
        return " ".join(map(str, v))
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def model_card(
    out_dir: str | Path,
    config: dict,
    validation: ValidationSpec,
    trainer: str,
    family_name: str,
    network_class: str,
    network_name: str,
    progress: dict[str, int],
    repo_id: str | None = None,
    notes: list[str] | tuple = (),
):
    """The `ModelCard` of the run in `out_dir` (its validation records are read from out_dir/validation).

    `config`: the resolved config as a dict (`to_dict`; config.json holds the same, a local base model by its
    absolute path): the card lists its settings and names its base model, reward and weights (LoRA or all);
    `validation`: how the run validated (the usage examples draw those images again);
    `progress`: what was trained, e.g. {"optimizer steps": 160} or {"epochs": 16, "optimizer steps": 32};
    `repo_id`: the hub repo it is pushed to (the loading example then names it instead of the folder);
    `notes`: more lines after the validation section (the guard's: refl_ddpo.run.guard)."""
    from huggingface_hub import ModelCard, ModelCardData

    from refl_ddpo.core.models import looks_local

    out_dir = Path(out_dir)
    pretrained_model = config["pretrained_model"]
    base = str(Path(pretrained_model).resolve()) if looks_local(pretrained_model) else pretrained_model
    on_hub = not looks_local(pretrained_model)
    method, reference, settings = METHODS[trainer]
    if trainer == "refl" and config.get(
        "backprop_steps"
    ):  # the same trainer, the reward through the last K steps
        method, reference = DRAFT_METHOD
    where = repo_id or str(out_dir.resolve())
    lora = bool(config["use_lora"])
    tags = ["text-to-image", "diffusers", CARD_TAG, trainer, "lora" if lora else "full-fine-tune"]
    tags.append(TAGS.get(family_name, family_name))
    data = ModelCardData(
        library_name="diffusers",
        pipeline_tag="text-to-image",
        base_model=pretrained_model if on_hub else None,  # the hub checks that it names a hub model
        tags=tags,
    )
    records = validation_files(out_dir)

    lines = [
        f"# {NAMES[trainer]} {'LoRA' if lora else 'fine-tune'} of {Path(base).name}",
        "",
        f"Trained with refl_ddpo by **{method}** ({reference}), rewarded by **{config['reward']}**.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}` |",
        f"| model family | {FAMILIES.get(family_name, family_name)} |",
        f"| method | {NAMES[trainer]} (refl_ddpo.trainers.{trainer}) |",
        f"| trained weights | {'LoRA adapters' if lora else 'the whole ' + network_name} |",
        *(f"| {k} | {v} |" for k, v in progress.items()),
    ]
    for name in (*settings, *_COMMON, *(_LORA if lora else ())):
        if name in config and config[name] is not None:
            lines.append(f"| {name} | `{_value(config[name])}` |")
    lines += ["", "Every setting of the run is in `config.json` beside the weights.", ""]

    lines += _validation_section(records, validation.prompts_file)
    lines += list(notes)
    # Wan 2.2 (text- or image-to-video): the expert(s) the LoRA is on
    expert = config.get("wan_expert") if family_name.startswith("wan") else None
    lines += _usage_section(validation, records, lora, base, where, network_class, network_name, expert)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))


def _validation_section(records: list[dict], prompts_file) -> list[str]:
    """The card's validation table (one row per validation, the reward means) and the last grid."""
    lines = ["## Validation", ""]
    if records:
        last = records[-1]
        sampler = last.get("sampler", {})
        lines += [
            (
                f"{len(last['records'])} images of held-out prompts ({prompts_file}), fixed seeds, "
                f"{sampler.get('scheduler')} with eta 0, {sampler.get('num_inference_steps')} steps, CFG "
                f"{sampler.get('guidance_scale')}, scored by the training reward; the same images at every "
                "validation, so only the weights differ."
            ),
            "",
        ]
        keys = [k for k in last["metrics"] if k.endswith("/mean")]
        lines += ["| " + " | ".join([last["unit"], *keys]) + " |", "|---" * (len(keys) + 1) + "|"]
        for r in records:
            lines.append(
                "| " + " | ".join([str(r["count"]), *(_fmt(r["metrics"].get(k)) for k in keys)]) + " |"
            )
        lines += _drift_table(records[0], last)
        lines += [
            "",
            (
                f"Last validation ({last['unit']} {last['count']}), each image captioned with its reward, seed "
                "and prompt:"
            ),
            "",
            f"![validation grid]({VALIDATION_DIR}/{last['grid']})",
            "",
        ]
    else:
        lines += ["No validation ran (train with `--validation_prompts_file` to get one).", ""]

    return lines


def _drift_table(first: dict, last: dict) -> list[str]:
    """The drift monitors (refl_ddpo.run.drift) at the first and the last validation, one row each; nothing when
    neither record has them."""
    from refl_ddpo.run.drift import PREFIX

    names = list(dict.fromkeys([*first.get("drift", {}), *last.get("drift", {})]))
    if not names:
        return []
    shown = [first] if first is last else [first, last]
    lines = [
        "",
        (
            "Drift monitors at the first and the last validation (image brightness and saturation, the change from "
            "the baseline's images, the diversity across a prompt's seeds, the trained weights' norm; "
            "refl_ddpo.run.drift):"
        ),
        "",
        "| monitor | " + " | ".join(f"{r['unit']} {r['count']}" for r in shown) + " |",
        "|---" * (len(shown) + 1) + "|",
    ]
    for name in names:
        values = (_fmt(r.get("drift", {}).get(name)) for r in shown)
        lines.append(f"| {name.removeprefix(PREFIX)} | " + " | ".join(values) + " |")
    return lines


def _usage_section(
    validation: ValidationSpec,
    records,
    lora: bool,
    base: str,
    where: str,
    network_class: str,
    network_name: str,
    expert: str | None = None,
):
    """Loading the weights with diffusers (`expert`: the Wan 2.2 expert(s) the LoRA is on), and the inference
    script's command that draws the validation again."""
    lines: list[str] = []
    example = records[-1]["records"][0]["prompt"] if records else "a photo of a cat"
    steps = validation.num_steps
    lines += [
        "## How to use",
        "",
        "With diffusers:",
        "",
        "```python",
        "from diffusers import DiffusionPipeline",
        "",
    ]
    if lora:
        lines += [
            f'pipe = DiffusionPipeline.from_pretrained("{base}")',
            f'pipe.load_lora_weights("{where}")',
        ]
        if expert == "transformer_2":
            lines[-1] = f'pipe.load_lora_weights("{where}", load_into_transformer_2=True)'
        elif expert == "both":  # the low-noise expert's in transformer_2/ (core.families.wan_experts)
            kw = 'subfolder="transformer_2", load_into_transformer_2=True'
            lines.append(f'pipe.load_lora_weights("{where}", {kw})')
    else:
        lines[-2] = f"from diffusers import DiffusionPipeline, {network_class}"
        lines += [
            f'{network_name} = {network_class}.from_pretrained("{where}", subfolder="unet")',
            f'pipe = DiffusionPipeline.from_pretrained("{base}", {network_name}={network_name})',
        ]
    lines += [
        (
            f'image = pipe("{example}", num_inference_steps={steps}, '
            f"guidance_scale={validation.guidance_scale:g}, height={validation.resolution}, "
            f"width={validation.resolution}).images[0]"
        ),
        "```",
        "",
        *_kit_example(validation, where, base),
    ]
    return lines


def _kit_example(validation: ValidationSpec, where: str, base: str) -> list[str]:
    """The inference script's command that draws the validation images again (same prompts, seeds, sampler)."""
    command = f"python inference/inference_lora.py --lora_dir {where} --pretrained_model {base}"
    if not validation.prompts_file:
        return ["With this kit:", "", "```bash", command, "```", ""]
    from refl_ddpo.core.prompts import DATA_DIR, PROMPT_SOURCES

    prompts = validation.prompts_file
    if prompts in PROMPT_SOURCES and not Path(prompts).exists():
        prompts = str(DATA_DIR / f"{prompts}.txt")
    flag = "edit_data" if validation.edits else "prompts_file"  # an editing run validates on edit records
    return [
        "With this kit, the validation images again (the same prompts, seeds and sampler):",
        "",
        "```bash",
        (
            f"{command} \\\n  --{flag} {prompts} --seed {validation.seed} --num_images_per_prompt "
            f"{validation.num_images} --num_inference_steps {validation.num_steps} --guidance_scale "
            f"{validation.guidance_scale:g} --resolution {validation.resolution}"
        ),
        "```",
        "",
    ]


def is_our_card(path: Path) -> bool:
    """Whether `path` is a model card this kit wrote (so that --overwrite_output_dir may delete it)."""
    import yaml
    from huggingface_hub import metadata_load

    try:
        meta = metadata_load(path) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(meta, dict) and CARD_TAG in (meta.get("tags") or [])
