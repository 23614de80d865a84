"""Beyond one GPU: FSDP2 through accelerate (--fsdp), on CPU processes over gloo; ReFL LoRA on tiny SD3 here
(tests/test_fsdp_grpo.py: GRPO, several machines and the settings refused; tests/test_fsdp_full.py: the full
fine-tune, FLUX.1 and where the weights live before `prepare`).

Sharding changes where the weights live, not the arithmetic: two processes with --fsdp train the weights of the same
two processes without it (DDP: each holds the whole network, the gradients all-reduced) to 1e-5, with validation,
sharded checkpoints (--fsdp_checkpoint sharded: DCP shards) and the text encoders sharded too; resumed from a
sharded checkpoint, the run equals the uninterrupted one bit for bit; the final weights are the diffusers files a
stock pipeline loads. (Not the single-process run: each process draws its own prompts and noise, seeded by its rank,
so one process with twice the batch sees other samples.)"""

import json

import pytest
import torch
from helpers import (
    FSDP_SHARDS,
    FSDP_TOL,
    assert_close,
    assert_lora_changes_stock_images,
    dcp_model,
    free_port,
    refl_flags,
    resume_two,
    saved_lora,
)

from refl_ddpo.core.lora import CONFIG_NAME, FULL_UNET_DIR, LORA_WEIGHTS_NAME
from refl_ddpo.core.sharding import SHARDS_DIR, peft_keys_to_model

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load(no_dist=True), on purpose
def test_refl_lora_under_fsdp_with_validation_and_sharded_checkpoints_equals_the_unsharded_run(
    two_process_runs, tiny_models
):
    """The FSDP run (validation, --fsdp_checkpoint sharded, the text encoders sharded too) against DDP's: the same
    final LoRA and checkpoint-2 LoRA to 1e-5, validation alike; checkpoint-N holds each process' DCP shards (listed
    in checkpoint.json), no gathered weights or optimizer; the final LoRA is in the diffusers format and the saved
    config carries the flags."""
    (ddp, rd), (fsdp, rf) = two_process_runs("refl-ddp"), two_process_runs("refl-fsdp")
    assert "weights sharded over 2 process(es) (FSDP2): one copy" in rf.stdout
    assert_close(saved_lora(fsdp), saved_lora(ddp))
    assert rf.stdout.count("validation after step") == rd.stdout.count("validation after step") == 3
    for name in ("step-0.json", "step-2.json", "step-3.json"):
        a = json.loads((ddp / "validation" / name).read_text())
        b = json.loads((fsdp / "validation" / name).read_text())
        assert a.keys() == b.keys()
        for key in a:
            if "mean" in key and isinstance(a[key], float):
                assert abs(a[key] - b[key]) <= FSDP_TOL, (name, key)
    assert sorted(p.name for p in fsdp.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    checkpoint = fsdp / "checkpoint-2"
    shards = sorted(p.name for p in (checkpoint / SHARDS_DIR).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    listed = json.loads((checkpoint / "checkpoint.json").read_text())["files"]
    assert {f"{SHARDS_DIR}/{name}" for name in shards} <= listed.keys()
    assert not (checkpoint / LORA_WEIGHTS_NAME).exists() and not (checkpoint / FULL_UNET_DIR).exists()
    assert not list(checkpoint.glob("optimizer*")) and not list(checkpoint.glob("*.bin"))
    lora = peft_keys_to_model(saved_lora(ddp / "checkpoint-2"))
    assert_close(dcp_model(checkpoint), {k.removeprefix("transformer."): v for k, v in lora.items()})
    saved = json.loads((fsdp / CONFIG_NAME).read_text())
    assert saved["fsdp_checkpoint"] == "sharded" and saved["fsdp_shard_text_encoders"] is True


def test_fsdp_lora_loads_in_the_stock_pipeline(two_process_runs, tiny_models):
    from diffusers import StableDiffusion3Pipeline

    fsdp, _ = two_process_runs("refl-fsdp")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_models / "tiny-sd3")
    assert_lora_changes_stock_images(pipe, fsdp, 32, part="transformer")


def test_sharded_checkpoint_resumes_to_the_uninterrupted_weights_on_as_many_processes(
    two_process_runs, tiny_models, tmp_path
):
    """Resumed with latest from the FSDP run's sharded checkpoint-2 (what a run killed after it leaves;
    helpers.resume_two): the final LoRA and the last checkpoint's counters equal the
    uninterrupted run's bit for bit. On another process count it is one line (as for every checkpoint)."""
    from refl_ddpo.core.errors import UserError
    from refl_ddpo.run.resume_fit import check_resume_fits
    from refl_ddpo.trainers.refl_config import ReFLConfig

    reference, _ = two_process_runs("refl-fsdp")
    record = json.loads((reference / "checkpoint-2" / "checkpoint.json").read_text())
    cfg = ReFLConfig(**json.loads((reference / "config.json").read_text()))  # the run's, resolved
    with pytest.raises(
        UserError, match=r"written by 2 process\(es\), this run has 1; resume it with NUM_PROCESSES=2"
    ):
        check_resume_fits(reference / "checkpoint-2", record, cfg, record["trainer"], "max_train_steps", 1)
    out = tmp_path / "resumed"
    r = resume_two(
        reference / "checkpoint-2", "train_refl_lora.sh", refl_flags(tiny_models, out, *FSDP_SHARDS)
    )
    assert "resumed from" in r.stdout and "checkpoint-2" in r.stdout
    resumed, uninterrupted = saved_lora(out), saved_lora(reference)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert json.loads((out / "checkpoint-3" / "train_state.json").read_text()) == json.loads(
        (reference / "checkpoint-3" / "train_state.json").read_text()
    )


# ---- --fsdp_shard_text_encoders: the frozen text encoders sharded per block too ----


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _encode_sharded(rank: int, tiny_models, port: int) -> None:
    """One of two processes over gloo (torch.multiprocessing.spawn): each family's text encoders, loaded sharded,
    hold about half of their weights on this process, encode (the prompts, the negative, `empty_cond`) as the
    whole ones in this process bit for bit, and are resharded after each encode. The two processes encode other
    prompts, other counts of them (the all-gathers do not depend on the input)."""
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from refl_ddpo.core.families import load_family

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    prompts = [["a red cube", "two blue spheres on a table"], ["a green pyramid"]][rank]
    try:
        # tiny SD3's text encoders (two CLIPs and T5): the run below
        for model in ("tiny-flux", "tiny-qwen-image", "tiny-z-image", "tiny-flux2", "tiny-flux2-klein-base"):
            whole = load_family(str(tiny_models / model))
            sharded = load_family(str(tiny_models / model), shard_text_encoders=True)
            params = [p for m in sharded.text_encoders() for p in m.parameters()]
            assert params and all(isinstance(p, DTensor) for p in params), model
            held, total = sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)
            assert abs(held / total - 0.5) < 0.01, (model, held, total)
            for with_negative in (False, True):
                a = whole.encode_prompts(prompts, with_negative)
                b = sharded.encode_prompts(prompts, with_negative)
                assert _equal(a[0], b[0]) and _equal(a[1], b[1]), (model, with_negative)
            assert _equal(whole.empty_cond(), sharded.empty_cond()), model
            # resharded after each encode: the registered parameters are the sharded ones again (gathered, FSDP2
            # registers plain tensors in their place)
            assert all(isinstance(p, DTensor) for m in sharded.text_encoders() for p in m.parameters()), model
    finally:
        dist.destroy_process_group()


def test_sharded_text_encoders_encode_as_the_whole_ones(tiny_models):
    """FLUX.1's CLIP and T5, Qwen-Image's Qwen2.5-VL and FLUX.2's Mistral3 / Qwen3, sharded per block over two
    processes (`refl_ddpo.core.sharding.shard_frozen`): the same conditioning as unsharded, bit for bit
    (`_encode_sharded`)."""
    import torch.multiprocessing as mp

    mp.spawn(_encode_sharded, args=(tiny_models, free_port()), nprocs=2)
