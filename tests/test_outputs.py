"""Outputs a person reads: compare.png's header and per-pair deltas, captions wrapped at words, inference scored
with several rewards, progress bars in logs, CPU threads, prompt lengths, one log run per start."""

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from refl_ddpo.apps import compare, inference
from refl_ddpo.apps.compare_picture import header_lines
from refl_ddpo.core.errors import UserError
from refl_ddpo.core.images import wrap_words
from refl_ddpo.run.flags import parse_config
from refl_ddpo.toy_world import DATA_DIR as TOY_WORLD_DIR

DATA = Path(__file__).resolve().parent.parent / "refl_ddpo" / "data"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- captions wrapped at words ----


def test_wrap_words_breaks_at_spaces_only():
    text = "a portrait of an old fisherman with a white beard"
    lines = wrap_words(text, 20, len)
    assert " ".join(lines) == text and all(len(line) <= 20 for line in lines)
    assert all(word in text.split() for line in lines for word in line.split())  # no word cut in two
    assert wrap_words(text, 20, len, max_lines=2)[-1].endswith("...")
    assert len(wrap_words(text, 20, len, max_lines=2)) == 2
    assert wrap_words("abcdefghij", 4, len) == ["abcd", "efgh", "ij"]  # only a word wider than a line is cut
    assert wrap_words("", 10, len) == []


# ---- compare: every shared reward, a header, per-pair deltas ----


def _run(rows, rewards=("imagereward",), **top):
    """A scores.json dict: rows of (prompt, seed, {reward: score})."""
    records = [
        {"prompt": p, "seed": s, "file": f"{i:04d}_00_seed{s}.png", **v} for i, (p, s, v) in enumerate(rows)
    ]
    return {"rewards": list(rewards), "records": records, **top}


def test_compare_runs_every_shared_reward():
    before = _run(
        [
            ("a", 1, {"x": 0.0, "y": 5.0, "z": 1.0}),
            ("a", 2, {"x": 1.0, "y": 4.0, "z": 1.0}),
            ("b", 3, {"x": 2.0, "y": 1.0, "z": 1.0}),
        ],
        rewards=("x", "y", "z"),
    )
    after = _run(
        [("a", 1, {"y": 6.0, "x": 1.0}), ("a", 2, {"y": 3.0, "x": 0.5}), ("b", 3, {"y": 1.0, "x": 2.0})],
        rewards=("y", "x"),
    )
    r = compare.compare_runs(before, after, num_resamples=500)
    assert r["rewards"] == ["x", "y"]  # z only in one run; the order of the first run
    assert r["mean_difference"] == r["per_reward"]["x"]["mean_difference"] == pytest.approx(0.5 / 3)
    y = r["per_reward"]["y"]
    assert y["mean_before"] == pytest.approx(10 / 3) and y["mean_after"] == pytest.approx(10 / 3)
    assert (y["wins"], y["ties"], y["losses"]) == (1, 1, 1) and y["win_rate"] == 0.5
    assert [p["scores"]["y"]["delta"] for p in r["pairs"]] == [1.0, -1.0, 0.0]
    assert [p["delta"] for p in r["pairs"]] == [1.0, -0.5, 0.0]  # the first shared reward at the top
    lines = header_lines(r)
    assert len(lines) == 2 and lines[0].startswith("x: before 1.000, after 1.167, difference +0.167")
    assert "95% CI" in lines[1] and "after wins 50%" in lines[1]
    text = compare.format_comparison(r, "before", "after")
    assert "mean x:" in text and "mean y:" in text
    with pytest.raises(UserError, match="share no reward"):
        compare.compare_runs(
            before, _run([(p, s, {}) for p, s, _ in [("a", 1, 0), ("a", 2, 0), ("b", 3, 0)]], ("w",))
        )


def test_old_scores_json_is_imagereward_only():
    old = {"records": [{"prompt": "a", "seed": 1, "file": "f.png", "imagereward": 0.5}]}
    assert compare.run_rewards(old) == ["imagereward"]
    r = compare.compare_runs(old, json.loads(json.dumps(old)), num_resamples=10)
    assert r["rewards"] == ["imagereward"] and r["mean_difference"] == 0


def _write_run(folder: Path, run: dict, colour) -> None:
    folder.mkdir(parents=True)
    for rec in run["records"]:
        Image.new("RGB", (32, 32), colour).save(folder / rec["file"])
    (folder / "scores.json").write_text(json.dumps(run))


