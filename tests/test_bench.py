"""benchmarks/ (bench.py, the CLI, and its modules): the real-size configs give SD v1.5's parameter counts, and a
minimal run of every case writes valid results (no timing is asserted)."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.config import BenchConfig
from benchmarks.models import parameter_counts, real_configs
from benchmarks.sweep import _VARIANT_FIELDS, child_flags
from refl_ddpo.run.flags import parse_config

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    """The CLI script, loaded from its file (it is run as a script, not imported as a package module)."""
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_configs_have_sd15_and_imagereward_parameter_counts():
    # Built on the meta device: no memory, no init. Counts of the released checkpoints' architectures:
    # SD v1.5 UNet 859,520,964; VAE 83,653,863; CLIP ViT-L/14 text 123,060,480; BLIP ViT-L/16 without head
    # 303,301,632; BLIP's BERT-base with cross-attention to 1024-wide image tokens 141,977,088; ImageReward's MLP.
    counts = parameter_counts(real_configs())
    assert counts == {
        "unet": 859_520_964,
        "vae": 83_653_863,
        "text_encoder": 123_060_480,
        "reward": 446_206_689,
        "reward.vision": 303_301_632,
        "reward.text": 141_977_088,
    }


def test_sdxl_configs_have_sdxl_base_parameter_counts(tmp_path):
    # SDXL base 1.0: UNet 2,567,463,684; VAE 83,653,863; CLIP ViT-L/14 text 123,060,480; OpenCLIP bigG text with
    # projection 694,659,840.
    from benchmarks.models import sdxl_configs

    assert parameter_counts(sdxl_configs(False, tmp_path)) == {
        "sdxl_unet": 2_567_463_684,
        "sdxl_vae": 83_653_863,
        "sdxl_clip_l": 123_060_480,
        "sdxl_clip_g": 694_659_840,
    }


def test_flux_configs_have_flux1_dev_parameter_counts(tmp_path):
    # FLUX.1-dev: transformer 11,901,408,320 (the published 12 B); VAE 83,819,683 (SD3's architecture); CLIP ViT-L/14
    # text 123,060,480; T5 v1.1 XXL encoder 4,762,310,656 (SD3.5's text_encoder_3).
    from benchmarks.models import flux_configs

    assert parameter_counts(flux_configs(False, tmp_path)) == {
        "flux_transformer": 11_901_408_320,
        "flux_vae": 83_819_683,
        "flux_clip_l": 123_060_480,
        "flux_t5": 4_762_310_656,
    }


def test_sweep_children_get_the_parents_workload_flags():
    cfg = parse_config(
        BenchConfig,
        [
            "--tiny",
            "--device",
            "cpu",
            "--refl_batch_sizes",
            "2",
            "3",
            "--no-tf32",
            "--dtype",
            "bf16",
            "--sweep",
            "--out",
            "x",
        ],
    )
    child = parse_config(BenchConfig, child_flags(cfg) + ["--out", "y"])
    variant = _VARIANT_FIELDS | {"out", "sweep"}
    assert {k: v for k, v in dataclasses.asdict(child).items() if k not in variant} == {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in variant
    }
    assert child.refl_batch_sizes == [2, 3] and child.tiny and not child.sweep
    assert child.dtype is None and child.tf32  # speed options come from the variant, not the parent


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--only", "refl,nonsense"], "--only"),
        (["--compile", "--warmup", "0"], "--warmup"),
        (["--ddpo_sample_batch_size", "6", "--ddpo_train_batch_size", "4"], "--ddpo_train_batch_size"),
        (["--refl_k", "40"], "--refl_k"),
    ],
)
def test_bad_flags_fail_in_one_line_before_anything_runs(bench, tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_minimal_tiny_run_of_every_case_writes_results(tmp_path):
    out = tmp_path / "out"
    argv = [
        "--tiny",
        "--device",
        "cpu",
        "--cpu_threads",
        "1",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
        "--only",
        "refl,ddpo_sample,ddpo_train,inference",
        "--refl_modes",
        "lora",
        "--refl_batch_sizes",
        "1",
        "--refl_steps",
        "3",
        "--refl_k",
        "1",
        "--ddpo_steps",
        "2",
        "--ddpo_sample_batch_size",
        "2",
        "--ddpo_train_batch_size",
        "1",
        "--inference_steps",
        "2",
        "--inference_batch_sizes",
        "2",
    ]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *argv],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert [c["name"] for c in results["cases"]] == [
        "refl lora b1",
        "ddpo_sample b2",
        "ddpo_train b2",
        "inference b2",
    ]
    for case in results["cases"]:
        assert "error" not in case, case
        assert case["median_s"] > 0 and len(case["times_s"]) == 1
        assert case["flops"] > 0 and case["peak_rss_bytes"] > 0
    assert results["cases"][-1]["per_image_s"] == pytest.approx(results["cases"][-1]["median_s"] / 2)
    assert results["meta"]["tiny"] and results["meta"]["parameters"]["unet"] > 0
    table = (out / "results.md").read_text()
    assert all(f"| {c['name']} |" in table for c in results["cases"])
    assert "ReFL: 3 steps" in table and "DDPO: 2 steps" in table and "GRPO" not in table


def test_a_measured_case_leaves_none_of_its_models_alive(tmp_path):
    """Cases share one Bench, so whatever a case leaves alive is in the next case's peak. The FLUX.1 cases kept their
    family on the Bench: on an H200, GRPO's sampling after the ReFL case measured 54.66 GiB, where it needs 32.13."""
    import gc
    import weakref

    from benchmarks.cases import make_cases
    from benchmarks.harness import Bench
    from benchmarks.measure import measure
    from benchmarks.models import model_configs

    argv = ["--tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--only", "flux_grpo_sample"]
    cfg = parse_config(BenchConfig, [*argv, "--ddpo_sample_batch_size", "1", "--ddpo_train_batch_size", "1"])
    cfg.ddpo_steps = 2
    (case,) = make_cases(cfg)
    built = []

    def setup(b):
        run, models = case.setup(b)
        built.extend(weakref.ref(m) for m in models.values())
        return run, models

    b = Bench(cfg, model_configs(True, tmp_path), tmp_path)  # alive, as for the next case
    result = measure(b, dataclasses.replace(case, setup=setup))
    gc.collect()
    assert "error" not in result and built
    assert [type(r()).__name__ for r in built if r() is not None] == []


