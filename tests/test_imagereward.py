"""ImageReward on timm + transformers: reproduces the reference package's numbers (tests/fixtures/imagereward_tiny),
loads what `write_imagereward` (refl_ddpo.testing.tiny_rewards) writes, keeps the graph to the images, and fails with one-line errors on bad files/images."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from refl_ddpo import rewards
from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import imagereward as ir
from refl_ddpo.testing.tiny_rewards import write_imagereward

FIXTURE = Path(__file__).parent / "fixtures" / "imagereward_tiny"
# The ViT the fixture was built with (its med_config.json only describes the text tower).
FIXTURE_VISION = {"embed_dim": 64, "depth": 2, "num_heads": 4}
PROMPTS = ["a photo of a cat", "an oil painting of a castle at sunset"]


@pytest.fixture(scope="module")
def io() -> dict:
    return torch.load(FIXTURE / "io.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imagereward_tiny")
    write_imagereward(out)
    return out


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory, tiny_dir) -> Path:
    """The reference checkpoint in the checkpoint/ layout: its med_config.json + the ViT size, write_imagereward's tokenizer
    (534 tokens, within the fixture's vocab of 1000; the fixture's inputs are token ids anyway)."""
    out = tmp_path_factory.mktemp("imagereward_fixture")
    shutil.copy(FIXTURE / "ImageReward.pt", out)
    med_config = json.loads((FIXTURE / "med_config.json").read_text())
    (out / "med_config.json").write_text(json.dumps({**med_config, "vision_config": FIXTURE_VISION}))
    shutil.copytree(tiny_dir / "bert-base-uncased", out / "bert-base-uncased")
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> ir.ImageRewardModel:
    return ir.load(tiny_dir)


def _smooth_images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """[n,3,h,w] in [0,1]: low-frequency colour fields, like decoded images rather than noise."""
    low = torch.rand(n, 3, 6, 8, generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic", align_corners=True).clamp(0, 1)


def _user_error(fn, *expected: str) -> str:
    with pytest.raises(UserError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for text in expected:
        assert text in message, message
    return message


# ---- the reference numbers ----


@pytest.mark.parametrize(
    "precision, dtype, atol", [("fp64", torch.float64, 1e-6), ("fp32", torch.float32, 1e-4)]
)
def test_reproduces_reference_outputs(fixture_dir, io, precision, dtype, atol):
    # Measured: fp64 <= 4e-15, fp32 <= 2e-6 (image_embeds/text_last_hidden_state), 5e-7 (rewards).
    model = ir.load(fixture_dir, dtype=dtype)
    out = model.features(io["input_ids"], io["attention_mask"], io["images"].to(dtype))
    ref = io[precision]
    for name in ("image_embeds", "text_last_hidden_state", "txt_features", "raw_mlp"):
        assert out[name].dtype == dtype
        torch.testing.assert_close(out[name], ref[name].to(dtype), atol=atol, rtol=0)
    assert out["rewards"].shape == (3,)
    torch.testing.assert_close(out["rewards"].double(), ref["rewards"][:, 0].double(), atol=atol, rtol=0)


def test_reproduces_reference_image_gradient(fixture_dir, io):
    model = ir.load(fixture_dir, dtype=torch.float64)
    images = io["images"].double().requires_grad_()
    model(io["input_ids"], io["attention_mask"], images).sum().backward()
    ref = io["grad_images_fp64"].double()
    relative = (images.grad - ref).abs().max() / ref.abs().max()
    assert relative <= 1e-5  # measured 3e-8 (the reference is stored in float32)


@pytest.mark.parametrize("case", ["sq", "rect", "down"])
@pytest.mark.parametrize("antialias", [True, False])
def test_preprocess_matches_torchvision_resize(io, case, antialias):
    pre = io["preprocess"]
    images = pre["down_in_uint8"].float() / 255 if case == "down" else pre[f"{case}_in"]
    out = ir.preprocess(images, antialias=antialias)
    assert out.shape == (images.shape[0], 3, 224, 224)
    torch.testing.assert_close(out, pre[f"{case}_out_antialias_{str(antialias).lower()}"], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "precision, dtype, atol", [("fp64", torch.float64, 1e-6), ("fp32", torch.float32, 1e-4)]
)
def test_reproduces_reference_end_to_end(fixture_dir, io, precision, dtype, atol):
    model = ir.load(fixture_dir, dtype=dtype)
    pre = io["preprocess"]
    for case in ("sq", "rect"):
        for antialias in (True, False):
            pixel_values = ir.preprocess(pre[f"{case}_in"], antialias=antialias)
            got = model(io["input_ids"][:2], io["attention_mask"][:2], pixel_values)
            ref = io["e2e"][f"{case}_antialias_{str(antialias).lower()}_rewards_{precision}"][:, 0]
            torch.testing.assert_close(got.double(), ref.double(), atol=atol, rtol=0)


# ---- write_imagereward, tokenizer, score() ----


def test_write_tiny_layout_and_determinism(tiny_dir, tmp_path):
    assert {p.name for p in tiny_dir.iterdir()} >= {"ImageReward.pt", "med_config.json", "bert-base-uncased"}
    state_dict = torch.load(tiny_dir / "ImageReward.pt", weights_only=True)
    official = torch.load(FIXTURE / "ImageReward.pt", weights_only=True)
    # Same keys as the official layout once the numbers are blanked out (the fixture has the official patterns).
    assert [re.sub(r"\d+", "N", k) for k in state_dict] == [re.sub(r"\d+", "N", k) for k in official]
    assert sum(v.numel() for v in state_dict.values()) * 4 < 5e6
    write_imagereward(tmp_path / "again")
    write_imagereward(tmp_path / "other", seed=1)
    again = torch.load(tmp_path / "again" / "ImageReward.pt", weights_only=True)
    other = torch.load(tmp_path / "other" / "ImageReward.pt", weights_only=True)
    assert all(torch.equal(state_dict[k], again[k]) for k in state_dict)
    assert not torch.equal(state_dict["mlp.layers.0.weight"], other["mlp.layers.0.weight"])


def test_tokenizer_is_blips(tiny, tiny_dir):
    vocab = (tiny_dir / "bert-base-uncased" / "vocab.txt").read_text().splitlines()
    assert [vocab[i] for i in (0, 100, 101, 102, 103)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = tiny.tokenizer
    # BLIP's init_tokenizer: [DEC] as bos, [ENC] as an extra special token, right after the BERT vocabulary
    # (30522 and 30523 in bert-base-uncased); med_config.json's vocab_size counts them.
    assert (tok.bos_token, tok.bos_token_id, tok.convert_tokens_to_ids("[ENC]")) == (
        "[DEC]",
        len(vocab),
        len(vocab) + 1,
    )
    assert tiny.blip.text_encoder.config.vocab_size == len(vocab) + 2
    input_ids, attention_mask = tiny.tokenize(PROMPTS + ["Zebras riding bicycles!"])
    assert input_ids.shape == attention_mask.shape == (3, 35)
    # ImageReward's score keeps [CLS] first (no [ENC] swap), ends with [SEP], pads with [PAD]=0.
    assert (input_ids[:, 0] == 101).all() and (input_ids != 100).all()
    lengths = attention_mask.sum(1)
    assert (input_ids[torch.arange(3), lengths - 1] == 102).all() and input_ids[0, lengths[0] :].eq(0).all()
    long_ids, _ = tiny.tokenize(["cat " * 100])
    assert long_ids.shape == (1, 35) and long_ids[0, -1] == 102


def test_tiny_rewards_have_a_spread_below_the_refl_margin(tiny):
    input_ids, attention_mask = tiny.tokenize(PROMPTS * 4)
    r = tiny(input_ids, attention_mask, ir.preprocess(_smooth_images(8, 64, 64)))
    assert r.std() > 0.05 and (r < 2).all()  # ReFL's loss is relu(2 - r): it must have something to push


def test_score_matches_tensor_path(tiny, tmp_path):
    prompt = PROMPTS[0]
    input_ids, attention_mask = tiny.tokenize([prompt])
    # No resize (short side already 224, only the crop): PIL and tensor paths must agree to rounding.
    image = TF.to_pil_image((_smooth_images(1, 224, 300)[0] * 255).round().to(torch.uint8))
    pixels = TF.to_image(image).float()[None] / 255
    tensor_reward = tiny(input_ids, attention_mask, ir.preprocess(pixels)).item()
    assert abs(tiny.score(prompt, image) - tensor_reward) <= 1e-3  # measured 0
    image.save(tmp_path / "image.png")
    scores = tiny.score(prompt, [image, str(tmp_path / "image.png")])
    assert isinstance(scores, list) and len(scores) == 2 and scores[0] == scores[1]

    # With a resize, PIL (uint8, rounding after each pass) and torch (float) bicubic differ by about 1/255:
    # measured 4.3e-3 per pixel in [0, 1] units, which moves this tiny random model's reward by up to 4e-3.
    image = TF.to_pil_image((_smooth_images(1, 300, 400, seed=1)[0] * 255).round().to(torch.uint8))
    pixels = TF.to_image(image).float()[None] / 255
    pil_pixels = tiny._pil_transform(image)[None]
    tensor_pixels = ir.preprocess(pixels)
    std = torch.tensor(ir.CLIP_STD)[:, None, None]
    assert ((pil_pixels - tensor_pixels) * std).abs().max() <= 1.5 / 255
    tensor_reward = tiny(input_ids, attention_mask, tensor_pixels).item()
    assert abs(tiny.score(prompt, image) - tensor_reward) <= 1e-2


# ---- gradients, precision, checkpointing, the registered reward ----


def test_rewards_are_differentiable_and_the_model_frozen(tiny):
    images = _smooth_images(2, 64, 96).requires_grad_()
    input_ids, attention_mask = tiny.tokenize(PROMPTS)
    rewards_ = tiny(input_ids, attention_mask, ir.preprocess(images))
    assert rewards_.shape == (2,) and rewards_.dtype == torch.float32
    rewards_.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    assert not any(p.requires_grad for p in tiny.parameters())
    assert all(p.grad is None for p in tiny.parameters())
    tiny.train()
    assert not any(m.training for m in tiny.modules())


def test_bf16_forward_close_to_fp32(tiny_dir, tiny):
    model = ir.load(tiny_dir, dtype=torch.bfloat16)
    input_ids, attention_mask = tiny.tokenize(PROMPTS * 2)
    pixel_values = ir.preprocess(_smooth_images(4, 64, 64))
    got = model(input_ids, attention_mask, pixel_values)
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got, tiny(input_ids, attention_mask, pixel_values), atol=0.1, rtol=0
    )  # measured 0.03


def test_gradient_checkpointing_recomputes_and_changes_nothing(tiny_dir):
    model = ir.load(tiny_dir)
    calls = {"vit": 0, "text": 0}

    def counter(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    # Hooks on submodules of the checkpointed blocks fire again when a block is recomputed in backward.
    model.blip.visual_encoder.blocks[0].mlp.fc1.register_forward_hook(counter("vit"))
    model.blip.text_encoder.encoder.layer[0].intermediate.dense.register_forward_hook(counter("text"))
    input_ids, attention_mask = model.tokenize(PROMPTS)
    images = _smooth_images(2, 64, 64).requires_grad_()

    def reward_and_grad():
        r = model(input_ids, attention_mask, ir.preprocess(images))
        return r.detach(), torch.autograd.grad(r.sum(), images)[0]

    plain = reward_and_grad()
    assert calls == {"vit": 1, "text": 1}
    model.set_gradient_checkpointing(True)
    model.eval()  # stays checkpointed: the text tower's train mode is part of the checkpointing state
    checkpointed = reward_and_grad()
    assert calls == {"vit": 3, "text": 3}  # forward + recompute in backward
    torch.testing.assert_close(checkpointed, plain, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert not model(input_ids, attention_mask, ir.preprocess(images)).requires_grad
    model.set_gradient_checkpointing(False)
    assert not any(m.training for m in model.modules())


def test_registered_reward(tiny_dir, tiny):
    assert rewards.factory("imagereward") is ir.imagereward and rewards.is_differentiable("imagereward")
    reward_fn = ir.imagereward(device=torch.device("cpu"), dtype=torch.float32, model_dir=str(tiny_dir))
    images = _smooth_images(3, 64, 64).requires_grad_()
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    got, info = reward_fn(images, prompts, [{}] * 3)
    assert got.shape == (3,) and got.dtype == torch.float32 and isinstance(info, dict)
    input_ids, attention_mask = tiny.tokenize(prompts)
    torch.testing.assert_close(got, tiny(input_ids, attention_mask, ir.preprocess(images)), atol=1e-6, rtol=0)
    got.sum().backward()
    assert images.grad.abs().sum() > 0
    again, _ = reward_fn(images.detach(), prompts, [{}] * 3)  # tokens now come from the cache
    torch.testing.assert_close(again, got.detach())


# ---- one-line errors ----


def _copy_layout(src: Path, dst: Path, skip: str = "") -> Path:
    dst.mkdir()
    for name in ("ImageReward.pt", "med_config.json", "bert-base-uncased"):
        if name != skip:
            (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, dst / name)
    return dst


@pytest.mark.parametrize("missing", ["ImageReward.pt", "med_config.json", "bert-base-uncased"])
def test_missing_files(tiny_dir, tmp_path, missing):
    folder = _copy_layout(tiny_dir, tmp_path / "ckpt", skip=missing)
    _user_error(lambda: ir.load(folder), str(folder / missing), "checkpoint/README.md")


def test_missing_folder(tmp_path):
    _user_error(lambda: ir.load(tmp_path / "nowhere"), "ImageReward.pt", "--reward_model_dir")


def test_hub_without_network(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    _user_error(lambda: ir.load("THUDM/ImageReward"), "THUDM/ImageReward", "checkpoint/README.md")


def _rewrite_checkpoint(tiny_dir: Path, tmp_path: Path, edit) -> Path:
    folder = _copy_layout(tiny_dir, tmp_path / "ckpt")
    state_dict = torch.load(folder / "ImageReward.pt", weights_only=True)
    edit(state_dict)
    torch.save(state_dict, folder / "ImageReward.pt")
    return folder


def test_state_dict_with_a_missing_key(tiny_dir, tmp_path):
    folder = _rewrite_checkpoint(tiny_dir, tmp_path, lambda sd: sd.pop("blip.visual_encoder.norm.bias"))
    _user_error(lambda: ir.load(folder), "missing keys: 1 (blip.visual_encoder.norm.bias)")


def test_state_dict_with_a_renamed_key(tiny_dir, tmp_path):
    key = "blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"
    folder = _rewrite_checkpoint(tiny_dir, tmp_path, lambda sd: sd.__setitem__(key + "_old", sd.pop(key)))
    _user_error(lambda: ir.load(folder), f"missing keys: 1 ({key})", f"unexpected keys: 1 ({key}_old)")


def test_state_dict_of_another_size(tmp_path):
    # The tiny file read as the official ViT-L (no vision_config): many shapes are wrong, a few are named.
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(FIXTURE / "ImageReward.pt", folder)
    shutil.copy(FIXTURE / "med_config.json", folder)
    write_imagereward(tmp_path / "tok")
    shutil.copytree(tmp_path / "tok" / "bert-base-uncased", folder / "bert-base-uncased")
    expected = "blip.visual_encoder.cls_token [1, 1, 64] vs [1, 1, 1024]"
    message = _user_error(lambda: ir.load(folder), "wrong shapes: 34 (", expected, "vision_config")
    assert "and " in message and "more" in message


def test_file_that_is_not_a_checkpoint(tiny_dir, tmp_path):
    folder = _copy_layout(tiny_dir, tmp_path / "ckpt")
    truncated = (folder / "ImageReward.pt").read_bytes()[:5000]
    for content in (b"<html>not found</html>", b"", truncated):
        (folder / "ImageReward.pt").write_bytes(content)
        _user_error(lambda: ir.load(folder), "is not a PyTorch checkpoint")
    torch.save([torch.zeros(1)], folder / "ImageReward.pt")
    _user_error(lambda: ir.load(folder), "holds a list, not a state dict")


@pytest.mark.parametrize(
    "images, expected",
    [
        (torch.full((1, 3, 32, 32), 1.5), "got values in [1.5, 1.5]"),
        (torch.full((1, 3, 32, 32), -0.2), "got values in [-0.2, -0.2]"),
        (torch.full((1, 3, 32, 32), float("nan")), "in [0, 1]"),
        (torch.rand(1, 4, 32, 32), "[1, 4, 32, 32]"),
        (torch.rand(2, 1, 32, 32), "[2, 1, 32, 32]"),
        (torch.rand(3, 32, 32), "[3, 32, 32]"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), "torch.uint8"),
    ],
)
def test_bad_images(images, expected):
    _user_error(lambda: ir.preprocess(images), expected)


def test_images_within_rounding_of_the_range_pass():
    images = torch.rand(1, 3, 32, 32)
    images[0, 0, 0, 0], images[0, 1, 0, 0] = 1 + 5e-4, -5e-4
    assert ir.preprocess(images).shape == (1, 3, 224, 224)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: c.pop("hidden_size"), "lacks hidden_size"),
        (lambda c: c.__setitem__("vision_config", {"width": 64}), "vision_config may only set img_size"),
    ],
)
def test_bad_med_config(tiny_dir, tmp_path, edit, expected):
    folder = _copy_layout(tiny_dir, tmp_path / "ckpt")
    med_config = json.loads((folder / "med_config.json").read_text())
    edit(med_config)
    (folder / "med_config.json").write_text(json.dumps(med_config))
    _user_error(lambda: ir.load(folder), expected)
