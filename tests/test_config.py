"""Config -> flags, --config files, cross-field checks, and prompt files."""

import json

import pytest

from refl_ddpo.config import CommonConfig, parse_config
from refl_ddpo.errors import UserError
from refl_ddpo.prompts import get_prompt_fn, load_prompts
from refl_ddpo.rewards import parse_reward_spec


def test_flags_defaults_and_overrides(tmp_path):
    cfg = parse_config(CommonConfig, [])
    assert cfg.lora_rank == 4 and cfg.use_lora and cfg.lora_target_modules == ["to_q", "to_k", "to_v", "to_out.0"]
    (tmp_path / "c.yaml").write_text("lora_rank: 16\nseed: 3\nmixed_precision: bf16\n")
    cfg = parse_config(CommonConfig, ["--config", str(tmp_path / "c.yaml"), "--seed", "5", "--no-use_lora",
                                      "--lora_alpha", "none", "--lora_target_modules", "to_q", "to_k"])
    assert (cfg.lora_rank, cfg.seed, cfg.use_lora, cfg.mixed_precision) == (16, 5, False, "bf16")
    assert cfg.lora_alpha is None and cfg.resolved_lora_alpha == 16.0
    assert cfg.lora_target_modules == ["to_q", "to_k"]
    # later flags win, so scripts can put defaults first and pass the user's flags after
    assert parse_config(CommonConfig, ["--seed", "1", "--seed", "2"]).seed == 2


def test_every_field_has_help():
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(CommonConfig))


def test_config_file_errors(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"lora_rnak": 3}))
    with pytest.raises(UserError, match="lora_rnak"):
        parse_config(CommonConfig, ["--config", str(tmp_path / "bad.json")])
    with pytest.raises(UserError, match="no such file"):
        parse_config(CommonConfig, ["--config", str(tmp_path / "missing.yaml")])


def test_checks_name_the_field():
    with pytest.raises(UserError, match="--lora_rank"):
        parse_config(CommonConfig, ["--lora_rank", "0"])
    with pytest.raises(SystemExit):  # argparse: a typo in a choice fails at parse time
        parse_config(CommonConfig, ["--mixed_precision", "fp8"])


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("# comment\na cat\n\na dog\n")
    assert [p for p, _ in load_prompts(tmp_path / "p.txt")] == ["a cat", "a dog"]
    (tmp_path / "p.json").write_text(json.dumps(["a", {"text": "b", "id": 7}, {"prompt": "c"}]))
    assert load_prompts(tmp_path / "p.json") == [("a", {}), ("b", {"id": 7}), ("c", {})]
    (tmp_path / "empty.txt").write_text("\n# nothing\n")
    with pytest.raises(UserError, match="no prompts"):
        load_prompts(tmp_path / "empty.txt")
    (tmp_path / "bad.json").write_text(json.dumps([{"caption": "x"}]))
    with pytest.raises(UserError, match="item 0"):
        load_prompts(tmp_path / "bad.json")
    fn = get_prompt_fn(str(tmp_path / "p.txt"), seed=0)
    assert {fn()[0] for _ in range(20)} == {"a cat", "a dog"}


def test_builtin_prompt_sources():
    for name in ["imagenet_animals", "simple_animals", "refl_prompts"]:
        prompt, metadata = get_prompt_fn(name, seed=0)()
        assert isinstance(prompt, str) and prompt and isinstance(metadata, dict)


def test_reward_spec():
    assert parse_reward_spec("jpeg_compressibility:1.0,imagereward:0.5") == [
        ("jpeg_compressibility", 1.0), ("imagereward", 0.5)]
    with pytest.raises(UserError, match="unknown reward 'nope'"):
        parse_reward_spec("nope")
    with pytest.raises(UserError, match="not a number"):
        parse_reward_spec("imagereward:x")
