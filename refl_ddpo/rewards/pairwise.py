"""Pairwise judges (--pairwise_reward): plain functions behind one contract, found by name in a static table.

    judge_fn(prompts, images_a, images_b, metadata) -> p_a_wins

`images_a` and `images_b` are float tensors [P, 3, H, W] in [0, 1] on the judge's device, `prompts` and `metadata`
the P pairs' prompt and metadata (a pair's two images share them: they are members of one group); `p_a_wins` is [P]
in [0, 1], the probability that image a fits its prompt better than image b, or a 0 / 1 verdict. A factory takes
`device`, `dtype`, `model_dir` (and `url` for a judge named `name:URL`) and returns the function.

A judge of the user's own is named by dotted path, `pkg.module:function`: the function itself is the judge_fn
above; it may return a tensor, an array or a list. A judge that asks a server is named `name:URL` (URL_JUDGES) and
its factory gets `url`: an OpenAI-compatible VLM judge is registered here as one more row of each table.

`group_win_rates` turns a judge into each sample's win rate within its group (Pref-GRPO), the reward GRPO trains on.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.user_code import import_ref, split_ref

if TYPE_CHECKING:
    import torch

JudgeFn = Callable[[list[str], "torch.Tensor", "torch.Tensor", list[dict]], "torch.Tensor"]

# name -> (module, factory function)
PAIRWISE: dict[str, tuple[str, str]] = {
    "toy_pairwise": ("refl_ddpo.rewards.pairwise", "toy_pairwise"),
    "vlm_pairwise": ("refl_ddpo.rewards.vlm_scores", "vlm_pairwise"),  # an OpenAI-compatible VLM server
}
# Judges that take a server's URL after the name (`name:URL`), passed to the factory as `url`; True: required
# (vlm_pairwise without one asks $OPENAI_BASE_URL, as the VLM rewards do).
URL_JUDGES: dict[str, bool] = {"vlm_pairwise": False}


def parse_pairwise_spec(spec: str) -> tuple[str, str | None]:
    """'toy_pairwise' -> ('toy_pairwise', None); 'name:URL' -> ('name', URL) for a URL judge; 'pkg.module:function'
    -> itself (imported and checked callable). Checks names, loads nothing."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    if name in URL_JUDGES:
        if URL_JUDGES[name] and not rest.startswith(("http://", "https://")):
            raise UserError(
                f"--pairwise_reward {spec}: {name} needs the server's URL, e.g. {name}:http://HOST:PORT."
            )
        return name, rest or None
    if name in PAIRWISE and not rest:
        return name, None
    ref = split_ref(spec)
    if ref is not None and not ref[1]:
        import_ref(spec, "--pairwise_reward")
        return spec, None
    known = ", ".join(sorted([*PAIRWISE, *URL_JUDGES]))
    raise UserError(
        f"--pairwise_reward: unknown judge '{spec}'; choose from {known}, or your own judge_fn(prompts, images_a, "
        "images_b, metadata) -> P(a beats b) as pkg.module:function."
    )


def build_pairwise(spec: str, device, dtype=None, model_dir: str = "checkpoint") -> JudgeFn:
    """The judge named by `spec`, its answers checked: P numbers in [0, 1] on the CPU as float64, or one line."""
    import torch

    name, url = parse_pairwise_spec(spec)
    if name in PAIRWISE:
        module, fn = PAIRWISE[name]
        judge = getattr(importlib.import_module(module), fn)(
            device=torch.device(device), dtype=dtype or torch.float32, model_dir=model_dir, url=url
        )
    else:
        judge = import_ref(name, "--pairwise_reward")

    def checked(prompts, images_a, images_b, metadata):
        p = torch.as_tensor(judge(prompts, images_a, images_b, metadata)).detach().double().cpu()
        if tuple(p.shape) != (len(prompts),) or not bool(((p >= 0) & (p <= 1)).all()):
            raise UserError(
                f"--pairwise_reward {spec} returned {tuple(p.shape)} values, not {len(prompts)} probabilities in "
                "[0, 1] (one per pair: P(image a beats image b))."
            )
        return p

    return checked


def group_win_rates(
    judge: JudgeFn,
    images: torch.Tensor,
    prompts: list[str],
    metadata: list[dict],
    group_ids: torch.Tensor,
    max_opponents: int = 0,
    generator: torch.Generator | None = None,
    batch_size: int = 8,
) -> torch.Tensor:
    """Each sample's win rate (N,) float64 within its group (`group_ids` (N,)): all other members as opponents, or
    `max_opponents` of them drawn per sample from `generator`; each unordered pair judged once, `batch_size` pairs
    per call of the judge (refl_ddpo.algorithms.multi_reward holds the maths)."""
    import torch

    from refl_ddpo.algorithms.multi_reward import judged_pairs, opponents, win_rates

    chosen = opponents(group_ids, max_opponents, generator)
    pairs = judged_pairs(chosen)  # (P, 2)
    verdicts = []
    for start in range(0, len(pairs), batch_size):
        a, b = pairs[start : start + batch_size].T.tolist()
        verdicts.append(judge([prompts[i] for i in a], images[a], images[b], [metadata[i] for i in a]))
    p = torch.cat(verdicts) if verdicts else torch.zeros(0, dtype=torch.float64)
    return win_rates(chosen, pairs, p)


def toy_pairwise(device, dtype, model_dir: str, **options) -> JudgeFn:
    """The toy world's judge of pairs: 1 where image a's shape has the prompt's colour and b's has not, 0 the other
    way round, 0.5 where both or neither have it (toy_world.judge's colour_ok on each); not differentiable."""
    from refl_ddpo.toy_world import world as toy_world

    def judge_fn(prompts, images_a, images_b, metadata):
        ok_a = toy_world.judge(images_a, list(prompts))["colour_ok"].double()
        ok_b = toy_world.judge(images_b, list(prompts))["colour_ok"].double()
        return 0.5 + 0.5 * (ok_a - ok_b)

    return judge_fn
