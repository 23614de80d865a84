"""Config dataclasses -> command-line flags, in layers, with checks before anything is loaded.

Every field carries `help` in its metadata (`field_(default, "sentence", group=..., flags=...)`); the flag `--name`
is generated from the field name (plus any extra option strings in `flags`), its type from the annotation
(`bool` -> `--x/--no-x`, `Literal[...]` -> choices), and `--help` lists the fields by group. Values come in layers,
each overriding the one before:

    the dataclass defaults
    < the calling script's defaults (train_scripts/*.sh pass them in REFL_DDPO_DEFAULTS)
    < a preset (`--preset NAME`, from the config's PRESETS table) where the config has one
    < --config FILE (yaml or json)
    < the flags on the command line (later flags win over earlier ones)

Aliases of a field (`ALIASES = {alias: field}` on the config class) are resolved per layer: an alias and its field
given in the same layer must agree. Cross-field checks live in each config's `check()` and raise `UserError` naming
the fields; they run before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import shlex
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from refl_ddpo.core.errors import UserError, read_utf8
from refl_ddpo.run.config import field_sections

DEFAULTS_ENV = "REFL_DDPO_DEFAULTS"  # a script's defaults, as flags (a layer below --config)
PROG_ENV = "REFL_DDPO_PROG"  # how the user called the program, for --help and usage lines


# --------------------------------------------------------------------------------------------------------------
# dataclass -> argparse
# --------------------------------------------------------------------------------------------------------------


def unwrap_optional(tp):
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_none(conv):
    def parse(s: str):
        return None if s.lower() in ("none", "null") else conv(s)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; the description's own lines and paragraphs kept."""


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors are one line, without the usage block, and name the closest flags to an unknown one
    ("did you mean --learning_rate?")."""

    def error(self, message: str):
        hints = []
        if "unrecognized arguments:" in message:
            for flag in re.findall(r"(?<!\S)--?[A-Za-z][\w-]*", message.partition(":")[2]):
                close = difflib.get_close_matches(flag, self._option_string_actions, n=2, cutoff=0.7)
                if close:
                    hints.append(f"{flag}: did you mean {' or '.join(close)}?")
        tail = "; ".join(hints) or "--help lists the flags"
        self.exit(2, f"{self.prog}: error: {message} ({tail})\n")


def build_parser(
    cls: type,
    description: str | None = None,
    suppress_defaults: bool = False,
    prog: str | None = None,
    script_defaults: dict | None = None,
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per dataclass field (grouped as the fields' `group`s), plus `--config`.

    `suppress_defaults`: unset flags are absent from the namespace (to read which flags were given);
    `script_defaults`: the calling script's values, shown as the defaults (so that --help shows what runs)."""
    parser = FlagParser(
        prog=prog or os.environ.get(PROG_ENV),
        usage="%(prog)s [--flag VALUE ...]   (--help: the flags by topic)",
        description=description or cls.__doc__,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
    )
    parser.add_argument("--config", help="A yaml or json file of field: value; flags override it.")
    hints = typing.get_type_hints(cls)
    sections = [
        (parser if title == "options" else parser.add_argument_group(title), fs)
        for title, fs in field_sections(cls)
    ]
    for group, f in ((g, f) for g, fs in sections for f in fs):
        tp, optional = unwrap_optional(hints[f.name])
        kw: dict[str, Any] = {"help": f.metadata.get("help", ""), "dest": f.name}
        if not suppress_defaults:
            kw["default"] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        origin = typing.get_origin(tp)
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kw["choices"] = list(typing.get_args(tp))
            kw["type"] = type(kw["choices"][0])
        elif origin is list:
            (inner,) = typing.get_args(tp)
            kw["nargs"] = "+"
            kw["type"] = inner
        else:
            kw["type"] = _parse_none(tp) if optional else tp
        if f.name == "preset" and getattr(cls, "PRESETS", None):
            kw["choices"] = list(cls.PRESETS)
            kw.pop("type", None)
        group.add_argument(f"--{f.name}", *f.metadata.get("flags", ()), **kw)
    if script_defaults and not suppress_defaults:
        parser.set_defaults(**script_defaults)
    return parser


