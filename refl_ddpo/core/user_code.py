"""The user's own functions, named on the command line by dotted path as `pkg.module:function` (the module imported
as Python imports it: from the working directory or PYTHONPATH), checked before any model loads."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from refl_ddpo.core.errors import UserError

# 'pkg.module:function', then an optional ':rest' (a reward's weight)
_REF = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*)(?::(.*))?")


def split_ref(text: str) -> tuple[str, str] | None:
    """'pkg.mod:fn' -> ('pkg.mod:fn', ''); 'pkg.mod:fn:0.5' -> ('pkg.mod:fn', '0.5'); None if not of that shape."""
    m = _REF.fullmatch(text)
    return (m.group(1), m.group(2) or "") if m else None


def import_ref(ref: str, flag: str) -> Callable:
    """The callable that 'pkg.module:function' names, or one line saying what to fix."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(
            f"{flag} {ref}: cannot import {module_name} ({type(e).__name__}: {e}); run from the folder that holds "
            "it or add that folder to PYTHONPATH."
        ) from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise UserError(f"{flag} {ref}: module {module_name} ({module.__file__}) has no {attr}.")
    if not callable(obj):
        raise UserError(f"{flag} {ref}: {attr} is a {type(obj).__name__}, not a function.")
    return obj
