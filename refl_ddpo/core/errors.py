"""User-facing errors: one line that says what to fix, and a non-zero exit code, never a traceback."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing file). `exit_code` is what the script exits with."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def cli_main(fn: Callable[..., T]) -> Callable[..., T]:
    """Wrap a script's `main` so that a `UserError` prints `error: <message>` on one line and exits non-zero."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(e.exit_code)

    return wrapper


def read_utf8(path, what: str) -> str:
    """The text of `path`, or a one-line UserError naming `what` (e.g. '--prompts_file x.txt'), the line and the byte
    offset of the first byte that is not UTF-8."""
    from pathlib import Path

    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{what} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (line {line}); "
            "save the file as UTF-8."
        ) from None
