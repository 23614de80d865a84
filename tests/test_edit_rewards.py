"""The rewards that see an edit's source (refl_ddpo.rewards.edit): CLIP directional similarity against its closed form
on the tiny CLIP, the preservation term, the VLM edit judge's request and parsed score on a stand-in server, the
reward server's request carrying the source image; a sample without a source is one line."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_vlm_scores import FAST, server  # noqa: F401 (a fixture)

from refl_ddpo.core.edit_data import SOURCE_IMAGES
from refl_ddpo.core.errors import UserError
from refl_ddpo.rewards import build_reward, is_differentiable
from refl_ddpo.rewards.remote import RemoteReward, decode_images

PROMPTS = ["make it blue", "add a hat"]


def _uint8_images(seed: int, n: int = 2, side: int = 32) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, 3, side, side), dtype=np.uint8)).float() / 255


def _metadata(sources: torch.Tensor, **extra) -> list[dict]:
    return [{SOURCE_IMAGES: [s], **extra} for s in sources]


def test_edit_preserve_is_one_minus_the_mean_absolute_difference():
    reward = build_reward("edit_preserve", "cpu")
    images, sources = _uint8_images(0), _uint8_images(1)
    ours, _ = reward(images, PROMPTS, _metadata(sources))
    expected = 1 - (images - sources).abs().mean(dim=(1, 2, 3))
    torch.testing.assert_close(ours, expected)
    same, _ = reward(sources, PROMPTS, _metadata(sources))
    assert torch.equal(same, torch.ones(2))
    # a source of another size is resized to the result's: a flat grey stays itself
    grey = torch.full((3, 64, 48), 0.5)
    flat, _ = reward(torch.full((2, 3, 32, 32), 0.25), PROMPTS, [{SOURCE_IMAGES: [grey]}] * 2)
    torch.testing.assert_close(flat, torch.full((2,), 0.75))
    assert is_differentiable("edit_preserve") and is_differentiable("edit_clip_direction")
    assert not is_differentiable("edit_judge")


def test_edit_clip_direction_is_the_closed_form_on_the_tiny_clip(tiny_models):
    """cos(E_img(result) - E_img(source), E_txt(target) - E_txt(source caption)) of the normalised CLIP embeddings,
    computed here with transformers' processor and model (32 px: no resize, so equal to float rounding); the captions
    from the metadata, else the instruction and the empty caption; the gradient reaches the result's pixels."""
    from transformers import CLIPModel, CLIPProcessor

    folder = tiny_models / "clip_score"
    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    reward = build_reward("edit_clip_direction", "cpu", model_dir=str(tiny_models))
    images, sources = _uint8_images(2), _uint8_images(3)

    def pils(x):
        return [Image.fromarray((im.permute(1, 2, 0) * 255).round().byte().numpy()) for im in x]

    def embeds(texts, x):
        inputs = processor(
            text=texts, images=pils(x), return_tensors="pt", padding="max_length", max_length=77
        )
        with torch.no_grad():
            out = model(**inputs)
        return out.image_embeds, out.text_embeds  # L2-normalised

    for metadata, targets, captions in [
        (_metadata(sources), PROMPTS, ["", ""]),
        (
            _metadata(sources, source_caption="a cat", target_caption="a blue cat"),
            ["a blue cat"] * 2,
            ["a cat"] * 2,
        ),
    ]:
        result, target_text = embeds(targets, images)
        source, source_text = embeds(captions, sources)
        expected = torch.nn.functional.cosine_similarity(result - source, target_text - source_text, dim=-1)
        ours, _ = reward(images, PROMPTS, metadata)
        assert expected.abs().max() > 0.01  # not all 0: the comparison means something
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    x = images.clone().requires_grad_(True)
    reward(x, PROMPTS, _metadata(sources))[0].sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_sample_without_a_source_is_one_line(tiny_models):
    for name in ("edit_preserve", "edit_clip_direction"):
        reward = build_reward(name, "cpu", model_dir=str(tiny_models))
        with pytest.raises(UserError, match="--edit_data") as e:
            reward(_uint8_images(0), PROMPTS, [{}, {}])
        assert "\n" not in str(e.value)


def _picture(url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def test_edit_judge_sends_instruction_source_and_result_and_reads_the_score(server):  # noqa: F811
    url, handler = server
    # the score is 10 x the red of the second image (the result) when the first (the source) is black
    handler.answer = lambda h, request, reds, text: (
        200,
        {"index": 0, "message": {"role": "assistant", "content": f"Fine. Final Score: {10 * reds[1]:.1f}"}},
    )
    reward = build_reward(f"edit_judge:{url}", "cpu", options={"edit_judge": FAST})
    results = torch.zeros(2, 3, 8, 8)
    results[0, 0], results[1, 0] = 0.4, 0.8
    sources = torch.zeros(2, 3, 8, 8)
    rewards, _ = reward(results, PROMPTS, _metadata(sources))
    torch.testing.assert_close(rewards, torch.tensor([0.4, 0.8]), atol=0.01, rtol=0)
    content = handler.requests[0]["messages"][0]["content"]
    assert [p["type"] for p in content] == ["text", "text", "image_url", "text", "image_url"]
    assert (
        "Instruction: [make it blue]" in content[0]["text"]
        or "Instruction: [add a hat]" in content[0]["text"]
    )
    assert _picture(content[2]["image_url"]["url"]).max() == 0  # the source first, then the result


def test_the_reward_server_request_carries_the_source_images(monkeypatch):
    sent = []

    def fake(self, path, payload=None, timeout=None):
        sent.append(json.loads(json.dumps(payload)))  # as JSON would carry it
        return {"rewards": [0.0] * len(payload["prompts"])}

    monkeypatch.setattr(RemoteReward, "_request", fake)
    client = RemoteReward("http://127.0.0.1:1")
    sources = _uint8_images(4)
    client(_uint8_images(5), PROMPTS, [{SOURCE_IMAGES: [sources[0]], "caption": "x"}, {}])
    first, second = sent[0]["metadata"]
    assert torch.equal(decode_images(first[SOURCE_IMAGES]), sources[:1]) and first["caption"] == "x"
    assert second == {}


def test_a_served_edit_reward_sees_the_source_as_in_process():
    """The server's worker reads the request's source images back: edit_preserve scored through the wire format equals
    the reward in process."""
    from refl_ddpo.rewards.remote import wire_metadata
    from refl_ddpo.rewards.serve_worker import score_batches

    reward = build_reward("edit_preserve", "cpu")
    images, sources = _uint8_images(6), _uint8_images(7)
    metadata = _metadata(sources, caption="x")
    wire = [json.loads(json.dumps(wire_metadata(m))) for m in metadata]
    served, _ = score_batches(reward, images, PROMPTS, wire, torch.device("cpu"), None)
    in_process, _ = reward(images, PROMPTS, metadata)
    assert torch.equal(served, in_process.float())
