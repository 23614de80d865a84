"""FLUX.1 Kontext (image editing) and the edit data: `--edit_data` read and refused in one line before any model
loads; the kit's loop equal to the stock `FluxKontextPipeline` with a source image; the reference's latents, packing
and position ids; GRPO's first update on policy with the source in the conditioning; ReFL, GRPO, DiffusionNFT and AWM
for two steps on edits with their LoRA moving and no base weight, the LoRA loading in the stock pipeline; inference's
scores.json naming each record's source image and instruction."""

import importlib
import json

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from helpers import ddpo_first_update, trainer_flags, watch_training
from PIL import Image

from refl_ddpo.core.edit_data import SOURCE_IMAGES, SOURCE_PATHS, load_edit_data, with_source_images
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.families import load_family
from refl_ddpo.core.families.flux_kontext import FluxKontext
from refl_ddpo.core.generate import generate_batch

pytestmark = pytest.mark.usefixtures("one_thread_module")  # conftest.py

MODEL = "tiny-flux-kontext"
RES = 32
PROMPTS = ["make it blue", "add a hat"]
SEEDS = [3, 7]


def _png(path, h: int, w: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def _edits(folder, lines: list[dict], size=(RES, RES)):
    """folder/edits.jsonl with `lines`, and every image they name written at `size` (H, W)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, line in enumerate(lines):
        for name in [line["image"]] if isinstance(line["image"], str) else line["image"]:
            if not (folder / name).exists():
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                _png(folder / name, *size, seed=i)
    path = folder / "edits.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _two_edits(folder):
    return _edits(
        folder, [{"image": "a.png", "instruction": PROMPTS[0]}, {"image": "b.png", "instruction": PROMPTS[1]}]
    )


# ---- the edit data ----


def test_edit_data_reads_instructions_sources_and_metadata(tmp_path):
    path = _edits(
        tmp_path / "d",
        [
            {"image": "a.png", "instruction": "make it blue", "caption": "a red square"},
            {"image": ["a.png", "sub/b.png"], "instruction": "swap them"},
        ],
        size=(48, 32),
    )
    edits = load_edit_data(path)
    assert [e[0] for e in edits] == ["make it blue", "swap them"]
    assert edits[0][1] == {"caption": "a red square", SOURCE_PATHS: [str(path.parent / "a.png")]}
    assert edits[1][1][SOURCE_PATHS] == [str(path.parent / "a.png"), str(path.parent / "sub/b.png")]
    # a folder: its metadata.jsonl
    (tmp_path / "d" / "metadata.jsonl").write_text(path.read_text())
    assert load_edit_data(tmp_path / "d") == edits
    sources = with_source_images(edits[1][1])[SOURCE_IMAGES]
    assert [tuple(s.shape) for s in sources] == [(3, 48, 32)] * 2 and 0 <= float(sources[0].min())
    expected = torch.from_numpy(np.array(Image.open(path.parent / "a.png"))).permute(2, 0, 1).float() / 255
    assert torch.equal(sources[0], expected)
    assert SOURCE_IMAGES not in edits[1][1]  # the listed metadata stays JSON


@pytest.mark.parametrize(
    "content, size, needle",
    [
        (None, None, "no such file"),
        ('{"image": "missing.png", "instruction": "x"}\n', None, "does not exist"),
        ('{"image": "bad.png", "instruction": "x"}\n', None, "could not be read"),
        ('{"image": "odd.png", "instruction": "x"}\n', (40, 24), "multiples of 16"),
        (
            '{"image": "a.png", "instruction": "x"}\n{"image": "big.png", "instruction": "y"}\n',
            None,
            "one size",
        ),
        ('{"image": "a.png"}\n', None, "'instruction' string"),
        ('{"image": [], "instruction": "x"}\n', None, "non-empty list"),
        ("not json\n", None, "not JSON"),
        ("\n", None, "holds no edits"),
    ],
    ids=[
        "no-file",
        "missing-image",
        "unreadable",
        "wrong-size",
        "mixed-sizes",
        "no-instruction",
        "no-image",
        "not-json",
        "empty",
    ],
)
def test_bad_edit_data_is_refused_in_one_line(tmp_path, content, size, needle):
    _png(tmp_path / "a.png", 32, 32)
    _png(tmp_path / "big.png", 64, 32)
    _png(tmp_path / "odd.png", *(size or (32, 32)))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    path = tmp_path / "edits.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=needle) as e:
        load_edit_data(path)
    assert "\n" not in str(e.value)


def test_a_trainer_refuses_bad_edit_data_before_loading_and_writes_nothing(tiny_models, tmp_path, capsys):
    from refl_ddpo.trainers import grpo

    path = _edits(tmp_path / "d", [{"image": "a.png", "instruction": "x"}], size=(40, 32))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        grpo.main(
            trainer_flags(tiny_models, out, model=MODEL, edit_data=path, device="cpu", report_to="none")
        )
    assert e.value.code != 0 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "multiples of 16" in err


def test_edit_data_on_a_model_that_does_not_edit_is_refused_before_loading(tiny_models, tmp_path, capsys):
    from refl_ddpo.apps import inference
    from refl_ddpo.trainers import nft

    path = _two_edits(tmp_path / "d")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        nft.main(
            trainer_flags(tiny_models, out, model="tiny-flux", edit_data=path, device="cpu", report_to="none")
        )
    assert e.value.code != 0 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "FluxPipeline folder" in err and "FLUX.1 Kontext" in err
    argv = ["--pretrained_model", str(tiny_models / "stable-diffusion"), "--edit_data", str(path)]
    with pytest.raises(SystemExit):
        inference.main_base([*argv, "--output_dir", str(out), "--device", "cpu"])
    assert "StableDiffusionPipeline folder" in capsys.readouterr().err and not out.exists()


def test_a_prompt_fn_may_give_pil_sources(tiny_models):
    """A user's prompt_fn may put PIL images in metadata["source_images"]: the same latents as the tensors."""
    family = load_family(str(tiny_models / MODEL))
    pils = _sources(32, 32)
    a = family.encode_conditioning(PROMPTS, [{SOURCE_IMAGES: [p]} for p in pils], False)[0]["image_latents"]
    b = family.encode_conditioning(PROMPTS, [{SOURCE_IMAGES: [_tensor(p)]} for p in pils], False)[0][
        "image_latents"
    ]
    assert torch.equal(a, b)


# ---- the family against the stock pipeline ----


@pytest.fixture(scope="module")
def kontext(tiny_models):
    pipe = FluxKontextPipeline.from_pretrained(tiny_models / MODEL)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sources(h: int, w: int) -> list[Image.Image]:
    rng = np.random.default_rng(1)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in PROMPTS]


