"""--offload_text_encoders: the text encoders live on the CPU and visit the device only while they encode prompts.

The device is the CPU here, so where a test needs to see a move it loads onto a stand-in device, `meta` (as
tests/test_fsdp.py does: a meta tensor keeps its shape and dtype, no data)."""

import json

import pytest
import torch
from helpers import run_in_process, run_script, trainer_flags, watch_training
from safetensors.torch import load_file

from refl_ddpo.core.lora import CONFIG_NAME, LORA_WEIGHTS_NAME

FAMILIES = ["stable-diffusion", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-z-image"]


def _devices(module: torch.nn.Module) -> set[str]:
    return {t.device.type for t in [*module.parameters(), *module.buffers()]}


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model", FAMILIES)
def test_the_text_encoders_load_on_the_host_and_visit_the_device_only_to_encode(
    tiny_models, model, monkeypatch
):
    """Loaded onto the stand-in device with the flag (and with the network held on the host as under --fsdp), the
    text encoders are on the CPU, every other part on the device; an encode (the prompts' and `empty_cond`'s)
    moves them to the device, encodes, and moves them back."""
    from refl_ddpo.core.families import TEXT_ENCODER_NAMES, load_family

    for network_on_host in (False, True):
        family = load_family(
            str(tiny_models / model),
            device="meta",
            network_on_host=network_on_host,
            offload_text_encoders=True,
        )
        encoders = family.text_encoders()
        assert encoders and all(_devices(m) == {"cpu"} for m in encoders)
        others = {
            n: m
            for n, m in family.pipe.components.items()
            if isinstance(m, torch.nn.Module) and n not in TEXT_ENCODER_NAMES and m is not family.network
        }
        assert others and all(_devices(m) == {"meta"} for m in others.values())
        assert _devices(family.network) == ({"cpu"} if network_on_host else {"meta"})

    events = []
    for i, module in enumerate(encoders):  # record the moves; a real move to meta would drop the weights
        monkeypatch.setattr(module, "to", lambda device, i=i: events.append((i, torch.device(device).type)))

    def encode(prompts, with_negative):
        events.append("encode")
        return {"prompt_embeds": torch.zeros(len(prompts), 1)}, None

    monkeypatch.setattr(family, "run_text_encoders", encode)
    n = len(encoders)
    expected = [(i, "meta") for i in range(n)] + ["encode"] + [(i, "cpu") for i in range(n)]
    family.encode_prompts(["a red cube"], with_negative=True)
    assert events == expected
    events.clear()
    family.empty_cond()
    assert events == expected


@pytest.mark.parametrize("model", FAMILIES)
def test_the_conditioning_is_the_same_with_the_flag_and_the_encoders_end_on_the_host(tiny_models, model):
    """On the CPU: every family's encoding (prompts, negative, `empty_cond`) with the flag equals (torch.equal) the
    encoding without it, and the text encoders are on the CPU after loading and after each encode."""
    from refl_ddpo.core.families import load_family

    plain = load_family(str(tiny_models / model))
    offloaded = load_family(str(tiny_models / model), offload_text_encoders=True)
    assert plain.text_encoder_device is None and offloaded.text_encoder_device == "cpu"
    prompts = ["a red cube", "two blue spheres on a table"]
    for with_negative in (False, True):
        a, b = plain.encode_prompts(prompts, with_negative), offloaded.encode_prompts(prompts, with_negative)
        assert _equal(a[0], b[0]) and _equal(a[1], b[1])
        assert all(_devices(m) == {"cpu"} for m in offloaded.text_encoders())
    assert _equal(plain.empty_cond(), offloaded.empty_cond())


def test_refl_with_the_flag_trains_the_same_lora_and_saves_the_flag(tiny_models, tmp_path, monkeypatch):
    """Two ReFL steps on tiny FLUX.1 with train_refl_lora.sh's recipe (in this process), with and without the flag:
    the same LoRA tensors (the device is the CPU, so only the path differs); the saved config and the script's --help
    carry the flag. Each run moved its LoRA and no base weight."""
    watch = watch_training(monkeypatch)
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload-{offload}"
        flags = trainer_flags(
            tiny_models,
            out,
            *(["--offload_text_encoders"] if offload else []),
            model="tiny-flux",
            resolution=32,
            num_inference_steps=4,
            k_lo=2,
            k_hi=3,
            device="cpu",
            train_batch_size=1,
            learning_rate="3e-2",
            max_train_steps=2,
            lora_init="random",
        )
        run_in_process(monkeypatch, "train_refl_lora.sh", flags)
        assert json.loads((out / CONFIG_NAME).read_text())["offload_text_encoders"] is offload
        runs[offload] = load_file(out / LORA_WEIGHTS_NAME)
        watch.assert_lora_moved_and_base_not(out)
    assert runs[False].keys() == runs[True].keys()
    assert all(torch.equal(runs[False][k], runs[True][k]) for k in runs[False])
    r = run_script("train_refl_lora.sh", ["--help"])
    assert r.returncode == 0 and "--offload_text_encoders" in r.stdout
