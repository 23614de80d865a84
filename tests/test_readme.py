"""The commands shown in README.md run: every `bash train_scripts/X.sh ...`, `python inference/X.py ...` and
`python -m refl_ddpo... ...` in its ```bash blocks names a script or module that exists and passes only flags (and
values) that the command's parser accepts, read as the command reads them (a train script's defaults included,
through docs/gen_flags.py's `script_layers`). No model is loaded. Also: the flag reference's sections are --help's."""

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest
from helpers import gen_flags

from refl_ddpo.core.errors import UserError
from refl_ddpo.run.flags import build_parser

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


# commands with a plain argparse parser (no config dataclass): where they are run from -> "module:parser factory"
PLAIN_PARSERS = {
    "inference/compare.py": "refl_ddpo.apps.compare:build_parser",
    "refl_ddpo.apps.compare": "refl_ddpo.apps.compare:build_parser",
}
SEPARATORS = {"&&", "||", ";", "|", "&"}


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, words) of every simple command in the ```bash blocks of a markdown text: continuation lines
    joined, comments dropped, split at && || ; | &, leading VAR=value assignments dropped."""
    found, block, lines = [], False, text.splitlines()
    pending, start = "", 0
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            block = not block and line.strip() == "```bash"
            continue
        if not block:
            continue
        pending, start = (pending + " " + line, start) if pending else (line, number)
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1]
            continue
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in SEPARATORS:
                while words and re.fullmatch(r"\w+=.*", words[0]):
                    words.pop(0)
                if words:
                    found.append((start, words))
                words = []
            else:
                words.append(token)
        pending = ""
    return found


def target(words: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind, name, flags) of a command this test checks: ("script", "train_scripts/X.sh", ...), ("file",
    "inference/X.py", ...) or ("module", "refl_ddpo....", ...); None for any other command."""
    head = words[0]
    python = head in ("python", "python3") or head.endswith("/python")
    if head == "bash" and len(words) > 1 and words[1].startswith("train_scripts/"):
        return "script", words[1], words[2:]
    if python and len(words) > 1 and words[1].startswith("inference/"):
        return "file", words[1], words[2:]
    if python and len(words) > 2 and words[1] == "-m" and words[2].split(".")[0] == "refl_ddpo":
        return "module", words[2], words[3:]
    return None


def _parse(parse, what: str) -> str | None:
    """Run a parse, returning its error (argparse's message, or a UserError) or None; --help is fine."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse()
    except SystemExit as e:
        if e.code not in (0, None):
            return f"{what}: {(err.getvalue().strip().splitlines() or [str(e)])[-1]}"  # argparse: usage, then error
    except UserError as e:
        return f"{what}: {e}"
    return None


def check(kind: str, name: str, flags: list[str]) -> str | None:
    """None if the command exists and its parser accepts these flags; else one line saying what is wrong."""
    what = " ".join([name, *flags])
    by_path = {c.path: c for c in gen_flags.COMMANDS}
    by_module = {c.module: c for c in gen_flags.COMMANDS if c.module}
    defaults: list[str] = []
    if kind == "script":
        if not (REPO / name).is_file():
            return f"{what}: no such script"
        launch = gen_flags.script_launches(REPO / "train_scripts").get(Path(name).name)
        if launch is None:  # a script of its own (demo.sh): it takes no flags
            return f"{what}: {name} takes no flags" if flags else None
        module, defaults = launch
        command = by_module.get(module)
    elif kind == "file":
        if not (REPO / name).is_file():
            return f"{what}: no such file"
        command, module = by_path.get(name), name
    else:
        parts = REPO.joinpath(*name.split("."))
        if not (parts.with_suffix(".py").is_file() or (parts / "__main__.py").is_file()):
            return f"{what}: no such module"
        command, module = by_module.get(name), name
    if command is not None:
        cls = command.config_class()
        with gen_flags.env_var("REFL_DDPO_PROG", name):  # how argparse names the command in its errors
            return _parse(lambda: gen_flags.script_layers(cls, defaults, flags), what)
    if module in PLAIN_PARSERS:
        mod, _, factory = PLAIN_PARSERS[module].partition(":")
        parser: argparse.ArgumentParser = getattr(importlib.import_module(mod), factory)()
        return _parse(lambda: parser.parse_args(flags), what)
    return f"{what}: no parser known for {module} (add it to gen_flags.COMMANDS or PLAIN_PARSERS)"


def readme_errors(text: str) -> tuple[int, list[str]]:
    """(commands checked, one line per wrong one)."""
    checked, errors = 0, []
    for line, words in bash_commands(text):
        found = target(words)
        if found is None:
            continue
        checked += 1
        error = check(*found)
        if error:
            errors.append(f"README.md:{line}: {error}")
    return checked, errors


def test_readme_commands_exist_and_take_their_flags():
    text = README.read_text()
    checked, errors = readme_errors(text)
    assert not errors, "\n".join(errors)
    assert checked >= 8 and "bash train_scripts/train_refl_lora.sh --preset toy_world" in text


# a markdown text with one mistake of each kind (and right commands beside them): see the test below
MISTAKES = r"""
```bash
bash train_scripts/train_refl_lora.sh --learning_rat 1e-4   # a misspelled flag
GPUS=0 bash train_scripts/train_ddpo.sh --preset nope && python inference/inference_lora.py --lora_dirr x
python -m refl_ddpo.trainers.grpo --group_size two
bash train_scripts/demo.sh --seed 1; bash train_scripts/train_nope.sh
python inference/nope.py; python -m refl_ddpo.trainers.nope; python inference/compare.py a
bash train_scripts/train_grpo.sh \
  --sde_windo 2
```
```bash
bash train_scripts/train_refl_full.sh --help && python inference/compare.py a b --max_pairs 3
python -m refl_ddpo.trainers.ddpo --beta 0.1 --timestep_fraction 0.5 | tee log
```
```
bash train_scripts/train_refl_lora.sh --not_a_bash_block 1
```
"""


def test_the_check_finds_every_kind_of_mistake():
    checked, errors = readme_errors(MISTAKES)
    assert checked == 13
    expected = [
        (3, "--learning_rat"),
        (4, "--preset nope"),
        (4, "--lora_dirr"),
        (5, "two"),
        (6, "takes no flags"),
        (6, "no such script"),
        (7, "no such file"),
        (7, "no such module"),
        (7, "compare.py a:"),
        (8, "--sde_windo"),  # a continued line: numbered where it starts
    ]
    assert len(errors) == len(expected), "\n".join(errors)
    for error, (line, words) in zip(errors, expected, strict=True):
        assert error.startswith(f"README.md:{line}: ") and words in error, error


@pytest.mark.parametrize("command", gen_flags.COMMANDS, ids=lambda c: c.page)
def test_the_flag_pages_have_the_sections_of_help(command):
    """docs/gen_flags.py groups the fields as --help does (build_parser's argument groups, by title)."""
    cls = command.config_class()
    parser = build_parser(cls)
    sections: dict[str, list[str]] = {}
    for group in parser._action_groups:
        dests = [a.dest for a in group._group_actions if a.dest not in ("help", "config")]
        if dests or group.title == "options":
            sections.setdefault(group.title, []).extend(dests)
    documented = {title: [f.name for f in fs] for title, fs in gen_flags.groups(cls)}
    assert documented == sections
