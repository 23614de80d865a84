"""Prompt sources: `prompt_fn() -> (prompt, metadata)`, found by name; the lists ship as text files (DATA_DIR).

A prompts file is one prompt per line (blank lines and lines starting with '#' skipped), or a JSON list of strings or
of objects with a "prompt" or "text" field (ImageReward's ReFL data uses "text"); other fields of an object travel
as the prompt's metadata.

Two sources read a file of flow_grpo's formats (`--prompt_fn NAME --prompts_file F`, FILE_SOURCES):
    geneval_file   GenEval's metadata JSONL (flow_grpo's dataset/geneval/*_metadata.jsonl, GenEval 2's data): one
                   JSON object per line with a "prompt"; the whole line (its tag, include / exclude lists, vqa_list,
                   prompt) is the prompt's metadata, as GenEval's server and geneval2 read it.
    ocr_file       flow_grpo's OCR prompts (dataset/ocr/*.txt): one prompt per line, the text to render in double
                   quotes; that text is the metadata's "ocr_text".

Edits (`--edit_data F`, refl_ddpo.core.edit_data) are a source too: the instruction is the prompt and the metadata
carries the source image(s), `metadata["source_images"]`: a list of (3, H, W) float32 tensors in [0, 1], one per
reference. A user's prompt_fn may return them there itself (tensors or PIL images).
"""

from __future__ import annotations

import inspect
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from refl_ddpo.core.errors import UserError, read_utf8
from refl_ddpo.core.user_code import import_ref, split_ref

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
PromptFn = Callable[[], tuple[str, dict]]
QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def load_prompts(path: str | Path) -> list[tuple[str, dict]]:
    """Read a prompts file into [(prompt, metadata)], with one-line errors for missing, empty or malformed files."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts_file {path}: no such file (one prompt per line, or a JSON list).")
    text = read_utf8(path, f"--prompts_file {path}")
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--prompts_file {path}: invalid JSON ({e}).") from None
        if not isinstance(items, list):
            raise UserError(
                f"--prompts_file {path}: JSON must be a list of strings or of {{'text': ...}} objects."
            )
        out = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                out.append((item, {}))
            elif isinstance(item, dict) and isinstance(item.get("prompt", item.get("text")), str):
                prompt = item.get("prompt", item.get("text"))
                out.append((prompt, {k: v for k, v in item.items() if k not in ("prompt", "text")}))
            else:
                raise UserError(
                    f"--prompts_file {path}: item {i} is neither a string nor an object with "
                    "a 'prompt' or 'text' string."
                )
    else:
        lines = (line.strip() for line in text.splitlines())
        out = [(line, {}) for line in lines if line and not line.startswith("#")]
    out = [(p, m) for p, m in out if p.strip()]
    if not out:
        raise UserError(f"--prompts_file {path} holds no prompts; write one prompt per line.")
    return out


def quoted_text(prompt: str) -> str | None:
    """The text inside the prompt's first pair of double quotes (straight or curly), or None."""
    match = QUOTED.search(prompt)
    return None if match is None else next(g for g in match.groups() if g is not None)


def _clause_ok(clause) -> bool:
    return (
        isinstance(clause, dict)
        and isinstance(clause.get("class"), str)
        and isinstance(clause.get("count"), int)
    )


def _geneval_line(line: str, where: str) -> tuple[str, dict]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e}); GenEval's metadata is one JSON object per line.") from None
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
        raise UserError(f"{where}: not a JSON object with a 'prompt' string (GenEval's metadata JSONL).")
    for key in ("include", "exclude"):
        if key in item and not (isinstance(item[key], list) and all(map(_clause_ok, item[key]))):
            raise UserError(
                f"{where}: '{key}' must be a list of {{'class': str, 'count': int, ...}} objects."
            )
    return item["prompt"], item


