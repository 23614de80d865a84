"""FSDP2 (--fsdp) on CPU processes over gloo: the full fine-tune of tiny SD3 (the unsharded run's weights to 1e-5,
a diffusers folder; resumed from its sharded checkpoint, the uninterrupted run's bit for bit), ReFL LoRA
on tiny FLUX.1, the shipped accelerate config, and where the network and the frozen parts live before and through
`prepare` (see tests/test_fsdp.py for ReFL LoRA)."""

import json

import pytest
import torch
from helpers import (
    FSDP_FULL_SHARDS,
    REPO,
    assert_close,
    assert_lora_changes_stock_images,
    dcp_model,
    refl_flags,
    resume_two,
    run_two,
    saved_lora,
)
from safetensors.torch import load_file

from refl_ddpo.core.lora import FULL_UNET_DIR
from refl_ddpo.core.sharding import SHARDS_DIR

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load(no_dist=True), on purpose
def test_full_finetune_under_fsdp_equals_the_unsharded_run_and_loads(two_process_runs, tiny_models):
    from diffusers import SD3Transformer2DModel

    (ddp, _), (fsdp, _) = two_process_runs("full-ddp"), two_process_runs("full-fsdp")
    # not bit-equal: FSDP's reduce-scatter sums in another order than DDP's all-reduce (about 1e-7 measured)
    assert_close(load_file(fsdp / FULL_UNET_DIR / WEIGHTS), load_file(ddp / FULL_UNET_DIR / WEIGHTS))
    assert (
        json.loads((fsdp / FULL_UNET_DIR / "config.json").read_text())["_class_name"]
        == "SD3Transformer2DModel"
    )
    loaded = SD3Transformer2DModel.from_pretrained(fsdp / FULL_UNET_DIR)
    base = SD3Transformer2DModel.from_pretrained(tiny_models / "tiny-sd3" / "transformer")
    saved = load_file(fsdp / FULL_UNET_DIR / WEIGHTS)
    assert all(torch.equal(p, saved[n]) for n, p in loaded.state_dict().items())
    assert any(not torch.equal(p, base.state_dict()[n]) for n, p in loaded.state_dict().items())
    # --fsdp_checkpoint sharded: checkpoint-2 holds the DCP shards, no unet/, the same weights
    assert (fsdp / "checkpoint-2" / SHARDS_DIR / ".metadata").is_file()
    assert not (fsdp / "checkpoint-2" / FULL_UNET_DIR).exists()
    gathered = load_file(ddp / "checkpoint-2" / FULL_UNET_DIR / WEIGHTS)
    del gathered["pos_embed.pos_embed"]  # a buffer the config rebuilds: the shards hold the parameters
    assert_close(dcp_model(fsdp / "checkpoint-2"), gathered)


def test_full_finetune_resumes_from_sharded_checkpoints_to_the_uninterrupted_weights(
    two_process_runs, tiny_models, tmp_path
):
    """The full fine-tune under FSDP resumed with latest from its sharded checkpoint-2 (what a run killed after it
    leaves; helpers.resume_two): the final unet/ (a diffusers folder) equals the uninterrupted run's bit for bit."""
    from diffusers import SD3Transformer2DModel

    reference, _ = two_process_runs("full-fsdp")
    out = tmp_path / "resumed"
    resume_two(
        reference / "checkpoint-2", "train_refl_lora.sh", refl_flags(tiny_models, out, *FSDP_FULL_SHARDS)
    )
    resumed, uninterrupted = (
        load_file(out / FULL_UNET_DIR / WEIGHTS),
        load_file(reference / FULL_UNET_DIR / WEIGHTS),
    )
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    SD3Transformer2DModel.from_pretrained(out / FULL_UNET_DIR)


def test_flux_lora_under_fsdp_equals_the_unsharded_run_and_loads_in_the_stock_pipeline(tiny_models, tmp_path):
    """Tiny FLUX.1 (its two block kinds sharded): ReFL under --fsdp gives the two-process DDP run's LoRA, which loads
    into FluxPipeline."""
    from diffusers import FluxPipeline

    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    run_two("train_refl_lora.sh", refl_flags(tiny_models, ddp, model="tiny-flux"))
    r = run_two("train_refl_lora.sh", refl_flags(tiny_models, fsdp, "--fsdp", model="tiny-flux"))
    assert "weights sharded over 2 process(es) (FSDP2): one copy" in r.stdout
    assert_close(saved_lora(fsdp), saved_lora(ddp))
    pipe = FluxPipeline.from_pretrained(tiny_models / "tiny-flux")
    assert_lora_changes_stock_images(pipe, fsdp, 32, part="transformer")


def test_the_shipped_accelerate_config_is_the_plugin_that_fsdp_builds():
    """train_scripts/accelerate/fsdp2.yaml names the settings of --fsdp's plugin (refl_ddpo.core.sharding.fsdp_plugin)."""
    import yaml
    from torch.distributed.fsdp import CPUOffloadPolicy

    from refl_ddpo.core.sharding import fsdp_plugin

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


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux", "stable-diffusion", "tiny-flux2"])
@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full"])
def test_under_fsdp_the_network_reaches_prepare_on_the_host_and_the_frozen_parts_on_the_device(
    tiny_models, model, use_lora
):
    """--fsdp: loading, LoRA and the fp32 upcast leave the whole network on the CPU (prepare's fully_shard puts only
    each process' shard on the device), the frozen parts on the device; without --fsdp all of it on the device."""
    from refl_ddpo.run.training import TrainableSpec, load_trainable_family

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


def test_a_sharded_prepare_never_holds_the_whole_network_on_the_device(
    tiny_models, tmp_path, monkeypatch, request
):
    """The kit's prepare step (refl_ddpo.run.session.prepare) on a full fine-tune of tiny FLUX.1 held on the host, counted with
    the memory bench's tools: rank 0 of 2 fake ranks, the meta device as the GPU (benchmarks.meta.fake_ranks), its
    bytes counted (PeakMemory). fully_shard moves each block whole to the device and keeps the shard: the device
    peak stays under the whole fp32 network, which a reference to the unsharded parameters kept through prepare
    (run.params before session.prepare let go of it) would hold there whole beside the shards."""
    from types import SimpleNamespace

    from diffusers import FluxTransformer2DModel
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    from benchmarks.meta import PeakMemory, fake_ranks, round_block
    from refl_ddpo.core.sharding import fsdp_plugin, hold_fsdp_state, local, release_fsdp_state
    from refl_ddpo.run.session import Run, prepare
    from refl_ddpo.run.training import TrainableSpec, make_accelerator, make_optimizer, make_trainable

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
    # accelerate's process state given back after the test, so that later tests on this worker do not shard
    request.addfinalizer(release_fsdp_state)
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
        cfg = SimpleNamespace(fold_lora=True, channels_last=False, compile=False)  # prepare's flags
        run = Run(
            cfg, "refl", "step", accelerator, SimpleNamespace(network=network), params, torch.bfloat16, None
        )
        run.optimizer = optimizer
        del params, optimizer, network
        assert mem.live == 0  # the network is on the host
        prepare(run)
        shards = sum(round_block(local(p).numel() * 4) for p in run.params)
        assert {local(p).device.type for p in run.params} == {"meta"}
        assert mem.peak < whole, (mem.peak, whole)
        assert mem.live <= shards + 16 * 1024  # the shards (and a few buffers)
