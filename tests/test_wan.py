"""What only the Wan family has, on the tiny random Wan 2.1 and Wan 2.2 (two experts) folders: the kit's videos vs
the stock WanPipeline's at the same seeds (CFG, and Wan 2.2's second guidance scale), which expert each step uses,
per-sample timesteps that straddle the boundary, a bad --num_frames refused in one line, the UniPC config's
flow_shift taken as the Euler sampler's shift."""

import pytest
import torch
from diffusers import WanPipeline

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.families.wan import Wan, check_num_frames
from refl_ddpo.core.generate import generate_batch

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

PROMPTS = ["a red cat", "a dog  &amp; the sun"]  # the second needs the pipeline's prompt_clean
SEEDS = [0, 1]
RES, FRAMES, STEPS = 16, 5, 4


def _stock(path) -> WanPipeline:
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _family(path) -> Wan:
    family = load_family(str(path))
    family.num_frames = FRAMES
    return family


@pytest.mark.parametrize(
    ("model", "guidance", "guidance_2"),
    [
        ("tiny-wan21", 4.0, None),
        ("tiny-wan22", 4.0, None),
        ("tiny-wan22", 3.0, 1.5),
        ("tiny-wan22", 1.0, None),
    ],
)
def test_videos_match_the_stock_pipeline(tiny_models, model, guidance, guidance_2):
    """generate_batch's frames (B, T, 3, H, W) equal WanPipeline's at the same seeds, to 1 grey level (float32)."""
    family = _family(tiny_models / model)
    family.guidance_scale_2 = guidance_2
    videos = generate_batch(family, PROMPTS, SEEDS, RES, STEPS, guidance)
    generators = [torch.Generator().manual_seed(s) for s in SEEDS]
    kwargs = {"guidance_scale_2": guidance_2} if guidance_2 is not None else {}
    stock = _stock(tiny_models / model)
    ref = stock(
        PROMPTS,
        height=RES,
        width=RES,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        generator=generators,
        output_type="pt",
        **kwargs,
    ).frames
    assert videos.shape == ref.shape == (2, FRAMES, 3, RES, RES)
    assert (videos - ref).abs().max().item() * 255 <= 1.0


def test_wan22_switches_experts_at_the_boundary(tiny_models):
    """Steps with t >= 875 run `transformer`, the others `transformer_2`; a batch whose samples straddle the boundary
    gives each sample its own expert's output."""
    family = _family(tiny_models / "tiny-wan22")
    scheduler = family.pipe.scheduler
    family.set_timesteps(scheduler, STEPS, None)
    assert family.boundary(scheduler) == 875.0
    calls = []
    hooks = [
        getattr(family.pipe, e).register_forward_hook(
            lambda m, a, k, o, e=e: calls.append(e), with_kwargs=True
        )
        for e in ("transformer", "transformer_2")
    ]
    x = torch.randn(2, 16, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    cond = {"prompt_embeds": torch.randn(2, 512, 32)}
    t = scheduler.timesteps
    with torch.no_grad():
        family.predict(x, t[0], scheduler, cond, None, 1.0)
        family.predict(x, t[-1], scheduler, cond, None, 1.0)
        mixed = family.predict(x, torch.stack([t[0], t[-1]]), scheduler, cond, None, 1.0)
        high = family.predict(x[:1], t[0], scheduler, {"prompt_embeds": cond["prompt_embeds"][:1]}, None, 1.0)
        low = family.predict(x[1:], t[-1], scheduler, {"prompt_embeds": cond["prompt_embeds"][1:]}, None, 1.0)
    for h in hooks:
        h.remove()
    assert t[0] >= 875 > t[-1]
    assert calls[:2] == ["transformer", "transformer_2"]
    torch.testing.assert_close(mixed, torch.cat([high, low]), rtol=1e-5, atol=1e-6)


def test_a_bad_num_frames_is_refused_in_one_line(tiny_models):
    check_num_frames(str(tiny_models / "tiny-wan21"), 9)
    with pytest.raises(UserError, match=r"--num_frames 8: .* 1 \+ 4 k") as e:
        check_num_frames(str(tiny_models / "tiny-wan21"), 8)
    assert "\n" not in str(e.value)


def test_train_expert_and_unipc_flow_shift(tiny_models):
    """--wan_expert picks the trained network (`transformer_2` only where the folder has one); a UniPC scheduler's
    flow_shift becomes the Euler sampler's shift."""
    from diffusers import UniPCMultistepScheduler

    family = _family(tiny_models / "tiny-wan22")
    family.train_expert("transformer_2")
    assert family.network is family.pipe.transformer_2
    with pytest.raises(UserError, match="has transformer$|has transformer\\."):
        _family(tiny_models / "tiny-wan21").train_expert("transformer_2")
    pipe = family.pipe
    pipe.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    euler = family.scheduler("FlowMatchEulerDiscreteScheduler")
    assert type(euler).__name__ == "FlowMatchEulerDiscreteScheduler" and euler.config.shift == 5.0
