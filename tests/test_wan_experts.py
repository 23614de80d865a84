"""--wan_expert both on the tiny Wan 2.2 (5 frames of 16 x 16 px, JPEG size per frame as reward): GRPO and
DiffusionNFT for two epochs with a LoRA on each expert, both moving (each got a gradient) and no base weight of
either; the two LoRAs load into the stock WanPipeline in two calls (the low-noise one from transformer_2/) and change
its video, and inference_lora.py draws that video; GRPO's first update is on policy; a run resumed from checkpoint-1
ends with both LoRAs bit-identical to the uninterrupted run's; the flag refused in one line, before loading, on Wan
2.1 and with --fsdp; (-m slow) two processes (DDP) train the pair, both experts or one (the other frozen), and end
with the same weights."""

import importlib
import shutil

import pytest
import torch
from diffusers import WanPipeline
from helpers import ddpo_first_update, watch_training
from safetensors.torch import load_file
from test_wan_training import RES, _flags, _stock_video, lora_inference_video

from refl_ddpo.core.families import load_family
from refl_ddpo.core.lora import EXPERT_2_DIR, LORA_WEIGHTS_NAME, add_lora

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

MODEL = "tiny-wan22"
EXPERT_FILES = {"transformer": LORA_WEIGHTS_NAME, "transformer_2": f"{EXPERT_2_DIR}/{LORA_WEIGHTS_NAME}"}


def _train(trainer, tiny_models, out, *extra, **flags):
    """`trainer` with --wan_expert both for two epochs in groups of 2, watched; returns the watch."""
    with pytest.MonkeyPatch.context() as mp:
        watch = watch_training(mp)
        importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(
            [*_flags(tiny_models, out, MODEL, wan_expert="both", group_size=2, **flags), *extra]
        )
    return watch


# KL to the base (both experts' LoRA off), a checkpoint after each epoch
GRPO = {"beta": "0.04", "save_freq": 1}


@pytest.fixture(scope="module")
def grpo_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("experts") / "grpo"
    return out, _train("grpo", tiny_models, out, **GRPO)


def assert_both_moved_and_no_base(watch, out):
    """The watch's check (the saved LoRA moved, no base weight did: both experts' base weights are the pipeline's),
    and per expert: its LoRA got a gradient, and its own file moved from its start."""
    from refl_ddpo.core.lora import read_lora_state

    watch.assert_lora_moved_and_base_not(out)
    seen = watch.runs[-1]
    saved = read_lora_state(seen["family"].network, out)  # both files, under the experts' names
    for name in EXPERT_FILES:
        assert any(n.startswith(f"{name}.") for n in seen["graded"]), f"no gradient reached {name}'s LoRA"
        mine = [k for k in saved if k.startswith(f"{name}.")]
        assert mine and any(not torch.equal(saved[k], seen["lora"][k]) for k in mine), (
            f"{name}'s LoRA is its start"
        )
    assert any(n.startswith("transformer_2.") for n in seen["base"]), (
        "the low-noise expert's base was not watched"
    )