def load_geneval_jsonl(path: str | Path) -> list[tuple[str, dict]]:
    """GenEval's metadata JSONL -> [(prompt, the whole line as metadata)]; one-line errors naming the line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts_file {path}: no such file (GenEval's metadata JSONL).")
    lines = read_utf8(path, f"--prompts_file {path}").splitlines()
    out = [
        _geneval_line(line, f"--prompts_file {path} line {i}")
        for i, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not out:
        raise UserError(f"--prompts_file {path} holds no prompts (GenEval's metadata JSONL).")
    return out


def load_ocr_prompts(path: str | Path) -> list[tuple[str, dict]]:
    """flow_grpo's OCR prompts -> [(prompt, {"ocr_text": the quoted text})]; a prompt without one is refused."""
    out = []
    for prompt, metadata in load_prompts(path):
        target = quoted_text(prompt)
        if not target or not target.strip():
            raise UserError(
                f"--prompts_file {path}: the prompt {prompt[:60]!r} has no text in double quotes to render "
                '(flow_grpo\'s OCR prompts: ... a sign that reads "Open" ...).'
            )
        out.append((prompt, {**metadata, "ocr_text": target}))
    return out


FILE_SOURCES: dict[str, Callable[[str | Path], list[tuple[str, dict]]]] = {
    "geneval_file": load_geneval_jsonl,
    "ocr_file": load_ocr_prompts,
}


def _draw_from(prompts: list[tuple[str, dict]], seed: int | None) -> PromptFn:
    rng = random.Random(seed)

    def prompt_fn() -> tuple[str, dict]:
        prompt, metadata = rng.choice(prompts)
        return prompt, dict(metadata)

    return prompt_fn


def from_file(path: str | Path, seed: int | None = None) -> PromptFn:
    """Uniformly random prompts from a file (seeded)."""
    prompts = load_prompts(path)
    rng = random.Random(seed)

    def prompt_fn() -> tuple[str, dict]:
        prompt, metadata = rng.choice(prompts)
        return prompt, dict(metadata)

    return prompt_fn


def _builtin(name: str) -> Callable[..., PromptFn]:
    def make(seed: int | None = None) -> PromptFn:
        return from_file(DATA_DIR / f"{name}.txt", seed)

    make.__doc__ = f"Random prompts from the shipped list {name}.txt (DATA_DIR)."
    return make


PROMPT_SOURCES: dict[str, Callable[..., PromptFn]] = {
    "imagenet_animals": _builtin("imagenet_animals"),  # ddpo-pytorch's source: ImageNet-1k animal classes
    "simple_animals": _builtin("simple_animals"),  # ddpo-pytorch's short list of common animals
    "refl_prompts": _builtin("refl_prompts"),  # default ReFL training prompts
    "toy_world_train": _builtin(
        "toy_world_train"
    ),  # the toy world's 12 training prompts (refl_ddpo.toy_world.world)
    "toy_world_heldout": _builtin("toy_world_heldout"),  # its 6 held-out prompts (evaluation only)
    # one colour word's 2 training prompts (a green circle / square; the policy-gradient presets, docs/toy_world.md)
    "toy_world_green": _builtin("toy_world_green"),
    "toy_world_green_heldout": _builtin("toy_world_green_heldout"),  # a green triangle (the guard's proof)
    "toy_world_cyan": _builtin("toy_world_cyan"),  # a cyan square / triangle (the toy-sd3 presets)
    # those two and a magenta square / circle, which toy-sd3 already draws right: a LoRA that turned every square
    # cyan would lose their reward (DDPO's toy-sd3 proof; docs/record/learning_spread.md)
    "toy_world_cyan_anchored": _builtin("toy_world_cyan_anchored"),
}


def resolve_prompts(name_or_path: str | None) -> list[tuple[str, dict]]:
    """[(prompt, metadata)] from a file, or from a list shipped in DATA_DIR by its source name."""
    if not name_or_path:
        raise UserError("--prompts_file is empty: pass a prompts file or a shipped list name (refl_prompts).")
    if name_or_path in PROMPT_SOURCES and not Path(name_or_path).exists():
        return load_prompts(DATA_DIR / f"{name_or_path}.txt")
    return load_prompts(name_or_path)


def user_prompt_source(ref: str) -> Callable[..., PromptFn]:
    """The user's prompt_fn 'pkg.module:function' as a source: called with no argument (ddpo-pytorch's and TRL's
    contract), or with `rng=` (a random.Random seeded like the shipped sources) when it takes that keyword."""
    fn = import_ref(ref, "--prompt_fn")
    try:
        takes_rng = "rng" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes_rng = False

    def make(seed: int | None = None) -> PromptFn:
        rng = random.Random(seed)

        def prompt_fn() -> tuple[str, dict]:
            out = fn(rng=rng) if takes_rng else fn()
            if not (
                isinstance(out, tuple)
                and len(out) == 2
                and isinstance(out[0], str)
                and isinstance(out[1], dict)
            ):
                raise UserError(
                    f"--prompt_fn {ref} returned {type(out).__name__} {str(out)[:60]!r}; a prompt_fn returns "
                    "(prompt: str, metadata: dict)."
                )
            return out

        return prompt_fn

    return make


