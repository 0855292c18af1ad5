"""Helpers shared by the run-based backends (W&B, ClearML, Trackio, MLflow).

These backends keep one *run* per training run, so they share the same questions: which ranks to
write, how a rank > 0 series is keyed, how rows are grouped into steps, which steps a resumed run
must not write again, and what the hyperparameters look like. Nothing here imports a backend.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from otel_train._internal.ratelimit import LogOnce
from otel_train.config.exporter_options import ExporterOptions
from otel_train.vocab.rows import LogRow, series_tag
from otel_train.vocab.run_identity import CONFIG_HASH, RUN_ID, RunInfo, config_hash
from otel_train.vocab.run_paths import run_folder as records_run_folder
from otel_train.vocab.semconv import display_name

__all__ = [
    "StepGate",
    "bounded",
    "by_step",
    "flatten",
    "histogram_bins",
    "hparams_for",
    "rank_tag",
    "run_folder",
    "safe_name",
    "series_name",
    "wanted",
]

_logger = logging.getLogger(__name__)

_RowT = TypeVar("_RowT")

#: The key under which the rank goes into the series suffix (`train/loss{rank=1}`).
RANK_SUFFIX_KEY = "rank"


def histogram_bins(row: Any, max_bins: int) -> tuple[list[int], list[float]] | None:
    """(counts, edges) of an explicit-bucket `HistogramRow`, the outer edges at its min and max.

    None when it cannot be drawn (no buckets, inconsistent counts, too many bins, empty).
    """
    counts = list(row.bucket_counts)
    bounds = list(row.explicit_bounds)
    if not counts or len(counts) != len(bounds) + 1 or len(counts) > max_bins or row.count == 0:
        return None
    low = min(row.min, bounds[0]) if bounds else row.min
    high = max(row.max, bounds[-1]) if bounds else row.max
    if high <= low:
        high = low + 1.0
    return counts, [low, *bounds, high]


def wanted(options: ExporterOptions, run: RunInfo) -> bool:
    """Whether rows of `run` (one rank) are written: rank 0 always; other ranks only with `all`."""
    return run.rank == 0 or options.ranks == "all"


#: The folder of a run's files where backends without a place of their own for text keep log records (MLflow's
#: artifacts, W&B's run files).
LOGS_FOLDER = "otel-train-logs"


def log_line(row: LogRow) -> str:
    """One log record as a line of text (with its traceback, if any, below it).

    Example:
        >>> log_line(LogRow(RunInfo("r", "r"), 3, 0, 13, "WARNING", "loss spiked", "train"))
        '[step 3] WARNING train: loss spiked\\n'
    """
    step = "-" if row.step is None else row.step
    line = f"[step {step}] {row.severity_text} {row.logger}: {row.body}\n"
    stack = row.attributes.get("exception.stacktrace")
    return f"{line}{stack.rstrip()}\n" if isinstance(stack, str) and stack else line


def logs_by_rank(options: ExporterOptions, rows: Iterable[LogRow]) -> dict[tuple[str, int], tuple[RunInfo, list[LogRow]]]:
    """The log records a backend writes (`wanted`), per (run id, rank), in order."""
    out: dict[tuple[str, int], tuple[RunInfo, list[LogRow]]] = {}
    for row in rows:
        if wanted(options, row.run):
            out.setdefault((row.run.run_id, row.run.rank), (row.run, []))[1].append(row)
    return out


def series_name(tag: str, name: str) -> str:
    """The name part of `tag`: `name`, or its display name where routing showed it so (`train/step_duration_s`).

    Example:
        >>> series_name("train/step_duration_s", "train.step.duration_s"), series_name("a{k=v}", "a")
        ('train/step_duration_s', 'a')
    """
    shown = display_name(name)
    return shown if shown != name and tag.startswith(shown) else name


def rank_tag(tag: str, name: str, attributes: Mapping[str, Any], rank: int) -> str:
    """`tag` for rank 0; for rank N > 0 the same series with `rank=N` added to its suffix.

    The name part stays as rank 0 shows it (a built-in series under its display name on every rank).

    Example:
        >>> rank_tag("eval/acc{split=val}", "eval/acc", {"split": "val"}, 2)
        'eval/acc{rank=2,split=val}'
        >>> rank_tag("train/step_duration_s", "train.step.duration_s", {}, 1)
        'train/step_duration_s{rank=1}'
    """
    if rank == 0:
        return tag
    return series_tag(series_name(tag, name), {**attributes, RANK_SUFFIX_KEY: rank})


def by_step(rows: Iterable[_RowT]) -> Iterator[tuple[int, list[_RowT]]]:
    """Rows grouped by `row.step`, in increasing step order (stable within a step)."""
    groups: dict[int, list[_RowT]] = {}
    for row in rows:
        groups.setdefault(row.step, []).append(row)  # type: ignore[attr-defined]
    for step in sorted(groups):
        yield step, groups[step]


class StepGate:
    """Decides which steps a backend may still write, per key (usually the rank).

    `floor` is the last step the backend already holds for a resumed run: rows at or below it are
    dropped, so a job restarted from a checkpoint does not write a step twice. With `monotonic`
    (W&B), a step older than the last one written is dropped too, because the backend would reject
    it with a warning per call. Every drop is counted; one warning per reason is logged.

    Example:
        >>> gate = StepGate("wandb", monotonic=True)
        >>> gate.set_floor(0, 4)
        >>> [gate.admit(0, s) for s in (3, 5, 5, 4, 6)]
        [False, True, True, False, True]
        >>> gate.dropped
        2
    """

    def __init__(self, backend: str, monotonic: bool) -> None:
        self._backend = backend
        self._monotonic = monotonic
        self._last: dict[Any, int] = {}
        self._floor: dict[Any, int] = {}
        self._series_floors: dict[Any, dict[str, int]] = {}
        self._log = LogOnce(_logger)
        self.dropped = 0
        #: Rows skipped because the backend holds their series at that step already (a series floor): not a loss.
        self.held = 0

    def set_floor(self, key: Any, step: int | None) -> None:
        if step is not None and step >= 0:
            self._floor[key] = max(step, self._floor.get(key, -1))

    def set_series_floors(self, key: Any, floors: Mapping[str, int]) -> None:
        """The last step the backend holds of each series of `key` (a resumed run whose store says so per series):
        a row given its series (`admit`'s `series`) is then dropped only at or below its own series' last step. The
        highest step of any series (`set_floor`) would cost a series that lags the others (another series logged
        ahead with ``step=``) the steps between them."""
        self._series_floors[key] = dict(floors)

    def floor(self, key: Any) -> int:
        return self._floor.get(key, -1)

    def last(self, key: Any) -> int:
        return self._last.get(key, -1)

    def admit(self, key: Any, step: int, rows: int = 1, series: str | None = None) -> bool:
        """True when `step` may be written for `key` (of `series`, where the rows are of one series); records it as
        written. A refused step counts `rows` (the rows it held) in `held` when the series' own floor refused it
        (the backend holds it), else in `dropped` (the highest step of any series: a lagging series' row is lost)."""
        floor = self._floor.get(key, -1)
        floors = self._series_floors.get(key) if series is not None else None
        if floors is not None:
            floor = floors.get(series, -1)  # type: ignore[arg-type]  # with `floors`, a series was given
        if step <= floor and floors is not None:
            self.held += rows
            self._log.warning(
                f"held-{key}",
                "%s: skipping rows a resumed run already holds (series at or below their last stored step, here "
                "%d); counted in `steps_held`, warned once",
                self._backend, floor,
            )
            return False
        if step <= floor:
            self.dropped += rows
            self._log.warning(
                f"floor-{key}",
                "%s: dropping rows for step %d and older of a resumed run (the run already holds steps "
                "up to %d); counted in `steps_dropped`, warned once",
                self._backend, step, floor,
            )
            return False
        last = self._last.get(key, -1)
        if self._monotonic and step < last:
            self.dropped += rows
            self._log.warning(
                f"late-{key}",
                "%s: dropping rows for step %d that arrived after step %d: the run has one step axis and "
                "cannot store an older step, so a row of another series below it lands in the other "
                "backends only (under every OTEL_TRAIN_STEP_ORDER); counted in `steps_dropped`, warned once",
                self._backend, step, last,
            )
            return False
        if step > last:
            self._last[key] = step
        return True


def flatten(mapping: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested mappings as one level, keys joined by `sep` (for stores with flat params).

    Example:
        >>> flatten({"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 1})
        {'optim/lr': 0.1, 'optim/betas': [0.9, 0.99], 'seed': 1}
    """
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        full = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, full, sep))
        else:
            out[full] = value
    return out


def hparams_for(options: ExporterOptions, run: RunInfo) -> dict[str, Any]:
    """The hyperparameters a backend stores once per run, with `train.config.hash` and the run id."""
    params: dict[str, Any] = dict(options.hparams or {})
    digest = run.config_hash or config_hash(options.hparams)
    if digest:
        params[CONFIG_HASH] = digest
    params.setdefault(RUN_ID, run.run_id)
    return params


_UNSAFE = re.compile(r"[^\w.\-]+")


def safe_name(text: str, limit: int = 128) -> str:
    """`text` with anything but letters, digits, `_`, `.` and `-` replaced by `-` (ids, file names)."""
    cleaned = _UNSAFE.sub("-", text).strip("-.") or "run"
    return cleaned[:limit]


def run_folder(options: ExporterOptions, run: RunInfo) -> Path:
    """The run's folder under the otel-train directory (the same one TensorBoard writes)."""
    return records_run_folder(options.directory, run.run_name)


def bounded(values: Sequence[_RowT], size: int) -> Iterator[Sequence[_RowT]]:
    """`values` in chunks of at most `size` (for backends with per-call limits)."""
    for start in range(0, len(values), size):
        yield values[start:start + size]
