"""DeepSpeed ZeRO-2 through accelerate (--deepspeed_zero 2, refl_ddpo/run/zero.py), on CPU processes over gloo.

ZeRO-2 partitions the optimizer state and the gradients, not the arithmetic: two processes under it train the weights
of the same two processes without it (DDP) to 1e-5 (GRPO on tiny SD3, LoRA, its KL switching the LoRA off, the
gradients clipped by DeepSpeed at --max_grad_norm); a run resumed from our checkpoint files
(safetensors, no DeepSpeed pickles) equals the uninterrupted one bit for bit; a NaN gradient stops a ReFL run in one
line before the update (DeepSpeed skips the step, the guard sees its inf norm); ZeRO-3, --fsdp beside it and one
process are refused in one line before any model loads. On the CPU DeepSpeed's shared-memory op is left out
(refl_ddpo.run.zero.without_cpu_comm_op): nothing is compiled."""

import pytest
import torch
from helpers import (
    REPO,
    ZERO2,
    assert_close,
    assert_lora_changes_stock_images,
    grpo_flags,
    refused,
    resume_two,
    run_script,
    saved_lora,
    script_env,
    trainer_flags,
)

from refl_ddpo.core.lora import LORA_WEIGHTS_NAME
from refl_ddpo.run.zero import OPTIMIZER_FILE, OPTIMIZER_GROUPS

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


def test_grpo_lora_under_zero2_equals_the_ddp_run_and_loads(two_process_runs, tiny_models):
    from diffusers import StableDiffusion3Pipeline

    (ddp, _), (zero, r) = two_process_runs("grpo-ddp"), two_process_runs("grpo-zero2")
    assert "weights identical on all 2 process(es)" in r.stdout
    assert_close(saved_lora(zero), saved_lora(ddp))
    assert_close(saved_lora(zero / "checkpoint-1"), saved_lora(ddp / "checkpoint-1"))
    assert any(not torch.equal(v, saved_lora(zero / "checkpoint-1")[k]) for k, v in saved_lora(zero).items())
    # ours, not DeepSpeed's pickled engine state: the optimizer gathered as safetensors
    saved = zero / "checkpoint-1"
    assert (saved / OPTIMIZER_FILE).is_file() and (saved / OPTIMIZER_GROUPS).is_file()
    assert not list(saved.glob("*.bin")) and not list(saved.glob("*.pt"))
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_models / "tiny-sd3")
    assert_lora_changes_stock_images(pipe, zero, 32, part="transformer")


def test_zero2_checkpoint_resumes_to_the_uninterrupted_weights(two_process_runs, tiny_models, tmp_path):
    """GRPO under ZeRO-2 resumed with latest from the run's checkpoint-1 (what a run killed after it leaves;
    helpers.resume_two): the LoRA equals the uninterrupted ZeRO-2 run's bit for bit."""
    reference, _ = two_process_runs("grpo-zero2")
    out = tmp_path / "resumed"
    flags = grpo_flags(tiny_models, out, *ZERO2)
    r = resume_two(reference / "checkpoint-1", "train_grpo.sh", flags)
    assert "resumed from" in r.stdout and "1 epoch(s) done" in r.stdout
    resumed, uninterrupted = saved_lora(out), saved_lora(reference)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


# --reward test_deepspeed:nan_grad_after_first (this folder on PYTHONPATH): finite rewards, a NaN gradient from the
# second call of each process on
_CALLS = [0]


def nan_grad_after_first(images, prompts, metadata):
    _CALLS[0] += 1
    rewards = images.float().mean(dim=(1, 2, 3))
    if _CALLS[0] > 1:  # d sqrt(x) / dx at 0, times 0
        rewards = rewards + (images.float().sum() * 0).sqrt()
    return rewards, {}


nan_grad_after_first.differentiable = True


def test_a_nan_gradient_under_zero2_stops_before_the_update_in_one_line(tiny_models, tmp_path):
    out = tmp_path / "out"
    flags = trainer_flags(
        tiny_models,
        out,
        *ZERO2,
        model="tiny-sd3",
        reward="test_deepspeed:nan_grad_after_first",
        num_inference_steps=3,
        k_lo=1,
        k_hi=2,
        train_batch_size=2,
        max_train_steps=2,
        checkpointing_steps=1,
        device="cpu",
        report_to="none",
    )
    env = script_env(NUM_PROCESSES="2", PYTHONPATH=f"{REPO / 'tests'}:{script_env().get('PYTHONPATH', '')}")
    r = run_script("train_refl_lora.sh", flags, env, timeout=400)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and last.startswith("error: the gradient norm is inf at step 2"), r.stderr[
        -3000:
    ]
    assert "checkpoint-1 stays the newest" in last
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (out / LORA_WEIGHTS_NAME).exists()


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--deepspeed_zero", "3"], "--deepspeed_zero 3 empties every weight outside a forward"),
        (["--deepspeed_zero", "2", "--fsdp"], "--deepspeed_zero and --fsdp are two engines"),
        (
            ["--deepspeed_zero", "2"],
            "--deepspeed_zero partitions the optimizer state over several processes but",
        ),
    ],
)
def test_zero3_zero2_with_fsdp_and_zero2_on_one_process_are_one_line_before_loading(
    extra, says, tiny_models, tmp_path, capsys, monkeypatch
):
    """The first case through the script, the others in this process (helpers.refused)."""
    flags = trainer_flags(
        tiny_models, tmp_path / "x", *extra, model="tiny-sd3", device="cpu", report_to="none"
    )
    through_script = extra == ["--deepspeed_zero", "3"]
    code, err = refused(monkeypatch, capsys, "train_grpo.sh", flags, through_script, script_env())
    lines = [line for line in err.strip().splitlines() if not line.startswith("running ")]
    assert code == 2 and len(lines) == 1 and says in lines[0], err[-3000:]
    assert not (tmp_path / "x" / "run.json").exists(), "the folder is given back"


def test_accelerate_config_file_names_the_settings_of_the_flag():
    """train_scripts/accelerate/deepspeed_zero2.yaml names what --deepspeed_zero 2 builds (refl_ddpo.run.zero)."""
    import yaml

    from refl_ddpo.run.zero import deepspeed_config

    shipped = yaml.safe_load((REPO / "train_scripts" / "accelerate" / "deepspeed_zero2.yaml").read_text())
    assert shipped["distributed_type"] == "DEEPSPEED"
    ds = shipped["deepspeed_config"]
    built = deepspeed_config(2, micro_batch=2, accumulation=3, max_grad_norm=0.5, mixed_precision="bf16")
    assert ds["zero_stage"] == built["zero_optimization"]["stage"] == 2
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"
    assert (
        "offload_optimizer" not in built["zero_optimization"]
        and "offload_param" not in built["zero_optimization"]
    )
    assert ds["zero3_init_flag"] is False
    assert shipped["mixed_precision"] == "bf16" and built["bf16"] == {"enabled": True}
    assert built["fp16"] == {"enabled": False}
    assert (built["train_micro_batch_size_per_gpu"], built["gradient_accumulation_steps"]) == (2, 3)
    assert built["gradient_clipping"] == 0.5
