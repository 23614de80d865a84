"""pickscore, clip_score (transformers CLIP) and hpsv2 (open_clip): our tensor preprocessing + score against the
libraries' own processors on PIL images + model forward, on the tiny random weights of `refl_ddpo.testing.tiny`.

Tolerance: the reference path stores the resized image as uint8 (PIL), twice (after the width pass and after the
height pass): 0.5 / 255 from the last rounding plus the first one's 0.5 / 255 carried through the cubic's weights
(sum of |w| about 1.2 with its negative lobes), 1.1 / 255 at most. Measured on noise images, the worst case: 1.02 /
255 shrinking, 1.07 / 255 enlarging. On images that need no resize the two agree to float rounding."""

import numpy as np
import pytest
import torch
from PIL import Image

from refl_ddpo.rewards import build_reward, is_differentiable

PROMPTS = ["a photo of a cat", "a red dog on a sofa", "x"]
PIXEL_TOL = 1.15 / 255  # in [0, 1] units, see the module docstring
SHAPES = [(48, 48), (48, 64), (64, 40), (20, 20), (32, 32)]


def _images(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    u8 = torch.randint(0, 256, (len(PROMPTS), 3, *shape), dtype=torch.uint8, generator=g)
    return u8, u8.float() / 255, [Image.fromarray(a.permute(1, 2, 0).numpy()) for a in u8]


@pytest.mark.parametrize("kind", ["pickscore", "clip_score"])
@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_clip_rewards_match_transformers_processor_and_model(tiny_models, kind, backend):
    from transformers import CLIPImageProcessor, CLIPProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from refl_ddpo.rewards import clip

    scorer = clip.load(kind, tiny_models)
    folder = tiny_models / kind
    image_processor = (CLIPImageProcessorPil if backend == "pil" else CLIPImageProcessor).from_pretrained(
        folder
    )
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=scorer.processor.tokenizer)
    std = torch.tensor(image_processor.image_std).view(1, 3, 1, 1)
    reward = build_reward(kind, "cpu", model_dir=str(tiny_models))
    for shape in SHAPES:
        _, x, pils = _images(shape)
        inputs = processor(
            text=PROMPTS,
            images=pils,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=77,
        )
        ours_pixels = clip.preprocess(x, scorer.processor.image_processor)
        assert ours_pixels.shape == inputs["pixel_values"].shape
        pixel_err = ((ours_pixels - inputs["pixel_values"]).abs() * std).max().item()
        assert pixel_err <= PIXEL_TOL, (shape, pixel_err * 255)
        with torch.no_grad():
            logits = scorer.model(**inputs).logits_per_image.diagonal()  # logit_scale.exp() * cos
            reference = logits if kind == "pickscore" else logits / scorer.model.logit_scale.exp() * 100
            ours, _ = reward(x, PROMPTS, [{}] * len(PROMPTS))
        assert reference.abs().min() > 0.05, "scores far from 0, so the relative check below means something"
        assert torch.allclose(ours, reference, atol=0.02 * reference.abs().max().item()), (
            shape,
            ours,
            reference,
        )
        if shape == (32, 32):  # no resize: equal to float rounding
            assert torch.allclose(ours, reference, atol=1e-4), (ours, reference)


def test_pickscore_is_logit_scale_times_cosine_and_prompt_dependent(tiny_models):
    from refl_ddpo.rewards import clip

    scorer = clip.load("pickscore", tiny_models)
    _, x, _ = _images((32, 32))
    with torch.no_grad():
        a = scorer(x, PROMPTS)
        b = scorer(x, PROMPTS[::-1])
        cos = a / scorer.model.logit_scale.exp()
    assert cos.abs().max() <= 1 + 1e-6
    assert not torch.allclose(a, b), "the text matters"


