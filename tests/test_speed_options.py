"""--channels_last and --compile (refl_ddpo.run.session.prepare): the network gives the same output with each as
without it, on the CPU; fused AdamW only where every parameter is a plain CUDA tensor; peft's input cast off on a
16-bit base only."""

import time
from types import SimpleNamespace

import pytest
import torch

from refl_ddpo.core.families import load_family
from refl_ddpo.core.lora import add_lora


def _prepared(tiny_models, **flags):
    """The tiny SD 1.x with LoRA, through the trainers' `prepare` with `flags` (float32, CPU); its output at a fixed
    input."""
    from helpers import cpu_accelerator

    from refl_ddpo.run.session import prepare

    torch.manual_seed(0)
    family = load_family(str(tiny_models / "stable-diffusion"))
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    cfg = SimpleNamespace(**{"channels_last": False, "compile": False, "fold_lora": True, **flags})
    run = SimpleNamespace(cfg=cfg, accelerator=cpu_accelerator(), family=family, params=params)
    run.optimizer = torch.optim.AdamW(params, lr=1e-3)
    prepare(run)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=generator)
    states = torch.randn(2, 77, family.network.config.cross_attention_dim, generator=generator)
    with torch.no_grad():
        out = run.network(x, 500, encoder_hidden_states=states).sample
    return run, out


def test_channels_last_gives_the_same_output(tiny_models):
    _, want = _prepared(tiny_models)
    run, got = _prepared(tiny_models, channels_last=True)
    conv = run.family.network.conv_in.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert run.optimizer.param_groups[0]["params"][0] is run.params[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compile_gives_the_same_output(tiny_models):
    """torch.compile on the CPU (inductor and a C++ compiler: 65 s of CPU, 3 minutes on a busy 2-core machine, for
    the tiny UNet; marker `slow`, run with -m slow)."""
    import shutil

    if shutil.which("g++") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile's CPU backend needs a C++ compiler")
    _, want = _prepared(tiny_models)
    t0 = time.perf_counter()
    run, got = _prepared(tiny_models, compile=True)
    print(f"compiled and ran in {time.perf_counter() - t0:.0f} s")
    assert run.family.network._compiled_call_impl is not None
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_fused_adamw_only_on_plain_cuda_parameters():
    from refl_ddpo.run.training import make_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = make_optimizer(params, learning_rate=1e-3, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)
    assert not opt.defaults.get("fused")


@pytest.mark.parametrize(("dtype", "casts"), [(torch.float32, True), (torch.bfloat16, False)])
def test_peft_input_cast_off_on_a_16_bit_base(tiny_models, dtype, casts):
    from peft.tuners.lora import LoraLayer

    family = load_family(str(tiny_models / "stable-diffusion"), dtype)
    add_lora(family.network, 4, 4, family.lora_target_modules)
    layers = [m for m in family.network.modules() if isinstance(m, LoraLayer)]
    assert layers and all(m.cast_input_dtype_enabled == casts for m in layers)


def test_compile_wiring_gives_the_same_output_through_dynamo(tiny_models, monkeypatch):
    """--compile's graph capture (dynamo, with AOTAutograd's eager backend in place of inductor's code generation):
    the same output as without it; the suite's fast stand-in for the `slow` test above."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    _, want = _prepared(tiny_models)
    run, got = _prepared(tiny_models, compile=True)
    assert run.family.network._compiled_call_impl is not None
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
