"""The LAION aesthetic reward on the tiny CLIP: loading, batch scores, gradient, preprocessing, one-line errors."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from refl_ddpo.core.errors import UserError, cli_main
from refl_ddpo.rewards import build_reward, is_differentiable
from refl_ddpo.rewards.aesthetic import HEAD_NAME, AestheticHead, _head_dims, load, preprocess


def _images(n=3, h=32, w=40, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def test_scores_a_batch_like_one_by_one(tiny_models):
    reward = build_reward("aesthetic", "cpu", torch.float32, str(tiny_models))
    images = _images()
    scores, _info = reward(images, ["a cat"] * 3, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    singles = torch.cat([reward(images[i : i + 1], ["a cat"], [{}])[0] for i in range(3)])
    torch.testing.assert_close(scores, singles, rtol=1e-5, atol=1e-6)
    assert scores.std() > 0  # different images, different scores


def test_matches_clip_features_and_head_by_hand(tiny_models):
    """score = head(f / |f|) with f = CLIPModel.get_image_features (as ddpo-pytorch's scorer)."""
    from transformers import CLIPModel

    scorer = load(tiny_models, "cpu")
    clip = CLIPModel.from_pretrained(tiny_models / "aesthetic" / "clip").eval()
    images = _images()
    with torch.no_grad():
        feats = clip.get_image_features(pixel_values=preprocess(images, clip.config.vision_config.image_size))
        feats = feats if torch.is_tensor(feats) else feats.pooler_output
        expected = scorer.head(feats / feats.norm(dim=-1, keepdim=True)).squeeze(1)
        torch.testing.assert_close(scorer(images), expected, rtol=1e-5, atol=1e-6)


def test_differentiable(tiny_models):
    assert is_differentiable("aesthetic")
    reward = build_reward("aesthetic", "cpu", torch.float32, str(tiny_models))
    images = _images().requires_grad_(True)
    scores, _ = reward(images, ["x"] * 3, [{}] * 3)
    scores.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    # frozen: no gradient is kept on the scorer's own weights
    assert not any(p.requires_grad for p in load(tiny_models, "cpu").parameters())


def test_preprocess_matches_clip_image_processor():
    """Tensor preprocessing vs transformers' CLIPImageProcessor (PIL bicubic) on a smooth non-square image."""
    from transformers import CLIPImageProcessor

    smooth = torch.nn.functional.interpolate(_images(1, 12, 15), size=(256, 320), mode="bilinear")
    u8 = (smooth * 255).round().to(torch.uint8)
    ref = CLIPImageProcessor()(images=[u8[0].permute(1, 2, 0).numpy()], return_tensors="pt").pixel_values
    ours = preprocess(u8.float() / 255, 224)
    assert ours.shape == ref.shape == (1, 3, 224, 224)
    assert (ours - ref).abs().max() < 0.05  # resampling kernels differ slightly; crop, mean, std must agree
    assert (ours - ref).abs().mean() < 0.01


def test_released_pth_layout_loads(tiny_models, tmp_path):
    """The head as released (.pth state dict, loaded weights_only) scores the same as the safetensors copy."""
    folder = tmp_path / "aesthetic"
    shutil.copytree(tiny_models / "aesthetic", folder)
    st = folder / f"{HEAD_NAME}.safetensors"
    torch.save(load_file(str(st)), folder / f"{HEAD_NAME}.pth")
    st.unlink()
    images = _images()
    torch.testing.assert_close(load(tmp_path, "cpu")(images), load(tiny_models, "cpu")(images))
    # the real widths 768-1024-128-64-16-1 are read from the keys
    assert _head_dims(AestheticHead((768, 1024, 128, 64, 16, 1)).state_dict(), "x") == (
        768,
        1024,
        128,
        64,
        16,
        1,
    )


def test_missing_head_is_one_line_error(tmp_path):
    with pytest.raises(UserError) as e:
        build_reward("aesthetic", "cpu", torch.float32, str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and f"{HEAD_NAME}.pth" in msg and str(tmp_path / "aesthetic" / "clip") in msg


def test_missing_clip_offline_is_one_line_error(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "aesthetic"
    folder.mkdir()
    shutil.copy(tiny_models / "aesthetic" / f"{HEAD_NAME}.safetensors", folder)
    with pytest.raises(UserError) as e:
        load(tmp_path, "cpu")
    assert "\n" not in str(e.value) and "openai/clip-vit-large-patch14" in str(e.value)


def test_wrong_head_file_is_one_line_error(tiny_models, tmp_path):
    folder = tmp_path / "aesthetic"
    shutil.copytree(tiny_models / "aesthetic", folder)
    torch.save({"fc.weight": torch.zeros(1, 32)}, folder / f"{HEAD_NAME}.pth")
    (folder / f"{HEAD_NAME}.safetensors").unlink()
    with pytest.raises(UserError, match="not the LAION aesthetic head"):
        load(tmp_path, "cpu")


def test_cli_reward_flag_error_exits_nonzero(tmp_path, capsys):
    """Through a script's main (cli_main) the missing files surface as one 'error:' line and a non-zero exit, no
    traceback."""
    with pytest.raises(SystemExit) as exc:
        cli_main(lambda: build_reward("aesthetic", "cpu", model_dir=str(tmp_path)))()
    err = capsys.readouterr().err
    assert exc.value.code != 0
    assert err.strip().startswith("error: aesthetic reward:") and "Traceback" not in err
