"""Before/after inference (inference/inference.py, inference_lora.py, compare.py) on the tiny random models."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from refl_ddpo.apps import compare, inference
from refl_ddpo.apps.compare import compare_runs, paired_bootstrap_ci
from refl_ddpo.apps.inference_config import LoraInferenceConfig
from refl_ddpo.core.families.sd import StableDiffusion
from refl_ddpo.core.generate import generate_batch
from refl_ddpo.core.lora import add_lora, save_lora
from refl_ddpo.core.models import load_pipeline
from refl_ddpo.run.flags import parse_config

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "inference"
PROMPTS = ["a photo of a cat", "an oil painting of a castle"]
N_PER_PROMPT, SEED = 2, 7
# batch 3 over 4 images: the first batch mixes both prompts, the last one is short
FAST = [
    "--num_inference_steps",
    "4",
    "--device",
    "cpu",
    "--num_images_per_prompt",
    str(N_PER_PROMPT),
    "--seed",
    str(SEED),
    "--batch_size",
    "3",
]
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def run_script(name: str, *args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # One intra-op thread: the tiny models gain nothing from more, and on a shared 2-core machine two spinning OpenMP
    # threads per process made these runs 10-40x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def make_lora(sd_dir: Path, out: Path, init: str, config: dict | None = None, **unet_kwargs) -> Path:
    """A LoRA saved by the kit's own save_lora; `unet_kwargs` build a UNet of another architecture instead."""
    if unet_kwargs:
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel.from_config(
            {**UNet2DConditionModel.load_config(sd_dir / "unet"), **unet_kwargs}
        )
    else:
        unet = load_pipeline(str(sd_dir)).unet
    add_lora(unet, 4, 4, TARGETS, init=init)
    return save_lora(unet, out, config=config)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tiny_models, prompts_file, tmp_path_factory) -> dict[str, Path]:
    """Base twice (inference.py's main in this process, and the script run from inside inference/), base + zero
    LoRA, base + random LoRA."""
    root = tmp_path_factory.mktemp("runs")
    sd = tiny_models / "stable-diffusion"
    recorded = {"pretrained_model": str(sd), "resolution": 32}  # what a trainer writes beside its LoRA
    loras = {init: make_lora(sd, root / f"lora_{init}", init, recorded) for init in ("gaussian", "random")}
    common = ["--prompts_file", prompts_file, "--reward_model_dir", tiny_models, *FAST]
    out = {
        "base": root / "base",
        "base_again": root / "base_again",
        "zero": root / "zero",
        "random": root / "random",
        **{f"lora_{k}": v for k, v in loras.items()},
    }
    base = ["--pretrained_model", sd, "--resolution", 32, *common]
    inference.main_base(list(map(str, [*base, "--output_dir", out["base"]])))
    p = run_script("inference.py", *base, "--output_dir", out["base_again"], cwd=SCRIPTS)
    assert p.returncode == 0, p.stderr[-2000:]
    # base + LoRA in this process (inference_lora.py's main; the script itself: test_lora_of_another_architecture...):
    # no --pretrained_model / --resolution, both come from the config.json beside the LoRA
    for name, init in (("zero", "gaussian"), ("random", "random")):
        inference.main_lora(list(map(str, ["--lora_dir", loras[init], "--output_dir", out[name], *common])))
    return out


def load_scores(run_dir: Path) -> dict:
    return json.loads((run_dir / "scores.json").read_text())


# ---- the scripts, end to end ----


def test_same_seed_and_prompt_give_bit_identical_images(runs):
    a, b = load_scores(runs["base"]), load_scores(runs["base_again"])
    assert [r["file"] for r in a["records"]] == [r["file"] for r in b["records"]]
    for r in a["records"]:
        assert np.array_equal(pixels(runs["base"] / r["file"]), pixels(runs["base_again"] / r["file"]))
    assert [r["imagereward"] for r in a["records"]] == [r["imagereward"] for r in b["records"]]
    # and different seeds give different images
    files = [r["file"] for r in a["records"]]
    assert not np.array_equal(pixels(runs["base"] / files[0]), pixels(runs["base"] / files[1]))