def _tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255


@pytest.mark.parametrize("guidance, true_cfg, size", [(3.5, 1.0, (48, 32)), (2.0, 3.0, (32, 32))])
def test_loop_reproduces_stock_kontext_with_a_source(kontext, guidance, true_cfg, size):
    """A source of another size than the target (48 x 32 -> 32 x 32), the embedded guidance, and true CFG against
    the empty prompt (both calls see the reference): within 1 grey level of the stock pipeline at the same seeds."""
    sources = _sources(*size)
    extra = {"negative_prompt": "", "true_cfg_scale": true_cfg} if true_cfg > 1 else {}
    ref = kontext(
        prompt=list(PROMPTS),
        image=sources,
        height=RES,
        width=RES,
        max_area=RES * RES,
        _auto_resize=False,
        num_inference_steps=4,
        guidance_scale=guidance,
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        output_type="pt",
        **extra,
    ).images
    family = FluxKontext(kontext)
    family.true_cfg_scale = true_cfg
    metadata = [{SOURCE_IMAGES: [_tensor(s)]} for s in sources]
    ours = generate_batch(family, PROMPTS, SEEDS, RES, 4, guidance, metadata=metadata)
    assert ours.shape == ref.shape == (2, 3, RES, RES)
    assert (ours - ref).abs().max().item() <= 1 / 255


