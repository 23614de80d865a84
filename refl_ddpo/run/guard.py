"""Guards against reward hacking at validation: the best weights kept by a validation metric, early stopping, and
the divergence line.

    --early_stop_metric KEY    any key a validation logs (validation/<reward>/mean|std, validation/drift/<name>)
    best                       the first validation (the baseline too) and every one that improves KEY by more than
                               --early_stop_min_delta (--early_stop_mode max: upwards, min: downwards) writes
                               output_dir/best/: the weights as the final save writes them, that validation's grid
                               and best.json; run.json records best_step and best_metric
    patience                   --early_stop_patience N validations in a row without an improvement stop the run
                               (one line says why); 0 never stops
    divergence                 the training reward's validation mean rising while KEY worsens, over two validations
                               in a row: one line, in the log and in the model card

The state (the best value and its step, the validations waited, the last values for the divergence) is decided on the
main process, handed to every process (`Guard.state` / `restore`), and saved in checkpoint-N's counters, so a
resumed run stops where an unbroken one does, with the same best/.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from refl_ddpo.core.errors import UserError
from refl_ddpo.run.runs import BEST_DIR, FINAL_FILES, RUN_FILE
from refl_ddpo.run.validation import VALIDATION_TOTAL

BEST_FILE = "best.json"


def check_guard(cfg) -> None:
    """Before any model loads: the --validation_reward spec and its files, --early_stop_* and --final_weights fit
    together (one line if not)."""
    if cfg.validation_reward:
        check_validation_reward(cfg)
    metric = cfg.early_stop_metric
    if metric is None:
        for name, default in (("early_stop_patience", 0), ("early_stop_min_delta", 0.0)):
            if getattr(cfg, name) != default:
                raise UserError(f"--{name} needs --early_stop_metric (the validation key to watch); set it.")
        if cfg.final_weights == "best":
            raise UserError(
                "--final_weights best needs --early_stop_metric (the key that says which is best)."
            )
        return
    if not cfg.validation_prompts_file:
        raise UserError(
            f"--early_stop_metric {metric} needs validation: set --validation_prompts_file (e.g. toy_world_heldout)."
        )
    known = known_keys(cfg)
    if metric not in known:
        raise UserError(
            f"--early_stop_metric {metric}: validation logs no such key with these flags; pick one of "
            f"{', '.join(known)}."
        )


def check_validation_reward(cfg) -> None:
    """--validation_reward parses (the grammar of --reward) and finds its files; it needs validation prompts."""
    from refl_ddpo.rewards import check_reward_files, parse_reward_spec

    if not cfg.validation_prompts_file:
        raise UserError(
            f"--validation_reward {cfg.validation_reward} scores the validation images: set "
            "--validation_prompts_file too."
        )
    try:
        parse_reward_spec(cfg.validation_reward)
        check_reward_files(cfg.validation_reward, cfg.reward_model_dir)
    except UserError as e:
        message = str(e)
        if message.startswith("--reward"):  # the flag the user set
            message = "--validation_reward" + message.removeprefix("--reward")
        raise UserError(message) from None


def reward_keys(spec: str, total: str) -> list[str]:
    """validation/<name>/mean|std of a reward spec (a weighted sum's total named `total`)."""
    from refl_ddpo.rewards import parse_reward_spec

    named = parse_reward_spec(spec)
    names = [named[0][0]] if len(named) == 1 and named[0][1] == 1.0 else [total, *(n for n, _ in named)]
    return [f"validation/{n}/{s}" for n in names for s in ("mean", "std")]


def known_keys(cfg) -> list[str]:
    """The keys a validation logs with these flags (drift: refl_ddpo.run.drift)."""
    from refl_ddpo.run.drift import DRIFT_NAMES, PREFIX

    keys = reward_keys(cfg.reward, "total")
    if cfg.validation_reward:
        keys += reward_keys(cfg.validation_reward, VALIDATION_TOTAL)
    return keys + [PREFIX + n for n in DRIFT_NAMES if n != "diversity" or cfg.num_validation_images > 1]


def validation_scorers(cfg, device, dtype) -> tuple:
    """(spec, reward) of --validation_reward, built once like the training reward, or nothing."""
    if not cfg.validation_reward or not cfg.validation_prompts_file:
        return ()
    from refl_ddpo.rewards import build_reward

    return (
        (cfg.validation_reward, build_reward(cfg.validation_reward, device, dtype, cfg.reward_model_dir)),
    )


def keeps_best(cfg) -> bool:
    """Whether the final folder holds best/'s weights (--final_weights, auto: when a metric is set)."""
    return cfg.final_weights == "best" or (cfg.final_weights == "auto" and cfg.early_stop_metric is not None)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


@dataclass
class Verdict:
    """What one validation decided: write best/, stop the run; the lines it said."""

    improved: bool = False
    stop: bool = False
    lines: list[str] = field(default_factory=list)


@dataclass
class Guard:
    """Early stopping on `metric` (see the module doc); `unit` names the count ("step" or "epoch")."""

    metric: str
    mode: str  # "max" or "min"
    patience: int
    min_delta: float
    unit: str
    keep_best: bool  # the final folder holds best/'s weights
    best_value: float | None = None
    best_count: int | None = None
    best_step: int | None = None  # the tracker step of the best validation
    waited: int = 0  # validations since the best without an improvement
    previous: list[float] | None = None  # (training reward mean, metric) of the last validation
    diverging: int = 0  # validations in a row where the training reward rose and the metric worsened
    notes: list[str] = field(default_factory=list)  # the stop and divergence lines, for the model card

    def state(self) -> dict:
        """The counters checkpoint-N keeps."""
        keys = ("best_value", "best_count", "best_step", "waited", "previous", "diverging", "notes")
        return {k: getattr(self, k) for k in keys}

    def restore(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, list(v) if isinstance(v, list) else v)

    def better(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best_value is None:
            return True
        gain = value - self.best_value if self.mode == "max" else self.best_value - value
        return gain > self.min_delta

    def observe(self, metrics: dict[str, float], count: int, step: int) -> Verdict:
        """The verdict of one validation's `metrics` (the training reward's first, then the validation rewards',
        then the drift monitors) after `count` iterations, logged at tracker `step`."""
        if self.metric not in metrics:
            raise UserError(
                f"--early_stop_metric {self.metric}: the validation after {self.unit} {count} logged no such key "
                f"(it logged {', '.join(metrics)})."
            )
        value = float(metrics[self.metric])
        verdict = Verdict()
        proxy = next(k for k in metrics if k.endswith("/mean"))
        self.diverge(float(metrics[proxy]), value, proxy, count, verdict)
        if self.better(value):
            self.best_value, self.best_count, self.best_step, self.waited = value, count, step, 0
            verdict.improved = True
            return verdict
        self.waited += 1
        if self.patience and self.waited >= self.patience:
            verdict.stop = True
            verdict.lines.append(self.stop_line())
            self.notes.append(verdict.lines[-1])
        return verdict

    def stop_line(self) -> str:
        kept = (
            f"kept {self.unit} {self.best_count}"
            if self.keep_best
            else f"kept the last weights (best/ holds {self.unit} {self.best_count})"
        )
        return (
            f"{self.metric} has not improved on {_fmt(self.best_value)} at {self.unit} {self.best_count} for "
            f"{self.waited} validations: stopped; {kept}"
        )

    def diverge(self, proxy_value: float, value: float, proxy: str, count: int, verdict: Verdict) -> None:
        """Count the validations where the training reward rose while the metric worsened; at two in a row, say so."""
        if self.previous is not None:
            before, gold_before = self.previous
            worse = value < gold_before if self.mode == "max" else value > gold_before
            self.diverging = self.diverging + 1 if proxy_value > before and worse else 0
            if self.diverging == 2:
                line = (
                    f"divergence at {self.unit} {count}: {proxy} rose to {_fmt(proxy_value)} while {self.metric} "
                    f"{'fell' if self.mode == 'max' else 'rose'} to {_fmt(value)} over the last two validations "
                    "(the training reward may be hacked)"
                )
                verdict.lines.append(line)
                self.notes.append(line)
        self.previous = [proxy_value, value]

    def best_record(self) -> dict:
        """best.json: the metric, its value, the step (and the epoch of an epoch trainer)."""
        record = {"metric": self.metric, "mode": self.mode, "value": self.best_value, "step": self.best_step}
        return {**record, self.unit: self.best_count}

    def card_lines(self) -> list[str]:
        """The model card's section on the guard."""
        held = "the best validation's (best/)" if self.keep_best else "the last ones"
        lines = [
            "## Early stopping and the best weights",
            "",
            (
                f"Watched `{self.metric}` ({self.mode}): best {_fmt(self.best_value)} at {self.unit} "
                f"{self.best_count}. The weights here are {held}."
            ),
            "",
        ]
        return lines + [f"- {note}" for note in self.notes] + ([""] if self.notes else [])


def make_guard(cfg, unit: str, state: dict | None) -> Guard | None:
    """The run's Guard (None without --early_stop_metric), its state restored from checkpoint-N's counters."""
    if cfg.early_stop_metric is None:
        return None
    guard = Guard(
        cfg.early_stop_metric,
        cfg.early_stop_mode,
        cfg.early_stop_patience,
        cfg.early_stop_min_delta,
        unit,
        keeps_best(cfg),
    )
    if state:
        guard.restore(state)
    return guard


def start_guard(output_dir: str | Path, guard: Guard, first: int) -> None:
    """A fresh run deletes an earlier attempt's best/; a resumed one records its best again in run.json (which
    start_run rewrote)."""
    import shutil

    if first == 0:
        shutil.rmtree(Path(output_dir) / BEST_DIR, ignore_errors=True)
    elif guard.best_count is not None:
        record_best(output_dir, guard)


def write_best_files(output_dir: str | Path, guard: Guard, grid: Path) -> None:
    """best/'s grid and best.json beside the weights written there, and run.json's best_step and best_metric."""
    import shutil

    from refl_ddpo.core.images import write_json_atomic

    folder = Path(output_dir) / BEST_DIR
    for old in folder.glob("*.png"):  # the grid of the best it replaces
        old.unlink()
    shutil.copyfile(grid, folder / grid.name)
    write_json_atomic(folder / BEST_FILE, {**guard.best_record(), "grid": grid.name})
    record_best(output_dir, guard)


def record_best(output_dir: str | Path, guard: Guard) -> None:
    """run.json's best_step (the tracker step), best_{unit} and best_metric (the value), and the metric's key."""

    run_file = Path(output_dir) / RUN_FILE
    record = json.loads(run_file.read_text()) if run_file.is_file() else {}
    record.update(best_step=guard.best_step, best_metric=guard.best_value, early_stop_metric=guard.metric)
    record[f"best_{guard.unit}"] = guard.best_count
    tmp = run_file.with_name(f".{RUN_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, run_file)


def best_folder(output_dir: str | Path, guard: Guard | None) -> Path | None:
    """best/ when the final folder should hold its weights and it holds this run's best, else None."""
    if guard is None or not guard.keep_best or guard.best_count is None:
        return None
    folder = Path(output_dir) / BEST_DIR
    try:
        record = json.loads((folder / BEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return folder if record.get(guard.unit) == guard.best_count else None


def copy_best(best: Path, output_dir: str | Path) -> None:
    """best/'s weights and config.json to the top of output_dir, as the final save would write them."""
    import shutil

    output_dir = Path(output_dir)
    for name in FINAL_FILES:
        if (best / name).is_dir():
            shutil.rmtree(output_dir / name, ignore_errors=True)
            shutil.copytree(best / name, output_dir / name)
        elif (best / name).is_file():
            shutil.copyfile(best / name, output_dir / name)


def guarded(run, result, done: int, step: int, save_weights) -> bool:
    """The guard's verdict on a validation (`result`, None off the main process), decided on the main process and
    handed to every process with the guard's state (an error too: no process is left waiting); best/ written on an
    improvement by `save_weights(run, folder)` (refl_ddpo.run.session's). Returns whether to stop."""
    from accelerate.utils import broadcast_object_list

    verdict, error = None, None
    if run.main:
        try:
            verdict = run.guard.observe({**result.metrics, **result.drift}, done, step)
        except UserError as e:
            error = str(e)
    verdict, error, state = broadcast_object_list([verdict, error, run.guard.state()])
    if error is not None:
        raise UserError(error)
    run.guard.restore(state)
    if verdict.improved:
        save_weights(run, Path(run.cfg.output_dir) / BEST_DIR)
        if run.main:
            write_best_files(run.cfg.output_dir, run.guard, result.grid)
    if run.main:
        from tqdm.auto import tqdm

        for line in verdict.lines:
            tqdm.write(line)
    return verdict.stop