def test_scores_json_pngs_and_grid(runs, tiny_models):
    scores = load_scores(runs["base"])
    records = scores["records"]
    assert len(records) == scores["count"] == len(PROMPTS) * N_PER_PROMPT
    expected = [(p, SEED + i * N_PER_PROMPT + j) for i, p in enumerate(PROMPTS) for j in range(N_PER_PROMPT)]
    assert [(r["prompt"], r["seed"]) for r in records] == expected
    values = [r["imagereward"] for r in records]
    assert all(isinstance(v, float) for v in values) and "score_error" not in scores
    assert scores["mean"] == pytest.approx(np.mean(values))
    assert scores["std"] == pytest.approx(np.std(values, ddof=1))
    for r in records:
        with Image.open(runs["base"] / r["file"]) as im:
            assert im.size == (32, 32)
            assert im.text["prompt"] == r["prompt"] and int(im.text["seed"]) == r["seed"]
    assert (runs["base"] / "grid.png").is_file()
    # each score is the ImageReward of its saved file, as the registry scores it (the one path)
    from refl_ddpo.rewards import build_reward

    imagereward = build_reward("imagereward", "cpu", model_dir=str(tiny_models))
    for r in records[:2]:
        with Image.open(runs["base"] / r["file"]) as im:
            x = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)[None].float() / 255
        with torch.no_grad():
            expected = float(imagereward(x, [r["prompt"]], [{}])[0][0])
        assert expected == pytest.approx(r["imagereward"], abs=1e-5)


def test_zero_lora_gives_the_base_images_and_a_trained_one_does_not(runs, tiny_sd):
    base, zero, rand = load_scores(runs["base"]), load_scores(runs["zero"]), load_scores(runs["random"])
    assert zero["config"]["pretrained_model"] == str(tiny_sd) and zero["config"]["resolution"] == 32
    for b, z, r in zip(base["records"], zero["records"], rand["records"], strict=True):
        assert (b["prompt"], b["seed"]) == (z["prompt"], z["seed"]) == (r["prompt"], r["seed"])
        assert np.array_equal(pixels(runs["base"] / b["file"]), pixels(runs["zero"] / z["file"]))
        assert not np.array_equal(pixels(runs["base"] / b["file"]), pixels(runs["random"] / r["file"]))
    assert [r["imagereward"] for r in zero["records"]] == [r["imagereward"] for r in base["records"]]


def test_compare_script(runs, tmp_path):
    out = tmp_path / "cmp"
    p = run_script("compare.py", runs["base"], runs["random"], "--out", out)
    assert p.returncode == 0, p.stderr
    assert "mean ImageReward" in p.stdout and PROMPTS[0] in p.stdout
    result = json.loads((out / "compare.json").read_text())
    before = {(r["prompt"], r["seed"]): r["imagereward"] for r in load_scores(runs["base"])["records"]}
    after = {(r["prompt"], r["seed"]): r["imagereward"] for r in load_scores(runs["random"])["records"]}
    deltas = [after[k] - before[k] for k in before]
    assert result["count"] == len(before) == len(result["pairs"])
    assert result["mean_before"] == pytest.approx(np.mean(list(before.values())))
    assert result["mean_after"] == pytest.approx(np.mean(list(after.values())))
    assert result["mean_difference"] == pytest.approx(np.mean(deltas))
    assert result["win_rate"] == pytest.approx(np.mean([d > 0 for d in deltas]))
    lo, hi = result["bootstrap_ci95"]
    assert min(deltas) <= lo <= result["mean_difference"] <= hi <= max(deltas)
    per_prompt = {r["prompt"]: r for r in result["per_prompt"]}
    assert set(per_prompt) == set(PROMPTS)
    for prompt in PROMPTS:
        mine = [after[k] - before[k] for k in before if k[0] == prompt]
        assert (
            per_prompt[prompt]["delta"] == pytest.approx(np.mean(mine))
            and per_prompt[prompt]["n"] == N_PER_PROMPT
        )
    with Image.open(out / "compare.png") as im:
        assert im.width > im.height / len(before)  # two columns: before | after
    # default --out: beside the second run (in-process: the script above already covered the entry point)
    compare.run_compare(runs["base"], runs["zero"])
    same = json.loads((runs["zero"].parent / "compare" / "compare.json").read_text())
    assert same["mean_difference"] == 0 and same["ties"] == same["count"] and same["bootstrap_ci95"] == [0, 0]


def test_help_from_inside_inference_dir():
    p = run_script("inference.py", "--help", cwd=SCRIPTS)
    assert p.returncode == 0, p.stderr
    assert "--num_images_per_prompt" in p.stdout and "--prompts_file" in p.stdout


# ---- bad input: one line, exit != 0, before any model is loaded where possible ----


def test_lora_of_another_architecture_is_refused(tiny_models, prompts_file, tmp_path):
    sd = tiny_models / "stable-diffusion"
    wrong = make_lora(sd, tmp_path / "wrong_lora", "random", cross_attention_dim=16)  # other text width
    p = run_script(
        "inference_lora.py",
        "--lora_dir",
        wrong,
        "--pretrained_model",
        sd,
        "--resolution",
        32,
        "--prompts_file",
        prompts_file,
        "--output_dir",
        tmp_path / "out",
        *FAST,
    )
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --lora_dir") and "another architecture" in lines[0]
    assert not (tmp_path / "out" / "scores.json").exists()


