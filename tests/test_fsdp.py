"""Beyond one GPU: FSDP2 through accelerate (--fsdp) and several machines (NUM_MACHINES ...), on CPU processes over gloo.

Sharding changes where the weights live, not the arithmetic: two processes with --fsdp train the weights of the same
two processes without it (DDP: each holds the whole network, the gradients all-reduced) to 1e-5 (ReFL and GRPO on
tiny SD3, and ReFL on tiny FLUX.1; LoRA and full fine-tune); a run killed with -9 and resumed under FSDP equals the
uninterrupted one, with gathered checkpoints or sharded ones (--fsdp_checkpoint sharded: DCP shards); two launchers
on one machine as machines 0 and 1 train one run; the final weights are the diffusers files a stock pipeline loads. (Not the single-process run: each process draws its own prompts and noise,
seeded by its rank, so one process with twice the batch sees other samples.)"""

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_lora_changes_stock_images, kill_after, run_script, script_env, trainer_flags
from safetensors.torch import load_file

from refl_ddpo.lora import FULL_UNET_DIR, LORA_WEIGHTS_NAME
from refl_ddpo.sharding import SHARDS_DIR, peft_keys_to_model

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

TOL = 1e-5
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _grpo_flags(tiny_models, out: Path, *extra: str) -> list[str]:
    """Tiny SD3, 2 processes x 2 samples in groups of 2, an SDE window of 2, beta; 2 epochs, a checkpoint after
    each."""
    return trainer_flags(
        tiny_models,
        out,
        "--global_std",
        *extra,
        model="tiny-sd3",
        sample_num_steps=4,
        sample_batch_size=2,
        sample_num_batches_per_epoch=1,
        train_batch_size=2,
        group_size=2,
        sde_window=2,
        beta="0.04",
        learning_rate="3e-2",
        num_epochs=2,
        save_freq=1,
        device="cpu",
        report_to="none",
        lora_init="random",
    )


def _refl_flags(tiny_models, out: Path, *extra: str, model: str = "tiny-sd3") -> list[str]:
    """ReFL, 3 steps of 2 micro-batches of 2 per process, checkpoint-2."""
    return trainer_flags(
        tiny_models,
        out,
        *extra,
        model=model,
        num_inference_steps=4,
        k_lo=2,
        k_hi=3,
        train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate="3e-2",
        max_train_steps=3,
        checkpointing_steps=2,
        device="cpu",
        report_to="none",
        lora_init="random",
    )


