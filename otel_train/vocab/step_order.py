"""The step-order policy: one rule, for every backend and the sink, for a step that goes backwards.

A series is one tag of one rank of one run. A row whose step is lower than the last step already
seen for its series "goes backwards" (equal steps are fine: several `log` calls in one step).
`OTEL_TRAIN_STEP_ORDER` says what happens to it:

- ``warn`` (default): counted, warned (at most once a minute per backend), and written as given by the backends
  that hold an older step as it was logged (JSONL, MLflow, ClearML, Trackio). TensorBoard and W&B cannot
  (`stores_older=False`): TensorBoard's reader takes a step going back for a restart and hides the series' later
  steps that were already logged, W&B drops it. They skip the row instead, counted with the drops: both show the
  series as first logged. A declared restart (`ot.resume`) is not a step going backwards (`restart`).
- ``drop``: dropped by every backend (each keeps its own per-series table, so a row is counted and
  warned once per backend), at most once a minute per backend. Every backend then shows the same points.
- ``raise``: on the training thread, `ot.step(i)` below the latest step entered, and `ot.log(...,
  step=s)` below it, raise `StepOrderError` (API misuse, raised where the mistake is made, before
  anything is recorded). Rows that still go backwards later (raw OTel instruments with their own
  `train.step`, other processes through the sink) cannot raise anywhere useful: they are dropped
  as under ``drop``.

Spans are not filtered: a span's step is an attribute on a timeline, not a point on a curve.

This module runs wherever windows reach backends (the training process, the exporter process,
the sink), so it imports nothing but `records`-level types.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from otel_train._internal.ratelimit import LogOnce

__all__ = ["POLICIES", "StepOrder"]

_logger = logging.getLogger(__name__)

POLICIES = ("warn", "drop", "raise")
_MAX_SERIES = 1_000_000  # remembered series before the memory is reset (bounded; a reset forgets, never drops)

_RowT = TypeVar("_RowT")


class StepOrder:
    """Applies the step-order policy to the rows of successive windows.

    Args:
        policy: ``warn``, ``drop`` or ``raise`` (see the module docstring).
        backend: Name used in the warning.
        stores_older: Whether the backend holds a row going backwards as logged; False: it drops such rows
            under ``warn`` too.

    Example:
        >>> from otel_train.vocab.rows import MetricRow
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> run = RunInfo("r", "r")
        >>> rows = [MetricRow(run, s, "loss", "loss", float(s), "gauge", 0) for s in (1, 2, 0, 3)]
        >>> order = StepOrder("drop")
        >>> [r.step for r in order.filter(rows)]
        [1, 2, 3]
        >>> order.backwards, order.dropped
        (1, 1)
    """

    def __init__(self, policy: str = "warn", backend: str = "otel-train", stores_older: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"step order policy {policy!r} is not allowed; use one of {', '.join(POLICIES)}")
        self.policy = policy
        self._backend = backend
        self._drop = policy != "warn" or not stores_older
        self._last: dict[tuple[str, int], dict[str, int]] = {}  # (run id, rank) -> tag -> last step
        self._series = 0
        self._log = LogOnce(_logger, interval_s=60.0)
        #: Rows whose step went backwards in their series (under every policy).
        self.backwards = 0
        #: Of those, rows kept from every backend (``drop`` and ``raise``).
        self.dropped = 0

    def restart(self, run_id: str, rank: int) -> None:
        """Forget the steps seen for one rank of one run: it restarts (a resume), so the steps that follow
        do not go backwards."""
        self._last.pop((run_id, rank), None)

    def counts(self) -> dict[str, int]:
        """The counters, for a shutdown summary or self-telemetry."""
        return {"backwards": self.backwards, "dropped": self.dropped}

    def skip(self, run_id: str, rank: int, tag: str, step: int, prev: int) -> None:
        """Count and warn about a row a backend that cannot store an older step leaves out before it reaches
        `filter`: a second value at step `step` of a series that had reached `prev` (the sink's reorder hold
        holding both; `otel_train.sink.runs.reorder`)."""
        self.backwards += 1
        self.dropped += 1
        self._warn((run_id, rank, tag), step, prev)

    def filter(self, rows: Sequence[_RowT]) -> Sequence[_RowT]:
        """`rows` less those the policy drops; remembers each series' latest step.

        Returns `rows` itself when nothing is dropped (no copy on the common path).
        """
        if self._series > _MAX_SERIES:
            self._last.clear()
            self._series = 0
        kept: list[_RowT] | None = None
        run: Any = None
        last: dict[str, int] = {}
        for i, row in enumerate(rows):
            r: Any = row
            if r.run is not run:  # rows come in long stretches of one rank: one lookup per stretch
                run = r.run
                last = self._last.setdefault((run.run_id, run.rank), {})
            tag, step = r.tag, r.step
            prev = last.get(tag)
            if prev is None or step >= prev:
                if prev is None:
                    self._series += 1
                last[tag] = step
                if kept is not None:
                    kept.append(row)
                continue
            self.backwards += 1
            if self._drop:
                self.dropped += 1
                if kept is None:
                    kept = list(rows[:i])
            elif kept is not None:
                kept.append(row)
            self._warn((run.run_id, run.rank, tag), step, prev)
        return rows if kept is None else kept

    def _warn(self, key: tuple[str, int, str], step: int, prev: int) -> None:
        run_id, rank, tag = key
        if self.policy != "warn":
            what = "dropped from every backend"
        elif self._drop:
            what = ("not written here (this backend would hide or drop it; JSONL, MLflow, ClearML and Trackio keep "
                    "it; declare a restart with otel_train.resume(step))")
        else:
            what = "written as given (TensorBoard and W&B skip it, counted)"
        self._log.warning(
            "backwards",
            "%s: series %r (run %s, rank %d) went back to step %d after step %d: %s "
            "(OTEL_TRAIN_STEP_ORDER=%s; %d row(s) so far, logged at most once a minute)",
            self._backend, tag, run_id, rank, step, prev, what, self.policy, self.backwards,
        )
