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
