"""Write the flag reference, docs/flags/<command>.md, from the configs' help text.

    python docs/gen_flags.py            # rewrites docs/flags/*.md (commit them; CI fails when they are stale)

One page per command (COMMANDS): its flags grouped by topic as `--help` groups them (the `group` of `field_`), each
with its type, default, aliases and help sentence; the defaults that the shell scripts in train_scripts/ pass
(REFL_DDPO_DEFAULTS, read through `refl_ddpo.run.flags.parse_layers` as the trainers read them) beside the trainer's
own where they differ; and the trainer's presets. The output is deterministic: no dates, no absolute paths (a path
under the repo is written relative to its root).

tests/test_readme.py uses COMMANDS and `script_layers` to check the commands shown in README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import re
import shlex
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "docs" / "flags"
SCRIPTS_DIR = ROOT / "train_scripts"
THIS = "docs/gen_flags.py"


@dataclass(frozen=True)
class Command:
    page: str  # docs/flags/<page>.md
    title: str
    config: str  # "module:ClassName" of its config dataclass
    module: str  # `python -m` module of the command, or "" for a file under inference/
    path: str  # the file that runs it (relative to the repo root)
    console_script: str  # the command `pip install -e .` installs

    def config_class(self) -> type:
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)


COMMANDS = (
    Command(
        "refl",
        "ReFL (and DRaFT, AlignProp)",
        "refl_ddpo.trainers.refl_config:ReFLConfig",
        "refl_ddpo.trainers.refl",
        "refl_ddpo/trainers/refl.py",
        "refl-ddpo-refl",
    ),
    Command(
        "ddpo",
        "DDPO",
        "refl_ddpo.trainers.ddpo_config:DDPOConfig",
        "refl_ddpo.trainers.ddpo",
        "refl_ddpo/trainers/ddpo.py",
        "refl-ddpo-ddpo",
    ),
    Command(
        "grpo",
        "GRPO",
        "refl_ddpo.trainers.grpo_config:GRPOConfig",
        "refl_ddpo.trainers.grpo",
        "refl_ddpo/trainers/grpo.py",
        "refl-ddpo-grpo",
    ),
    Command(
        "nft",
        "DiffusionNFT",
        "refl_ddpo.trainers.forward_config:NFTConfig",
        "refl_ddpo.trainers.nft",
        "refl_ddpo/trainers/nft.py",
        "refl-ddpo-nft",
    ),
    Command(
        "awm",
        "AWM",
        "refl_ddpo.trainers.forward_config:AWMConfig",
        "refl_ddpo.trainers.awm",
        "refl_ddpo/trainers/awm.py",
        "refl-ddpo-awm",
    ),
    Command(
        "inference",
        "Inference",
        "refl_ddpo.apps.inference_config:InferenceConfig",
        "",
        "inference/inference.py",
        "refl-ddpo-inference",
    ),
    Command(
        "inference_lora",
        "Inference with a LoRA",
        "refl_ddpo.apps.inference_config:LoraInferenceConfig",
        "",
        "inference/inference_lora.py",
        "refl-ddpo-inference-lora",
    ),
)


# each command's guide (under docs/): its method, presets and logged metrics, or how to use it
GUIDES = {
    "refl": ("ReFL, DRaFT, AlignProp", "trainers/refl.md"),
    "ddpo": ("DDPO", "trainers/ddpo.md"),
    "grpo": ("GRPO", "trainers/grpo.md"),
    "nft": ("DiffusionNFT and AWM", "trainers/nft_awm.md"),
    "awm": ("DiffusionNFT and AWM", "trainers/nft_awm.md"),
    "inference": ("Inference", "inference.md"),
    "inference_lora": ("Inference", "inference.md"),
}


# ---------------------------------------------------------------------------------------------------------------
# the shell scripts' defaults
# ---------------------------------------------------------------------------------------------------------------

LAUNCH_LINE = re.compile(r"^\s*launch\s+(\S+)(.*?)\s--\s+\"\$@\"\s*$", re.MULTILINE)


def script_launches(scripts_dir: Path = SCRIPTS_DIR) -> dict[str, tuple[str, list[str]]]:
    """{script file name: (module, the defaults it passes)} for each train_scripts/*.sh that calls launch.sh's
    `launch MODULE [defaults...] -- "$@"`."""
    found = {}
    for path in sorted(scripts_dir.glob("*.sh")):
        text = path.read_text().replace("\\\n", " ")
        match = LAUNCH_LINE.search(text)
        if match:
            found[path.name] = (match.group(1), shlex.split(match.group(2)))
    return found


@contextlib.contextmanager
def env_var(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def script_layers(cls: type, defaults: list[str], argv: list[str] | None = None) -> dict[str, Any]:
    """The field values a script's defaults (and then `argv`) set, read as the trainer reads them: launch.sh passes
    the defaults in REFL_DDPO_DEFAULTS and `refl_ddpo.run.flags.parse_layers` parses them (aliases resolved). Raises
    SystemExit (argparse) or UserError on a flag or value the command refuses."""
    from refl_ddpo.run.flags import DEFAULTS_ENV, parse_layers

    with env_var(DEFAULTS_ENV, " ".join(shlex.quote(a) for a in defaults)):
        return parse_layers(cls, list(argv or []))


# ---------------------------------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------------------------------


def show(value: Any) -> str:
    """A value as it would be written on the command line (a path under the repo relative to its root)."""
    if isinstance(value, (list, tuple)):
        return " ".join(show(v) for v in value)
    if isinstance(value, str):
        path = Path(value)
        if path.is_absolute():
            with contextlib.suppress(ValueError):
                return path.resolve().relative_to(ROOT).as_posix()
        return value
    return repr(value)


def code(value: Any) -> str:
    text = show(value)
    return f"`{text}`" if text else '`""`'


# markdown's specials; `_` only where it could open or close emphasis (not inside a word such as text_encoder_3)
_ESCAPE = re.compile(r"([\\*\[\]<>|]|(?<!\w)_|_(?!\w))")


def prose(text: str) -> str:
    """Help text in a table cell: markdown's special characters escaped outside `code spans`."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else _ESCAPE.sub(r"\\\1", p) for p in parts)


def type_text(cls: type, f: dataclasses.Field, tp) -> str:
    """The flag's type as build_parser reads it."""
    from refl_ddpo.run.flags import unwrap_optional

    tp, optional = unwrap_optional(tp)
    if f.name == "preset" and getattr(cls, "PRESETS", None):
        text = "one of " + ", ".join(f"`{p}`" for p in sorted(cls.PRESETS))
    elif tp is bool:
        return "bool"
    elif typing.get_origin(tp) is Literal:
        text = "one of " + ", ".join(f"`{c}`" for c in typing.get_args(tp))
    elif typing.get_origin(tp) is list:
        text = f"{typing.get_args(tp)[0].__name__} ... (one or more)"
    else:
        text = getattr(tp, "__name__", str(tp))
    return f"{text} or `None`" if optional else text


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def groups(cls: type) -> list[tuple[str, list[dataclasses.Field]]]:
    """The fields by `--help` section, as build_parser groups them (refl_ddpo.run.config.field_sections)."""
    from refl_ddpo.run.config import field_sections

    return field_sections(cls)


# ---------------------------------------------------------------------------------------------------------------
# a page
# ---------------------------------------------------------------------------------------------------------------


GENERATED = f"<!-- generated by {THIS}: do not edit; regenerate with `python {THIS}` -->"
SCRIPTS_NOTE = (
    "What each shell script passes as its defaults (in `REFL_DDPO_DEFAULTS`); the Default column below shows its "
    "value beside the trainer's where they differ. A preset overrides them."
)
PRESETS_NOTE = "`--preset NAME` sets these values as defaults, above the script's and below `--config` and the flags you type."


def page(cmd: Command) -> str:
    """The markdown of one command's page."""
    cls = cmd.config_class()
    launches = {name: args for name, (module, args) in script_launches().items() if module == cmd.module}
    scripts = {name: script_layers(cls, args) for name, args in launches.items()}
    run = [f"`bash train_scripts/{name} [--flag VALUE ...]`" for name in scripts]
    run.append(f"`python -m {cmd.module}`" if cmd.module else f"`python {cmd.path}`")
    layers = "the script's defaults, `--preset NAME`, " if scripts else ""
    run_line = (
        f"Run as {', '.join(run)} or `{cmd.console_script}` (installed); `--help` lists the same flags by topic. "
        f"Values come in layers, each overriding the one before: the defaults below, {layers}`--config FILE` "
        "(yaml or json), then the flags you type ([Layout](../layout.md))."
    )
    name, guide = GUIDES[cmd.page]
    what = (
        "the method, the presets and the logged metrics" if guide.startswith("trainers/") else "how to use it"
    )
    run_line += f" For {what}, see [{name}](../{guide})."
    lines = [
        f"# {cmd.title}: flags",
        "",
        GENERATED,
        "",
        prose(" ".join((cls.__doc__ or "").split())),
        "",
        run_line,
        "",
    ]
    if scripts:
        lines += ["## Scripts", "", SCRIPTS_NOTE, "", "| Script | Its defaults |", "|---|---|"]
        for name, args in launches.items():
            lines.append(f"| `train_scripts/{name}` | {f'`{shlex.join(args)}`' if args else '(none)'} |")
        lines.append("")
    lines += ["## Flags", "", *flag_tables(cls, scripts)]
    if getattr(cls, "PRESETS", None):
        lines += ["## Presets", "", PRESETS_NOTE, "", *preset_tables(cls)]
    return "\n".join(lines).rstrip() + "\n"


def flag_tables(cls: type, scripts: dict[str, dict[str, Any]]) -> list[str]:
    """One table per --help section: flag (and aliases), type, default (and the scripts' values), help."""
    from refl_ddpo.run.flags import unwrap_optional

    hints = typing.get_type_hints(cls)
    aliases = getattr(cls, "ALIASES", {})
    lines = []
    for title, fs in groups(cls):
        lines += [f"### {title}", "", "| Flag | Type | Default | Help |", "|---|---|---|---|"]
        if title == "options":
            lines.append(
                "| `--config` | str | `None` | A yaml or json file of field: value; flags override it. |"
            )
        for f in fs:
            tp = hints[f.name]
            names = [f"--{f.name}"] + (["--no-" + f.name] if unwrap_optional(tp)[0] is bool else [])
            flag = " / ".join(f"`{n}`" for n in names)
            extra = [
                *f.metadata.get("flags", ()),
                *(f"--{a}" for a, n in sorted(aliases.items()) if n == f.name),
            ]
            if extra:
                flag += "<br>alias " + ", ".join(f"`{e}`" for e in extra)
            if f.name in aliases:
                flag += f"<br>(alias of `--{aliases[f.name]}`)"
            default = [code(default_of(f))] + [
                f"{name}: {code(values[f.name])}"
                for name, values in scripts.items()
                if f.name in values and values[f.name] != default_of(f)
            ]
            help_text = prose(f.metadata.get("help", ""))
            lines.append(f"| {flag} | {type_text(cls, f, tp)} | {'<br>'.join(default)} | {help_text} |")
        lines.append("")
    return lines


def preset_tables(cls: type) -> list[str]:
    """One table per preset (by name): the flags it sets, in the order of the fields, its value and the default."""
    fs = {f.name: (i, f) for i, f in enumerate(dataclasses.fields(cls))}
    lines = []
    for name, values in sorted(cls.PRESETS.items()):
        lines += [f"### {name}", "", "| Flag | Value | Trainer default |", "|---|---|---|"]
        for key in sorted(values, key=lambda k: fs[k][0]):
            lines.append(f"| `--{key}` | {code(values[key])} | {code(default_of(fs[key][1]))} |")
        lines.append("")
    return lines


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write every command's page; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for cmd in COMMANDS:
        path = out_dir / f"{cmd.page}.md"
        path.write_text(page(cmd))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="Folder to write to (default: docs/flags).")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # refl_ddpo from this checkout, installed or not
    for path in generate(args.out):
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    main()
