"""Rewards: plain functions behind one contract, found by name.

    reward_fn(images, prompts, metadata) -> (rewards, info)

`images` is a float tensor [B, 3, H, W] in [0, 1] on the reward's device, `prompts` a list of B strings, `metadata` a
list of B dicts from the prompt source; `rewards` is a float32 tensor [B] on the same device and `info` a dict of
extra scalars/tensors for logging. A reward that is `differentiable` keeps the autograd graph back to `images`
(ReFL needs this); the others may leave it (DDPO does not care).

A factory takes `device`, `dtype` and `model_dir` (the --reward_model_dir folder) and returns the function; it never
picks a device itself. `build_reward("jpeg_compressibility:1.0,imagereward:0.5", ...)` gives the weighted sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from refl_ddpo.errors import UserError

RewardFn = Callable[[torch.Tensor, list[str], list[dict]], tuple[torch.Tensor, dict]]
RewardFactory = Callable[..., RewardFn]  # (device: torch.device, dtype: torch.dtype, model_dir: str) -> RewardFn


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    differentiable: bool

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        return self.fn(images, prompts, metadata)


_REGISTRY: dict[str, tuple[RewardFactory, bool]] = {}


def register(name: str, differentiable: bool) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: make a reward factory available by `name`."""

    def deco(factory: RewardFactory) -> RewardFactory:
        _REGISTRY[name] = (factory, differentiable)
        return factory

    return deco


def _load_builtin() -> None:
    # Importing the modules runs their @register decorators.
    from refl_ddpo.rewards import aesthetic, imagereward, jpeg  # noqa: F401


def available() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """'a:1.0,b:0.5' -> [('a', 1.0), ('b', 0.5)]; 'a' -> [('a', 1.0)]. Checks names, no model is loaded."""
    names = available()
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        if name not in names:
            raise UserError(f"--reward: unknown reward '{name}'; choose from {', '.join(names)} "
                            "(weighted sums as name:weight,name:weight).")
        try:
            out.append((name, float(weight) if weight else 1.0))
        except ValueError:
            raise UserError(f"--reward: weight '{weight}' of '{name}' is not a number (write name:0.5).") from None
    if not out:
        raise UserError("--reward is empty: name a reward, e.g. --reward jpeg_compressibility.")
    return out


def is_differentiable(spec: str) -> bool:
    return all(_REGISTRY[name][1] for name, _ in parse_reward_spec(spec))


def build_reward(spec: str, device: torch.device | str, dtype: torch.dtype = torch.float32,
                 model_dir: str = "checkpoint", options: dict[str, dict] | None = None) -> Reward:
    """Build the reward named by `spec` (one name, or a weighted sum 'a:1.0,b:0.5').

    `options` maps a reward name to extra keyword arguments of its factory, e.g.
    {"imagereward": {"antialias": False}}."""
    parts = parse_reward_spec(spec)
    device = torch.device(device)
    options = options or {}
    built = [(name, w, _REGISTRY[name][0](device=device, dtype=dtype, model_dir=model_dir, **options.get(name, {})))
             for name, w in parts]
    differentiable = all(_REGISTRY[name][1] for name, _ in parts)
    if len(built) == 1 and built[0][1] == 1.0:
        name, _, fn = built[0]
        return Reward(name, fn, differentiable)

    def weighted(images, prompts, metadata):
        total, info = None, {}
        for name, w, fn in built:
            r, i = fn(images, prompts, metadata)
            info[name] = r.detach()
            info.update({f"{name}/{k}": v for k, v in i.items()})
            total = w * r if total is None else total + w * r
        return total, info

    return Reward(spec, weighted, differentiable)
