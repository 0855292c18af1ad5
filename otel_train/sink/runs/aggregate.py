"""Cross-rank aggregates: `train/loss/mean` (and min, max) per run and step.

A step is aggregated once every rank of `train.world_size` has reported at least one row for it,
or when `timeout_s` has passed since its first row (a slow or dead rank must not hold the series
back forever); then over the ranks that did report. Rows for a step already aggregated are late:
they are written per rank as usual and counted, but the aggregate is not rewritten. Runs with a
`train.world_size` of 1 get no aggregates (they would repeat the series).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from otel_train.vocab.rows import MetricRow, series_tag
from otel_train.vocab.run_identity import RunInfo

__all__ = ["Aggregator"]

_KINDS = frozenset({"gauge", "counter", "sum"})  # histogram stat rows are not averaged across ranks
_DONE_KEPT = 100_000  # aggregated steps remembered to recognise late rows


class _Step:
    __slots__ = ("first_seen", "ranks", "series", "time_unix_nano")

    def __init__(self, now: float) -> None:
        self.first_seen = now
        self.ranks: set[int] = set()
        # tag -> (name, extra attrs, {rank: value})
        self.series: dict[str, tuple[str, Any, dict[int, float]]] = {}
        self.time_unix_nano = 0


class Aggregator:
    """Aggregates of one run. Not thread-safe: the router calls it under the run's lock.

    Args:
        stats: Which aggregates, from ``mean``, ``min``, ``max``.
        timeout_s: Seconds after a step's first row at which it is aggregated without the missing ranks.
        clock: Monotonic clock (tests inject one).
    """

    def __init__(self, stats: Sequence[str], timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stats = tuple(stats)
        self.timeout_s = timeout_s
        self._clock = clock
        self._steps: dict[int, _Step] = {}
        self._done: dict[int, None] = {}  # insertion-ordered set
        self._world_size = 1
        self._run0: RunInfo | None = None
        self.late_rows = 0

    def add(self, rows: Sequence[MetricRow]) -> list[MetricRow]:
        """Take one request's rows; return the aggregate rows of every step now complete."""
        now = self._clock()
        touched: set[int] = set()
        for row in rows:
            run = row.run
            if row.kind not in _KINDS or run.world_size <= 1:
                continue  # a single-rank run has nothing to aggregate across
            self._world_size = max(self._world_size, run.world_size)
            if run.rank == 0 and self._run0 is None:
                self._run0 = run
            if row.step in self._done:
                self.late_rows += 1
                continue
            st = self._steps.get(row.step)
            if st is None:
                st = self._steps[row.step] = _Step(now)
            st.ranks.add(run.rank)
            st.time_unix_nano = max(st.time_unix_nano, row.time_unix_nano)
            entry = st.series.get(row.tag)
            if entry is None:
                entry = st.series[row.tag] = (row.name, row.attributes, {})
            entry[2][run.rank] = row.value
            touched.add(row.step)
            if self._run0 is None:
                self._run0 = dataclasses.replace(run, rank=0, local_rank=0, pid=0)
        out: list[MetricRow] = []
        for step in sorted(touched):
            st = self._steps[step]
            if len(st.ranks) >= self._world_size:
                out.extend(self._emit(step))
        return out

    def expire(self) -> list[MetricRow]:
        """Aggregate the steps whose timeout has passed."""
        now = self._clock()
        due = [s for s, st in self._steps.items() if now - st.first_seen >= self.timeout_s]
        out: list[MetricRow] = []
        for step in sorted(due):
            out.extend(self._emit(step))
        return out

    def drain(self) -> list[MetricRow]:
        """Aggregate every pending step (at shutdown or when the run is closed)."""
        out: list[MetricRow] = []
        for step in sorted(self._steps):
            out.extend(self._emit(step))
        return out

    @property
    def pending_steps(self) -> int:
        return len(self._steps)

    def _emit(self, step: int) -> list[MetricRow]:
        st = self._steps.pop(step)
        self._done[step] = None
        while len(self._done) > _DONE_KEPT:
            del self._done[next(iter(self._done))]
        run0 = self._run0
        out: list[MetricRow] = []
        if run0 is None:  # unreachable: set by the first row of any step
            return out
        for name, attrs, by_rank in st.series.values():
            values = list(by_rank.values())
            for stat in self.stats:
                if stat == "mean":
                    value = sum(values) / len(values)
                elif stat == "min":
                    value = min(values)
                else:
                    value = max(values)
                agg_name = f"{name}/{stat}"
                out.append(MetricRow(run0, step, agg_name, series_tag(agg_name, attrs), value, "gauge",
                                     st.time_unix_nano, dict(attrs)))
        return out