def test_compare_png_has_a_header_and_a_caption_per_pair(tmp_path):
    long_prompt = "an ancient library with endless bookshelves and floating candles, fantasy, highly detailed"
    rows_b = [(long_prompt, s, {"imagereward": 0.1 * s, "aesthetic": 5.0}) for s in range(3)]
    rows_a = [(long_prompt, s, {"imagereward": 0.2 * s + 0.1, "aesthetic": 5.5}) for s in range(3)]
    _write_run(tmp_path / "base", _run(rows_b, ("imagereward", "aesthetic")), (200, 30, 30))
    _write_run(tmp_path / "lora", _run(rows_a, ("imagereward", "aesthetic")), (30, 30, 200))
    result = compare.run_compare(str(tmp_path / "base"), str(tmp_path / "lora"), str(tmp_path / "cmp"), 200)
    assert set(result["per_reward"]) == {"imagereward", "aesthetic"}
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["per_reward"]["aesthetic"]["mean_difference"] == pytest.approx(0.5)
    im = np.asarray(Image.open(tmp_path / "cmp" / "compare.png").convert("RGB")).astype(int)
    red = np.where((im[:, :, 0] > 150) & (im[:, :, 2] < 80))[0]  # rows of the "before" images
    top = red.min()
    assert top > 60, "a header of text lines above the first pair"
    assert (im[:top] < 100).all(axis=2).any(), "the header holds dark text"
    # the first pair's caption (prompt on 2+ lines, a line per reward) lies between its image and the next row
    gaps = np.diff(red)
    caption = gaps[gaps > 1].max() if (gaps > 1).any() else None
    assert caption is not None and caption > 4 * 17  # at least 4 lines of 17 px
    # an odd pair count leaves the last row half empty; two pairs per row by default
    assert im.shape[1] == 2 * 2 * 192


def _write_toy_run(folder: Path, rows: list[tuple[str, int]], drawn: list[str]) -> None:
    """An inference run folder of the toy world: per (prompt, seed) row an image rendered for `drawn` (the prompt's
    colour or another), scored by toy_color_match."""
    from refl_ddpo.toy_world import world as tw

    images = tw.render_prompts(drawn, torch.Generator().manual_seed(0))  # uint8 (B, 3, 32, 32)
    scored = [(p, s, {"toy_color_match": float(p == d)}) for (p, s), d in zip(rows, drawn, strict=True)]
    run = _run(scored, ("toy_color_match",))
    folder.mkdir(parents=True)
    for rec, image in zip(run["records"], images, strict=True):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / rec["file"])
    (folder / "scores.json").write_text(json.dumps(run))


def test_compare_png_of_the_toy_world_states_the_judge_and_every_prompt(tmp_path):
    """demo.sh's comparison: 6 held-out prompts x 8 seeds, more pairs than --max_pairs 32. The header states the
    judge's colour accuracy, grey, dirty and ragged before -> after (python -m refl_ddpo.toy_world.world's numbers),
    every prompt is shown, each caption carries the pair's judgement."""
    from refl_ddpo.apps.compare_picture import caption_lines
    from refl_ddpo.toy_world import world as tw

    prompts = list(tw.HELDOUT_PROMPTS)
    rows = [(p, s) for p in prompts for s in range(8)]
    # before: the first 4 seeds of every prompt drawn in another colour (red, or blue for red prompts)
    wrong = [p.replace(p.split()[1], "blue" if "red" in p else "red") for p, _ in rows]
    before = [w if s < 4 else p for (p, s), w in zip(rows, wrong, strict=True)]
    _write_toy_run(tmp_path / "base", rows, before)
    _write_toy_run(tmp_path / "lora", rows, [p for p, _ in rows])
    result = compare.run_compare(str(tmp_path / "base"), str(tmp_path / "lora"), str(tmp_path / "cmp"), 200)

    b, a = tw.judge_run(tmp_path / "base"), tw.judge_run(tmp_path / "lora")
    assert (b["accuracy"], a["accuracy"]) == (0.5, 1.0)
    header = header_lines(result)[0]
    print(header)
    assert header == (
        f"toy judge over 48 pairs: colour accuracy 50.0% -> 100.0%, grey {b['grey']:.3f} -> {a['grey']:.3f}, "
        f"dirty {b['dirty']:.3f} -> {a['dirty']:.3f}, ragged {b['ragged']:.3f} -> {a['ragged']:.3f}"
    )
    assert header_lines(result)[1].startswith("toy_color_match: before 0.500, after 1.000")
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["toy_judge"]["before"] == {k: b[k] for k in ("accuracy", "dirty", "grey", "ragged")}

    shown = compare.shown_pairs(result["pairs"], 32)
    assert len(shown) == 30 and {p["prompt"] for p in shown} == set(prompts)  # 5 seeds of each of the 6
    assert [p["seed"] for p in shown[:5]] == [0, 1, 2, 3, 4]
    first = [text for text, _ in caption_lines(shown[0], 10_000, len)]
    red_or_blue = "blue" if "red" in shown[0]["prompt"] else "red"
    assert first[0] == f"{shown[0]['prompt']} (seed 0)"
    assert first[-2].startswith(f"judge before: {red_or_blue}, wrong; grey ")
    assert first[-1].startswith(f"judge after: {shown[0]['prompt'].split()[1]}, right; grey ")
    with Image.open(tmp_path / "cmp" / "compare.png") as im:  # 4 pairs a row, 8 rows for 30 pairs
        assert im.width == 4 * 2 * 192 and im.height > 8 * 192
    assert compare.shown_pairs(result["pairs"], 4) == [result["pairs"][8 * i] for i in range(6)]  # one each
    assert compare.shown_pairs(result["pairs"], 0) == []