def _is_user_ref(name: str) -> bool:
    return name not in PROMPT_SOURCES and split_ref(name) is not None and not Path(name).exists()


def check_prompt_source(name: str, prompts_file: str | None = None) -> None:
    """A shipped source's name (a file source's with its readable `prompts_file`) or the user's importable
    'pkg.module:function'; else one line with the choices."""
    if name in FILE_SOURCES:
        if not prompts_file:
            raise UserError(
                f"--prompt_fn {name} reads --prompts_file F (flow_grpo's format); pass it (DDPO, GRPO, NFT, AWM)."
            )
        FILE_SOURCES[name](prompts_file)
    elif _is_user_ref(name):
        user_prompt_source(name)
    elif name not in PROMPT_SOURCES:
        raise UserError(
            f"--prompt_fn {name}: unknown prompt source; choose from {', '.join(PROMPT_SOURCES)}, from_file, "
            f"{', '.join(FILE_SOURCES)} (with --prompts_file) or your own function as pkg.module:function."
        )


def get_prompt_fn(name_or_path: str, seed: int | None = None) -> PromptFn:
    """A registered source by name (`imagenet_animals`, ...), the user's 'pkg.module:function', or `from_file` for a
    path."""
    if name_or_path in PROMPT_SOURCES:
        return PROMPT_SOURCES[name_or_path](seed)
    if _is_user_ref(name_or_path):
        return user_prompt_source(name_or_path)(seed)
    if Path(name_or_path).suffix or "/" in name_or_path or Path(name_or_path).exists():
        return from_file(name_or_path, seed)
    raise UserError(f"prompts '{name_or_path}': neither a file nor one of {', '.join(PROMPT_SOURCES)}.")


def epoch_prompt_fn(
    prompt_fn: str, prompts_file: str | None, seed: int | None = None, edit_data: str | None = None
) -> PromptFn:
    """The sample-then-train trainers' prompts: --prompt_fn with --prompts_file (from_file or a file source), or the
    edits of --edit_data (instruction, metadata with the source images: refl_ddpo.core.edit_data)."""
    if edit_data:
        from refl_ddpo.core.edit_data import edit_prompt_fn

        return edit_prompt_fn(edit_data, seed)
    if prompt_fn in FILE_SOURCES:
        return _draw_from(FILE_SOURCES[prompt_fn](prompts_file), seed)
    return get_prompt_fn(prompts_file if prompt_fn == "from_file" else prompt_fn, seed)


class PromptDraw:
    """A trainer's prompts per batch from one torch generator: uniform draws from a list of (prompt, metadata), or a
    prompt source (`get_prompt_fn`'s names) seeded per batch from the same generator, so that restoring the
    generator's state restores the prompts (bit-exact resume)."""

    def __init__(self, prompts: list[tuple[str, dict]] | None = None, source: str | None = None):
        self.prompts, self.source = prompts, source

    def describe(self) -> str:
        return f"prompt_fn {self.source}" if self.source is not None else str(len(self.prompts))

    def __call__(self, n: int, generator) -> tuple[list[str], list[dict]]:
        import torch

        if self.source is not None:
            seed = int(torch.randint(2**62, (1,), generator=generator))
            prompt_fn = get_prompt_fn(self.source, seed)
            pairs = [prompt_fn() for _ in range(n)]
        else:
            pairs = [
                self.prompts[i] for i in torch.randint(len(self.prompts), (n,), generator=generator).tolist()
            ]
        from refl_ddpo.core.edit_data import with_source_images

        return [p for p, _ in pairs], [with_source_images(m) for _, m in pairs]  # copies


def load_records(path: str, edits: bool) -> list[tuple[str, dict]]:
    """(prompt, metadata) pairs: `path`'s edit records read as --edit_data's when `edits` (an editing run), else the
    prompts of a prompts file or shipped list (`resolve_prompts`)."""
    from refl_ddpo.core.edit_data import load_edit_data

    return load_edit_data(path) if edits else resolve_prompts(path)