def _load_config_file(path: str, cls: type) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file.")
    import yaml

    text = read_utf8(p, f"--config {path}")
    try:
        data = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:  # parse errors carry a line number
        raise UserError(
            f"--config {path} is not valid {p.suffix.lstrip('.') or 'json'}: {e}".splitlines()[0]
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of field: value.")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(map(str, data)) - names)
    if unknown:
        raise UserError(f"--config {path}: unknown field(s) {', '.join(unknown)}; see --help for names.")
    hints = typing.get_type_hints(cls)
    return {name: _file_value(hints[name], value, f"--config {path}: {name}") for name, value in data.items()}


_TRUE, _FALSE = ("true", "1"), ("false", "0")
_INVALID = object()  # a --config value that its field's type does not take


def _file_bool(value):
    """A YAML / JSON boolean, 0 / 1, or the strings true / false / 1 / 0, as a bool; else _INVALID."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    return text in _TRUE if text in _TRUE + _FALSE else _INVALID


def _file_number(tp: type, value):
    """An int / float field's value (a number, not a bool, or a string such as '1e-4'), else _INVALID."""
    if isinstance(value, tp if tp is int else (int, float)) and not isinstance(value, bool):
        return tp(value)
    if isinstance(value, str):
        try:
            return tp(value)
        except ValueError:
            pass
    return _INVALID


def _file_value(tp, value, where: str):
    """A --config value as its field's type, read as strictly as the flag would be: null only where the field may
    be None; booleans are YAML/JSON booleans, 0 / 1 or the strings true / false / 1 / 0 (not yes / no / on: a YAML
    file's unquoted yes / no are YAML 1.1 booleans already); numbers may be written as strings ('1e-4', which
    PyYAML reads as a string)."""
    tp, optional = unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if value is None:
        if optional:
            return None
        raise UserError(f"{where} is null; give {_describe(tp)}, or leave the key out for the default.")
    if tp is bool:
        converted = _file_bool(value)
    elif origin is Literal:
        converted = value if not isinstance(value, bool) and value in typing.get_args(tp) else _INVALID
    elif origin is list:
        (inner,) = typing.get_args(tp)
        ok = isinstance(value, list) and all(isinstance(v, inner) and not isinstance(v, bool) for v in value)
        converted = list(value) if ok else _INVALID
    elif tp in (int, float):
        converted = _file_number(tp, value)
    elif tp is str:
        converted = value if isinstance(value, str) else _INVALID
    else:
        converted = value
    if converted is not _INVALID:
        return converted
    raise UserError(f"{where} is {value!r} ({type(value).__name__}); give {_describe(tp)}.")


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin is list:
        return f"a list of {typing.get_args(tp)[0].__name__} values, e.g. [a, b]"
    return {int: "a whole number", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", "a value")
    )


def _resolve_aliases(cls: type, layer: dict, where: str) -> dict:
    """An alias in a layer sets its field; both in one layer must agree."""
    layer = dict(layer)
    for alias, name in getattr(cls, "ALIASES", {}).items():
        if alias in layer and layer[alias] is not None:
            if name in layer and layer[name] != layer[alias]:
                raise UserError(
                    f"--{alias} {layer[alias]} and --{name} {layer[name]} disagree{where}; --{alias} "
                    f"is an alias of --{name}: give only one of them."
                )
            layer[name] = layer.pop(alias)
        layer.pop(alias, None)
    return layer


def parse_layers(cls: type, argv: list[str] | None = None, description: str | None = None) -> dict:
    """The field values from every layer (see the module doc), merged, before the dataclass is built."""
    explicit = build_parser(cls, description, suppress_defaults=True)
    script = vars(explicit.parse_args(shlex.split(os.environ.get(DEFAULTS_ENV, ""))))
    script.pop("config", None)
    script = _resolve_aliases(cls, script, " in the script's defaults")
    # --help (with the script's values as the defaults), and argparse's own errors
    build_parser(cls, description, script_defaults=script).parse_args(argv)
    flags = vars(explicit.parse_args(argv))
    config_path = flags.pop("config", None)
    layers = [(script, "script")]
    file_layer = _load_config_file(config_path, cls) if config_path else {}
    flags_layer = _resolve_aliases(cls, flags, "")
    file_layer = _resolve_aliases(cls, file_layer, f" in --config {config_path}")
    preset = flags_layer.get("preset", file_layer.get("preset", layers[0][0].get("preset")))
    presets = getattr(cls, "PRESETS", {})
    if preset is not None:
        if preset not in presets:
            raise UserError(f"--preset {preset}: unknown; choose from {', '.join(presets) or 'none'}.")
        layers.append((dict(presets[preset]), "preset"))
    layers += [(file_layer, "file"), (flags_layer, "flags")]
    values: dict = {}
    for layer, _ in layers:
        values.update(layer)
    return values


def parse_config(cls: type, argv: list[str] | None = None, description: str | None = None):
    """Parse the layers (script defaults, preset, --config FILE, flags) into a checked `cls` instance."""
    cfg = cls(**parse_layers(cls, argv, description))  # aliases filled in by __post_init__
    cfg.check()
    return cfg