def test_grids_wrap_into_rows(tmp_path):
    """A prompt's 16 images make two rows of 8 in grid.png, not one row of 16 (SD3's 4096 x 284 grid)."""
    from refl_ddpo.core.images import grid_columns

    assert [grid_columns(c) for c in (1, 4, 8, 9, 12, 16, 64)] == [1, 4, 8, 8, 6, 8, 8]
    records = [{"prompt": "a cyan circle", "seed": s, "toy_color_match": 1.0} for s in range(16)]
    images = [torch.full((32, 32, 3), 128, dtype=torch.uint8)] * 16
    inference._save_grid(tmp_path / "grid.png", images, records, ["toy_color_match"], per_prompt=16)
    with Image.open(tmp_path / "grid.png") as im:
        assert im.width == 8 * 256 and 2 * 256 < im.height < 3 * 256
    inference._save_grid(tmp_path / "single.png", images, records, ["toy_color_match"], per_prompt=1)
    with Image.open(tmp_path / "single.png") as im:  # one image per prompt: near square, 4 x 4
        assert im.width == 4 * 256 and 4 * 256 < im.height < 5 * 256


# ---- inference with several rewards ----


def _cfg(tiny_sd, prompts_file, out, *extra):
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
            "2",
            *extra,
        ],
    )


def test_inference_scores_every_reward_named(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    out = tmp_path / "out"
    cfg = _cfg(
        tiny_models / "stable-diffusion",
        prompts,
        out,
        "--reward_model_dir",
        str(tiny_models),
        "--rewards",
        "jpeg_incompressibility,imagereward",
    )
    result = inference.run_inference(cfg)
    scores = json.loads((out / "scores.json").read_text())
    assert scores["rewards"] == ["jpeg_incompressibility", "imagereward"] == result["rewards"]
    from refl_ddpo.rewards import build_reward
    from refl_ddpo.rewards.jpeg import jpeg_size_kb

    # ImageReward as the registry scores it: the one path (tests/test_remote_reward.py checks it to 1e-6)
    imagereward = build_reward("imagereward", "cpu", model_dir=str(tiny_models))
    for r in scores["records"]:
        with Image.open(out / r["file"]) as im:
            x = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)[None].float() / 255
            assert r["jpeg_incompressibility"] == pytest.approx(float(jpeg_size_kb(x)[0]), abs=1e-6)
            with torch.no_grad():
                expected = float(imagereward(x, [r["prompt"]], [{}])[0][0])
            assert r["imagereward"] == pytest.approx(expected, abs=1e-5)
    values = [r["jpeg_incompressibility"] for r in scores["records"]]
    assert scores["scores"]["jpeg_incompressibility"]["mean"] == pytest.approx(np.mean(values))
    assert scores["scorer"] == "jpeg_incompressibility" and scores["mean"] == pytest.approx(np.mean(values))
    # the default stays ImageReward alone
    assert inference.InferenceConfig().rewards == "imagereward"