def test_the_reference_tokens_follow_the_target_with_first_id_one(tiny_models):
    family = load_family(str(tiny_models / MODEL))
    assert family.name == "flux_kontext"
    metadata = [{SOURCE_IMAGES: [_tensor(s)]} for s in _sources(48, 32)]
    cond, uncond = family.encode_conditioning(PROMPTS, metadata, with_negative=False)
    # the tiny VAE halves the side: a 48 x 32 source is 24 x 16 latents, 12 x 8 = 96 packed tokens
    assert uncond is None and tuple(cond["image_latents"].shape) == (2, 16, 24, 16)
    packed = torch.zeros(2, 64, 64)  # a 32 x 32 target: 16 x 16 latents, 64 tokens
    ids = family.pipe._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32)
    tokens, all_ids = family.with_references(packed, ids, cond)
    assert tokens.shape == (2, 64 + 96, 64) and all_ids.shape == (160, 3)
    assert torch.equal(all_ids[:64], ids) and (all_ids[64:, 0] == 1).all()
    assert all_ids[64:, 1].max() == 11 and all_ids[64:, 2].max() == 7
    torch.testing.assert_close(tokens[:, 64:], family.pack(cond["image_latents"]))


def test_without_a_source_kontext_draws_from_the_prompt_as_flux(tiny_models):
    """No source image: the prompt alone, as the stock pipeline without `image` (tiny-flux has the same weights)."""
    kontext, flux = load_family(str(tiny_models / MODEL)), load_family(str(tiny_models / "tiny-flux"))
    a = generate_batch(kontext, PROMPTS, SEEDS, RES, 2, 3.5)
    b = generate_batch(flux, PROMPTS, SEEDS, RES, 2, 3.5)
    assert torch.equal(a, b)
    two = [{SOURCE_IMAGES: [torch.zeros(3, 32, 32)] * 2}] * 2
    with pytest.raises(UserError, match="one source image per instruction"):
        kontext.encode_conditioning(PROMPTS, two, with_negative=False)


def test_grpo_first_update_is_on_policy_with_the_source(tiny_models):
    from refl_ddpo.core.lora import add_lora

    torch.manual_seed(0)
    family = load_family(str(tiny_models / MODEL))
    family.pipe.scheduler = scheduler = family.policy_scheduler()
    params = add_lora(family.network, 4, 4, family.lora_target_modules, init="random")
    metadata = {SOURCE_IMAGES: [_tensor(_sources(32, 32)[0])]}
    kw = {"num_steps": 3, "guidance_scale": 3.5, "eta": 0.7}
    samples, first = ddpo_first_update(
        family, scheduler, params, family.empty_cond(), PROMPTS * 2, RES, metadata=metadata, **kw
    )
    assert tuple(samples["image_latents"].shape) == (4, 16, 16, 16)
    assert first["approx_kl"] < 1e-10 and first["clipfrac"] == 0.0, first


# ---- the trainers on edits ----


