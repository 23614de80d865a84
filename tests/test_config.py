"""Config -> flags, --config files, cross-field checks, and prompt files."""

import json

import pytest

from refl_ddpo.config import CommonConfig, parse_config
from refl_ddpo.errors import UserError
from refl_ddpo.prompts import get_prompt_fn, load_prompts
from refl_ddpo.rewards import parse_reward_spec


def test_flags_defaults_and_overrides(tmp_path):
    cfg = parse_config(CommonConfig, [])
    assert (
        cfg.lora_rank == 4
        and cfg.use_lora
        and cfg.lora_target_modules == ["to_q", "to_k", "to_v", "to_out.0"]
    )
    (tmp_path / "c.yaml").write_text("lora_rank: 16\nseed: 3\nmixed_precision: bf16\n")
    cfg = parse_config(
        CommonConfig,
        [
            "--config",
            str(tmp_path / "c.yaml"),
            "--seed",
            "5",
            "--no-use_lora",
            "--lora_alpha",
            "none",
            "--lora_target_modules",
            "to_q",
            "to_k",
        ],
    )
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
        ("jpeg_compressibility", 1.0),
        ("imagereward", 0.5),
    ]
    with pytest.raises(UserError, match="unknown reward 'nope'"):
        parse_reward_spec("nope")
    with pytest.raises(UserError, match="not a number"):
        parse_reward_spec("imagereward:x")


# ---- layers: script defaults < preset < --config < flags ----


def test_script_defaults_are_a_layer_below_the_config_file(tmp_path, monkeypatch):
    from refl_ddpo.trainers.refl_config import ReFLConfig

    monkeypatch.setenv("REFL_DDPO_DEFAULTS", "--learning_rate 1e-4 --grad_scale 0.01 --output_dir 'a b/refl'")
    cfg = parse_config(ReFLConfig, [])
    assert (cfg.learning_rate, cfg.grad_scale, cfg.output_dir) == (1e-4, 0.01, "a b/refl")
    (tmp_path / "f.yaml").write_text("learning_rate: 0.003\n")
    cfg = parse_config(ReFLConfig, ["--config", str(tmp_path / "f.yaml")])
    assert (cfg.learning_rate, cfg.grad_scale) == (0.003, 0.01), (
        "the file wins over the script, not the reverse"
    )
    cfg = parse_config(ReFLConfig, ["--config", str(tmp_path / "f.yaml"), "--learning_rate", "0.5"])
    assert cfg.learning_rate == 0.5


def test_abbreviated_flags_are_errors(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(CommonConfig, ["--learning_rat", "1e-3"])
    assert e.value.code == 2 and "--learning_rat" in capsys.readouterr().err


def test_diffusers_name_of_the_model_flag_is_accepted():
    cfg = parse_config(CommonConfig, ["--pretrained_model_name_or_path", "org/model"])
    assert cfg.pretrained_model == "org/model"


def test_mixed_precision_defaults_to_the_accelerate_config(tmp_path, monkeypatch):
    (tmp_path / "acc.yaml").write_text("compute_environment: LOCAL_MACHINE\nmixed_precision: bf16\n")
    monkeypatch.setenv("ACCELERATE_CONFIG_FILE", str(tmp_path / "acc.yaml"))
    assert parse_config(CommonConfig, []).mixed_precision == "bf16"
    assert parse_config(CommonConfig, ["--mixed_precision", "no"]).mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_CONFIG_FILE", str(tmp_path / "none.yaml"))
    assert parse_config(CommonConfig, []).mixed_precision == "no"


def test_help_is_grouped_and_names_the_script(monkeypatch, capsys):
    from refl_ddpo.trainers.ddpo_config import DDPOConfig

    monkeypatch.setenv("REFL_DDPO_PROG", "bash train_scripts/train_ddpo.sh")
    with pytest.raises(SystemExit):
        parse_config(DDPOConfig, ["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: bash train_scripts/train_ddpo.sh")
    for group in ("models:", "LoRA:", "sampling:", "training:", "advantages:"):
        assert f"\n{group}\n" in out, group


def test_a_bad_flag_fails_without_importing_model_code():
    """The reward table is static: checking --reward imports no reward model module (nor diffusers)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom refl_ddpo.config import parse_config\nfrom refl_ddpo.trainers.ddpo_config import "
        "DDPOConfig\ntry:\n    parse_config(DDPOConfig, ['--reward', 'nope'])\nexcept Exception as e:\n"
        "    print(type(e).__name__)\nprint(sorted(m for m in sys.modules if m.startswith(('diffusers', "
        "'transformers', 'refl_ddpo.rewards.'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.splitlines() == ["UserError", "[]"], r.stdout
