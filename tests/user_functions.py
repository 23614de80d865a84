"""A user's own reward and prompt functions, as the trainers take them by dotted path (`--reward
user_functions:redness`, `--prompt_fn user_functions:colour_prompt`): the tests start the scripts from this folder, or put it on
PYTHONPATH."""

import torch

PROMPTS = ("a red circle", "a blue square", "a green triangle")
NOT_A_FUNCTION = 3


def redness(images, prompts, metadata):
    """How much redder than green and blue each image is: differentiable, so ReFL can use it."""
    r = images[:, 0] - 0.5 * (images[:, 1] + images[:, 2])
    return r.mean(dim=(1, 2)), {"red": images[:, 0].mean().detach()}


redness.differentiable = True


def brightness_list(images, prompts, metadata):
    """A plain list of floats and an empty info, as a non-torch reward returns."""
    return [float(x) for x in images.mean(dim=(1, 2, 3))], {}


def wrong_shape(images, prompts, metadata):
    return torch.zeros(len(prompts) + 1), {}


def no_info(images, prompts, metadata):
    return torch.zeros(len(prompts))


def colour_prompt(rng):
    """Seeded by the trainer through `rng`."""
    prompt = rng.choice(PROMPTS)
    return prompt, {"colour": prompt.split()[1]}


def fixed_prompt():
    """ddpo-pytorch's / TRL's shape: no argument."""
    return "a red circle", {}


def bad_prompt():
    return "a red circle"


def _scheduled(name: str, images, prompts):
    """On held-out prompts (each starts with "held-out"), the next value of the comma list in the environment
    variable {NAME}_VALUES for every image, the calls counted in the file {NAME}_CALLS; elsewhere redness (so that
    training has a gradient). With one validation batch, call n is validation n: the tests force a metric up or
    down."""
    import os
    from pathlib import Path

    if not all(p.startswith("held-out") for p in prompts):
        return redness(images, prompts, {})[0]
    if (
        os.environ.get("RANK", "0") != "0"
    ):  # a sharded run's other processes validate too; the main one's count
        return images.mean(dim=(1, 2, 3)) * 0
    calls = Path(os.environ[f"{name}_CALLS"])
    n = int(calls.read_text()) if calls.is_file() else 0
    calls.write_text(str(n + 1))
    value = float(os.environ[f"{name}_VALUES"].split(",")[n])
    return images.mean(dim=(1, 2, 3)) * 0 + value


def gold_schedule(images, prompts, metadata):
    """A validation reward the test scripts: GOLD_VALUES, GOLD_CALLS."""
    return _scheduled("GOLD", images, prompts), {}


def proxy_schedule(images, prompts, metadata):
    """A training reward whose validation means the test scripts (PROXY_VALUES, PROXY_CALLS); redness in training."""
    return _scheduled("PROXY", images, prompts), {}


proxy_schedule.differentiable = True


def slow_redness(images, prompts, metadata):
    """redness, taking 5 s over a batch with the prompt "slow": the reward server's tests kill its worker mid-call."""
    import time

    if "slow" in prompts:
        time.sleep(5.0)
    return redness(images, prompts, metadata)


slow_redness.differentiable = True
