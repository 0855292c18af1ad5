"""What an OTLP point means for its run's series: the sink's temporality and step rules, in one place.

Any OTel sender may send to the sink, and most use the SDK default, CUMULATIVE temporality: every
collection re-sends every series it ever saw (a point per ``train.step`` attribute set, so all past
steps again), each sum as its total since the series' start time. otel-train itself sends DELTA.
`SeriesLedger` turns both into the same rows, per (run, rank, series):

* **Counters** (monotonic sums) are shown as running totals. A DELTA point adds its value; one that
  arrives after a later step of its series was written (requests reordered by parallel collector
  consumers) is written at its own step with the total as of that step (the increases of the later steps
  it has seen are left out); the totals already written at those later steps lacked it and cannot be taken
  back: such points are counted (`late_delta_points`, and the rows they left short in `stale_totals`,
  shown in `/health`). A
  CUMULATIVE point adds its increase since the previous point of the same OTel series (name +
  attributes, ``train.step`` included) from the same sender (`service.instance.id`, else host and pid);
  a later start time, or a lower value at a later time, is a reset (a restarted process), so the whole
  value is new. Points are ordered by their own times, not by arrival: a point older than the one
  already applied (an earlier time, or an earlier start time) is late and changes nothing. A point that
  adds nothing to an already-written series is a repeat and is not written again. Two senders on one
  series are counted as a collision (`collisions`, shown in `/health`): their increases add up.
* **Up-down counters** (non-monotonic sums) are running totals in both temporalities, like counters
  (a CUMULATIVE point adds its change since the previous point, which may be negative; only a new
  start time is a reset), so one program gives the same rows either way. A NaN or ±inf sum point is
  counted (`nan_points`) and skipped, never added.
* **Gauges** (and up-down values, summary quantiles): written once per (series, step, value); a
  re-sent unchanged point is not written again (a NaN is the same value as a NaN of the same bits).
* **Histograms** (explicit and exponential) and **summaries**: CUMULATIVE points become the
  increase since the previous point (count, sum and buckets), the shape DELTA points already have;
  an unchanged point is a repeat. ``/count`` and ``/sum`` are per collection window either way;
  ``/min`` and ``/max`` run since the series' start either way (DELTA ones are combined).
* **Step-less points** (no ``train.step``) take the run's current step (the highest step any rank of
  the run has reported) when the run has steps, else a per-series sequence number 0, 1, 2, ...; the
  point's own time stays its wall time.

State is bounded: each table is cleared when it reaches its size limit (a repeat is then written
again at worst; totals are kept apart and bounded by the number of series).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

from otel_train.collect.sdk_rows import MetricsConverter
from otel_train.rows import ExponentialBuckets, HistogramRow, MetricRow, explicit_buckets

__all__ = [
    "CUMULATIVE_COUNTER",
    "CUMULATIVE_UPDOWN",
    "DELTA_SUM",
    "GAUGE",
    "STEPLESS",
    "SeriesLedger",
    "exponential_buckets",
]

#: Step of a decoded point that had no `train.step`: resolved by `SeriesLedger.resolve_step`.
STEPLESS = -(1 << 62)

_float_bits = struct.Struct("<d").pack


def _same_value(written: float | None, value: float) -> bool:
    """Whether a gauge value equals the one written: NaN equals a NaN of the same bit pattern (NaN != NaN)."""
    return written == value or (written is not None and math.isnan(value)
                                and _float_bits(written) == _float_bits(value))


# How a pending number point is turned into a row (see the module docstring).
GAUGE, DELTA_SUM, CUMULATIVE_COUNTER, CUMULATIVE_UPDOWN = range(4)

# Entries per table and run (~200 bytes each): covers the full re-send of 100 metrics at the OTel SDK's
# default cardinality limit (2,000 attribute sets, i.e. steps, per metric).
_MAX_ENTRIES = 200_000
# Recent steps of a DELTA sum series whose increases are kept, to give a late point the total at its own step.
_DELTA_STEPS = 128


def exponential_buckets(scale: int, zero_count: int, positive: tuple[int, Sequence[int]],
                        negative: tuple[int, Sequence[int]]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Explicit (bounds, counts) of an OTLP exponential histogram, for backends that draw histograms.

    Bucket ``i`` (``offset + i``) covers ``(base**i, base**(i+1)]`` with ``base = 2**(2**-scale)``;
    negative buckets mirror it; the zero bucket sits between. Each explicit bucket ends at the upper
    edge of its exponential bucket; the first explicit bucket is open below, the last (empty) above.

    Example:
        >>> exponential_buckets(0, 1, (0, [2, 3]), (0, []))
        ((0.0, 2.0, 4.0), (1, 2, 3, 0))
    """

    return explicit_buckets(ExponentialBuckets(scale, zero_count, positive[0], tuple(positive[1]), negative[0],
                                               tuple(negative[1])))