@pytest.mark.parametrize("trainer", ["refl", "grpo", "nft", "awm"])
def test_trainer_runs_two_steps_on_edits(trainer, tiny_models, kontext, tmp_path, capsys, monkeypatch):
    """Two steps (ReFL) or two epochs on --edit_data: the LoRA moved and no base weight did; GRPO's and ReFL's LoRA
    loads in the stock FluxKontextPipeline and changes its images."""
    watch = watch_training(monkeypatch)
    out = tmp_path / trainer
    common = {"model": MODEL, "edit_data": _two_edits(tmp_path / "d"), "learning_rate": "3e-2"}
    common |= {"lora_init": "random", "device": "cpu", "report_to": "none", "seed": 5}
    if trainer == "grpo":  # validated on the edits, each instruction with its source
        common |= {"validation_prompts_file": common["edit_data"], "num_validation_images": 1}
        common |= {"validation_num_steps": 2, "validation_guidance_scale": 3.5}
    if trainer == "refl":
        flags = {"num_inference_steps": 4, "k_lo": 2, "k_hi": 3, "train_batch_size": 2, "max_train_steps": 2}
        flags |= {"guidance_scale": 3.5}
    else:
        flags = {"reward": "jpeg_compressibility", "sample_num_steps": 3, "sample_batch_size": 2}
        flags |= {"sample_num_batches_per_epoch": 1, "train_batch_size": 2, "num_epochs": 2, "group_size": 2}
        flags |= {"sample_guidance_scale": 3.5}
    importlib.import_module(f"refl_ddpo.trainers.{trainer}").main(
        trainer_flags(tiny_models, out, **(common | flags))
    )
    assert watch.runs[-1]["family"].name == "flux_kontext"
    watch.assert_lora_moved_and_base_not(out)
    if trainer in ("refl", "grpo"):
        _assert_lora_changes_stock_edits(kontext, out)
    if trainer == "grpo":
        _assert_compare_shows_source_before_after(tiny_models, out, common["edit_data"], tmp_path)
        _assert_validation_edits_with_the_sources(tiny_models, out, common["edit_data"])


def _assert_validation_edits_with_the_sources(tiny_models, out, edit_data):
    """The last validation's records name their sources, and their rewards are those of the trained LoRA's edits of
    those sources (not of its images drawn from the instructions alone); the model card's command draws them again."""
    from refl_ddpo.core.lora import load_lora_into_pipeline
    from refl_ddpo.rewards import build_reward

    records = json.loads((out / "validation" / "epoch-2.json").read_text())["records"]
    assert [r["source_image"] for r in records] == [[str(edit_data.parent / n)] for n in ("a.png", "b.png")]
    family, reward = (
        load_family(str(tiny_models / MODEL)),
        build_reward("jpeg_compressibility", torch.device("cpu")),
    )
    load_lora_into_pipeline(family.pipe, out)
    metadata = [with_source_images(m) for _, m in load_edit_data(edit_data)]
    edits = generate_batch(family, PROMPTS, [5, 6], RES, 2, 3.5, metadata=metadata)
    alone = generate_batch(family, PROMPTS, [5, 6], RES, 2, 3.5)
    expected = reward.fn(edits, PROMPTS, metadata)[0]
    assert [r["reward"] for r in records] == pytest.approx(expected.tolist(), abs=1e-5)
    assert not torch.allclose(expected, reward.fn(alone, PROMPTS, metadata)[0], atol=1e-3)
    assert (
        f"--edit_data {edit_data} --seed 5" in (out / "README.md").read_text()
    )  # the card's command draws them


def _assert_compare_shows_source_before_after(tiny_models, lora_dir, edit_data, tmp):
    """Before / after inference on the edits with their scores, and the comparison: a row of source | before |
    after per pair, each pair naming its source."""
    from refl_ddpo.apps import compare, inference

    common = ["--edit_data", str(edit_data), "--reward_model_dir", str(tiny_models), "--device", "cpu"]
    common += ["--num_inference_steps", "3", "--num_images_per_prompt", "1", "--resolution", str(RES)]
    common += ["--rewards", "jpeg_compressibility,edit_preserve", "--guidance_scale", "3.5"]
    before, after = tmp / "before", tmp / "after"
    inference.main_base(
        ["--pretrained_model", str(tiny_models / MODEL), "--output_dir", str(before), *common]
    )
    inference.main_lora(["--lora_dir", str(lora_dir), "--output_dir", str(after), *common])
    result = compare.run_compare(str(before), str(after), str(tmp / "cmp"))
    assert [p["source_image"] for p in result["pairs"]] == [
        [str(edit_data.parent / n)] for n in ("a.png", "b.png")
    ]
    assert result["per_reward"]["edit_preserve"]["mean_difference"] != 0
    with Image.open(tmp / "cmp" / "compare.png") as im:
        assert im.width == 2 * 3 * 192  # two pairs a row, three cells each


