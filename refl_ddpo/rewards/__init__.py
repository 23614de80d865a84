"""Rewards: plain functions behind one contract, found by name in a static table.

    reward_fn(images, prompts, metadata) -> (rewards, info)

`images` is a float tensor [B, 3, H, W] (or videos [B, T, 3, H, W]: image rewards score their frames, see `video`)
in [0, 1] on the reward's device, `prompts` a list of B strings, `metadata` a
list of B dicts from the prompt source (for an edit, `metadata[i]["source_images"]`: the sample's source images, a
list of (3, H, W) float32 tensors in [0, 1] on the CPU, refl_ddpo.core.edit_data; the edit rewards read them);
`rewards` is a float32 tensor [B] on the same device and `info` a dict of extra scalars/tensors for logging. A reward
that is `differentiable` keeps the autograd graph back to `images` (ReFL needs this); the others may leave it (DDPO
does not care).

A factory takes `device`, `dtype` and `model_dir` (the --reward_model_dir folder) and returns the function; it never
picks a device itself. `build_reward("jpeg_compressibility:1.0,imagereward:0.5", ...)` gives the weighted sum.
The table names each factory by module, so that checking a `--reward` flag imports no model code.

A reward of the user's own is named by dotted path, `pkg.module:function` (a weight after a second colon:
`my_rewards:brightness:0.5`): the function itself is the reward_fn above (ddpo-pytorch's and TRL's contract); it may
return the rewards as a tensor, an array or a list; set `function.differentiable = True` on one that keeps the graph
(ReFL needs it). It is imported, and checked to be callable, when the flag is checked, before any model loads.
"""

from __future__ import annotations

import importlib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from refl_ddpo.core.errors import UserError
from refl_ddpo.core.user_code import import_ref, split_ref

if TYPE_CHECKING:
    import torch

RewardFn = Callable[["torch.Tensor", list[str], list[dict]], tuple["torch.Tensor", dict]]
RewardFactory = Callable[
    ..., RewardFn
]  # (device: torch.device, dtype: torch.dtype, model_dir: str) -> RewardFn