def _combine(pick: Callable[[float, float], float], a: float, b: float) -> float:
    """`pick` (min or max) of two optional values (NaN: absent)."""
    return b if math.isnan(a) else a if math.isnan(b) else pick(a, b)


class SeriesLedger(MetricsConverter):
    """One run's series state: running totals, previous cumulative points, steps and sequence numbers.

    The router keeps one per run and calls it with the run's lock held, in arrival order.
    """

    def __init__(self, max_entries: int = _MAX_ENTRIES) -> None:
        super().__init__()
        self._max = max_entries
        # (rank, sender, tag, step) -> (start time, value, time) of the newest cumulative point applied
        self._cumulative: dict[tuple[int, str, str, int], tuple[int, float, int]] = {}
        self._written: dict[tuple[int, str, int], float] = {}  # last value of step-less series
        self._hists: dict[tuple[int, str, str, int],
                          tuple[int, int, float, tuple[float, ...], tuple[int, ...], int]] = {}
        self._extremes: dict[tuple[int, str, str, int], tuple[float, float]] = {}  # DELTA histograms' min, max
        self._senders: dict[tuple[int, str], str] = {}  # (rank, tag) -> first sender of a cumulative series
        #: Cumulative points of a series from a second sender (two processes on one run and rank).
        self.collisions = 0
        #: The first few series with two senders, for the log and `/runs`.
        self.collided: list[str] = []
        #: Cumulative points older than the one already applied (reordered by the network): not applied.
        self.late_points = 0
        #: Sum points whose value was NaN: not added to the running total.
        self.nan_points = 0
        #: DELTA sum points that arrived after a later step of their series was written.
        self.late_delta_points = 0
        #: Rows written before such a point whose running total lacked it (written once, not rewritten).
        self.stale_totals = 0
        # (rank, tag) -> [highest step, {step: increase} of the series' recent steps (the highest `_DELTA_STEPS`)]
        self._delta_steps: dict[tuple[int, str], list[Any]] = {}
        self._sequence: dict[tuple[int, str], int] = {}
        self._gauges: dict[int, dict[tuple[str, int], float]] = {}  # by rank: (tag, step) -> value written
        self._gauge_entries = 0
        #: The highest step any rank of the run has reported (-1: none yet).
        self.current_step = -1

    # -- steps -----------------------------------------------------------------------------------
    def saw_step(self, step: int) -> None:
        self.current_step = max(self.current_step, step)

    def resolve_step(self, rank: int, tag: str) -> int:
        """The step of a step-less point of a series: the run's current step, else its sequence number."""
        if self.current_step >= 0:
            return self.current_step
        key = (rank, tag)
        n = self._sequence.get(key, 0)
        if len(self._sequence) >= self._max:
            self._sequence.clear()
        self._sequence[key] = n + 1
        return n

    # -- number points -----------------------------------------------------------------------------
    def gauges(self, rows: list[MetricRow], append: Callable[[MetricRow], None]) -> None:
        """Gauge rows with a step, the sink's hot path: `append` those not written before with their value."""
        tables = self._gauges
        room = self._max - self._gauge_entries  # one bound for all ranks of the run
        rank = -1
        written: dict[tuple[str, int], float] = {}
        for row in rows:
            if row.run.rank != rank:
                rank = row.run.rank
                written = tables.get(rank) or tables.setdefault(rank, {})
            key = (row.tag, row.step)
            value = row.value
            prev = written.get(key)
            if prev == value or (prev is not None and _same_value(prev, value)):
                continue  # re-sent unchanged
            if room <= 0:
                for table in tables.values():
                    table.clear()
                room = self._max
            room -= 1
            written[key] = value
            append(row)
        self._gauge_entries = self._max - room

    def _sender(self, rank: int, tag: str, sender: str) -> None:
        key = (rank, tag)
        first = self._senders.get(key)
        if first is None:
            self._remember(self._senders, key, sender)
        elif first != sender:
            self.collisions += 1
            if len(self.collided) < 10 and tag not in self.collided:
                self.collided.append(tag)

    def _late(self, prev: tuple[int, float, int] | None, start: int, t: int) -> bool:
        """Whether a cumulative point is older than the one applied before it (by start time, then time)."""
        if prev is not None and (start < prev[0] or (start == prev[0] and t < prev[2])):
            self.late_points += 1
            return True
        return False

    def number(self, row: MetricRow, mode: int, start_unix_nano: int, sender: str = "") -> bool:
        """Apply the rule of `mode` to `row` (its value, and its step if step-less); False: not written."""
        rank = row.run.rank
        stepless = row.step == STEPLESS
        if mode != GAUGE and not math.isfinite(row.value):
            self.nan_points += 1  # a NaN or ±inf would be the running total for the rest of the run
            return False
        if mode == DELTA_SUM:
            if stepless:
                row.step = self.resolve_step(rank, row.tag)
            row.value = self._delta(row)
            return True
        if mode in (CUMULATIVE_COUNTER, CUMULATIVE_UPDOWN):
            key = (rank, sender, row.tag, row.step)
            prev = self._cumulative.get(key)
            value = row.value
            t = row.time_unix_nano
            if self._late(prev, start_unix_nano, t):
                return False
            self._sender(rank, row.tag, sender)
            if prev is None or prev[0] != start_unix_nano or (mode == CUMULATIVE_COUNTER and value < prev[1]):
                increase = value  # a new series or a reset (restarted process): all of it is new
            else:
                increase = value - prev[1]  # an up-down counter may go down
                if increase == 0.0:
                    return False  # a repeat of an unchanged cumulative point
            self._remember(self._cumulative, key, (start_unix_nano, value, t))
            if stepless:
                row.step = self.resolve_step(rank, row.tag)
            row.value = self.accumulate(row.run, row.tag, increase, True)
            return True
        # GAUGE: the value itself, once per (series, step, value)
        if stepless:
            last = self._written.get((rank, row.tag, STEPLESS))
            if _same_value(last, row.value) and self.current_step < 0:
                return False  # an unchanged step-less value re-sent with no step to tell it apart
            self._remember(self._written, (rank, row.tag, STEPLESS), row.value)
            row.step = self.resolve_step(rank, row.tag)
        out: list[MetricRow] = []
        self.gauges([row], out.append)
        return bool(out)

    def _delta(self, row: MetricRow) -> float:
        """The running total of a DELTA sum at the row's own step, also when a later step came first."""
        key = (row.run.rank, row.tag)
        entry = self._delta_steps.get(key)
        if entry is None:
            if len(self._delta_steps) >= self._max:
                self._delta_steps.clear()
            entry = self._delta_steps[key] = [-1, {}]
        top, steps = entry
        step = row.step
        total = self.accumulate(row.run, row.tag, row.value, True)
        steps[step] = steps.get(step, 0.0) + row.value
        if len(steps) > 2 * _DELTA_STEPS:  # keep the recent steps: late points come a few requests late
            for s in sorted(steps)[:-_DELTA_STEPS]:
                del steps[s]
        if step >= top:
            entry[0] = step
            return total
        later = [v for s, v in steps.items() if s > step]
        self.late_delta_points += 1
        self.stale_totals += len(later)
        return float(total - sum(later))

    # -- histograms and summaries --------------------------------------------------------------------
    def histogram(self, row: HistogramRow, cumulative: bool, start_unix_nano: int,
                  sender: str = "") -> HistogramRow | None:
        """The increase of a histogram point since its series' previous one, or None for a repeat.

        DELTA points are returned as they are (their step resolved if step-less).
        """
        rank = row.run.rank
        if cumulative:
            key = (rank, sender, row.tag, row.step)
            prev = self._hists.get(key)
            if prev is not None and self._late((prev[0], 0.0, prev[5]), start_unix_nano, row.time_unix_nano):
                return None
            self._sender(rank, row.tag, sender)
            self._remember(self._hists, key, (start_unix_nano, row.count, row.sum, tuple(row.explicit_bounds),
                                              tuple(row.bucket_counts), row.time_unix_nano))
            if prev is not None and prev[0] == start_unix_nano and row.count >= prev[1]:
                if row.count == prev[1]:
                    return None  # a repeat
                buckets = row.bucket_counts
                if prev[3] == tuple(row.explicit_bounds) and len(prev[4]) == len(buckets):
                    buckets = tuple(b - a for a, b in zip(prev[4], buckets, strict=True))
                row = HistogramRow(row.run, row.step, row.name, row.tag, row.count - prev[1], row.sum - prev[2],
                                   row.min, row.max, row.explicit_bounds, buckets, row.time_unix_nano,
                                   row.attributes)
        elif not (math.isnan(row.min) and math.isnan(row.max)):
            # DELTA min/max are per window, CUMULATIVE ones since the series' start: keep the latter in both
            # (a window's min cannot be told from cumulative points; a running min can be from DELTA ones).
            key = (rank, sender, row.tag, row.step)
            seen = self._extremes.get(key)
            if seen is not None:
                row = dataclasses.replace(row, min=_combine(min, seen[0], row.min),
                                          max=_combine(max, seen[1], row.max))
            self._remember(self._extremes, key, (row.min, row.max))
        if row.step == STEPLESS:
            row.step = self.resolve_step(rank, row.tag)
        return row

    def compact(self) -> None:
        """Forget which gauge values were written (the bulk of the state) when the run closes; totals and
        previous cumulative points stay, so a resumed run continues its counters."""
        self._gauges.clear()
        self._gauge_entries = 0
        self._written.clear()
        self._delta_steps.clear()

    def _remember(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        if len(table) >= self._max and key not in table:
            table.clear()
        table[key] = value