def _run(script: str, args: list[str], **env) -> subprocess.CompletedProcess:
    r = run_script(script, args, script_env(NUM_PROCESSES="2", **env), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _assert_close(a: dict, b: dict, tol: float = TOL) -> float:
    assert a.keys() == b.keys() and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, worst
    return worst


def _lora(folder: Path) -> dict:
    return load_file(folder / LORA_WEIGHTS_NAME)


_runs: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    """Each named two-process run once per module: (output folder, completed process)."""

    def run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        if name not in _runs:
            out = tmp_path_factory.mktemp(name) / "run"
            script, flags = {
                "grpo-ddp": ("train_grpo.sh", _grpo_flags(tiny_models, out)),
                "grpo-fsdp": ("train_grpo.sh", _grpo_flags(tiny_models, out, "--fsdp")),
                "refl-ddp": ("train_refl_lora.sh", _refl_flags(tiny_models, out, *VALIDATION)),
                "refl-fsdp": ("train_refl_lora.sh", _refl_flags(tiny_models, out, "--fsdp", *VALIDATION)),
                "refl-fsdp-shards": ("train_refl_lora.sh", _refl_flags(tiny_models, out, *SHARDS)),
                "full-ddp": ("train_refl_lora.sh", _refl_flags(tiny_models, out, *FULL)),
                "full-fsdp": ("train_refl_lora.sh", _refl_flags(tiny_models, out, "--fsdp", *FULL)),
            }[name]
            _runs[name] = out, _run(script, flags)
        return _runs[name]

    yield run
    _runs.clear()


# validation: every process draws (a sharded network needs all of them in each forward), the main one writes
VALIDATION = (
    "--gradient_checkpointing",
    *("--validation_prompts_file", "toy_world_heldout", "--validation_steps", "2"),
    *("--num_validation_images", "1", "--validation_num_steps", "2"),
)
FULL = ("--no-use_lora", "--learning_rate", "1e-3")
# --fsdp_checkpoint sharded: checkpoint-1, -2 and -3, the last two kept
SHARDS = (
    *("--fsdp", *VALIDATION, "--fsdp_checkpoint", "sharded"),
    *("--checkpointing_steps", "1", "--checkpoints_total_limit", "2"),
)


def test_grpo_lora_under_fsdp_equals_the_unsharded_run(runs):
    (ddp, _), (fsdp, r) = runs("grpo-ddp"), runs("grpo-fsdp")
    assert "weights sharded over 2 process(es) (FSDP2): one copy" in r.stdout
    _assert_close(_lora(fsdp), _lora(ddp))
    _assert_close(_lora(fsdp / "checkpoint-1"), _lora(ddp / "checkpoint-1"))
    assert any(not torch.equal(v, _lora(fsdp / "checkpoint-1")[k]) for k, v in _lora(fsdp).items())
    # the optimizer state is kept gathered, as safetensors, not pickled
    assert (fsdp / "checkpoint-1" / "optimizer_fsdp.safetensors").is_file()
    assert not list((fsdp / "checkpoint-1").glob("*.bin"))


def test_refl_lora_under_fsdp_with_validation_and_checkpointing_equals_the_unsharded_run(runs, tiny_models):
    (ddp, rd), (fsdp, rf) = runs("refl-ddp"), runs("refl-fsdp")
    _assert_close(_lora(fsdp), _lora(ddp))
    _assert_close(_lora(fsdp / "checkpoint-2"), _lora(ddp / "checkpoint-2"))
    assert rf.stdout.count("validation after step") == rd.stdout.count("validation after step") == 3
    for name in ("step-0.json", "step-2.json", "step-3.json"):
        a = json.loads((ddp / "validation" / name).read_text())
        b = json.loads((fsdp / "validation" / name).read_text())
        assert a.keys() == b.keys()
        for key in a:
            if "mean" in key and isinstance(a[key], float):
                assert abs(a[key] - b[key]) <= TOL, (name, key)


def test_fsdp_lora_loads_in_the_stock_pipeline(runs, tiny_models):
    from diffusers import StableDiffusion3Pipeline

    fsdp, _ = runs("refl-fsdp")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_models / "tiny-sd3")
    assert_lora_changes_stock_images(pipe, fsdp, 32, part="transformer")


def test_full_finetune_under_fsdp_equals_the_unsharded_run_and_loads(runs, tiny_models):
    from diffusers import SD3Transformer2DModel

    (ddp, _), (fsdp, _) = runs("full-ddp"), runs("full-fsdp")
    # not bit-equal: FSDP's reduce-scatter sums in another order than DDP's all-reduce (about 1e-7 measured)
    _assert_close(load_file(fsdp / FULL_UNET_DIR / WEIGHTS), load_file(ddp / FULL_UNET_DIR / WEIGHTS))
    assert (
        json.loads((fsdp / FULL_UNET_DIR / "config.json").read_text())["_class_name"]
        == "SD3Transformer2DModel"
    )
    loaded = SD3Transformer2DModel.from_pretrained(fsdp / FULL_UNET_DIR)
    base = SD3Transformer2DModel.from_pretrained(tiny_models / "tiny-sd3" / "transformer")
    saved = load_file(fsdp / FULL_UNET_DIR / WEIGHTS)
    assert all(torch.equal(p, saved[n]) for n, p in loaded.state_dict().items())
    assert any(not torch.equal(p, base.state_dict()[n]) for n, p in loaded.state_dict().items())
    _assert_close(
        load_file(fsdp / "checkpoint-2" / FULL_UNET_DIR / WEIGHTS),
        load_file(ddp / "checkpoint-2" / FULL_UNET_DIR / WEIGHTS),
    )