# name -> (module, factory function, differentiable)
REWARDS: dict[str, tuple[str, str, bool]] = {
    "aesthetic": ("refl_ddpo.rewards.aesthetic", "aesthetic", True),
    "clip_score": ("refl_ddpo.rewards.clip", "clip_score", True),
    "edit_clip_direction": ("refl_ddpo.rewards.edit", "edit_clip_direction", True),
    "edit_judge": ("refl_ddpo.rewards.edit", "edit_judge", False),
    "edit_preserve": ("refl_ddpo.rewards.edit", "edit_preserve", True),
    "hpsv2": ("refl_ddpo.rewards.hpsv2", "hpsv2", True),
    "hpsv3": ("refl_ddpo.rewards.hpsv3", "hpsv3", True),
    "imagereward": ("refl_ddpo.rewards.imagereward", "imagereward", True),
    "jpeg_compressibility": ("refl_ddpo.rewards.jpeg", "jpeg_compressibility", False),
    "jpeg_incompressibility": ("refl_ddpo.rewards.jpeg", "jpeg_incompressibility", False),
    "geneval": ("refl_ddpo.rewards.geneval", "geneval", False),
    "geneval2": ("refl_ddpo.rewards.vlm_scores", "geneval2", False),
    "ocr": ("refl_ddpo.rewards.ocr", "ocr", False),
    "pickscore": ("refl_ddpo.rewards.clip", "pickscore", True),
    "remote": ("refl_ddpo.rewards.remote", "remote", False),
    "toy_classifier": ("refl_ddpo.rewards.toy", "toy_classifier", True),
    "toy_color_match": ("refl_ddpo.rewards.toy", "toy_color_match", False),
    "toy_clean": ("refl_ddpo.rewards.toy", "toy_clean", True),
    "toy_color_clean": ("refl_ddpo.rewards.toy", "toy_color_clean", False),
    "toy_palette_clean": ("refl_ddpo.rewards.toy", "toy_palette_clean", True),
    "toy_judge": ("refl_ddpo.rewards.toy", "toy_judge", False),
    "temporal_consistency": ("refl_ddpo.rewards.video", "temporal_consistency", True),
    "unifiedreward": ("refl_ddpo.rewards.vlm_scores", "unifiedreward", False),
    "vlm_bertscore": ("refl_ddpo.rewards.vlm", "vlm_bertscore", False),
    "vlm_judge": ("refl_ddpo.rewards.vlm", "vlm_judge", False),
    "vlm_yesno": ("refl_ddpo.rewards.vlm_scores", "vlm_yesno", False),
}
# Rewards that take a URL after the name: `remote:URL` and `geneval:URL` (required: the reward server), the VLM
# rewards (optional: the OpenAI-compatible server; default $OPENAI_BASE_URL) and `ocr:URL` (optional: a VLM reads the
# text; without a URL PaddleOCR does). A weight follows the URL after '@' (`remote:http://host:8000@0.5`), since a URL
# has colons of its own.
VLM_SERVER_REWARDS = ("vlm_judge", "vlm_bertscore", "unifiedreward", "vlm_yesno", "geneval2", "edit_judge")
URL_REWARDS: dict[str, bool] = {"remote": True, "geneval": True, "ocr": False} | dict.fromkeys(
    VLM_SERVER_REWARDS, False
)
# Files a reward reads from --reward_model_dir, checked before any model loads; hub: a hub id may stand for the folder.
REWARD_FILES: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "imagereward": (
        ("ImageReward.pt", "med_config.json", "bert-base-uncased"),
        True,
        "put ImageReward.pt, med_config.json and bert-base-uncased/ there (see checkpoint/README.md)",
    ),
    "hpsv3": (
        ("HPSv3.safetensors", "Qwen2-VL-7B-Instruct/config.json"),
        False,
        "put HPSv3.safetensors (MizzenAI/HPSv3) and Qwen2-VL-7B-Instruct/ there (see docs/rewards.md)",
    ),
    "toy_classifier": (
        ("toy_classifier.safetensors", "toy_classifier.json"),
        False,
        "write them with `python -m refl_ddpo.tiny OUT --toy_world` and pass --reward_model_dir OUT",
    ),
}
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def check_reward_files(spec: str, model_dir: str) -> None:
    """Every reward of `spec` that reads files finds them in `model_dir`: else one line naming what is missing."""
    for name, _ in parse_reward_spec(spec):
        if name not in REWARD_FILES:
            continue
        files, hub, fix = REWARD_FILES[name]
        if hub and not os.path.exists(model_dir) and _HUB_ID.fullmatch(model_dir):
            continue  # fetched from the hub when the reward loads
        missing = [f for f in files if not (Path(model_dir) / f).exists()]
        if missing:
            raise UserError(
                f"--reward {name}: --reward_model_dir {model_dir} lacks {', '.join(missing)}; {fix}."
            )


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    differentiable: bool
    # it takes whole videos (B, T, 3, H, W): one of its parts has `.video` (else frames only)
    video: bool = False
    # a video's leading frames it reads (--video_reduction first:K); None: all of them
    frames: int | None = None

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        return self.fn(images, prompts, metadata)


def available() -> list[str]:
    return sorted(REWARDS)


def base_name(name: str) -> str:
    """The registry name of a spec's reward: 'remote:http://h:1' -> 'remote', 'pickscore' -> 'pickscore'; a user's
    'pkg.module:function' is its own name."""
    base = name.partition(":")[0]
    return base if base in REWARDS else name


def reward_url(name: str) -> str | None:
    """The URL of 'remote:URL' / 'vlm_judge:URL'; None for a reward named without one."""
    base, _, url = name.partition(":")
    return url if base in URL_REWARDS and url else None


