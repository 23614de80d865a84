"""HPSv3 on the pinned transformers: reproduces the `hpsv3` package's own scores and image gradients of a tiny random
HPSv3 (tests/fixtures/hpsv3_tiny, made by its make_hpsv3_tiny.py in the package's environment), its text token by
token, and fails with one-line errors on missing or mismatched files and bad images."""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torchvision.transforms.v2 import functional as TF

from refl_ddpo import rewards
from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import hpsv3 as hps
from refl_ddpo.rewards import hpsv3_model
from refl_ddpo.testing.tiny_rewards import write_hpsv3

FIXTURE = Path(__file__).parent / "fixtures" / "hpsv3_tiny"


@pytest.fixture(scope="module")
def io() -> dict:
    return torch.load(FIXTURE / "io.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def loaded():
    return hps.load(FIXTURE)


def _user_error(fn, *expected: str) -> str:
    with pytest.raises(UserError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message
    return message


# ---- the reference numbers ----


def test_fixture_files_are_the_recorded_ones():
    lines = (FIXTURE / "SHA256SUMS").read_text().splitlines()
    assert len(lines) == 12
    for line in lines:
        digest, name = line.split()
        assert hashlib.sha256((FIXTURE / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("case", ["square", "wide", "square_one"])
def test_reproduces_reference_scores_and_gradients(loaded, io, case):
    # square: 3 images 64x64 -> 448x448, prompts of three lengths (right padding); wide: 2 images 48x80 -> 364x588;
    # square_one: the third square image alone (the package gives it the score it has in the batch).
    model, tokenizer = loaded
    ref = io[case]
    reward_fn = hps.reward_from_model(model, tokenizer)
    images = ref["images"].clone().requires_grad_()
    got, info = reward_fn(images, ref["prompts"], [{}] * len(images))
    assert got.shape == (len(images),) and got.dtype == torch.float32
    # measured <= 3e-7 (mu and sigma)
    torch.testing.assert_close(got.detach(), ref["logits"][:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(info["sigma"], ref["logits"][:, 1], atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(got.sum(), images)
    relative = (grad - ref["grad_images"]).abs().max() / ref["grad_images"].abs().max()
    assert relative <= 1e-4  # measured 7e-6


def test_text_and_grid_are_the_packages(loaded, io):
    _, tokenizer = loaded
    for case in ("square", "wide"):
        ref = io[case]
        pixel_values, grid_thw = hpsv3_model.preprocess(ref["images"])
        assert torch.equal(grid_thw, ref["image_grid_thw"])
        assert pixel_values.shape == (int(grid_thw.prod(1).sum()), 3 * 2 * 14 * 14)
        input_ids, attention_mask = hps.tokenize(tokenizer, ref["prompts"], int(grid_thw[0].prod()) // 4)
        assert torch.equal(input_ids, ref["input_ids"]) and torch.equal(attention_mask, ref["attention_mask"])
    assert tokenizer.convert_tokens_to_ids(hpsv3_model.REWARD_TOKEN) == io["reward_token_id"]


def test_pil_path_of_the_package(loaded, io):
    # The package's default path resizes PIL images with PIL (uint8); fed those pixels, the model gives its scores.
    model, tokenizer = loaded
    ref = io["pil"]
    h, w = hpsv3_model.resized_size(*ref["images_uint8"].shape[-2:])
    pil = [
        Image.fromarray(x.permute(1, 2, 0).numpy()).resize((w, h), Image.BICUBIC) for x in ref["images_uint8"]
    ]
    pixels = torch.stack([TF.to_image(p) for p in pil]).float() / 255  # already at HPSv3's size: no resize
    got, info = hps.reward_from_model(model, tokenizer)(pixels, ref["prompts"], [{}] * len(pil))
    torch.testing.assert_close(got, ref["logits"][:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(info["sigma"], ref["logits"][:, 1], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "size, expected",
    [((64, 64), (448, 448)), ((48, 80), (364, 588)), ((512, 512), (448, 448)), ((1024, 576), (588, 336))],
)
def test_resized_size(size, expected):
    h, w = hpsv3_model.resized_size(*size)
    assert (h, w) == expected and h % 28 == 0 and w % 28 == 0


# ---- the registered reward, frozen model ----


def test_registered_reward_is_differentiable_and_frozen(io):
    assert rewards.factory("hpsv3") is hps.hpsv3 and rewards.is_differentiable("hpsv3")
    rewards.check_reward_files("hpsv3", str(FIXTURE))
    reward = rewards.build_reward("hpsv3", "cpu", torch.float32, model_dir=str(FIXTURE))
    images = io["square_one"]["images"].clone().requires_grad_()
    got, info = reward(images, io["square_one"]["prompts"], [{}])
    torch.testing.assert_close(got.detach(), io["square_one"]["logits"][:, 0], atol=1e-5, rtol=0)
    assert set(info) == {"sigma"} and info["sigma"].shape == (1,)
    got.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0


def test_model_is_frozen_in_eval_mode(loaded):
    model, _ = loaded
    model.train()
    assert not any(m.training for m in model.modules())
    assert not any(p.requires_grad for p in model.parameters())
    assert model.rm_head[0].weight.dtype == torch.float32


def test_write_hpsv3_is_the_fixtures_layout(tmp_path):
    folder = write_hpsv3(tmp_path)
    own, fixture = load_file(folder / "HPSv3.safetensors"), load_file(FIXTURE / "HPSv3.safetensors")
    assert {k: v.shape for k, v in own.items()} == {k: v.shape for k, v in fixture.items()}
    rewards.check_reward_files("hpsv3", str(folder))
    reward_fn = hps.hpsv3(torch.device("cpu"), torch.float32, str(folder))
    images = torch.rand(4, 3, 32, 48, generator=torch.Generator().manual_seed(0)).requires_grad_()
    got, info = reward_fn(images, ["a cat", "a red car", "a cat", "two dogs"], [{}] * 4)
    assert got.shape == info["sigma"].shape == (4,) and torch.isfinite(got).all() and got.std() > 1e-3
    got.sum().backward()
    assert images.grad.abs().sum() > 0
    again = load_file(write_hpsv3(tmp_path / "again") / "HPSv3.safetensors")
    assert all(torch.equal(own[k], again[k]) for k in own)


def test_gradient_checkpointing_recomputes_and_changes_nothing(io):
    model, tokenizer = hps.load(FIXTURE)
    calls = {"vit": 0, "text": 0}

    def counter(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    # Hooks inside the checkpointed blocks fire again when a block is recomputed in backward.
    model.visual.blocks[0].mlp.fc1.register_forward_hook(counter("vit"))
    model.language_model.layers[0].mlp.up_proj.register_forward_hook(counter("text"))
    ref = io["square_one"]
    images = ref["images"].clone().requires_grad_()
    reward_fn = hps.reward_from_model(model, tokenizer)

    def reward_and_grad():
        r, _ = reward_fn(images, ref["prompts"], [{}])
        return r.detach(), torch.autograd.grad(r.sum(), images)[0]

    plain = reward_and_grad()
    assert calls == {"vit": 1, "text": 1}
    model.set_gradient_checkpointing(True)
    model.eval()  # stays checkpointed: the towers' train mode is part of the checkpointing state
    checkpointed = reward_and_grad()
    assert calls == {"vit": 3, "text": 3}  # forward + recompute in backward
    torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert not reward_fn(images, ref["prompts"], [{}])[0].requires_grad
    model.set_gradient_checkpointing(False)
    assert not any(m.training for m in model.modules())


def test_bf16_close_to_fp32(io):
    # Qwen2-VL in bf16 (the package's bf16 casts the whole model, rotary buffers too), the head in float32.
    model, tokenizer = hps.load(FIXTURE, dtype=torch.bfloat16)
    assert model.language_model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rm_head[0].weight.dtype == torch.float32
    ref = io["square"]
    got, info = hps.reward_from_model(model, tokenizer)(ref["images"], ref["prompts"], [{}] * 3)
    assert got.dtype == info["sigma"].dtype == torch.float32
    torch.testing.assert_close(got, ref["logits"][:, 0], atol=0.05, rtol=0)  # measured 0.009


def test_refl_flags_reach_hpsv3():
    from refl_ddpo.trainers.refl import ReFLConfig

    ReFLConfig(reward="hpsv3", reward_gradient_checkpointing=True).check()
    _user_error(lambda: ReFLConfig(reward="hpsv3", reward_antialias=False).check(), "applies to ImageReward")
    _user_error(
        lambda: ReFLConfig(reward="aesthetic", reward_gradient_checkpointing=True).check(),
        "ImageReward and HPSv3",
    )


# ---- one-line errors ----


def _copy(tmp_path: Path, skip: str = "") -> Path:
    folder = tmp_path / "hpsv3"
    folder.mkdir()
    for name in ("HPSv3.safetensors", "Qwen2-VL-7B-Instruct"):
        if name != skip:
            (shutil.copytree if (FIXTURE / name).is_dir() else shutil.copy)(FIXTURE / name, folder / name)
    return folder


@pytest.mark.parametrize("missing", ["HPSv3.safetensors", "Qwen2-VL-7B-Instruct"])
def test_missing_files(tmp_path, missing):
    folder = _copy(tmp_path, skip=missing)
    _user_error(lambda: hps.load(folder), str(folder / missing), "docs/rewards.md")
    _user_error(lambda: rewards.check_reward_files("hpsv3", str(folder)), missing, "--reward_model_dir")


def test_missing_folder(tmp_path):
    _user_error(lambda: hps.load(tmp_path / "nowhere"), "HPSv3.safetensors", "MizzenAI/HPSv3")


def test_checkpoint_with_a_missing_key(tmp_path):
    folder = _copy(tmp_path)
    state_dict = load_file(folder / "HPSv3.safetensors")
    del state_dict["rm_head.3.bias"]
    save_file(state_dict, folder / "HPSv3.safetensors")
    _user_error(lambda: hps.load(folder), "missing keys: 1 (rm_head.3.bias)")


def test_checkpoint_of_another_tokenizer(tmp_path):
    folder = _copy(tmp_path)
    state_dict = load_file(folder / "HPSv3.safetensors")
    state_dict["model.embed_tokens.weight"] = state_dict["model.embed_tokens.weight"][:-1].contiguous()
    save_file(state_dict, folder / "HPSv3.safetensors")
    _user_error(lambda: hps.load(folder), "264 tokens with <|Reward|>", "embeds 263")


def test_not_a_checkpoint(tmp_path):
    folder = _copy(tmp_path)
    (folder / "HPSv3.safetensors").write_bytes(b"not safetensors")
    _user_error(lambda: hps.load(folder), "is not a safetensors file")


@pytest.mark.parametrize(
    "images, expected",
    [
        (torch.full((1, 3, 32, 32), 1.5), "got values in [1.5, 1.5]"),
        (torch.rand(1, 4, 32, 32), "[1, 4, 32, 32]"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), "torch.uint8"),
        (torch.rand(1, 3, 2, 500), "aspect ratio up to 200"),
    ],
)
def test_bad_images(images, expected):
    _user_error(lambda: hpsv3_model.preprocess(images), expected)