def test_lora_with_more_blocks_is_refused(tiny_sd, tmp_path):
    """diffusers only warns when LoRA keys have no layer; a UNet with an extra block must still be refused."""
    extra = {
        "block_out_channels": (32, 64, 64),
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    }
    lora = make_lora(tiny_sd, tmp_path / "lora3", "random", **extra)
    from refl_ddpo.core.errors import UserError
    from refl_ddpo.core.lora import load_lora_into_pipeline

    with pytest.raises(UserError, match="another architecture"):
        load_lora_into_pipeline(load_pipeline(str(tiny_sd)), lora)


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    import refl_ddpo.core.models

    monkeypatch.setattr(refl_ddpo.core.models, "load_pipeline", refuse)


@pytest.mark.parametrize(
    "case", ["missing_lora_dir", "empty_prompts", "zero_images", "missing_base", "missing_recorded_base"]
)
def test_bad_input_is_one_line_error(case, tiny_sd, prompts_file, tmp_path, capsys, no_model_loading):
    base = [
        "--pretrained_model",
        str(tiny_sd),
        "--prompts_file",
        str(prompts_file),
        "--device",
        "cpu",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    script, args, expect = {
        "missing_lora_dir": (
            "inference_lora.py",
            [*base, "--lora_dir", str(tmp_path / "nope")],
            "--lora_dir",
        ),
        "empty_prompts": (
            "inference.py",
            [*base, "--prompts_file", str(tmp_path / "empty.txt")],
            "no prompts",
        ),
        "zero_images": ("inference.py", [*base, "--num_images_per_prompt", "0"], "--num_images_per_prompt"),
        "missing_base": (
            "inference.py",
            [*base, "--pretrained_model", str(tmp_path / "no_sd")],
            "--pretrained_model",
        ),
        "missing_recorded_base": (
            "inference_lora.py",
            ["--lora_dir", str(tmp_path / "lora"), *base[2:]],
            "config.json",
        ),
    }[case]
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (tmp_path / "lora" / "config.json").write_text(json.dumps({"pretrained_model": str(tmp_path / "gone")}))
    main = runpy.run_path(str(SCRIPTS / script))["main"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], lines
    assert not (tmp_path / "out" / "scores.json").exists()


def test_lora_defaults_come_from_its_config_and_flags_win(runs, tiny_sd, tmp_path):
    lora = str(runs["lora_gaussian"])
    cfg = parse_config(LoraInferenceConfig, ["--lora_dir", lora, "--device", "cpu"])
    assert (cfg.pretrained_model, cfg.resolution, cfg.dtype) == (str(tiny_sd), 32, "fp32")
    other = tmp_path / "sd_copy"
    other.symlink_to(tiny_sd)
    cfg = parse_config(
        LoraInferenceConfig,
        ["--lora_dir", lora, "--device", "cpu", "--pretrained_model", str(other), "--resolution", "64"],
    )
    assert (cfg.pretrained_model, cfg.resolution) == (str(other), 64)


# ---- the library ----


def test_generation_keeps_no_autograd_graph_and_is_batch_independent(tiny_sd):
    pipe = load_pipeline(str(tiny_sd))
    params = add_lora(pipe.unet, 4, 4, TARGETS, init="random")
    assert all(p.requires_grad for p in params)  # a graph would be built if grad were on
    seen = []
    pipe.unet.register_forward_pre_hook(lambda module, args: seen.append(torch.is_grad_enabled()))
    pipe.vae.decoder.register_forward_pre_hook(lambda module, args: seen.append(torch.is_grad_enabled()))
    from diffusers import DDIMScheduler

    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    family = StableDiffusion(pipe)
    images = generate_batch(family, PROMPTS, [3, 4], 32, 3, 7.5)
    assert images.shape == (2, 3, 32, 32) and images.grad_fn is None and not images.requires_grad
    assert seen == [False] * 4  # 3 UNet steps + 1 decode, none with grad
    # each image from its own seed: the same noise whatever the batch (equal up to batched-kernel rounding)
    alone = torch.cat(
        [generate_batch(family, [p], [s], 32, 3, 7.5) for p, s in zip(PROMPTS, [3, 4], strict=True)]
    )
    torch.testing.assert_close(images, alone, atol=1e-4, rtol=0)
    # stochastic DDIM (eta 1) draws its step noise from the same per-image generators
    noisy = generate_batch(family, PROMPTS, [3, 4], 32, 3, 7.5, eta=1.0)
    noisy_alone = torch.cat(
        [generate_batch(family, [p], [s], 32, 3, 7.5, eta=1.0) for p, s in zip(PROMPTS, [3, 4], strict=True)]
    )
    torch.testing.assert_close(noisy, noisy_alone, atol=1e-4, rtol=0)
    assert (noisy - images).abs().max() > 1e-2


def _config(tiny_sd, prompts_file, out: Path, *extra: str):
    return parse_config(
        inference.InferenceConfig,
        [
            "--pretrained_model",
            str(tiny_sd),
            "--prompts_file",
            str(prompts_file),
            "--output_dir",
            str(out),
            "--resolution",
            "32",
            "--num_inference_steps",
            "2",
            "--device",
            "cpu",
            "--num_images_per_prompt",
            "1",
            *extra,
        ],
    )


def test_missing_imagereward_files_still_write_images_with_null_scores(
    tiny_sd, prompts_file, tmp_path, capsys
):
    cfg = _config(tiny_sd, prompts_file, tmp_path / "out", "--reward_model_dir", str(tmp_path / "no_reward"))
    inference.run_inference(cfg)
    scores = load_scores(tmp_path / "out")
    assert "ImageReward.pt" in scores["score_error"]
    assert scores["mean"] is None and scores["std"] is None
    assert [r["imagereward"] for r in scores["records"]] == [None] * len(PROMPTS)
    assert all((tmp_path / "out" / r["file"]).is_file() for r in scores["records"])
    assert (tmp_path / "out" / "grid.png").is_file()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "ImageReward" in warnings[0]


def test_failed_run_leaves_no_stale_scores(tiny_models, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "scores.json").write_text(json.dumps({"records": [], "mean": 9.9}))  # from an earlier run
    calls = []
    real = inference.generate_batch

    def fail_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(inference, "generate_batch", fail_second_batch)
    cfg = _config(
        tiny_models / "stable-diffusion",
        prompts_file,
        out,
        "--reward_model_dir",
        str(tiny_models),
        "--batch_size",
        "1",
    )
    with pytest.raises(RuntimeError, match="simulated"):
        inference.run_inference(cfg)
    assert not (out / "scores.json").exists() and not list(out.glob(".*.tmp"))


def _run(pairs: list[tuple[str, int, float | None]]) -> dict:
    return {
        "records": [{"prompt": p, "seed": s, "file": f"{p}-{s}.png", "imagereward": v} for p, s, v in pairs]
    }


def test_compare_runs_pairs_by_prompt_and_seed():
    before = _run([("a", 1, 0.0), ("a", 2, 1.0), ("b", 3, 2.0)])
    after = _run([("b", 3, 2.0), ("a", 2, 0.5), ("a", 1, 1.0)])  # other order: matched by key, not position
    r = compare_runs(before, after, num_resamples=2000)
    assert [p["delta"] for p in r["pairs"]] == [1.0, -0.5, 0.0]
    assert (r["wins"], r["ties"], r["losses"]) == (1, 1, 1) and r["win_rate"] == 0.5  # ties count half
    assert r["mean_difference"] == pytest.approx(0.5 / 3)
    assert {p["prompt"]: p["delta"] for p in r["per_prompt"]} == {"a": 0.25, "b": 0.0}
    from refl_ddpo.core.errors import UserError

    with pytest.raises(UserError, match="different \\(prompt, seed\\) pairs"):
        compare_runs(before, _run([("a", 1, 0.0), ("a", 2, 1.0), ("b", 4, 2.0)]))
    missing = compare_runs(
        before, {**_run([("a", 1, None), ("a", 2, None), ("b", 3, None)]), "score_error": "x"}
    )
    assert "mean_difference" not in missing and "x" in missing["score_error"]


def test_paired_bootstrap_interval():
    rng = np.random.default_rng(1)
    diffs = rng.normal(0.3, 1.0, size=200)
    lo, hi = paired_bootstrap_ci(diffs, 4000, seed=5)
    assert (lo, hi) == paired_bootstrap_ci(diffs, 4000, seed=5)  # seeded
    assert lo < diffs.mean() < hi
    se = diffs.std(ddof=1) / np.sqrt(
        len(diffs)
    )  # the normal approximation's half-width is 1.96 standard errors
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert paired_bootstrap_ci([0.25] * 5, 100) == (0.25, 0.25)


@pytest.mark.parametrize("scheduler", sorted(StableDiffusion.schedulers))
def test_every_scheduler_choice_runs(scheduler, tiny_sd, tmp_path):
    cfg = _config(tiny_sd, tmp_path / "unused.txt", tmp_path / "out", "--scheduler", scheduler)
    family, _ = inference.load_inference_family(cfg)
    assert type(family.pipe.scheduler).__name__ == StableDiffusion.schedulers[scheduler]
    a, b = (generate_batch(family, PROMPTS[:1], [5], 32, 2, 7.5) for _ in range(2))
    assert a.shape == (1, 3, 32, 32) and torch.isfinite(a).all() and torch.equal(a, b)