def _parse_url_part(part: str) -> tuple[str, str]:
    """'remote:URL[@w]' -> ('remote:URL', 'w' or ''); 'vlm_judge[:w]' -> ('vlm_judge', 'w' or '')."""
    from urllib.parse import urlsplit

    base, _, rest = part.partition(":")
    if not rest.startswith(("http://", "https://")):
        if URL_REWARDS[base]:
            server = (
                "GenEval's reward server (yifan123/reward-server, app_geneval.py)"
                if base == "geneval"
                else "start one with `python -m refl_ddpo.rewards.serve --reward NAME --port 8000`"
            )
            raise UserError(
                f"--reward {part}: {base} needs the server's URL, e.g. {base}:http://127.0.0.1:8000 ({server})."
            )
        return base, rest
    url, weight = rest, ""
    head, sep, tail = rest.rpartition("@")
    if sep and re.fullmatch(r"[-+0-9.eEinfa]+", tail):
        url, weight = head, tail
    parts = urlsplit(url)
    if not parts.hostname or any(c.isspace() for c in url):
        raise UserError(
            f"--reward {part}: '{url}' is not an http(s) URL with a host (e.g. http://127.0.0.1:8000)."
        )
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        raise UserError(f"--reward {part}: '{url}' has a port that is not a number.") from None
    return f"{base}:{url}", weight


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """'a:1.0,b:0.5' -> [('a', 1.0), ('b', 0.5)]; 'a' -> [('a', 1.0)]; 'remote:URL@0.5' -> [('remote:URL', 0.5)].
    Checks names, no model is loaded."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        if name in URL_REWARDS:
            name, weight = _parse_url_part(part)
        elif name not in REWARDS and (ref := split_ref(part)):
            name, weight = ref
            import_ref(name, "--reward")
        elif name not in REWARDS:
            raise UserError(
                f"--reward: unknown reward '{name}'; choose from {', '.join(available())} "
                "(weighted sums as name:weight,name:weight; remote:URL for a reward server; your own function "
                "as pkg.module:function)."
            )
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = None
        if value is None or not math.isfinite(value):
            raise UserError(
                f"--reward: weight '{weight}' of '{name}' is not a finite number (write name:0.5)."
            )
        out.append((name, value))
    if not out:
        raise UserError("--reward is empty: name a reward, e.g. --reward jpeg_compressibility.")
    return out


def is_differentiable(spec: str) -> bool:
    return all(
        REWARDS[name][2]
        if name in REWARDS
        else bool(getattr(import_ref(name, "--reward"), "differentiable", False))
        for name in map(base_name, (n for n, _ in parse_reward_spec(spec)))
    )


def factory(name: str) -> RewardFactory:
    base = base_name(name)
    if base not in REWARDS:
        return _user_factory(base)
    module, fn, _ = REWARDS[base]
    return getattr(importlib.import_module(module), fn)


def _user_factory(ref: str) -> RewardFactory:
    """A factory for the user's reward_fn 'pkg.module:function': its rewards as float32 [B] on the images' device,
    or one line saying what it returned instead."""
    fn = import_ref(ref, "--reward")

    def make(device=None, dtype=None, model_dir=None, **_) -> RewardFn:
        import torch

        def reward_fn(images, prompts, metadata):
            out = fn(images, prompts, metadata)
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
                raise UserError(
                    f"--reward {ref} returned a {type(out).__name__}; a reward_fn returns (rewards, info): "
                    f"{len(prompts)} numbers and a dict (may be empty)."
                )
            rewards = out[0]
            if not torch.is_tensor(rewards):
                rewards = torch.as_tensor(rewards, dtype=torch.float32)
            if tuple(rewards.shape) != (len(prompts),):
                raise UserError(
                    f"--reward {ref} returned rewards of shape {tuple(rewards.shape)} for {len(prompts)} "
                    f"images; return one number per image, shape ({len(prompts)},)."
                )
            return rewards.to(device=images.device, dtype=torch.float32), out[1]

        reward_fn.video = getattr(fn, "video", False)  # a function of whole videos says so (rewards.video)
        return reward_fn

    return make


def build_reward(
    spec: str,
    device,
    dtype=None,
    model_dir: str = "checkpoint",
    options: dict[str, dict] | None = None,
    video_reduction: str = "mean",
) -> Reward:
    """Build the reward named by `spec` (one name, or a weighted sum 'a:1.0,b:0.5').

    `options` maps a reward name to extra keyword arguments of its factory, e.g. {"imagereward": {"antialias":
    False}}; a URL in the spec ('remote:URL', 'vlm_judge:URL') is passed as `url`. Videos (B, T, 3, H, W): each image
    reward scores frames, reduced by `video_reduction` (`refl_ddpo.rewards.video.frames_reward`); with first:K the
    Reward's `frames` says K, so that the reward-backprop trainers decode those frames alone."""
    import torch

    from refl_ddpo.core.progress import quiet_library_bars
    from refl_ddpo.core.video import leading_frames
    from refl_ddpo.rewards.video import frames_reward

    quiet_library_bars()
    parts = parse_reward_spec(spec)
    device, dtype, options = torch.device(device), dtype or torch.float32, options or {}
    built = []
    for name, w in parts:
        kwargs = dict(options.get(base_name(name), {}))
        if reward_url(name):
            kwargs["url"] = reward_url(name)
        fn = factory(name)(device=device, dtype=dtype, model_dir=model_dir, **kwargs)
        built.append((name, w, fn if getattr(fn, "video", False) else frames_reward(fn, video_reduction)))
    differentiable, frames = is_differentiable(spec), leading_frames(video_reduction)
    video = any(getattr(fn, "video", False) for _, _, fn in built)
    if len(built) == 1 and built[0][1] == 1.0:
        name, _, fn = built[0]
        return Reward(name, fn, differentiable, video=video, frames=frames)

    def weighted(images, prompts, metadata):
        total, info = None, {}
        for name, w, fn in built:
            r, i = fn(images, prompts, metadata)
            info[name] = r.detach()
            info.update({f"{name}/{k}": v for k, v in i.items()})
            total = w * r if total is None else total + w * r
        return total, info

    return Reward(spec, weighted, differentiable, video=video, frames=frames)


