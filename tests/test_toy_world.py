"""The toy world: palette and grammar, renderer, judge, committed weights (checksums, copy), VAE, classifier and its
rewards, and the base model's deliberately middling colour accuracy."""

import shutil

import pytest
import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.prompts import DATA_DIR as PROMPTS_DIR
from refl_ddpo.toy_world import files as toy_files
from refl_ddpo.toy_world import world as tw

SD = tw.DATA_DIR / tw.SD_DIRNAME


def _rendered(n=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [tw.PROMPTS[i % len(tw.PROMPTS)] for i in range(n)]
    return tw.render_prompts(prompts, g), prompts


def test_palette_and_grammar():
    assert tw.COLOURS == {
        "red": (220, 30, 30),
        "green": (30, 170, 50),
        "blue": (40, 70, 230),
        "yellow": (235, 215, 40),
        "magenta": (215, 40, 215),
        "cyan": (40, 205, 215),
    }
    assert tw.SHAPES == ("circle", "square", "triangle")
    assert len(set(tw.PROMPTS)) == 18 and "a cyan triangle" in tw.PROMPTS
    assert len(tw.TRAIN_PROMPTS) == 12 and len(tw.HELDOUT_PROMPTS) == 6
    assert set(tw.TRAIN_PROMPTS) | set(tw.HELDOUT_PROMPTS) == set(tw.PROMPTS)
    assert not set(tw.TRAIN_PROMPTS) & set(tw.HELDOUT_PROMPTS)
    held = [tw.parse_prompt(p) for p in tw.HELDOUT_PROMPTS]
    assert sorted(c for c, _ in held) == sorted(tw.COLOURS)
    assert all(sum(s == shape for _, s in held) == 2 for shape in tw.SHAPES)
    data = PROMPTS_DIR
    assert (data / "toy_world_train.txt").read_text().split("\n")[:12] == list(tw.TRAIN_PROMPTS)
    assert (data / "toy_world_heldout.txt").read_text().split("\n")[:6] == list(tw.HELDOUT_PROMPTS)
    assert (data / "toy_world_green.txt").read_text().split("\n")[:2] == list(tw.PG_TRAIN_PROMPTS)
    assert tw.PG_TRAIN_PROMPTS == ("a green circle", "a green square")
    assert tw.PG_HELDOUT_PROMPTS == ("a green triangle",)
    assert (data / "toy_world_cyan.txt").read_text().split("\n")[:2] == list(tw.SD3_TRAIN_PROMPTS)
    assert tw.SD3_TRAIN_PROMPTS == ("a cyan square", "a cyan triangle")
    assert tw.SD3_HELDOUT_PROMPTS == ("a cyan circle",)
    anchored = (data / "toy_world_cyan_anchored.txt").read_text().split("\n")[:4]
    assert anchored == [*tw.SD3_TRAIN_PROMPTS, "a magenta square", "a magenta circle"]
    assert set(anchored) <= set(tw.TRAIN_PROMPTS)  # nothing held out
    assert tw.parse_prompt("a cyan triangle") == ("cyan", "triangle")
    for bad in ("a purple circle", "a red hexagon", "red circle", "a big red circle", ""):
        with pytest.raises(UserError) as e:
            tw.parse_prompt(bad)
        assert "\n" not in str(e.value)


def test_render_is_deterministic_and_crisp():
    a = tw.render("red", "circle", torch.Generator().manual_seed(3))
    b = tw.render("red", "circle", torch.Generator().manual_seed(3))
    assert a.dtype == torch.uint8 and a.shape == (3, 32, 32) and torch.equal(a, b)
    images, _ = _rendered(180, seed=1)
    allowed = torch.tensor([tw.BACKGROUND, *tw.COLOURS.values()])
    px = images.permute(0, 2, 3, 1).reshape(-1, 3)
    assert ((px[:, None, :] == allowed[None]).all(-1).any(-1)).all()
    fg = (images != 128).any(1)
    for mask in fg:
        ys, xs = mask.nonzero(as_tuple=True)
        extent = max(ys.max() - ys.min(), xs.max() - xs.min()) + 1
        assert 9 <= extent <= 24


def test_judge_on_rendered_wrong_colour_and_tinted_background():
    images, prompts = _rendered()
    res = tw.judge(images, prompts)
    assert res["accuracy"] == 1.0 and res["dirty_mean"] == 0.0
    assert tw.colour_accuracy(images.float() / 255, prompts) == 1.0
    wrong = [tw.PROMPTS[(tw.PROMPTS.index(p) + 3) % 18] for p in prompts]  # next colour, same shape
    assert tw.judge(images, wrong)["accuracy"] == 0.0
    tinted = images.float()
    bg = (images == 128).all(1, keepdim=True)
    tinted = torch.where(bg, tinted + torch.tensor([60.0, -30.0, -30.0]).view(1, 3, 1, 1), tinted) / 255
    res = tw.judge(tinted, prompts)
    assert res["accuracy"] == 1.0 and res["dirty_mean"] > 0.4
    blank = torch.full((2, 3, 32, 32), 0.5)
    assert not tw.judge(blank, ["a red circle", "a blue square"])["colour_ok"].any()


def test_judging_a_run_folder_counts_right_images_per_prompt(tmp_path, capsys):
    import json

    from PIL import Image

    prompts = ["a red circle", "a red circle", "a green square"]
    images = tw.render_prompts(prompts, torch.Generator().manual_seed(0))  # uint8 (3, 3, 32, 32)
    records = []
    for i, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(tmp_path / f"{i}.png")
        # the second red circle is judged against the wrong colour
        records.append({"file": f"{i}.png", "prompt": "a blue circle" if i == 1 else prompt})
    (tmp_path / "scores.json").write_text(json.dumps({"records": records}))
    r = tw.judge_run(tmp_path)
    assert r["by_prompt"] == {"a red circle": (1, 1), "a blue circle": (0, 1), "a green square": (1, 1)}
    assert r["images"] == 3 and r["accuracy"] == pytest.approx(2 / 3)
    tw.main([str(tmp_path)])
    assert "colour accuracy 66.7% of 3 images" in capsys.readouterr().out


def test_grey_fraction_sees_a_shape_grown_to_fill_the_frame():
    """`dirty` cannot see a frame filled with the prompt's own colour (those pixels are near its palette colour);
    `grey` can: it is 1 - the shape's area on rendered images and 0 on a filled frame."""
    images, prompts = _rendered()
    res = tw.judge(images, prompts)
    area = (images != 128).any(1).float().mean(dim=(1, 2))
    assert torch.allclose(res["grey"], 1 - area)
    assert (res["grey"] > 0.4).all()
    red = torch.tensor(tw.COLOURS["red"], dtype=torch.float32).view(1, 3, 1, 1) / 255
    filled = red.expand(1, 3, 32, 32).clone()
    filled[..., 4:20, 4:20] = 0.5  # a grey hole: the judge still finds a 'shape' (the red) around it
    res = tw.judge(filled, ["a red square"])
    assert res["dirty_mean"] == 0.0 and res["grey"].item() == pytest.approx(0.25)


def test_ragged_fraction_sees_a_shape_broken_into_specks():
    """`ragged` is the fraction of shape pixels on the shape's edge: the perimeter of a filled square, about 0.31 on
    average over rendered shapes, and 1 for a shape broken into specks that `dirty` and `grey` score like a solid
    one."""
    square = torch.full((1, 3, 32, 32), 0.5)
    red = torch.tensor(tw.COLOURS["red"], dtype=torch.float32).view(1, 3, 1, 1) / 255
    square[..., 8:24, 8:24] = red
    assert tw.judge(square, ["a red square"])["ragged"].item() == pytest.approx(60 / 256)
    images, prompts = tw.random_batch(256, torch.Generator().manual_seed(0))
    ragged = tw.judge(images, prompts)["ragged"]
    assert 0.25 < ragged.mean() < 0.35 and ragged.max() < 0.7
    specks = torch.full((1, 3, 32, 32), 0.5)
    specks[..., 2:30:2, 2:30:2] = red  # 196 single pixels: about as many as a square 14 pixels across
    res = tw.judge(specks, ["a red square"])
    assert res["colour_ok"].item() and res["dirty_mean"] == 0.0 and res["ragged"].item() == 1.0


def test_committed_files_match_sha256sums():
    listed = toy_files.verify_sums(tw.DATA_DIR)
    present = {p.relative_to(tw.DATA_DIR).as_posix() for p in tw.DATA_DIR.rglob("*") if p.is_file()}
    assert set(listed) == present - {toy_files.SUMS_NAME}
    assert {
        "toy_classifier.safetensors",
        "toy_classifier.json",
        "toy-sd/model_index.json",
        "toy-sd3/model_index.json",
        "toy-sd3/transformer/diffusion_pytorch_model.safetensors",
    } <= set(listed)
    assert sum((tw.DATA_DIR / p).stat().st_size for p in listed) < 9e6  # 8.1 MB: toy-sd 5.0, toy-sd3 2.8


def test_toy_world_copy_and_corruption(tmp_path, monkeypatch, capsys):
    from refl_ddpo.testing import tiny

    sd = tiny.write_toy_world(tmp_path / "ok")
    assert (
        sd == tmp_path / "ok" / "toy-sd" and (sd / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    )
    assert (tmp_path / "ok" / "toy_classifier.safetensors").is_file()
    sd3 = tmp_path / "ok" / tw.SD3_DIRNAME
    assert (sd3 / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    bad = tmp_path / "bad_src"
    shutil.copytree(tw.DATA_DIR, bad)
    with open(bad / "toy_classifier.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(UserError, match="toy_classifier.safetensors"):
        toy_files.write_toy_world(tmp_path / "x", source=bad)
    # the CLI: a mismatch is one line and exit 2 (random models skipped to keep this fast)
    monkeypatch.setattr(tw, "DATA_DIR", bad)
    monkeypatch.setattr(tiny, "write_tiny_models", lambda out, *a, **k: out)
    with pytest.raises(SystemExit) as e:
        tiny.main([str(tmp_path / "cli"), "--toy_world"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "SHA256" in err and "\n" not in err


def test_vae_round_trip_keeps_colours():
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(SD / "vae").eval()
    assert vae.config.scaling_factor > 0
    images, prompts = _rendered(36, seed=7)
    with torch.no_grad():
        x = images.float() / 255 * 2 - 1
        z = vae.encode(x).latent_dist.mode()
        assert z.shape == (36, 4, 16, 16)
        assert 0.5 < (z * vae.config.scaling_factor).std() < 2.0
        out = (vae.decode(z).sample / 2 + 0.5).clamp(0, 1)
    res = tw.judge(out, prompts)
    assert res["accuracy"] >= 0.95 and res["dirty_mean"] < 0.1


def test_classifier_and_rewards():
    from refl_ddpo.rewards.toy import toy_classifier, toy_color_match

    images, prompts = _rendered(seed=5)
    x = images.float() / 255
    model = tw.load_classifier(tw.DATA_DIR)
    with torch.no_grad():
        lc, ls = model(x)
    c, s = tw.prompt_indices(prompts)
    assert (lc.argmax(1) == c).float().mean() >= 0.95 and (ls.argmax(1) == s).float().mean() >= 0.9

    fn = toy_classifier(torch.device("cpu"), torch.float32, str(tw.DATA_DIR))
    xg = x.clone().requires_grad_(True)
    r, info = fn(xg, prompts, [{}] * len(prompts))
    # read at temperature 8 (toy.TEMPERATURE): right prompts score well above 1/18, and above every wrong one
    assert r.shape == (72,) and r.dtype == torch.float32 and r.mean() > 0.5
    r.sum().backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0 and torch.isfinite(xg.grad).all()
    wrong = [tw.PROMPTS[(tw.PROMPTS.index(p) + 3) % 18] for p in prompts]
    r_wrong = fn(x, wrong, [{}] * 72)[0]
    assert r_wrong.mean() < 0.2 and (r.detach() > r_wrong).all()
    big = torch.nn.functional.interpolate(x, size=64, mode="nearest").requires_grad_(True)
    r64, _ = fn(big, prompts, [{}] * 72)
    assert r64.mean() > 0.45
    r64.sum().backward()
    assert big.grad.abs().sum() > 0

    match = toy_color_match(torch.device("cpu"), torch.float32, str(tw.DATA_DIR))
    r, info = match(x, prompts, [{}] * 72)
    assert r.dtype == torch.float32 and (r == 1).all() and (info["dirty"] == 0).all()
    assert (match(x, wrong, [{}] * 72)[0] == 0).all()

    with pytest.raises(UserError, match="--toy_world"):
        toy_classifier(torch.device("cpu"), torch.float32, "/nonexistent/folder")
    with pytest.raises(UserError):
        fn(x[:1], ["a purple circle"], [{}])


def test_toy_clean_is_the_judges_cleanliness_made_differentiable():
    from refl_ddpo.rewards import build_reward

    images, prompts = _rendered(seed=6)
    x = images.float() / 255
    fn = build_reward("toy_clean", "cpu", model_dir=str(tw.DATA_DIR))
    assert fn.differentiable
    clean = fn(x, prompts, [{}] * 72)[0]
    assert clean.shape == (72,) and (clean > 0.97).all()
    wrong = [f"a {tw.parse_prompt(tw.PROMPTS[(tw.PROMPTS.index(p) + 3) % 18])[0]} circle" for p in prompts]
    assert (fn(x, wrong, [{}] * 72)[0] < clean - 0.02).all()  # the shape's pixels are not the asked colour
    # a tinted background: grey 128 -> (205, 205, 128)
    tinted = (x + torch.tensor([0.3, 0.3, 0.0]).view(1, 3, 1, 1)).clamp(0, 1)
    assert (fn(tinted, prompts, [{}] * 72)[0] < 0.5).all()
    target = torch.tensor([tw.COLOURS[tw.parse_prompt(p)[0]] for p in prompts]).float() / 255
    # the frame filled with the asked colour: clean inside, not on the border ring
    filled = target.view(72, 3, 1, 1).expand(72, 3, tw.SIZE, tw.SIZE)
    ring = 4 * (tw.SIZE - 1) / tw.SIZE**2
    assert torch.allclose(fn(filled, prompts, [{}] * 72)[0], torch.tensor(1 - ring), atol=0.01)
    blank = torch.full((1, 3, tw.SIZE, tw.SIZE), 128 / 255)
    assert fn(blank, ["a red circle"], [{}])[0].item() > 0.99  # a term against dirt, not a reward on its own
    g = torch.Generator().manual_seed(0)
    blotchy = torch.rand(4, 3, tw.SIZE, tw.SIZE, generator=g).requires_grad_(True)
    both = build_reward("toy_classifier:1,toy_clean:0.2", "cpu", model_dir=str(tw.DATA_DIR))
    r, info = both(blotchy, prompts[:4], [{}] * 4)
    assert both.differentiable and torch.allclose(r, info["toy_classifier"] + 0.2 * info["toy_clean"])
    assert (info["toy_clean"] < 0.5).all()
    r.sum().backward()
    assert torch.isfinite(blotchy.grad).all() and blotchy.grad.abs().sum() > 0


def test_toy_palette_clean_allows_every_palette_colour_and_nothing_else():
    from refl_ddpo.rewards import build_reward

    images, prompts = _rendered(seed=6)
    x = images.float() / 255
    strict = build_reward("toy_clean", "cpu", model_dir=str(tw.DATA_DIR))
    fn = build_reward("toy_palette_clean", "cpu", model_dir=str(tw.DATA_DIR))
    assert fn.differentiable
    clean = fn(x, prompts, [{}] * 72)[0]
    # every allowed colour of toy_clean is allowed here, so a pixel is never dirtier: >= toy_clean, image by image
    assert (clean >= strict(x, prompts, [{}] * 72)[0]).all() and (clean > 0.97).all()
    # the colour the prompt asks for does not matter: a shape of the wrong colour is as clean (toy_clean: dirtier)
    wrong = [f"a {tw.parse_prompt(tw.PROMPTS[(tw.PROMPTS.index(p) + 3) % 18])[0]} circle" for p in prompts]
    assert torch.equal(fn(x, wrong, [{}] * 72)[0], clean)
    assert (strict(x, wrong, [{}] * 72)[0] < clean - 0.02).all()
    tinted = (x + torch.tensor([0.3, 0.3, 0.0]).view(1, 3, 1, 1)).clamp(0, 1)  # grey 128 -> (205, 205, 128)
    assert (fn(tinted, prompts, [{}] * 72)[0] < 0.5).all()
    g = torch.Generator().manual_seed(0)
    blotchy = torch.rand(4, 3, tw.SIZE, tw.SIZE, generator=g).requires_grad_(True)
    r = fn(blotchy, prompts[:4], [{}] * 4)[0]
    assert (r < 0.5).all()
    r.sum().backward()
    assert torch.isfinite(blotchy.grad).all() and blotchy.grad.abs().sum() > 0


def test_toy_color_clean_is_the_sum_on_the_right_colour_and_zero_on_a_wrong_one():
    from refl_ddpo.rewards import build_reward

    images, prompts = _rendered(seed=7)
    x = images.float() / 255
    fn = build_reward("toy_color_clean", "cpu", model_dir=str(tw.DATA_DIR))
    summed = build_reward("toy_color_match:1,toy_clean:1", "cpu", model_dir=str(tw.DATA_DIR))
    assert not fn.differentiable
    r, info = fn(x, prompts, [{}] * 72)
    assert (
        torch.equal(r, summed(x, prompts, [{}] * 72)[0]) and (r > 1.95).all()
    )  # rendered: right colour, clean
    assert "dirty" in info
    wrong = [f"a {tw.parse_prompt(tw.PROMPTS[(tw.PROMPTS.index(p) + 3) % 18])[0]} circle" for p in prompts]
    assert torch.equal(fn(x, wrong, [{}] * 72)[0], torch.zeros(72))  # toy_clean alone would pay about 0.9
    blank = torch.full((1, 3, tw.SIZE, tw.SIZE), 128 / 255)
    assert fn(blank, ["a red circle"], [{}])[0].item() == 0.0  # no shape, no colour: nothing for being clean


def test_toy_judge_is_one_on_a_clean_shape_of_the_right_colour_only():
    """toy_judge on rendered images: 1 where the colour is right; 0 on a wrong colour, a frame filled with the right
    colour (grey falls) and the right colour broken into specks (ragged rises), which toy_color_match scores 1."""
    from refl_ddpo.rewards import build_reward, is_differentiable, parse_reward_spec
    from refl_ddpo.rewards.toy import JUDGE_MAX_RAGGED, JUDGE_MIN_GREY

    images, prompts = _rendered(seed=8)
    x = images.float() / 255
    fn = build_reward("toy_judge", "cpu", model_dir=str(tw.DATA_DIR))
    assert not fn.differentiable and not is_differentiable("toy_judge")
    r, info = fn(x, prompts, [{}] * 72)
    assert r.shape == (72,) and r.dtype == torch.float32 and torch.equal(r, torch.ones(72))
    assert set(info) == {"colour_ok", "grey", "dirty", "ragged"} and all(
        v.shape == (72,) for v in info.values()
    )
    assert torch.equal(fn(images, prompts, [{}] * 72)[0], r), "uint8 images too"
    wrong = [tw.PROMPTS[(tw.PROMPTS.index(p) + 3) % 18] for p in prompts]
    assert torch.equal(fn(x, wrong, [{}] * 72)[0], torch.zeros(72))

    match = build_reward("toy_color_match", "cpu", model_dir=str(tw.DATA_DIR))
    colour = torch.tensor(tw.COLOURS["green"]).float().view(3, 1, 1) / 255
    grey = torch.full((3, tw.SIZE, tw.SIZE), 128 / 255)
    filled = grey.clone()
    filled[:, 2:-2, 2:-2] = colour  # a 28 x 28 square: the frame filled but for a grey rim
    specks = grey.clone()
    checker = (torch.arange(16).view(-1, 1) + torch.arange(16).view(1, -1)) % 2 == 0
    specks[:, 8:24, 8:24] = torch.where(checker, colour, specks[:, 8:24, 8:24])  # 128 green specks
    bad = torch.stack([filled, specks])
    judged = tw.judge(bad, ["a green square"] * 2)
    assert judged["grey"][0] < JUDGE_MIN_GREY and judged["ragged"][1] > JUDGE_MAX_RAGGED
    assert torch.equal(match(bad, ["a green square"] * 2, [{}] * 2)[0], torch.ones(2)), "the colour is right"
    assert torch.equal(fn(bad, ["a green square"] * 2, [{}] * 2)[0], torch.zeros(2))

    # a weighted spec: the verdict as a part beside another reward
    assert parse_reward_spec("toy_judge:1,toy_clean:0.5") == [("toy_judge", 1.0), ("toy_clean", 0.5)]
    both = build_reward("toy_judge:1,toy_clean:0.5", "cpu", model_dir=str(tw.DATA_DIR))
    total, parts = both(x[:4], prompts[:4], [{}] * 4)
    assert torch.equal(parts["toy_judge"], torch.ones(4)) and "toy_judge/ragged" in parts
    assert torch.allclose(total, parts["toy_judge"] + 0.5 * parts["toy_clean"])


def test_base_model_is_deliberately_imperfect():
    """Inference defaults (DDIM 50 steps, eta 0, CFG 7.5, 32 px), stock pipeline, seeds 1000 and 1001 for every
    prompt (one CPU generator per image): colour accuracy within [0.2, 0.7], so rewards have room to improve it.
    Committed weights: 0.44 here (0.40 over seeds 1000..1007), dirty about 0.16."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(SD, safety_checker=None)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    prompts = list(tw.PROMPTS) * 2
    gens = [torch.Generator().manual_seed(seed) for seed in (1000, 1001) for _ in tw.PROMPTS]
    images = pipe(
        prompts,
        height=32,
        width=32,
        num_inference_steps=50,
        guidance_scale=7.5,
        eta=0.0,
        generator=gens,
        output_type="pt",
    ).images
    assert images.shape == (36, 3, 32, 32)
    res = tw.judge(images, prompts)
    assert 0.2 <= res["accuracy"] <= 0.7, res["accuracy"]
    assert res["dirty_mean"] < 0.35


def test_captions_confuse_partner_colours_at_the_asked_rate():
    """The base's imperfection: `_captions` names the partner colour with probability `confuse_p`, drawing the same
    random numbers whatever `confuse_p` is (so the default build stays the committed one)."""
    from refl_ddpo.testing import toy_train as tb

    prompts = [tw.PROMPTS[i % len(tw.PROMPTS)] for i in range(2000)]
    names = list(tw.PROMPTS) + [""]

    def swapped(p):
        g = torch.Generator().manual_seed(0)
        idx = tb._captions(prompts, g, p)
        pairs = [(q, names[i]) for q, i in zip(prompts, idx.tolist(), strict=True) if names[i]]
        partner = [f"a {tb.CONFUSABLE[tw.parse_prompt(q)[0]]} {tw.parse_prompt(q)[1]}" for q, _ in pairs]
        assert all(c in (q, o) for (q, c), o in zip(pairs, partner, strict=True))
        return sum(c == o for (_, c), o in zip(pairs, partner, strict=True)) / len(pairs), torch.rand(
            1, generator=g
        )

    (none, after0), (half, after5), (all_, after1) = swapped(0.0), swapped(tb.CONFUSE_P), swapped(1.0)
    assert none == 0.0 and all_ == 1.0 and abs(half - tb.CONFUSE_P) < 0.04
    assert after0 == after5 == after1


def test_build_unet_from_a_folder(tmp_path, capsys):
    """`toy_build OUT --unet_from --confuse_p P` trains only a fresh UNet on the committed VAE and text encoder (2
    steps here) and writes a loadable OUT/toy-sd/ with its checksums; a bad probability is a one-line error that
    writes nothing (its main in this process: the check comes before anything is built)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from refl_ddpo.testing import toy_build

    with pytest.raises(SystemExit) as bad:
        toy_build.main([str(tmp_path / "bad"), "--unet_from", "--confuse_p", "1.5"])
    assert bad.value.code != 0 and "--confuse_p" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "bad").exists()

    # in a subprocess: the build switches torch to deterministic algorithms on one thread, for the whole process
    subprocess.run(
        [
            sys.executable,
            "-m",
            "refl_ddpo.testing.toy_build",
            str(tmp_path),
            "--unet_from",
            "--unet_steps",
            "2",
            "--confuse_p",
            "0.3",
        ],
        check=True,
        capture_output=True,
    )
    out = tmp_path / tw.SD_DIRNAME
    assert len(toy_files.verify_sums(tmp_path)) == 10  # toy-sd/'s files, listed and matching

    def same(name):
        ours, committed = load_file(out / name), load_file(SD / name)
        return ours.keys() == committed.keys() and all(torch.equal(ours[k], committed[k]) for k in ours)

    assert same("vae/diffusion_pytorch_model.safetensors")
    assert not same("unet/diffusion_pytorch_model.safetensors")