@pytest.mark.parametrize(
    "rewards, message",
    [
        ("nope", "--rewards: unknown reward 'nope'"),
        ("imagereward,imagereward", "twice"),
        (",", "empty"),
        ("toy_classifier", "--rewards toy_classifier: --reward_model_dir"),
    ],
)
def test_bad_rewards_fail_before_loading(rewards, message, tmp_path, monkeypatch):
    monkeypatch.setattr(inference, "load_inference_family", lambda cfg: pytest.fail("loaded a model"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    with pytest.raises(UserError, match=message):
        _cfg(
            TOY_WORLD_DIR / "toy-sd",
            prompts,
            tmp_path / "out",
            "--rewards",
            rewards,
            "--reward_model_dir",
            str(tmp_path),
        )


# ---- progress bars ----


def test_progress_bar_in_a_log_writes_plain_lines(monkeypatch):
    from refl_ddpo.core.progress import progress_bar, run_clock

    monkeypatch.setenv("REFL_DDPO_PROGRESS_INTERVAL", "0")
    log = io.StringIO()  # not a terminal
    with progress_bar(5, "epoch 1/2 training", unit="step", file=log) as bar:
        for i in range(5):
            bar.set_postfix(loss=f"{0.1 * i:.3g}", refresh=False)
            bar.update(1)
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines and all(line.startswith("epoch 1/2 training") for line in lines)
    assert "5/5" in lines[-1] and "loss=0.4" in lines[-1]
    assert len(lines) == len(set(lines))  # closing does not repeat the last line
    monkeypatch.setenv("REFL_DDPO_PROGRESS_INTERVAL", "3600")
    quiet = io.StringIO()
    with progress_bar(5, "short", file=quiet) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""  # a phase shorter than the interval writes nothing
    off = io.StringIO()
    with progress_bar(5, "other rank", file=off, enabled=False) as bar:
        bar.update(5)
    assert off.getvalue() == ""
    assert run_clock(62, 1, 3) == "1:02 elapsed, ~3:06 left" and run_clock(3700, 2, 0) == "1:01:40 elapsed"


# ---- CPU threads ----


def test_default_cpu_threads_rule():
    from refl_ddpo.run.threads import default_cpu_threads

    assert default_cpu_threads(physical=2, cores=2, load=4.6) == 1  # the loaded 2-core machine of the issue
    assert default_cpu_threads(physical=16, cores=32, load=0.2) == 16  # idle: the physical cores
    assert default_cpu_threads(physical=16, cores=16, load=0.0, local_processes=4) == 4
    assert default_cpu_threads(physical=8, cores=8, load=None) == 8
    assert default_cpu_threads(physical=8, cores=8, load=float("nan")) == 8


def test_set_cpu_threads_env(monkeypatch):
    from refl_ddpo.run.threads import THREADS_ENV, set_cpu_threads

    monkeypatch.setenv(THREADS_ENV, "2")
    assert set_cpu_threads() == 2 == torch.get_num_threads()
    monkeypatch.setenv(THREADS_ENV, "zero")
    with pytest.raises(UserError, match=THREADS_ENV):
        set_cpu_threads()
    monkeypatch.delenv(THREADS_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(3)
    assert set_cpu_threads() == 3  # the user's OMP_NUM_THREADS: torch's own choice is left alone


# ---- prompt lengths ----


def test_shipped_prompt_lists_fit_clip():
    """Every prompt list in refl_ddpo/data fits CLIP's 77 tokens (begin and end tokens included), counted with
    OpenAI CLIP's BPE tokenizer as open_clip ships it."""
    tokenizer_module = pytest.importorskip(
        "open_clip.tokenizer", reason="open_clip carries CLIP's BPE vocabulary"
    )
    from refl_ddpo.core.prompts import load_prompts

    tokenizer = tokenizer_module.SimpleTokenizer()
    files = sorted(DATA.glob("*.txt"))
    assert len(files) >= 6
    for path in files:
        for prompt, _ in load_prompts(str(path)):
            n = len(tokenizer.encode(prompt)) + 2
            assert n <= 77, f"{path.name}: '{prompt}' is {n} tokens"


def test_truncation_is_said_once_per_run(tiny_sd, capsys):
    import logging

    from refl_ddpo.core.families import load_family

    family = load_family(str(tiny_sd))
    long_prompt = "a very long prompt " * 8  # the tiny tokenizer has one token per character: > 77
    for _ in range(3):
        family.encode_prompts([long_prompt, "a cat"], with_negative=True)
    err = [line for line in capsys.readouterr().err.splitlines() if "truncated" in line]
    assert len(err) == 1 and "said once per run" in err[0]
    assert logging.getLogger(type(family.pipe).__module__).getEffectiveLevel() >= logging.ERROR


# ---- one log run per start ----


def test_each_start_is_a_new_log_run(tmp_path):
    from refl_ddpo.run.training import next_log_run, start_trackers

    calls = []

    def init_trackers(project, config, init_kwargs):
        calls.append((project, init_kwargs))
        os.makedirs(os.path.join(accelerator.project_configuration.logging_dir, project))

    accelerator = SimpleNamespace(
        is_main_process=True,
        project_configuration=SimpleNamespace(logging_dir=None),
        init_trackers=init_trackers,
    )
    where = {"output_dir": str(tmp_path), "logging_dir": "logs"}
    assert next_log_run(tmp_path / "logs") == "run-1"
    assert start_trackers(accelerator, "refl", {"a": [1]}, report_to="all", **where) == "run-1"
    assert start_trackers(accelerator, "refl", {"a": [1]}, report_to="all", **where) == "run-2"
    assert (tmp_path / "logs" / "run-1" / "refl").is_dir() and (tmp_path / "logs" / "run-2" / "refl").is_dir()
    assert calls[1] == ("refl", {"wandb": {"dir": str(tmp_path / "logs"), "name": "refl-run-2"}})
    assert start_trackers(accelerator, "refl", {}, report_to="none", **where) is None