def test_killed_fsdp_run_resumes_to_the_uninterrupted_weights(runs, tiny_models, tmp_path):
    """GRPO under FSDP, killed (-9, the launcher's whole group) after checkpoint-1, resumed with latest: the LoRA
    equals the uninterrupted FSDP run's bit for bit, and the counters too."""
    reference, _ = runs("grpo-fsdp")
    out = tmp_path / "killed"
    flags = _grpo_flags(tiny_models, out, "--fsdp")
    kill_after(out / "checkpoint-1", "train_grpo.sh", flags)
    assert not (out / LORA_WEIGHTS_NAME).exists(), "killed before the end"
    r = _run("train_grpo.sh", [*flags, "--resume_from_checkpoint", "latest"])
    assert "resumed from" in r.stdout and "1 epoch(s) done" in r.stdout
    resumed, uninterrupted = _lora(out), _lora(reference)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert json.loads((out / "checkpoint-2" / "train_state.json").read_text()) == json.loads(
        (reference / "checkpoint-2" / "train_state.json").read_text()
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load(no_dist=True), on purpose
def test_sharded_checkpoints_hold_dcp_shards_and_the_final_weights_are_the_gathered_runs(runs):
    """--fsdp_checkpoint sharded: checkpoint-N holds each process' DCP shards (listed in checkpoint.json), no gathered
    weights or optimizer; read whole in one process (DCP reshards), they are the gathered run's checkpoint-2 LoRA bit
    for bit; resuming with another process count is one line (as for every checkpoint); the final LoRA is the
    gathered-checkpoint run's, bit for bit, in the diffusers format."""
    import torch.distributed.checkpoint as dcp

    from refl_ddpo.errors import UserError
    from refl_ddpo.resume_fit import check_resume_fits
    from refl_ddpo.trainers.refl_config import ReFLConfig

    (gathered, _), (out, _) = runs("refl-fsdp"), runs("refl-fsdp-shards")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    checkpoint = out / "checkpoint-2"
    shards = sorted(p.name for p in (checkpoint / SHARDS_DIR).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    listed = json.loads((checkpoint / "checkpoint.json").read_text())["files"]
    assert {f"{SHARDS_DIR}/{name}" for name in shards} <= listed.keys()
    assert not (checkpoint / LORA_WEIGHTS_NAME).exists() and not (checkpoint / FULL_UNET_DIR).exists()
    assert not list(checkpoint.glob("optimizer*")) and not list(checkpoint.glob("*.bin"))
    saved = dcp.FileSystemReader(checkpoint / SHARDS_DIR).read_metadata().state_dict_metadata
    whole = {k: torch.empty(v.size) for k, v in saved.items() if k.startswith("model.")}
    dcp.load(whole, checkpoint_id=checkpoint / SHARDS_DIR, no_dist=True)
    lora = peft_keys_to_model(_lora(gathered / "checkpoint-2"))
    assert whole.keys() == {"model." + k.removeprefix("transformer.") for k in lora}
    assert all(torch.equal(whole["model." + k.removeprefix("transformer.")], v) for k, v in lora.items())
    record = json.loads((checkpoint / "checkpoint.json").read_text())
    cfg = ReFLConfig(**json.loads((out / "config.json").read_text()))  # the run's, resolved
    with pytest.raises(
        UserError, match=r"written by 2 process\(es\), this run has 1; resume it with NUM_PROCESSES=2"
    ):
        check_resume_fits(checkpoint, record, cfg, record["trainer"], "max_train_steps", 1)
    final, reference = _lora(out), _lora(gathered)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in final)


def test_killed_run_with_sharded_checkpoints_resumes_to_the_uninterrupted_weights(
    runs, tiny_models, tmp_path
):
    """ReFL LoRA under FSDP with --fsdp_checkpoint sharded, killed (-9) after checkpoint-2, resumed with latest from
    its DCP shards: the final LoRA and the last checkpoint's counters equal the uninterrupted run's bit for bit."""
    reference, _ = runs("refl-fsdp-shards")
    out = tmp_path / "killed"
    flags = _refl_flags(tiny_models, out, *SHARDS)
    kill_after(out / "checkpoint-2", "train_refl_lora.sh", flags)
    assert not (out / LORA_WEIGHTS_NAME).exists() and not (out / "checkpoint-3").exists(), (
        "killed before the end"
    )
    r = _run("train_refl_lora.sh", [*flags, "--resume_from_checkpoint", "latest"])
    assert "resumed from" in r.stdout and "checkpoint-2" in r.stdout
    resumed, uninterrupted = _lora(out), _lora(reference)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert json.loads((out / "checkpoint-3" / "train_state.json").read_text()) == json.loads(
        (reference / "checkpoint-3" / "train_state.json").read_text()
    )


def test_killed_full_finetune_with_sharded_checkpoints_resumes_to_the_gathered_runs_weights(
    runs, tiny_models, tmp_path
):
    """A full fine-tune under FSDP with --fsdp_checkpoint sharded: checkpoint-2 holds the DCP shards, no unet/;
    killed (-9) after it and resumed, the final unet/ (a diffusers folder) equals the gathered-checkpoint run's bit
    for bit."""
    from diffusers import SD3Transformer2DModel

    reference, _ = runs("full-fsdp")
    out = tmp_path / "killed"
    flags = _refl_flags(tiny_models, out, "--fsdp", *FULL, "--fsdp_checkpoint", "sharded")
    kill_after(out / "checkpoint-2", "train_refl_lora.sh", flags)
    assert not (out / FULL_UNET_DIR).exists(), "killed before the end"
    assert (out / "checkpoint-2" / SHARDS_DIR / ".metadata").is_file()
    assert not (out / "checkpoint-2" / FULL_UNET_DIR).exists()
    _run("train_refl_lora.sh", [*flags, "--resume_from_checkpoint", "latest"])
    resumed, uninterrupted = (
        load_file(out / FULL_UNET_DIR / WEIGHTS),
        load_file(reference / FULL_UNET_DIR / WEIGHTS),
    )
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    SD3Transformer2DModel.from_pretrained(out / FULL_UNET_DIR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_on_one_host_train_one_run(runs, tiny_models, tmp_path):
    """Two launchers, machines 0 and 1 over 127.0.0.1, one process each, --fsdp across them: one result, the same
    weights as the two processes of one machine."""
    reference, _ = runs("grpo-ddp")
    out = tmp_path / "two-machines"
    flags = _grpo_flags(tiny_models, out, "--fsdp")
    common = {"NUM_MACHINES": "2", "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(_free_port())}
    procs = [
        subprocess.Popen(
            ["bash", str(REPO / "train_scripts" / "train_grpo.sh"), *flags],
            cwd=REPO,
            env=script_env(NUM_PROCESSES="2", MACHINE_RANK=str(rank), RENDEZVOUS_TIMEOUT="120", **common),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert "this is machine 1 with 1" in results[1][1]
    assert "saved final weights" in results[0][0] and "saved final weights" not in results[1][0]
    assert json.loads((out / "checkpoint-2" / "checkpoint.json").read_text())["num_processes"] == 2
    _assert_close(_lora(out), _lora(reference))


@pytest.mark.parametrize(
    "env, says",
    [
        ({"NUM_MACHINES": "2", "MACHINE_RANK": "0", "MAIN_PROCESS_PORT": "29500"}, "needs MAIN_PROCESS_IP"),
        ({"NUM_MACHINES": "2", "MAIN_PROCESS_IP": "127.0.0.1"}, "needs MAIN_PROCESS_PORT"),
        ({"NUM_MACHINES": "2", "MACHINE_RANK": "2"}, "MACHINE_RANK='2' must be 0 .. 1"),
        ({"NUM_MACHINES": "2", "NUM_PROCESSES": "3"}, "does not split over NUM_MACHINES=2"),
        ({"NUM_MACHINES": "x"}, "NUM_MACHINES='x' must be a positive integer"),
        ({"MAIN_PROCESS_PORT": "70000", "NUM_PROCESSES": "2"}, "must be a port number"),
        ({"RENDEZVOUS_TIMEOUT": "0", "NUM_PROCESSES": "2"}, "RENDEZVOUS_TIMEOUT='0'"),
        (
            {"NUM_MACHINES": "2", "MAIN_PROCESS_IP": "no-such-host.invalid", "MAIN_PROCESS_PORT": "29500"},
            "does not resolve",
        ),
    ],
)
def test_machine_settings_are_checked_in_one_line_before_anything_starts(env, says, tmp_path):
    r = run_script("train_grpo.sh", ["--output_dir", str(tmp_path / "x")], script_env(**env), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip().splitlines()[-1]] and says in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


def test_a_machine_that_never_meets_machine_0_is_one_line(tiny_models, tmp_path):
    """Machine 1 alone: the rendezvous times out (RENDEZVOUS_TIMEOUT) and says so in one line, exit 2."""
    env = {"NUM_MACHINES": "2", "MACHINE_RANK": "1", "MAIN_PROCESS_IP": "127.0.0.1"}
    env |= {"MAIN_PROCESS_PORT": str(_free_port()), "RENDEZVOUS_TIMEOUT": "2"}
    r = run_script("train_grpo.sh", _grpo_flags(tiny_models, tmp_path / "x"), script_env(**env), timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("launching ")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: the rendezvous at 127.0.0.1:") and "MAIN_PROCESS_IP" in lines[0]


@pytest.mark.parametrize(
    "script, extra, says",
    [
        ("train_grpo.sh", ["--fsdp"], "--fsdp shards the network over several processes but this run has 1"),
        ("train_grpo.sh", ["--fsdp_cpu_offload"], "add --fsdp"),
        (
            "train_grpo.sh",
            ["--fsdp_checkpoint", "sharded"],
            "--fsdp_checkpoint sharded writes FSDP's shards: add",
        ),
        ("train_refl_lora.sh", ["--fsdp", "--no-use_lora", "--use_ema"], "drop --use_ema or --fsdp"),
        ("train_nft.sh", ["--fsdp"], "DiffusionNFT and AWM keep a copy"),
    ],
)
def test_fsdp_settings_that_cannot_work_are_one_line_before_loading(
    script, extra, says, tiny_models, tmp_path
):
    flags = trainer_flags(
        tiny_models, tmp_path / "x", *extra, model="tiny-sd3", device="cpu", report_to="none"
    )
    r = run_script(script, flags, script_env(), timeout=120)
    assert r.returncode == 2 and says in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]
    assert not (tmp_path / "x" / "run.json").exists(), "the folder is given back"


def test_flux_lora_under_fsdp_equals_the_unsharded_run_and_loads_in_the_stock_pipeline(tiny_models, tmp_path):
    """Tiny FLUX.1 (its two block kinds sharded): ReFL under --fsdp gives the two-process DDP run's LoRA, which loads
    into FluxPipeline."""
    from diffusers import FluxPipeline

    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    _run("train_refl_lora.sh", _refl_flags(tiny_models, ddp, model="tiny-flux"))
    r = _run("train_refl_lora.sh", _refl_flags(tiny_models, fsdp, "--fsdp", model="tiny-flux"))
    assert "weights sharded over 2 process(es) (FSDP2): one copy" in r.stdout
    _assert_close(_lora(fsdp), _lora(ddp))
    pipe = FluxPipeline.from_pretrained(tiny_models / "tiny-flux")
    assert_lora_changes_stock_images(pipe, fsdp, 32, part="transformer")


def test_the_shipped_accelerate_config_is_the_plugin_that_fsdp_builds():
    """train_scripts/accelerate/fsdp2.yaml names the settings of --fsdp's plugin (refl_ddpo.sharding.fsdp_plugin)."""
    import yaml
    from torch.distributed.fsdp import CPUOffloadPolicy

    from refl_ddpo.sharding import fsdp_plugin

    shipped = yaml.safe_load((REPO / "train_scripts" / "accelerate" / "fsdp2.yaml").read_text())
    assert shipped["distributed_type"] == "FSDP"
    fsdp = shipped["fsdp_config"]
    plugin = fsdp_plugin("bf16")
    assert fsdp["fsdp_version"] == plugin.fsdp_version == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "transformer_auto_wrap_policy" in repr(plugin.auto_wrap_policy)
    assert fsdp["fsdp_reshard_after_forward"] is plugin.reshard_after_forward is True
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT" == plugin.state_dict_type.name
    assert fsdp["fsdp_offload_params"] is False and not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert isinstance(fsdp_plugin("no", cpu_offload=True).cpu_offload, CPUOffloadPolicy)
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is plugin.cpu_ram_efficient_loading is False
    assert fsdp["fsdp_activation_checkpointing"] is plugin.activation_checkpointing is False
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_plugin("no").mixed_precision_policy is None


class _MetaAccelerator:
    """What load_trainable_family reads of an accelerator, its device `meta`: a stand-in GPU on which a premature
    `.to(device)` of the network shows (a meta tensor keeps its shape and dtype, no data)."""

    device = torch.device("meta")
    mixed_precision = "bf16"

    def __init__(self, sharded: bool):
        from accelerate.utils import DistributedType

        self.distributed_type = DistributedType.FSDP if sharded else DistributedType.MULTI_CPU

    def register_save_state_pre_hook(self, hook):
        pass

    def register_load_state_pre_hook(self, hook):
        pass


def _devices(module: torch.nn.Module) -> set[str]:
    return {t.device.type for t in [*module.parameters(), *module.buffers()]}


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux", "stable-diffusion"])
@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_under_fsdp_the_network_reaches_prepare_on_the_host_and_the_frozen_parts_on_the_device(
    tiny_models, model, use_lora
):
    """--fsdp: loading, LoRA and the fp32 upcast leave the whole network on the CPU (prepare's fully_shard puts only
    each process' shard on the device), the frozen parts on the device; without --fsdp all of it on the device."""
    from refl_ddpo.training import TrainableSpec, load_trainable_family

    spec = TrainableSpec(
        use_lora=use_lora,
        rank=2,
        alpha=2.0,
        target_modules=None,
        init="gaussian",
        gradient_checkpointing=True,
    )
    for sharded in (True, False):
        family, params, _ = load_trainable_family(_MetaAccelerator(sharded), str(tiny_models / model), spec)
        network = family.network
        frozen = {
            name: m
            for name, m in family.pipe.components.items()
            if isinstance(m, torch.nn.Module) and m is not network
        }
        assert frozen and all(_devices(m) == {"meta"} for m in frozen.values()), {
            n: _devices(m) for n, m in frozen.items()
        }
        assert _devices(network) == ({"cpu"} if sharded else {"meta"})
        assert params and all(p.dtype == torch.float32 and p.requires_grad for p in params)
        assert {p.device.type for p in params} == ({"cpu"} if sharded else {"meta"})
        if sharded and use_lora:  # the frozen base stays in the weight dtype, on the host
            assert {p.dtype for p in network.parameters() if not p.requires_grad} == {torch.bfloat16}
        if sharded:  # the host copy holds values (a whole network): the LoRA init and the upcast ran on it
            assert all(torch.isfinite(p).all() for p in params)


def test_a_sharded_prepare_never_holds_the_whole_network_on_the_device(tiny_models, tmp_path, monkeypatch):
    """The kit's prepare step (skeleton.prepare) on a full fine-tune of tiny FLUX.1 held on the host, counted with
    the memory bench's tools: rank 0 of 2 fake ranks, the meta device as the GPU (benchmarks.memory.fake_ranks), its
    bytes counted (PeakMemory). fully_shard moves each block whole to the device and keeps the shard: the device
    peak stays under the whole fp32 network, which a reference to the unsharded parameters kept through prepare
    (run.params before skeleton.prepare let go of it) would hold there whole beside the shards."""
    from types import SimpleNamespace

    from diffusers import FluxTransformer2DModel
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    from benchmarks.memory import PeakMemory, fake_ranks, round_block
    from refl_ddpo.sharding import fsdp_plugin, hold_fsdp_state, local
    from refl_ddpo.trainers.skeleton import Run, prepare
    from refl_ddpo.training import TrainableSpec, make_accelerator, make_optimizer, make_trainable

    def move(params, buffers, device):
        """FSDP2's _move_states_to_device, with swap_tensors where its `.data =` refuses CPU -> meta (as it takes
        CPU -> CUDA): the parameter object then holds the device tensor, as on a GPU."""
        for t in [*params, *buffers]:
            if t.device != device:
                with torch.no_grad():
                    moved = t.to(device)
                    if isinstance(t, torch.nn.Parameter):
                        moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
                torch.utils.swap_tensors(t, moved)

    monkeypatch.setattr(_fsdp_init, "_move_states_to_device", move)
    with fake_ranks(2), PeakMemory() as mem:
        accelerator = make_accelerator(
            1,
            mixed_precision="bf16",
            report_to="none",
            output_dir=str(tmp_path),
            logging_dir="logs",
            device="cpu",
        )
        hold_fsdp_state(accelerator, fsdp_plugin("bf16"))
        network = FluxTransformer2DModel.from_pretrained(
            tiny_models / "tiny-flux" / "transformer", torch_dtype=torch.bfloat16
        ).requires_grad_(False)
        spec = TrainableSpec(
            use_lora=False,
            rank=2,
            alpha=2.0,
            target_modules=None,
            init="gaussian",
            gradient_checkpointing=False,
        )
        params = make_trainable(network, spec)
        whole = sum(round_block(p.numel() * 4) for p in params)  # fp32, as the device's blocks
        optimizer = make_optimizer(params, learning_rate=1e-3, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)
        run = Run(None, accelerator, SimpleNamespace(network=network), params, torch.bfloat16, None)
        run.optimizer = optimizer
        del params, optimizer, network
        assert mem.live == 0  # the network is on the host
        prepare(run)
        shards = sum(round_block(local(p).numel() * 4) for p in run.params)
        assert {local(p).device.type for p in run.params} == {"meta"}
        assert mem.peak < whole, (mem.peak, whole)
        assert mem.live <= shards + 16 * 1024  # the shards (and a few buffers)