# ---- peak memory computed on the meta device (benchmarks/memory.py) ----


def test_peak_memory_tracker_counts_blocks_views_and_frees():
    import torch

    from benchmarks.meta import PeakMemory

    with PeakMemory() as mem:
        a = torch.empty(1000, device="meta")  # 4000 bytes -> 8 blocks of 512
        view = a[:10]  # a view: same storage, nothing new
        b = torch.empty(10, device="meta")  # 40 bytes -> one block
        host = torch.ones(10**6)  # host tensors are not device memory
        assert (mem.live, mem.peak) == (4096 + 512, 4096 + 512)
        del a, view
        assert mem.live == 512 and mem.peak == 4096 + 512
        mem.reset_peak()
        c = b * 2  # an op's output
        assert mem.peak == 1024 and host.sum().item() == 10**6
        assert c.sum().item() == 0.5  # device values read on the host are made up
        del b, c
    assert mem.live == 0


def test_cuda_behaviour_on_meta_autocast_and_fused_attention():
    import torch
    import torch.nn.functional as F

    from benchmarks.meta import PeakMemory, cuda_on_meta

    with cuda_on_meta(), PeakMemory() as mem:
        x = torch.randn(1, 32, 8, 8, device="meta")
        w = torch.randn(16, 8, device="meta", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert F.linear(x, w).dtype == torch.bfloat16  # lower-precision list
            assert F.linear(x, w).dtype == torch.bfloat16  # the weight's cast is cached
            assert F.group_norm(x.bfloat16(), 8).dtype == torch.float32  # fp32 list
            assert F.interpolate(x.bfloat16(), scale_factor=2.0).dtype == torch.float32
            assert x.bfloat16().softmax(-1).dtype == torch.float32
        assert F.linear(x, w).dtype == torch.float32  # outside autocast
        # Tensors made or moved on the accelerator's device (cuda) are device tensors, on meta.
        made = torch.zeros(2, 3, dtype=torch.float64, device=torch.device("cuda", 0))
        assert made.device.type == "meta" and mem.live >= 512
        assert torch.ones(2).to(torch.device("cuda", 0)).device.type == "meta"
        assert torch.ones(2).to("cuda", torch.float16).dtype == torch.float16
        # Attention at 4096 tokens: the flash kernel keeps no 4096 x 4096 score matrix (32 MiB per head in bf16).
        q = torch.randn(1, 2, 4096, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        mem.reset_peak()
        F.scaled_dot_product_attention(q, q, q).sum().backward()
        assert mem.peak - mem.live < 8 * 2**20


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recomputation_behaves_as_cuda_on_meta(reentrant):
    """Gradient checkpointing recomputes in backward, where the torch-function mode stack is empty: the
    recomputation must still see autocast's casts and the fused attention, or it saves other tensors than the
    forward (torch.utils.checkpoint raises) and counts the math path's attention matrix."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from benchmarks.meta import PeakMemory, cuda_on_meta

    def block(x, w):  # an fp32 trained weight on bf16 activations, then attention over 4096 tokens
        q = F.linear(x, w).unflatten(-1, (2, 64)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q)

    with cuda_on_meta(), PeakMemory() as mem:
        x = torch.randn(1, 4096, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(128, 128, device="meta", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = checkpoint(block, x, w, use_reentrant=reentrant)
        assert out.dtype == torch.bfloat16
        out.sum().backward()
        assert w.grad.dtype == torch.float32 and x.grad.shape == x.shape
        # The math path would hold 2 x 4096 x 4096 fp32 scores (128 MiB); flash keeps outputs and log-sum-exp.
        assert mem.peak < 16 * 2**20


def test_memory_only_on_tiny_models(tmp_path):
    import torch

    from benchmarks.memory import run_memory_only
    from benchmarks.meta import round_block
    from benchmarks.models import construct, model_configs

    argv = ["--memory_only", "--tiny", "--out", str(tmp_path), "--only", "refl", "--refl_modes", "lora"]
    argv += ["--refl_batch_sizes", "1", "--refl_steps", "3", "--refl_k", "1"]
    results = run_memory_only(parse_config(BenchConfig, argv), argv)
    (case,) = results["cases"]
    # The weights live after setup: every parameter and buffer of the four models, in bf16 (LoRA in fp32).
    configs = model_configs(True, tmp_path / "models")
    frozen = 0
    with torch.device("meta"):
        for name, c in configs.items():
            model = construct(name, c)
            tensors = [*model.parameters(), *model.buffers()]
            frozen += sum(round_block(t.numel() * 2) for t in tensors if t.is_floating_point())
    assert frozen <= case["setup_bytes"] < 1.1 * frozen
    # The step holds the weights, the Adam states, the activations saved for backward and the gradients.
    assert case["setup_bytes"] < case["steady_bytes"] < case["peak_bytes"] < 3 * case["setup_bytes"]
    assert (tmp_path / "memory.md").read_text().count("| refl lora b1 |") == 1


def test_memory_only_sdxl_refl_on_tiny_models(tmp_path):
    """The SDXL ReFL case counts on meta (the tiny SDXL's UNet with its added conditions, its two CLIPs)."""
    from benchmarks.memory import run_memory_only
    from benchmarks.models import architectures

    argv = ["--memory_only", "--tiny", "--out", str(tmp_path), "--only", "sdxl_refl", "--refl_modes", "lora"]
    argv += ["--refl_batch_sizes", "1", "--refl_steps", "3", "--refl_k", "1"]
    (case,) = run_memory_only(parse_config(BenchConfig, argv), argv)["cases"]
    assert case["setup_bytes"] < case["steady_bytes"] < case["peak_bytes"] < 3 * case["setup_bytes"]
    assert (tmp_path / "memory.md").read_text().count("| sdxl_refl lora b1 |") == 1
    assert architectures(["sdxl_refl"]) == "SDXL base 1.0 architecture"


def test_memory_only_ddpo_on_tiny_models(tmp_path):
    """DDPO's sampling and training pass count on meta (the trainer makes tensors on the accelerator's device)."""
    from benchmarks.memory import run_memory_only

    argv = ["--memory_only", "--tiny", "--out", str(tmp_path), "--only", "ddpo_sample,ddpo_train"]
    argv += ["--ddpo_sample_batch_size", "1", "--ddpo_train_batch_size", "1", "--ddpo_steps", "2"]
    sample, train = run_memory_only(parse_config(BenchConfig, argv), argv)["cases"]
    assert (sample["name"], train["name"]) == ("ddpo_sample b1", "ddpo_train b1")
    # Training holds the Adam states, the activations saved for backward and the gradients on top of the weights.
    assert sample["setup_bytes"] <= sample["steady_bytes"] < sample["peak_bytes"]
    assert train["setup_bytes"] < train["steady_bytes"] < train["peak_bytes"]
    assert train["peak_bytes"] > sample["peak_bytes"]


def test_memory_only_flux_cases_on_tiny_models(tmp_path):
    """FLUX.1's ReFL step and GRPO's sampling and training pass count on meta (the tiny FLUX.1-dev), with the text
    encoders' weights beside the peak and the derived peak without them."""
    import torch

    from benchmarks.memory import run_memory_only
    from benchmarks.meta import round_block
    from benchmarks.models import architectures, construct, flux_configs

    argv = [
        "--memory_only",
        "--tiny",
        "--out",
        str(tmp_path),
        "--only",
        "flux_refl,flux_grpo_sample,flux_grpo_train",
    ]
    argv += ["--refl_modes", "lora", "--refl_batch_sizes", "1", "--refl_steps", "3", "--refl_k", "1"]
    argv += ["--ddpo_sample_batch_size", "1", "--ddpo_train_batch_size", "1", "--ddpo_steps", "2"]
    refl, sample, train = run_memory_only(parse_config(BenchConfig, argv), argv)["cases"]
    assert [c["name"] for c in (refl, sample, train)] == [
        "flux_refl lora b1",
        "flux_grpo_sample b1",
        "flux_grpo_train b1",
    ]
    assert refl["setup_bytes"] < refl["steady_bytes"] < refl["peak_bytes"]
    assert train["setup_bytes"] < train["steady_bytes"] < train["peak_bytes"]
    configs = flux_configs(True, tmp_path / "models")
    with torch.device("meta"):
        encoders = [construct(n, configs[n]) for n in ("flux_clip_l", "flux_t5")]
    tensors = [t for e in encoders for t in (*e.parameters(), *e.buffers())]  # bf16, but integer buffers
    expected = sum(
        round_block(t.numel() * (2 if t.is_floating_point() else t.element_size())) for t in tensors
    )
    for case in (refl, sample, train):
        assert case["text_encoder_bytes"] == expected
        assert case["peak_text_encoders_offloaded_bytes"] == case["peak_bytes"] - expected
    table = (tmp_path / "memory.md").read_text()
    assert "| flux_refl lora b1 |" in table and "text encoders off the device" in table
    assert architectures(["flux_refl", "flux_grpo_train"]) == "FLUX.1-dev architecture"


def test_fsdp_all_gathered_blocks_are_counted_and_freed_on_meta():
    """FSDP2 on fake ranks: each block's bf16 parameters are all-gathered into storage that FSDP2 resizes in place
    (filled for use, emptied after): the peak holds a gathered block and the live bytes drop back after forward."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from benchmarks.meta import PeakMemory, fake_ranks

    side, ranks = 1024, 8
    # rank 0's part of a Linear(1024, 1024): 1/8 of the fp32 weight, and its bias chunk in one 512-byte block
    shard = side * side * 4 // ranks + 512
    with fake_ranks(ranks), PeakMemory() as mem:
        with torch.device("meta"):
            blocks = torch.nn.Sequential(*[torch.nn.Linear(side, side) for _ in range(4)])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in blocks:
            fully_shard(b, mp_policy=policy, reshard_after_forward=True)
        fully_shard(blocks, mp_policy=policy)
        import gc

        gc.collect()
        assert mem.live == 4 * shard
        shards = mem.live
        x = torch.zeros(1, side, device="meta")
        mem.reset_peak()
        blocks(x).float().sum().backward()
        gathered = side * side * 2 + 512  # one block's bf16 weight and bias, unsharded
        grads = 4 * shard  # the reduce-scattered fp32 gradients: 1/8 each
        assert mem.peak >= shards + gathered
        # At most the block in use and the prefetched one gathered, and one block's unsharded bf16 gradient with
        # its fp32 copy for the fp32 reduce-scatter (5 gathered blocks' bytes): never all four blocks' worth.
        assert mem.peak < shards + grads + 5 * gathered
        assert mem.live - shards < grads + 16 * 1024  # the gathered blocks freed (activations: a few KiB)


def test_memory_only_sharded_counts_one_rank_of_the_trained_network(tmp_path):
    """--fsdp_world_size 8 on the tiny FLUX.1-dev's full fine-tune: rank 0 holds the trained network's fp32 shards
    (FSDP2 pads every parameter to 8 equal row chunks) and their two AdamW states in place of the whole; the rest
    (frozen parts, activations) is what the unsharded count holds."""
    import math

    import torch

    from benchmarks.memory import run_memory_only
    from benchmarks.meta import round_block
    from benchmarks.models import construct, flux_configs

    def count(ranks: int) -> dict:
        argv = ["--memory_only", "--tiny", "--out", str(tmp_path / str(ranks)), "--only", "flux_refl"]
        argv += ["--refl_modes", "full", "--refl_batch_sizes", "1", "--refl_steps", "2", "--refl_k", "1"]
        argv += ["--fsdp_world_size", str(ranks)]
        return run_memory_only(parse_config(BenchConfig, argv), argv)["cases"][0]

    whole, sharded = count(0), count(8)
    config = flux_configs(True, tmp_path / "models")["flux_transformer"]
    with torch.device("meta"):
        network = construct("flux_transformer", config)
    shapes = [p.shape for p in network.parameters()]
    full = sum(round_block(math.prod(s) * 4) for s in shapes)
    shard = sum(round_block(math.ceil(s[0] / 8) * math.prod(s[1:]) * 4) for s in shapes)
    assert whole["setup_bytes"] - sharded["setup_bytes"] == full - shard
    states = sharded["steady_bytes"] - sharded["setup_bytes"]
    assert states - 2 * shard == whole["steady_bytes"] - whole["setup_bytes"] - 2 * full
    assert sharded["peak_bytes"] < whole["peak_bytes"]
    assert "rank 0 of 8" in (tmp_path / "8" / "memory.md").read_text()


def test_committed_memory_results_name_the_architecture_they_count():
    """Every memory.json under benchmarks/results names the architectures of its cases (memory_sd35m_512 once said
    SD v1.5 for SD3.5 Medium); qwen_memory.py's name Qwen-Image in their memory.md."""
    import json

    from benchmarks.models import architectures

    results = sorted(Path(__file__).resolve().parents[1].glob("benchmarks/results/memory_*/memory.json"))
    assert results
    for path in results:
        data = json.loads(path.read_text())
        if "meta" not in data:  # benchmarks/qwen_memory.py's results
            assert "not measured: Qwen-Image architecture," in (path.parent / "memory.md").read_text(), path
            continue
        if data["meta"]["options"]["tiny"]:
            continue
        cases = [c.strip() for c in data["meta"]["options"]["only"].split(",") if c.strip()]
        assert data["meta"]["models"] == architectures(cases), path
        assert f"not measured: {architectures(cases)}," in (path.parent / "memory.md").read_text(), path


def test_memory_only_counts_the_text_encoders_offloaded(tmp_path):
    """--offload_text_encoders in the count (FLUX.1's ReFL step, tiny): the encoders' weights are off the device
    before the run and on it while the prompts are encoded, so the run's live bytes drop by their weights and the
    peak lies between the derived figure (peak less their weights) and the peak with them kept."""
    from benchmarks.memory import run_memory_only

    argv = [
        "--memory_only",
        "--tiny",
        "--only",
        "flux_refl",
        "--refl_modes",
        "lora",
        "--refl_batch_sizes",
        "1",
    ]
    argv += ["--refl_steps", "3", "--refl_k", "1"]
    (kept,) = run_memory_only(parse_config(BenchConfig, argv + ["--out", str(tmp_path / "kept")]), argv)[
        "cases"
    ]
    argv += ["--offload_text_encoders", "--out", str(tmp_path / "off")]
    (off,) = run_memory_only(parse_config(BenchConfig, argv), argv)["cases"]
    te = kept["text_encoder_bytes"]
    assert off["text_encoders_offloaded"] and "text_encoder_bytes" not in off
    assert off["setup_bytes"] == kept["setup_bytes"] - te
    assert off["steady_bytes"] == kept["steady_bytes"] - te
    assert kept["peak_bytes"] - te <= off["peak_bytes"] <= kept["peak_bytes"]
    assert off["peak_bytes"] >= off["steady_bytes"] + te  # the encode holds them beside everything else
    assert "--offload_text_encoders" in (tmp_path / "off" / "memory.md").read_text()


def test_memory_only_sharded_counts_the_text_encoders_sharded(tmp_path):
    """--fsdp_shard_text_encoders with --fsdp_world_size 8 (the tiny FLUX.1-dev's ReFL LoRA step): the text encoders
    sharded by the kit's shard_frozen, rank 0 holding each parameter's padded 1/8 row chunk (buffers whole) in place
    of the whole, before and through the run."""
    import math

    import torch

    from benchmarks.memory import run_memory_only
    from benchmarks.meta import round_block
    from benchmarks.models import construct, flux_configs

    def count(*extra: str) -> dict:
        argv = [
            "--memory_only",
            "--tiny",
            "--only",
            "flux_refl",
            "--refl_modes",
            "lora",
            "--refl_batch_sizes",
        ]
        argv += ["1", "--refl_steps", "2", "--refl_k", "1", "--fsdp_world_size", "8", *extra]
        argv += ["--out", str(tmp_path / str(len(extra)))]
        return run_memory_only(parse_config(BenchConfig, argv), argv)["cases"][0]

    whole, sharded = count(), count("--fsdp_shard_text_encoders")
    configs = flux_configs(True, tmp_path / "models")
    with torch.device("meta"):
        encoders = [construct(name, configs[name]) for name in ("flux_clip_l", "flux_t5")]
    shapes = [p.shape for e in encoders for p in e.parameters()]
    shard = sum(round_block(math.ceil(s[0] / 8) * math.prod(s[1:]) * 2) for s in shapes)  # bf16
    saved = (
        whole["text_encoder_bytes"]
        - shard
        - sum(round_block(b.numel() * 8) for e in encoders for b in e.buffers())
    )
    assert sharded["text_encoders_sharded"] and "text_encoder_bytes" not in sharded
    assert whole["setup_bytes"] - sharded["setup_bytes"] == saved > 0
    assert whole["steady_bytes"] - sharded["steady_bytes"] == saved
    # the tiny step peaks in the encode (tiny T5's activations), which now holds the gathered blocks and FSDP2's
    # all-gather buffers beside the shards: its peak moves by less than the encoders' weights
    assert abs(sharded["peak_bytes"] - whole["peak_bytes"]) < whole["text_encoder_bytes"]
    assert "--fsdp_shard_text_encoders" in (tmp_path / "1" / "memory.md").read_text()