def count_nonfinite(rewards: torch.Tensor) -> int:
    """How many of the rewards (N,) are NaN or inf (a reward that broke: the trainers and inference stop on them)."""
    import torch

    return int((~torch.isfinite(rewards.detach())).sum())


def reward_stats(
    spec: str, rewards: torch.Tensor, parts: dict[str, torch.Tensor] | None = None
) -> dict[str, float]:
    """`reward/<name>/mean|std` of rewards (N,) (population std); for a weighted sum, `reward/total/...` and one pair
    per part (`parts`: name -> that part's rewards (N,), as the weighted reward's info carries them)."""
    named = parse_reward_spec(spec)
    if len(named) == 1 and named[0][1] == 1.0:
        series = {named[0][0]: rewards}
    else:
        series = {
            "total": rewards,
            **{name: (parts or {})[name] for name, _ in named if name in (parts or {})},
        }
    out = {}
    for name, values in series.items():
        values = values.detach().double().cpu()
        out[f"reward/{name}/mean"] = float(values.mean())
        out[f"reward/{name}/std"] = float(values.std(unbiased=False)) if len(values) > 1 else 0.0
    return out


def per_sample_info(info: dict, batch: int) -> dict[str, torch.Tensor]:
    """The entries of a reward's `info` with one value per sample (1-D, `batch` long), detached: a weighted reward's
    parts under their names, a reward's own extras (e.g. HPSv3's `sigma`) under theirs."""
    import torch

    return {k: v.detach() for k, v in info.items() if torch.is_tensor(v) and v.ndim == 1 and len(v) == batch}


def info_means(spec: str, info: dict[str, torch.Tensor]) -> dict[str, float]:
    """`reward/<key>/mean` of each per-sample entry of `info` (name -> (N,)) that is not a part of the --reward `spec`
    (e.g. HPSv3's `sigma`, as `reward/hpsv3/sigma/mean`; a part's own under `reward/<part>/<key>/mean`, the weighted
    reward's info keys being `<part>/<key>`)."""
    named = parse_reward_spec(spec)
    prefix = f"{named[0][0]}/" if len(named) == 1 else ""
    parts = {name for name, _ in named}
    return {f"reward/{prefix}{k}/mean": float(v.double().mean()) for k, v in info.items() if k not in parts}
