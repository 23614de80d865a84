"""Progress bars that read well in a terminal and in a log file: one bar per phase, metrics as its postfix.

In a terminal a bar redraws in place (tqdm as usual). When the output is not a terminal (a log file, a pipe, a job
scheduler's capture) a redrawn bar would litter it with carriage returns and half lines, so the bar instead writes a
plain line, at most once every REFL_DDPO_PROGRESS_INTERVAL seconds (default 30), plus its final state when it was
shown at all: a short phase writes nothing, a long one a line per interval with its postfix metrics.

Callers update the postfix with `refresh=False`; the bar draws it with the next update.
"""

from __future__ import annotations

import os
import sys

INTERVAL_ENV = "REFL_DDPO_PROGRESS_INTERVAL"
DEFAULT_LOG_INTERVAL = 30.0  # seconds between two lines of a bar when the output is not a terminal


class _LineWriter:
    """A file for tqdm's status printer that turns every redraw ('\\r' + status + padding) into one plain line, and
    drops the clears (only '\\r' and spaces) and a repeat of the line before."""

    def __init__(self, stream):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line and line != self.last:  # closing redraws the last state once more
            self.stream.write(line + "\n")
            self.last = line

    def flush(self) -> None:
        self.stream.flush()


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def log_interval() -> float:
    """Seconds between two lines of a bar in a log (REFL_DDPO_PROGRESS_INTERVAL, default 30)."""
    value = os.environ.get(INTERVAL_ENV)
    try:
        return max(0.0, float(value)) if value else DEFAULT_LOG_INTERVAL
    except ValueError:
        return DEFAULT_LOG_INTERVAL


def progress_bar(
    total: int | None,
    desc: str,
    *,
    unit: str = "it",
    initial: int = 0,
    leave: bool = True,
    enabled: bool = True,
    file=None,
):
    """A tqdm bar for one phase on `file` (stderr by default); `enabled=False` (not the local main process) shows
    nothing. In a terminal it redraws in place; elsewhere it writes plain lines (see the module's docstring)."""
    from tqdm.auto import tqdm

    stream = file if file is not None else sys.stderr
    common = {"total": total, "desc": desc, "unit": unit, "initial": initial, "disable": not enabled}
    if _is_tty(stream):
        return tqdm(file=stream, leave=leave, dynamic_ncols=True, **common)
    interval = log_interval()
    return tqdm(
        file=_LineWriter(stream),
        leave=True,  # its last state is a line of the log, if it was shown at all
        ascii=True,  # no block characters in a log
        mininterval=interval,
        delay=interval,  # a phase shorter than the interval writes nothing
        **common,
    )


def run_clock(elapsed: float, done: int, left: int) -> str:
    """'1:02 elapsed, ~3:06 left' after `done` of `done + left` equal units took `elapsed` seconds."""

    def hms(seconds: float) -> str:
        m, sec = divmod(round(seconds), 60)
        h, m = divmod(m, 60)
        return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"

    text = f"{hms(elapsed)} elapsed"
    if done > 0 and left > 0:
        text += f", ~{hms(elapsed / done * left)} left"
    return text


def quiet_library_bars() -> None:
    """When stderr is not a terminal, switch off diffusers', transformers' and huggingface_hub's own bars (loading
    components, weights, downloads): redrawn with carriage returns, they would litter the log."""
    if _is_tty(sys.stderr):
        return
    import diffusers
    import huggingface_hub
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
