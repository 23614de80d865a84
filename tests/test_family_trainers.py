"""Every trainer on every model family (tests/family_specs.py), in this process on the tiny random folders: ReFL
training a LoRA that loads in the stock pipeline, with validation and a card that name the family and a scored
before / after inference; one of DRaFT-K, AlignProp and DRaFT-LV per family; GRPO, DiffusionNFT and AWM for two epochs;
each moving its LoRA and no base weight, with every network call of its loop near the loop. What a family owes the kit
below the trainers (the loop against the stock pipeline, the reward gradient, DDPO's first update):
tests/test_family_conformance.py."""

import importlib
from pathlib import Path

import pytest
from family_specs import FAMILIES, NAMES, RES, Spec, stock_pipeline
from helpers import (
    DRAFT_CASES,
    assert_lora_changes_stock_images,
    assert_lora_moves_the_scores,
    trainer_flags,
    watch_training,
)

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


# ---- the trainers, in this process ----


def _refl_flags(spec: Spec, tiny_models, out: Path, *extra: str, **flags) -> list[str]:
    recipe = {"num_inference_steps": 4, "k_lo": 2, "k_hi": 3} | spec.refl_flags
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=spec.model,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        device="cpu",
        report_to="none",
        **(recipe | flags),
    )


def _policy_flags(spec: Spec, tiny_models, out: Path, **flags) -> list[str]:
    return trainer_flags(
        tiny_models,
        out,
        model=spec.model,
        reward="jpeg_compressibility",
        prompt_fn="simple_animals",  # prompts of unequal lengths: an epoch's batches concatenate padded
        sample_num_steps=3,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        learning_rate="3e-2",
        lora_init="random",
        num_epochs=2,
        device="cpu",
        report_to="none",
        **(spec.policy_flags | flags),
    )


@pytest.mark.parametrize("name", NAMES)
def test_refl_trains_a_lora_that_loads_in_the_stock_pipeline_and_the_card_names_the_family(
    name, tiny_models, tmp_path, capsys, monkeypatch
):
    """ReFL (ImageReward, the KL term on) for 2 steps with validation: the LoRA moved and no base weight did, it
    changes the stock pipeline's images, the run, the validation files and the model card name the family, and the
    before / after inference with its scores and the scored comparison see it."""
    from refl_ddpo.run.model_card import CARD_NAME
    from refl_ddpo.run.validation import validation_files
    from refl_ddpo.trainers import refl

    spec = FAMILIES[name]
    watch = watch_training(monkeypatch)
    prompts = tmp_path / "validation.txt"
    prompts.write_text("a photo of a cat\n")
    out = tmp_path / "refl"
    flags = {"validation_prompts_file": prompts, "num_validation_images": 1, "validation_num_steps": 3}
    refl.main(_refl_flags(spec, tiny_models, out, max_train_steps=2, kl_weight=1, **flags))
    printed = capsys.readouterr().out
    assert f"model family: {spec.name}" in printed and f"sampler: {spec.refl_sampler}" in printed
    watch.assert_lora_moved_and_base_not(out)
    watch.assert_loop_near_the_network()
    assert_lora_changes_stock_images(stock_pipeline(spec, tiny_models / spec.model), out, RES, part=spec.part)
    records = validation_files(out)
    assert [r["count"] for r in records] == [0, 2] and {r["family"] for r in records} == {spec.name}
    card = (out / CARD_NAME).read_text()
    assert spec.card[0] in card and spec.card[1] in card

    guidance = spec.refl_flags.get("guidance_scale")
    extra = ["--resolution", str(RES)] + (["--guidance_scale", str(guidance)] if guidance else [])
    assert_lora_moves_the_scores(tiny_models, tiny_models / spec.model, out, prompts, tmp_path, *extra)


# Each family runs one of the three variants, each variant three families (DRaFT-LV on SD 1.x's UNet and DDPM rollout):
# what differs between families on these paths (the grad steps under checkpoint, add_noise, step, cond_cat, the decode)
# is run on every family by test_denoise_reaches_the_network_in_two_kit_frames, the reward-gradient test and
# test_trainer_runs_two_epochs (DiffusionNFT and AWM re-noise with add_noise); the variants' own logic does not
# depend on the family (tests/test_draft.py).
DRAFT_RUNS = [(name, *DRAFT_CASES[(i + 2) % len(DRAFT_CASES)]) for i, name in enumerate(NAMES)]


@pytest.mark.parametrize("name, flags, described", DRAFT_RUNS, ids=[f"{n}-{d}" for n, _, d in DRAFT_RUNS])
def test_draft_k_alignprop_and_draft_lv_run_two_steps(
    name, flags, described, tiny_models, tmp_path, capsys, monkeypatch
):
    from refl_ddpo.trainers import refl

    spec = FAMILIES[name]
    watch = watch_training(monkeypatch)
    out = tmp_path / "draft"
    refl.main(_refl_flags(spec, tiny_models, out, *flags, max_train_steps=2))
    assert described in capsys.readouterr().out
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    watch.assert_lora_moved_and_base_not(out)
    watch.assert_loop_near_the_network()


# DDPO is not among them: it is GRPO's loop (refl_ddpo.trainers.policy_gradient's `train`) with its own epoch plan and
# advantages, neither of which looks at the family; its sampling and first PPO update on every family are
# tests/test_family_conformance.py's test_ddpo_first_update_is_on_policy_through_the_sample_buffers, its script end to
# end tests/test_ddpo.py's (SD 1.x) and test_sd3.py's.
@pytest.mark.parametrize("trainer", ["grpo", "nft", "awm"])
@pytest.mark.parametrize("name", NAMES)
def test_trainer_runs_two_epochs(name, trainer, tiny_models, tmp_path, capsys, monkeypatch):
    """GRPO (KL to the base on), DiffusionNFT and AWM for two epochs: the LoRA moved and no base weight did, every
    network call of the loop was at most 3 kit frames below it; GRPO's and DiffusionNFT's load in the stock pipeline
    and change its images."""
    spec = FAMILIES[name]
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    extra = {"grpo": {"group_size": 2, "beta": "0.04"}}.get(trainer, {"group_size": 2})
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(
        _policy_flags(spec, tiny_models, out, **extra)
    )
    assert "epoch 2/2" in capsys.readouterr().out
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    watch.assert_lora_moved_and_base_not(out)
    watch.assert_loop_near_the_network()
    if trainer in ("grpo", "nft"):
        assert_lora_changes_stock_images(
            stock_pipeline(spec, tiny_models / spec.model), out, RES, part=spec.part
        )
