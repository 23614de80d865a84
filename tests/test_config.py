"""Config -> flags, --config files, cross-field checks, and prompt files."""

import json

import pytest

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.prompts import get_prompt_fn, load_prompts
from refl_ddpo.rewards import parse_reward_spec
from refl_ddpo.run.config import CommonConfig
from refl_ddpo.run.flags import parse_config
from refl_ddpo.trainers.refl_config import ReFLConfig


def test_flags_defaults_and_overrides(tmp_path):
    cfg = parse_config(CommonConfig, [])
    assert (
        cfg.lora_rank == 4
        and cfg.use_lora
        and cfg.lora_target_modules is None  # the model family's targets, resolved when the model is known
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
    with pytest.raises(UserError, match="not a finite number"):
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


def test_a_misspelled_flag_is_one_line_that_names_the_closest_flags(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(ReFLConfig, ["--learnig_rate", "1e-4", "--grad_scal", "3", "--zzz"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage" not in err, err
    assert (
        "--learnig_rate: did you mean --learning_rate?" in err
        and "--grad_scal: did you mean --grad_scale" in err
    )
    with pytest.raises(SystemExit):
        parse_config(ReFLConfig, ["--preset", "toy"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "invalid choice: 'toy'" in err and "toy_world" in err


def test_help_shows_the_defaults_the_calling_script_sets(monkeypatch, capsys):
    monkeypatch.setenv("REFL_DDPO_DEFAULTS", "--learning_rate 1e-4 --grad_scale 0.01")
    with pytest.raises(SystemExit):
        parse_config(ReFLConfig, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "LoRA recipe: 0.01). (default: 0.01)" in out and "(default: 0.0001)" in out


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
        "import sys\nfrom refl_ddpo.run.flags import parse_config\nfrom refl_ddpo.trainers.ddpo_config import "
        "DDPOConfig\ntry:\n    parse_config(DDPOConfig, ['--reward', 'nope'])\nexcept Exception as e:\n"
        "    print(type(e).__name__)\nprint(sorted(m for m in sys.modules if m.startswith(('diffusers', "
        "'transformers', 'refl_ddpo.rewards.'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.splitlines() == ["UserError", "[]"], r.stdout


# ---- non-finite and bad input before anything loads (issue #19): one line naming the flag ----

_NUMBER_CASES = [  # (config, argv, what the one line must name)
    ("refl", ["--learning_rate", "inf"], "--learning_rate"),
    ("refl", ["--learning_rate", "nan"], "--learning_rate"),
    ("refl", ["--grad_scale", "nan"], "--grad_scale"),
    ("refl", ["--margin", "nan"], "--margin"),
    ("refl", ["--margin=-inf"], "--margin"),
    ("refl", ["--adam_beta1", "1.5"], "--adam_beta1"),
    ("refl", ["--adam_beta2", "nan"], "--adam_beta2"),
    ("refl", ["--adam_epsilon=-1"], "--adam_epsilon"),
    ("refl", ["--max_grad_norm", "nan"], "--max_grad_norm"),
    ("refl", ["--lora_alpha", "nan"], "--lora_alpha"),
    ("refl", ["--ema_decay", "nan"], "--ema_decay"),
    ("refl", ["--scheduler", "ddim", "--eta", "nan"], "--eta"),
    ("refl", ["--kl_weight", "nan"], "--kl_weight"),
    ("refl", ["--pretrain_loss_weight", "inf"], "--pretrain_loss_weight"),
    ("refl", ["--guidance_scale", "nan"], "--guidance_scale"),
    ("refl", ["--reward", "toy_classifier:inf"], "toy_classifier"),
    ("refl", ["--device", "mps"], "--device mps"),
    ("ddpo", ["--sample_eta", "nan"], "--sample_eta"),
    ("ddpo", ["--train_clip_range", "nan"], "--train_clip_range"),
    ("ddpo", ["--train_adv_clip_max", "inf"], "--train_adv_clip_max"),
    ("ddpo", ["--train_timestep_fraction", "nan"], "--train_timestep_fraction"),
    ("ddpo", ["--guidance_scale", "nan"], "--guidance_scale"),
    ("ddpo", ["--sample_guidance_scale", "inf"], "--sample_guidance_scale"),
    ("ddpo", ["--kl_weight", "nan"], "--kl_weight"),
    ("ddpo", ["--reward", "jpeg_compressibility:nan"], "jpeg_compressibility"),
    ("ddpo", ["--device", "cuda:1"], "--device cuda:1"),
    ("inference", ["--guidance_scale", "nan"], "--guidance_scale"),
    ("inference", ["--eta", "inf"], "--eta"),
]


def _config_class(name):
    from refl_ddpo.apps.inference_config import InferenceConfig, LoraInferenceConfig
    from refl_ddpo.trainers.ddpo_config import DDPOConfig
    from refl_ddpo.trainers.refl_config import ReFLConfig

    return {
        "refl": ReFLConfig,
        "ddpo": DDPOConfig,
        "inference": InferenceConfig,
        "lora": LoraInferenceConfig,
    }[name]


def _model_folder(tmp_path):
    """A folder that passes the model-folder check (model_index.json listing no component): nothing loads here."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")
    return str(tmp_path / "model")


def test_every_non_finite_or_out_of_range_number_is_one_line_naming_the_flag(tmp_path):
    model = ["--pretrained_model", _model_folder(tmp_path)]
    for config, argv, name in _NUMBER_CASES:
        with pytest.raises(UserError) as e:
            parse_config(_config_class(config), model + argv)
        msg = str(e.value)
        assert name in msg and "\n" not in msg, (argv, msg)
    # inf where the help says so: no PPO clipping
    assert parse_config(_config_class("ddpo"), ["--train_clip_range", "inf"]).train_clip_range == float("inf")


def test_lora_scale_nan_is_refused(tmp_path):
    (tmp_path / "pytorch_lora_weights.safetensors").write_bytes(b"")
    argv = ["--pretrained_model", _model_folder(tmp_path), "--lora_dir", str(tmp_path), "--lora_scale", "nan"]
    with pytest.raises(UserError, match="--lora_scale"):
        parse_config(_config_class("lora"), argv)


def test_device_cuda_without_a_gpu_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for config in ("refl", "ddpo"):
        with pytest.raises(UserError, match="--device cuda: no CUDA GPU"):
            parse_config(_config_class(config), ["--device", "cuda"])


@pytest.mark.parametrize(
    "text, name",
    [
        ("learning_rate: null\n", "learning_rate is null"),
        ("learning_rate: [1, 2]\n", "learning_rate is [1, 2]"),
        ("use_lora: 'no'\n", "use_lora is 'no'"),
        ("use_lora: maybe\n", "use_lora is 'maybe'"),
        ("max_train_steps: ten\n", "max_train_steps is 'ten'"),
        ("max_train_steps: 10.5\n", "max_train_steps"),
        ("lora_target_modules: to_q\n", "lora_target_modules"),
        ("lora_target_modules: [to_q, null]\n", "lora_target_modules"),
        ("scheduler: euler\n", "scheduler is 'euler'"),
        ("output_dir: 5\n", "output_dir is 5"),
        ("seed: true\n", "seed is True"),
        ("seed: {a: 1}\n", "seed is {'a': 1}"),
        ("margin: .nan\n", "--margin"),
        ("learning_rate: .inf\n", "--learning_rate"),
    ],
)
def test_config_file_values_are_checked_like_flags(text, name, tmp_path):
    from refl_ddpo.trainers.refl_config import ReFLConfig

    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(UserError) as e:
        parse_config(ReFLConfig, ["--config", str(tmp_path / "c.yaml")])
    assert name in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_config_file_booleans_and_numbers_read_as_the_flags_would(tmp_path):
    from refl_ddpo.trainers.refl_config import ReFLConfig

    for text, use_lora in (("yes", True), ("no", False), ("'true'", True), ("'0'", False), ("1", True)):
        (tmp_path / "c.yaml").write_text(f"use_lora: {text}\nuse_ema: false\n")
        assert parse_config(ReFLConfig, ["--config", str(tmp_path / "c.yaml")]).use_lora is use_lora, text
    (tmp_path / "c.yaml").write_text("learning_rate: 1e-4\nlora_alpha: null\nmax_train_steps: '7'\n")
    cfg = parse_config(ReFLConfig, ["--config", str(tmp_path / "c.yaml")])  # PyYAML reads 1e-4 as a string
    assert (cfg.learning_rate, cfg.lora_alpha, cfg.max_train_steps) == (1e-4, None, 7)
    (tmp_path / "c.json").write_text('{"margin": NaN}')
    with pytest.raises(UserError, match="--margin"):
        parse_config(ReFLConfig, ["--config", str(tmp_path / "c.json")])


def test_files_that_are_not_utf8_name_the_line_and_byte(tmp_path):
    (tmp_path / "p.txt").write_bytes("a cat\na d\u00f6g\n".encode() + b"caf\xe9\n")
    with pytest.raises(UserError, match=r"p.txt is not UTF-8 text: byte 0xe9 at offset 16 \(line 3\)"):
        load_prompts(tmp_path / "p.txt")
    (tmp_path / "c.yaml").write_bytes(b"seed: 1\n# \xff\n")
    with pytest.raises(
        UserError, match=r"--config .*c.yaml is not UTF-8 text: byte 0xff at offset 10 \(line 2\)"
    ):
        parse_config(CommonConfig, ["--config", str(tmp_path / "c.yaml")])


# ---- the configs are composed of small parts (issue #63) ----

CONFIG_MODULES = (
    "refl_ddpo.run.parts",
    "refl_ddpo.run.config",
    "refl_ddpo.trainers.epoch_parts",
    "refl_ddpo.trainers.ddpo_config",
    "refl_ddpo.trainers.ddpo_presets",
    "refl_ddpo.trainers.groups",
    "refl_ddpo.trainers.grpo_config",
    "refl_ddpo.trainers.forward_config",
    "refl_ddpo.trainers.refl_config",
)


def _levels(cls: type) -> int:
    """How many classes stand between `cls` and object, on its longest line of bases (a part of object: 1)."""
    return 0 if cls is object else 1 + max(_levels(base) for base in cls.__bases__)


def test_configs_are_parts_two_levels_deep_with_presets_in_their_bodies():
    """Each trainer's config inherits parts and nothing else (config -> part -> object, the methods mixin a part),
    and no config module patches a class after its body (`X.PRESETS = ...`): presets and aliases are in it."""
    import ast
    import importlib
    from pathlib import Path

    from refl_ddpo.trainers.ddpo_config import DDPOConfig
    from refl_ddpo.trainers.forward_config import AWMConfig, NFTConfig
    from refl_ddpo.trainers.grpo_config import GRPOConfig

    configs = [CommonConfig, ReFLConfig, DDPOConfig, GRPOConfig, NFTConfig, AWMConfig]
    parts = {base for cls in configs for base in cls.__bases__}
    assert not parts & set(configs), "a config built on another config"
    assert {cls.__name__: _levels(cls) for cls in configs} == {cls.__name__: 2 for cls in configs}
    assert {p.__name__ for p in parts if _levels(p) != 1} == set()
    assert all(
        "PRESETS" in cls.__dict__ for cls in (ReFLConfig, DDPOConfig, GRPOConfig, NFTConfig, AWMConfig)
    )
    for name in CONFIG_MODULES:
        path = Path(importlib.import_module(name).__file__)
        for node in ast.parse(path.read_text()).body:
            targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
            patched = [t for t in targets if isinstance(t, ast.Attribute)]
            assert not patched, f"{path.name}:{node.lineno} assigns {ast.unparse(patched[0])} after its class"