def _assert_lora_changes_stock_edits(pipe, lora_dir):
    """The stock pipeline's edit of a source changes once `load_lora_weights(lora_dir)` ran; the LoRA unloaded."""
    kw = {"prompt": "make it blue", "image": _sources(32, 32)[0], "height": RES, "width": RES}
    kw |= {"max_area": RES * RES, "_auto_resize": False, "num_inference_steps": 3, "output_type": "pt"}
    before = pipe(generator=torch.Generator().manual_seed(0), **kw).images
    pipe.load_lora_weights(str(lora_dir))
    try:
        after = pipe(generator=torch.Generator().manual_seed(0), **kw).images
        loaded = [n for n, _ in pipe.transformer.named_parameters() if "lora_" in n]
    finally:
        pipe.unload_lora_weights()
    assert loaded and (before - after).abs().max() > 1e-4


def test_inference_names_each_records_source_and_instruction(tiny_models, tmp_path):
    from refl_ddpo.apps import inference
    from refl_ddpo.run.flags import parse_config

    path = _two_edits(tmp_path / "d")
    argv = ["--pretrained_model", str(tiny_models / MODEL), "--edit_data", str(path), "--device", "cpu"]
    argv += [
        "--output_dir",
        str(tmp_path / "out"),
        "--num_images_per_prompt",
        "1",
        "--num_inference_steps",
        "2",
    ]
    argv += ["--resolution", str(RES), "--rewards", "jpeg_compressibility"]
    result = inference.run_inference(parse_config(inference.InferenceConfig, argv))
    records = result["records"]
    assert [r["instruction"] for r in records] == PROMPTS
    assert [r["source_image"] for r in records] == [
        [str(path.parent / "a.png")],
        [str(path.parent / "b.png")],
    ]
    json.dumps(result)  # JSON all through: no tensor in the records


def test_flow_factory_kontext_preset_keeps_its_numbers_and_trains_on_edits(
    tiny_models, tmp_path, capsys, monkeypatch
):
    """Flow-Factory's FLUX.1 Kontext example as data (one GPU's share), and a run of it on the tiny folder with
    --edit_data (smaller batches, fewer steps, one epoch, CPU precision)."""
    from helpers import train_preset_small

    from refl_ddpo.run.flags import parse_config
    from refl_ddpo.trainers import grpo
    from refl_ddpo.trainers.grpo_config import GRPOConfig

    cfg = parse_config(GRPOConfig, ["--preset", "flow_factory_flux1_kontext"])
    assert (cfg.pretrained_model, cfg.reward, cfg.resolution, cfg.sample_num_steps, cfg.sample_eta) == (
        "black-forest-labs/FLUX.1-Kontext-dev",
        "pickscore",
        384,
        10,
        0.9,
    )
    assert (cfg.sample_guidance_scale, cfg.sde_window, cfg.train_skip_last_steps, cfg.group_size) == (
        2.5,
        1,
        6,
        16,
    )
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.learning_rate, cfg.train_clip_range) == (64, 128, 3e-4, 1e-4)
    small = {
        "sample_num_steps": 4,
        "train_skip_last_steps": 2,
        "lora_rank": 4,
        "lora_alpha": 8,
        "save_freq": 1,
    }
    small |= {"validation_num_steps": 2}
    train_preset_small(
        monkeypatch,
        capsys,
        grpo.main,
        tiny_models,
        tmp_path / "out",
        "flow_factory_flux1_kontext",
        model=MODEL,
        resolution=RES,
        edit_data=_two_edits(tmp_path / "d"),
        **small,
    )