def stock_videos(model_dir, lora_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock pipeline's video of "a cat" before and after the two loads a user makes (the model card's); every
    saved matrix of each file lands in its expert."""
    pipe = WanPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    before = _stock_video(pipe)
    pipe.load_lora_weights(str(lora_dir))
    pipe.load_lora_weights(str(lora_dir), subfolder=EXPERT_2_DIR, load_into_transformer_2=True)
    for expert, file in EXPERT_FILES.items():
        saved = load_file(lora_dir / file)
        loaded = [n for n, _ in getattr(pipe, expert).named_parameters() if "lora_" in n]
        assert saved and all(k.startswith("transformer.") for k in saved) and len(loaded) == len(saved), (
            expert
        )
    return before, _stock_video(pipe)


def test_grpo_trains_both_experts_and_the_stock_pipeline_loads_them(grpo_run, tiny_models, tmp_path):
    out, watch = grpo_run
    assert_both_moved_and_no_base(watch, out)
    before, after = stock_videos(tiny_models / MODEL, out)
    assert (before - after).abs().max() > 1e-4
    assert (lora_inference_video(out, tmp_path) - after[0]).abs().max() * 255 <= 1  # inference_lora.py: both
    card = (out / "README.md").read_text()
    assert f'subfolder="{EXPERT_2_DIR}", load_into_transformer_2=True' in card


def test_grpo_resumed_from_checkpoint_1_restores_both(grpo_run, tiny_models, tmp_path, capsys):
    whole, _ = grpo_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-1", resumed / "checkpoint-1")
    assert (resumed / "checkpoint-1" / EXPERT_FILES["transformer_2"]).is_file()
    _train("grpo", tiny_models, resumed, "--resume_from_checkpoint", "latest", **GRPO)
    assert "resumed from" in capsys.readouterr().out
    for file in EXPERT_FILES.values():
        a, b, first = (load_file(d / file) for d in (whole, resumed, whole / "checkpoint-1"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
        assert any(not torch.equal(first[k], a[k]) for k in a), f"{file}: the resumed epoch did not train"


def test_nft_trains_both_experts(tiny_models, tmp_path):
    out = tmp_path / "nft"
    watch = _train("nft", tiny_models, out)
    assert_both_moved_and_no_base(watch, out)
    before, after = stock_videos(tiny_models / MODEL, out)
    assert (before - after).abs().max() > 1e-4


def test_grpo_first_update_with_both_experts_is_on_policy(tiny_models):
    torch.manual_seed(0)
    family = load_family(str(tiny_models / MODEL), expert="both")
    family.num_frames = 5
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    assert {n.split(".")[0] for n, p in family.network.named_parameters() if p.requires_grad} == set(
        EXPERT_FILES
    )
    kw = {"num_steps": 3, "guidance_scale": 4.0, "eta": 1.0}
    _, first = ddpo_first_update(
        family, scheduler, params, family.empty_cond(), ["a cat", "a bird"] * 4, RES, **kw
    )
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


@pytest.mark.parametrize(
    ("model", "extra", "says"), [("tiny-wan21", (), "has one expert"), (MODEL, ("--fsdp",), "--fsdp is not")]
)
def test_both_refused_before_loading(model, extra, says, tiny_models, tmp_path, monkeypatch, capsys):
    from refl_ddpo.core import models
    from refl_ddpo.trainers import grpo

    monkeypatch.setattr(models, "load_pipeline", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit):
        grpo.main([*_flags(tiny_models, tmp_path / "out", model, wan_expert="both", group_size=2), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[0].startswith("error: --wan_expert both") and says in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize(("expert", "batch"), [("both", "2"), ("transformer", "1"), ("transformer", "2")])
def test_two_processes_train_the_pair(expert, batch, tiny_models, tmp_path):
    """GRPO on two processes (DDP over the pair; a backward that ran one expert leaves the other's LoRA unused, which
    DDP must find): two epochs, the LoRA file(s) written, every process with the same weights. With one trained
    expert the steps of the frozen one go through the pair too (its zero link made inside the wrapped call): called
    directly, they hung both processes after epoch 1's sampling, and so did a micro-batch whose rows called both
    experts in two forwards before one backward (now one forward of the pair); a hang fails here at run_two's time
    limit. About 15-30 s each on 2 cores."""
    from helpers import run_two

    out = tmp_path / "two"
    flags = _flags(tiny_models, out, MODEL, wan_expert=expert, group_size=2, beta="0.04")
    flags[flags.index("--train_batch_size") + 1] = batch  # 2: micro-batches whose rows straddle the boundary
    r = run_two("train_grpo.sh", flags)
    assert "weights identical on all 2 process(es)" in r.stdout, r.stdout[-2000:]
    files = EXPERT_FILES.values() if expert == "both" else [LORA_WEIGHTS_NAME]
    assert all((out / file).is_file() for file in files)
    assert expert == "both" or not (out / EXPERT_2_DIR).exists()