@pytest.mark.parametrize("kind", ["pickscore", "clip_score", "hpsv2"])
def test_gradient_reaches_the_pixels(tiny_models, kind):
    assert is_differentiable(kind)
    reward = build_reward(kind, "cpu", model_dir=str(tiny_models))
    x = torch.rand(2, 3, 48, 40, generator=torch.Generator().manual_seed(1)).requires_grad_()
    rewards, _ = reward(x, PROMPTS[:2], [{}, {}])
    assert rewards.shape == (2,) and rewards.dtype == torch.float32
    rewards.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    # each image's score depends on its own pixels only
    x.grad = None
    rewards, _ = reward(x, PROMPTS[:2], [{}, {}])
    rewards[0].backward()
    assert x.grad[0].abs().sum() > 0 and x.grad[1].abs().sum() == 0


def test_hpsv2_matches_open_clip_transforms_and_model(tiny_models):
    import open_clip

    from refl_ddpo.rewards import hpsv2

    folder = tiny_models / "hpsv2"
    model, _, preprocess_val = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    model.eval()
    reward = build_reward("hpsv2", "cpu", model_dir=str(tiny_models))
    std = torch.tensor(hpsv2.OPENAI_STD).view(1, 3, 1, 1)
    for shape in SHAPES:
        _, x, pils = _images(shape, seed=2)
        pixels = torch.stack([preprocess_val(p) for p in pils])
        pixel_err = ((hpsv2.preprocess(x, 32) - pixels).abs() * std).max().item()
        assert pixel_err <= PIXEL_TOL, (shape, pixel_err * 255)
        with torch.no_grad():
            out = model(pixels, tokenizer(PROMPTS))
            features = (out["image_features"], out["text_features"]) if isinstance(out, dict) else out[:2]
            reference = torch.diagonal(features[0] @ features[1].T)  # HPSv2's score.py
            ours, _ = reward(x, PROMPTS, [{}] * len(PROMPTS))
        tol = 1e-5 if shape == (32, 32) else 2e-3
        assert torch.allclose(ours, reference, atol=tol), (shape, ours, reference)


def test_hpsv2_released_layout_loads_with_weights_only(tiny_models, tmp_path):
    """A {'state_dict': ...} .pt under the released name (the layout of HPS_v2.1_compressed.pt) goes into a named
    open_clip config, read with weights_only=True, and scores as the same weights in the local-dir layout; a file of
    another model is a one-line error."""
    import json

    import open_clip
    from safetensors.torch import load_file

    from refl_ddpo.core.errors import UserError
    from refl_ddpo.rewards import hpsv2

    folder = tiny_models / "hpsv2"
    config = json.loads((folder / hpsv2.OPEN_CLIP_CONFIG).read_text())
    (tmp_path / "tiny-hps-test.json").write_text(json.dumps(config["model_cfg"]))
    open_clip.add_model_config(tmp_path / "tiny-hps-test.json")
    released = tmp_path / "released" / "hpsv2"
    released.mkdir(parents=True)
    torch.save({"state_dict": load_file(folder / "open_clip_model.safetensors")}, released / hpsv2.WEIGHTS)
    a = hpsv2.load(released.parent, arch="tiny-hps-test")
    b = hpsv2.load(tiny_models)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a(x, PROMPTS[:2]), b(x, PROMPTS[:2]))
    bad = tmp_path / "bad" / "hpsv2"
    bad.mkdir(parents=True)
    torch.save({"state_dict": {"visual.proj": torch.zeros(2, 2)}}, bad / hpsv2.WEIGHTS)
    with pytest.raises(UserError) as e:
        hpsv2.load(bad.parent, arch="tiny-hps-test")
    assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_missing_files_offline_is_one_line(tmp_path, monkeypatch):
    from refl_ddpo.core.errors import UserError
    from refl_ddpo.rewards import clip

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as e:
        clip.load("pickscore", tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path / "pickscore") in str(e.value)


def test_nonsquare_and_odd_inputs_do_not_crash(tiny_models):
    reward = build_reward("pickscore:0.5,hpsv2:2", "cpu", model_dir=str(tiny_models))
    x = torch.rand(2, 3, 37, 53)
    rewards, info = reward(x, PROMPTS[:2], [{}, {}])
    assert rewards.shape == (2,) and torch.isfinite(rewards).all()
    assert torch.allclose(rewards, 0.5 * info["pickscore"] + 2 * info["hpsv2"])
    np.testing.assert_array_equal(x.shape, (2, 3, 37, 53))
