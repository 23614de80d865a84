"""The user's own reward_fn and prompt_fn named by dotted path: parsed, checked and wrapped before any model loads,
with one-line errors (tests/user_functions.py holds the functions)."""

import sys
from pathlib import Path

import pytest
import torch

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.prompts import check_prompt_source, get_prompt_fn
from refl_ddpo.rewards import build_reward, is_differentiable, parse_reward_spec
from refl_ddpo.run.flags import parse_config
from refl_ddpo.trainers.ddpo_config import parse_ddpo_config
from refl_ddpo.trainers.refl_config import ReFLConfig

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def test_spec_takes_a_dotted_path_with_a_weight_beside_registry_names():
    spec = "user_functions:redness:0.5,toy_clean"
    assert parse_reward_spec(spec) == [("user_functions:redness", 0.5), ("toy_clean", 1.0)]
    assert is_differentiable(spec)
    assert not is_differentiable("user_functions:brightness_list")


@pytest.mark.parametrize(
    "spec, words",
    [
        ("no_such_module_xyz:fn", ["cannot import no_such_module_xyz", "PYTHONPATH"]),
        ("user_functions:missing", ["has no missing"]),
        ("user_functions:NOT_A_FUNCTION", ["NOT_A_FUNCTION is a int, not a function"]),
        ("user_functions:redness:heavy", ["weight 'heavy'"]),
        ("jpeg_smallness", ["unknown reward 'jpeg_smallness'", "pkg.module:function"]),
    ],
)
def test_bad_dotted_rewards_are_one_line(spec, words):
    with pytest.raises(UserError) as e:
        parse_reward_spec(spec)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_user_reward_is_wrapped_to_float32_on_the_images_device_and_sums_with_weights():
    images = torch.rand(3, 3, 8, 8, requires_grad=True)
    prompts, metadata = ["a"] * 3, [{}] * 3
    r, info = build_reward("user_functions:redness", "cpu")(images, prompts, metadata)
    assert r.dtype == torch.float32 and r.shape == (3,) and "red" in info
    r.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0  # the graph reaches the images
    total, info = build_reward("user_functions:redness:2,user_functions:brightness_list:-1", "cpu")(
        images.detach(), prompts, metadata
    )
    expected = 2 * info["user_functions:redness"] - info["user_functions:brightness_list"]
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(info["user_functions:brightness_list"], images.detach().mean(dim=(1, 2, 3)))


@pytest.mark.parametrize(
    "name, words", [("wrong_shape", ["shape (4,) for 3 images"]), ("no_info", ["returns (rewards, info)"])]
)
def test_a_user_reward_that_breaks_the_contract_says_how(name, words):
    reward = build_reward(f"user_functions:{name}", "cpu")
    with pytest.raises(UserError) as e:
        reward(torch.rand(3, 3, 8, 8), ["a"] * 3, [{}] * 3)
    for w in words:
        assert w in str(e.value)


def test_user_prompt_fn_is_seeded_through_rng_or_called_bare():
    draws = [[get_prompt_fn("user_functions:colour_prompt", seed=s)() for _ in range(8)] for s in (0, 0, 1)]
    assert draws[0] == draws[1] != draws[2]
    assert all(m == {"colour": p.split()[1]} for p, m in draws[0])
    assert get_prompt_fn("user_functions:fixed_prompt", seed=0)() == ("a red circle", {})
    with pytest.raises(UserError, match=r"returns \(prompt: str, metadata: dict\)"):
        get_prompt_fn("user_functions:bad_prompt", seed=0)()
    with pytest.raises(UserError, match="unknown prompt source"):
        check_prompt_source("imagenet_animal")


def test_configs_check_the_user_functions_before_any_model_loads():
    cfg = parse_ddpo_config(
        ["--reward", "user_functions:brightness_list", "--prompt_fn", "user_functions:fixed_prompt"]
    )
    assert (cfg.reward, cfg.prompt_fn) == ("user_functions:brightness_list", "user_functions:fixed_prompt")
    with pytest.raises(UserError, match="has no nope"):
        parse_ddpo_config(["--prompt_fn", "user_functions:nope"])
    assert parse_config(ReFLConfig, ["--reward", "user_functions:redness"]).reward == "user_functions:redness"
    with pytest.raises(UserError, match="differentiable = True"):
        parse_config(ReFLConfig, ["--reward", "user_functions:brightness_list"])
