"""What an OTLP point means for its run's series: the sink's temporality and step rules, in one place.

Any OTel sender may send to the sink, and most use the SDK default, CUMULATIVE temporality: every
collection re-sends every series it ever saw (a point per ``train.step`` attribute set, so all past
steps again), each sum as its total since the series' start time. otel-train itself sends DELTA.
`SeriesLedger` turns both into the same rows, per (run, rank, series):

* **Counters** (monotonic sums) are shown as running totals. A DELTA point adds its value; one that
  arrives after a later step of its series was written (requests reordered by parallel collector
  consumers) is written at its own step with the total as of that step (the increases of the later steps
  it has seen are left out); the totals already written at those later steps lacked it: the series'
  highest step is written once more with the whole total (unless a higher step in the same request carries
  it), so the series ends at the true total in every backend. Such points are counted
  (`late_delta_points`, and the rows they left short in `stale_totals`, shown in `/health`). A
  CUMULATIVE point adds its increase since the previous point of the same OTel series (name +
  attributes, ``train.step`` included) from the same sender (`service.instance.id`, else host and pid);
  a later start time, or a lower value at a later time, is a reset (a restarted process), so the whole
  value is new; a new sender takes the series over where the previous one stopped. Points are ordered by
  their own times, not by arrival: a point older than the one already applied (an earlier time, or an
  earlier start time) is late and changes nothing. A point that adds nothing to an already-written series
  is a repeat and is not written again. Two senders sending one series at once (an earlier sender's point
  after another's) are counted as a collision (`collisions`, shown in `/health`: a point each time the
  sender changes back): their increases add up.
* **Up-down counters** (non-monotonic sums) are running totals in both temporalities, like counters
  (a CUMULATIVE point adds its change since the previous point, which may be negative; only a new
  start time is a reset), so one program gives the same rows either way (but for a collection whose net change
  is 0: a DELTA row of 0; CUMULATIVE cannot tell it from a re-send, so no row). A NaN or ±inf sum point is
  counted (`nan_points`) and skipped, never added.
* **Gauges** (and up-down values, summary quantiles): written once per (series, step, value); a
  re-sent unchanged point is not written again (a NaN is the same value as a NaN of the same bits). A point
  older than the newest point of its series applied (an earlier time: a collector's retry arriving after a later
  export) is late: it changes no value already written (a step that has one, or a step-less point) and is
  counted in `late_points`; at a step that has no value yet it is written.
* **Histograms** (explicit and exponential) and **summaries**: CUMULATIVE points become the
  increase since the previous point (count, sum and buckets), the shape DELTA points already have;
  an unchanged point is a repeat. ``/count`` and ``/sum`` are per collection window either way;
  ``/min`` and ``/max`` run since the series' start either way (DELTA ones are combined).
* **Step-less points** (no ``train.step``) take the run's current step (the highest step any rank of
  the run has reported) when the run has steps, else a per-series sequence number 0, 1, 2, ...; the
  point's own time stays its wall time.

Retries are idempotent: a DELTA point is applied once per (series, step, sender, start time, time), a span
once per (trace id, span id), a log record once per its key (`otel_train.sink.runs.log_keys`), so a request sent
again after a lost acknowledgement changes nothing.

State is bounded by series x a window of recent steps (`_WINDOW_STEPS`), never cleared wholesale: a point
further below its series' highest step than the window is not applied (`window_skipped`), as the step order
rule would have it. The state is made durable with the run's spool (`otel_train.sink.runs.state`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

from otel_train.collect.sdk_rows import MetricsConverter
from otel_train.sink.runs.log_keys import log_key
from otel_train.vocab.rows import (
    ExponentialBuckets,
    HistogramRow,
    LogRow,
    MetricRow,
    SpanRow,
    explicit_buckets,
)
from otel_train.vocab.run_identity import RunInfo

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

# Series per per-series table and run (the step-less tables, first senders): ~200 bytes each.
_MAX_ENTRIES = 200_000
# Steps below its highest that a series remembers (gauge values written, cumulative points, DELTA increases):
# more than the OTel SDK's default cardinality limit (2,000 attribute sets, i.e. steps, per metric), so a
# cumulative sender's re-send of every past step is recognised whole.
_WINDOW_STEPS = 4096
# Span ids remembered per run to recognise a retried request (~100 bytes each).
_MAX_SPANS = 100_000
# Log record keys remembered per run, likewise (~100 bytes each).
_MAX_LOGS = 100_000
_MISSING: Any = object()
_LOW_64 = (1 << 64) - 1
_NO_FLOOR = -(1 << 64)
_SENDERS_KEPT = 4  # senders remembered per cumulative series (the latest): enough to tell a collision  # below every step: a series with nothing out of its window


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

    The router keeps one per run and calls it with the run's lock held, in arrival order. Every table keyed by
    step keeps a window of the `window_steps` most recent steps of each series (its highest step seen, less
    the window): a point further below is not applied (counted in `window_skipped`), so the state is bounded by
    series x window and never cleared wholesale. With `persistent`, every change between `begin` and
    `commit` is recorded (`changes`), so the caller can write it next to the run's spool (`otel_train.sink.
    run_state`) or undo it (`rollback`) when the request cannot be made durable.
    """

    def __init__(self, max_entries: int = _MAX_ENTRIES, window_steps: int = _WINDOW_STEPS,
                 persistent: bool = False) -> None:
        super().__init__()
        self._max = max_entries  # per-series tables (one entry per series, not per step)
        self._window = window_steps
        self.persistent = persistent
        # Tables by id (`_TABLES`); the step-keyed ones are keyed (rank, tag, step, ...).
        self._sums: dict[tuple[int, str], float] = {}  # running totals
        self._tops: dict[tuple[int, str], int] = {}  # the highest step of each series
        # Gauge values written, per series: rank -> tag -> {step: value}. Kept apart from `_tables`: a lookup per
        # series (by its tag's cached hash) and a small int key per point on the hot path; no key tuple held.
        self._gauges: dict[int, dict[str, dict[int, float]]] = {}
        self._gauge_entries = 0  # steps held in `_gauges` (all series), for the prune trigger
        # (rank, tag) -> the step at or below which a gauge value is out of the window (set when pruning; only
        # series with steps that far below their highest)
        self._floors: dict[tuple[int, str], int] = {}
        # (rank, tag, step, sender) -> (start time, value, time) of the newest cumulative point applied
        self._cumulative: dict[tuple[int, str, int, str], tuple[int, float, int]] = {}
        self._hists: dict[tuple[int, str, int, str],
                          tuple[int, int, float, tuple[float, ...], tuple[int, ...], int]] = {}
        self._extremes: dict[tuple[int, str, int, str], tuple[float, float]] = {}  # DELTA histograms' min, max
        self._deltas: dict[tuple[int, str, int], float] = {}  # DELTA sums' increase per step (late points)
        self._delta_seen: dict[tuple[int, str, int, str, int, int], int] = {}  # DELTA points applied: retries
        self._spans: dict[tuple[int, int, int], int] = {}  # (trace id high, low, span id) of spans taken: retries
        self._logs: dict[int, int] = {}  # keys of log records taken (`log_key`): retries
        self._written: dict[tuple[int, str], float] = {}  # last value of step-less gauge series
        # The newest time of a gauge point applied, per series: rank -> tag -> time (as `_gauges`: no key tuple on the
        # hot path). Kept durable with the gauge rows written (their times, a column of the gauge block) and in the
        # snapshot (``m``); a rollback restores it from `_time_undo`.
        self._gauge_times: dict[int, dict[str, int]] = {}
        self._time_undo: list[tuple[dict[str, int], str, int | None]] = []
        # (rank, tag) -> the senders of a cumulative series, the latest last (a few)
        self._senders: dict[tuple[int, str], tuple[str, ...]] = {}
        self._sequence: dict[tuple[int, str], int] = {}
        self._tables: dict[str, dict[Any, Any]] = {
            "T": self._sums, "P": self._tops, "C": self._cumulative, "H": self._hists,
            "X": self._extremes, "L": self._deltas, "D": self._delta_seen, "S": self._spans, "W": self._written,
            "N": self._senders, "Q": self._sequence, "O": self._logs,
        }
        self._undo: list[tuple[str, Any, Any]] | None = None  # (table, key, old value) since `begin`
        # Gauge rows written since `begin`, in order, and where each run of them of one series starts (an index
        # in `_new_rows`): the journal's gauge block, and what `rollback` removes.
        self._new_rows: list[MetricRow] = []
        self._new_at: list[int] = []
        # (index in `_new_rows`, series' steps, step, old value) of gauge values changed since `begin` (rare)
        self._changed_gauges: list[tuple[int, dict[int, float], int, float]] = []
        self._corrections: dict[tuple[int, str], MetricRow] = {}  # (rank, tag) -> its highest step, whole
        self._counts_before: tuple[Any, ...] = ()
        # Step-keyed entries at which the next commit drops those out of the window (amortised: a scan per doubling).
        self._prune_at = self._prune_min = 16 * window_steps
        #: Cumulative points of a series from a second sender (two processes on one run and rank).
        self.collisions = 0
        #: The first few series with two senders, for the log and `/runs`.
        self.collided: list[str] = []
        #: Cumulative and gauge points older than the one already applied (reordered by the network): not applied.
        self.late_points = 0
        #: Sum points whose value was NaN: not added to the running total.
        self.nan_points = 0
        #: DELTA sum points that arrived after a later step of their series was written.
        self.late_delta_points = 0
        #: Rows written before such a point whose running total lacked it (written once, not rewritten).
        self.stale_totals = 0
        #: Points more than the window of steps below their series' highest step: not applied.
        self.window_skipped = 0
        #: DELTA points, spans and log records received again (a sender's retry): not applied again.
        self.retries_skipped = 0
        #: Rows written again with a DELTA series' whole total after a late point (not points received).
        self.corrections = 0
        #: The highest step any rank of the run has reported (-1: none yet).
        self.current_step = -1

    # -- changes: recorded, undone, written and read back -------------------------------------------------
    _COUNTS = ("current_step", "collisions", "late_points", "nan_points", "late_delta_points", "stale_totals",
               "window_skipped", "retries_skipped", "corrections")

    def begin(self) -> None:
        """Start recording changes (a persistent ledger; a no-op otherwise)."""
        if self.persistent:
            self._undo = []
            self._clear_new()
            self._counts_before = (*(getattr(self, n) for n in self._COUNTS), len(self.collided))

    def changes(self) -> list[Any]:
        """The changes since `begin`, msgpack-able: [counters, [[table, key, value], ...], gauge block] (`load`):
        the gauge values written as columns [ranks, tags, starts, steps, values], in runs of one series each,
        the series' (rank, tag) once per run, starting at its index in the steps and values."""
        undo = self._undo or []
        tables = self._tables
        seen: set[tuple[str, Any]] = set()
        out: list[Any] = []
        for tid, key, _ in undo:
            if (tid, key) in seen:
                continue
            seen.add((tid, key))
            value = tables[tid].get(key, _MISSING)
            if value is not _MISSING:
                out.append([tid, key, value])
        rows = self._new_rows
        at = self._new_at
        firsts = [rows[i] for i in at]
        block = [[r.run.rank for r in firsts], [r.tag for r in firsts], at, [r.step for r in rows],
                 [r.value for r in rows], [r.time_unix_nano for r in rows]]
        return [[*(getattr(self, n) for n in self._COUNTS), self.collided], out, block]

    def _clear_new(self) -> None:
        self._new_rows = []
        self._new_at = []
        self._changed_gauges = []
        self._time_undo = []

    def commit(self) -> None:
        """Keep the changes since `begin` (they are durable); drop entries that fell out of the window."""
        self._undo = None
        self._clear_new()
        # Nothing is out of the window before the run's steps span it (a series' steps are at most the run's).
        if self.current_step >= self._window and (self._gauge_entries + len(self._cumulative) + len(self._deltas)
                                                  + len(self._delta_seen) > self._prune_at):
            self._prune()

    def rollback(self) -> None:
        """Undo every change since `begin` (the request could not be made durable and is refused)."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        tables = self._tables
        for tid, key, old in reversed(undo):
            if old is _MISSING:
                tables[tid].pop(key, None)
            else:
                tables[tid][key] = old
        # Gauge writes, newest first: a changed value gets its old one back, a new one goes.
        changed = {i: (steps, old) for i, steps, _, old in self._changed_gauges}
        gauges = self._gauges
        for i in range(len(self._new_rows) - 1, -1, -1):
            row = self._new_rows[i]
            if i in changed:
                steps, old = changed[i]
                steps[row.step] = old
            else:
                by_tag = gauges.get(row.run.rank, {})
                steps = by_tag.get(row.tag, {})
                steps.pop(row.step, None)
                self._gauge_entries -= 1
                if not steps:
                    by_tag.pop(row.tag, None)  # a series this request began
        for times, tag, before in reversed(self._time_undo):
            if before is None:
                times.pop(tag, None)
            else:
                times[tag] = before
        self._corrections.clear()
        self._clear_new()
        *counts, collided = self._counts_before
        for name, value in zip(self._COUNTS, counts, strict=True):
            setattr(self, name, value)
        del self.collided[collided:]

    def dump(self) -> list[Any]:
        """The whole state, msgpack-able (`load`): the counters, and each table as [keys, values] (the gauge
        values as ``g``, a gauge block as `changes` writes it, a run per series)."""
        tables: dict[str, Any] = {tid: [list(table), list(table.values())] for tid, table in self._tables.items()}
        series = [(rank, tag, steps) for rank, by_tag in self._gauges.items() for tag, steps in by_tag.items()
                  if steps]
        newest = [(rank, tag, t) for rank, by_tag in self._gauge_times.items() for tag, t in by_tag.items()]
        tables["m"] = [[n[0] for n in newest], [n[1] for n in newest], [n[2] for n in newest]]
        tables["g"] = [[s[0] for s in series], [s[1] for s in series],
                       list(itertools.accumulate((len(s[2]) for s in series[:-1]), initial=0)) if series else [],
                       list(itertools.chain.from_iterable(s[2] for s in series)),
                       list(itertools.chain.from_iterable(s[2].values() for s in series))]
        return [[*(getattr(self, n) for n in self._COUNTS), self.collided], tables]

    def load(self, state: list[Any] | None, changes: list[list[Any]]) -> None:
        """Restore a `dump`, then apply `changes` (lists of `changes()`) in order; `loaded` when done.

        Also reads what the previous format wrote: gauge values as a flat table ``G`` of (rank, tag, step) keys in
        a snapshot, and as a list of such keys and a list of values closing a journal record."""
        if state is not None:
            counts, tables = state
            self._set_counts(counts)
            for tid, data in tables.items():
                if tid == "g":
                    self._load_gauge_block(data)
                    continue
                if tid == "m":  # the newest gauge point time of each series
                    for rank, tag, t in zip(*data, strict=True):
                        self._gauge_times.setdefault(int(rank), {})[str(tag)] = int(t)
                    continue
                keys, values = data
                if tid == "M":  # an earlier format of the same: (rank, tag) keys
                    for (rank, tag), t in zip(keys, values, strict=True):
                        self._gauge_times.setdefault(int(rank), {})[str(tag)] = int(t)
                    continue
                if tid == "G":  # the previous format
                    self._load_gauges(keys, values)
                    continue
                fix = _VALUE_OF[tid]
                self._tables[tid].update(zip(map(_key, keys), values if fix is _same else map(fix, values),
                                             strict=True))
        for change in changes:
            counts, entries, *gauges = change
            self._set_counts(counts)
            for tid, key, value in entries:
                if tid == "G":  # the previous format: a changed gauge value
                    self._load_gauges([key], [value])
                elif tid == "M":  # an earlier format of the newest gauge times: (rank, tag) -> time
                    self._gauge_times.setdefault(int(key[0]), {})[str(key[1])] = int(value)
                else:
                    self._tables[tid][_key(key)] = _VALUE_OF[tid](value)
            if len(gauges) == 2:  # the previous format: gauge keys first written, their values
                self._load_gauges(*gauges)
            else:
                self._load_gauge_block(gauges[0])

    def _load_gauges(self, keys: list[Any], values: list[float]) -> None:
        """Gauge values keyed (rank, tag, step), as the previous format wrote them."""
        for (rank, tag, step), value in zip(keys, values, strict=True):
            self._steps_of(rank, tag)[step] = value
        self._count_gauges()

    def _load_gauge_block(self, block: list[Any]) -> None:
        """Gauge values from a gauge block (`changes`), set in order (a later value of a step replaces an earlier
        one); with its times column (the previous format had none), each series' newest point time."""
        ranks, tags, starts, steps, values, *rest = block
        times = rest[0] if rest else None
        ends = [*starts[1:], len(steps)] if starts else []
        if not len(ranks) == len(tags) == len(starts) or len(steps) != len(values) or \
                (times is not None and len(times) != len(steps)) or \
                (starts[0] if starts else len(steps)) != 0 or any(a > b for a, b in zip(starts, ends, strict=True)):
            raise ValueError("a gauge block whose columns do not match")
        for rank, tag, a, b in zip(ranks, tags, starts, ends, strict=True):
            self._steps_of(rank, tag).update(zip(steps[a:b], values[a:b], strict=True))
            if times is not None and b > a:
                by_tag = self._gauge_times.setdefault(rank, {})
                by_tag[tag] = max(by_tag.get(tag, 0), *times[a:b])
        self._count_gauges()

    def _steps_of(self, rank: int, tag: str) -> dict[int, float]:
        """The gauge values a series has written, by step (created empty)."""
        by_tag = self._gauges.get(rank)
        if by_tag is None:
            by_tag = self._gauges[rank] = {}
        steps = by_tag.get(tag)
        if steps is None:
            steps = by_tag[tag] = {}
        return steps

    def _count_gauges(self) -> None:
        self._gauge_entries = sum(len(steps) for by_tag in self._gauges.values() for steps in by_tag.values())

    def loaded(self) -> None:
        """Restoring is done: drop what fell out of the window."""
        self._prune()

    def _set_counts(self, counts: list[Any]) -> None:
        *numbers, collided = counts
        for name, value in zip(self._COUNTS, numbers, strict=False):
            setattr(self, name, int(value))
        self.collided = [str(t) for t in collided]

    def _set(self, tid: str, table: dict[Any, Any], key: Any, value: Any) -> None:
        undo = self._undo
        if undo is not None:
            undo.append((tid, key, table.get(key, _MISSING)))
        table[key] = value

    def _prune(self) -> None:
        """Drop step-keyed entries more than the window below their series' highest step (for gauges, the
        highest step written is found here, in the same pass, rather than kept per row: the hot path stays one
        lookup)."""
        tops, window, floors = self._tops, self._window, self._floors
        gauges = self._gauges
        for rank, by_tag in gauges.items():
            for tag, steps in by_tag.items():
                if steps:
                    top = max(steps)
                    if top > tops.get((rank, tag), top - 1):
                        tops[(rank, tag)] = top
        for series, top in tops.items():
            if top - window > floors.get(series, STEPLESS) and (series in floors or top >= window):
                floors[series] = top - window
        for (rank, tag), floor in floors.items():
            by_tag = gauges.get(rank, {})
            kept = by_tag.get(tag)
            if kept:
                for step in [s for s in kept if s <= floor]:
                    del kept[step]
                if not kept:
                    del by_tag[tag]  # its floor stays: older steps are still not written again
        self._count_gauges()
        live = self._gauge_entries
        tables: tuple[dict[Any, Any], ...] = (self._cumulative, self._hists, self._extremes, self._deltas,
                                              self._delta_seen)
        for table in tables:
            if table:
                gone = [k for k in table if k[2] != STEPLESS and k[2] <= tops.get((k[0], k[1]), k[2]) - window]
                for k in gone:
                    del table[k]
                live += len(table)
        if len(self._spans) > _MAX_SPANS:
            for span in list(itertools.islice(self._spans, len(self._spans) - _MAX_SPANS)):
                del self._spans[span]
        if len(self._logs) > _MAX_LOGS:
            for log in list(itertools.islice(self._logs, len(self._logs) - _MAX_LOGS)):
                del self._logs[log]
        self._prune_at = max(self._prune_min, 4 * live)  # a scan per quadrupling: amortised, bounded

    def _in_window(self, rank: int, tag: str, step: int) -> bool:
        """Whether `step` is within the window of its series (raising the series' highest step); counted if not."""
        if step == STEPLESS:
            return True
        key = (rank, tag)
        top = self._tops.get(key)
        if top is None or step > top:
            self._set("P", self._tops, key, step)
            return True
        if step <= top - self._window:
            self.window_skipped += 1
            return False
        return True

    def accumulate(self, run: RunInfo, tag: str, value: float, delta: bool) -> float:
        """Running total of a sum series of the run (DELTA points add up; CUMULATIVE points replace)."""
        key = (run.rank, tag)
        total = self._sums.get(key, 0.0) + value if delta else value
        self._set("T", self._sums, key, total)
        return total

    def new_spans(self, spans: list[SpanRow]) -> list[SpanRow]:
        """`spans` less those taken before (by trace and span id: a sender's retry)."""
        seen = self._spans
        out = []
        for span in spans:
            trace = span.trace_id
            key = (trace >> 64, trace & _LOW_64, span.span_id)  # 64-bit parts: msgpack's integers
            if key in seen:
                self.retries_skipped += 1
                continue
            self._set("S", seen, key, 1)
            out.append(span)
        return out

    def new_logs(self, logs: list[LogRow]) -> list[LogRow]:
        """`logs` less those taken before (by `log_key`: a sender's retry); the oldest keys past `_MAX_LOGS` go."""
        seen = self._logs
        out = []
        for record in logs:
            key = log_key(record)
            if key in seen:
                self.retries_skipped += 1
                continue
            self._set("O", seen, key, 1)
            out.append(record)
        if len(seen) > _MAX_LOGS + _MAX_LOGS // 4:  # amortised: a trim per quarter of the bound
            for key in list(itertools.islice(seen, len(seen) - _MAX_LOGS)):
                del seen[key]
        return out

    # -- steps -----------------------------------------------------------------------------------
    def saw_step(self, step: int) -> None:
        self.current_step = max(self.current_step, step)

    def resolve_step(self, rank: int, tag: str) -> int:
        """The step of a step-less point of a series: the run's current step, else its sequence number."""
        if self.current_step >= 0:
            return self.current_step
        key = (rank, tag)
        n = self._sequence.get(key, 0)
        self._remember("Q", self._sequence, key, n + 1)
        return n

    # -- number points -----------------------------------------------------------------------------
    def gauges(self, rows: list[MetricRow], append: Callable[[MetricRow], None]) -> None:
        """Gauge rows with a step, the sink's hot path: `append` those not written before with their value.

        Rows come grouped by series (a metric's points in a request): the series' table is looked up when the
        row's run or tag is another object than the previous row's, then one lookup by step per point."""
        gauges = self._gauges
        floors = self._floors
        record = self._undo is not None
        new_rows, new_at = self._new_rows, self._new_at
        run: Any = None
        rank = 0
        tag: Any = None
        by_tag: dict[str, dict[int, float]] = {}
        steps: dict[int, float] = {}
        recorded: Any = None  # the series `new_at` last began a run of rows for
        floor = _NO_FLOOR
        added = 0
        all_times = self._gauge_times
        times: dict[str, int] = {}
        time_undo = self._time_undo if record else None
        newest = newest_before = 0  # the series' newest point time applied (0: none, or no time given)
        for row in rows:
            if row.tag is not tag or row.run is not run:
                if newest != newest_before:  # once per series, on the hot path
                    if time_undo is not None:
                        time_undo.append((times, tag, newest_before or None))
                    times[tag] = newest
                if row.run is not run:
                    run = row.run
                    rank = run.rank
                    found = gauges.get(rank)
                    if found is None:
                        found = gauges[rank] = {}
                    by_tag = found
                    found_times = all_times.get(rank)
                    if found_times is None:
                        found_times = all_times[rank] = {}
                    times = found_times
                tag = row.tag
                series = by_tag.get(tag)
                if series is None:
                    series = by_tag[tag] = {}
                steps = series
                floor = floors.get((rank, tag), _NO_FLOOR) if floors else _NO_FLOOR
                newest = newest_before = times.get(tag, 0)
            step = row.step
            value = row.value
            t = row.time_unix_nano
            old = steps.get(step, _MISSING)
            if old is _MISSING:
                if step <= floor:
                    self.window_skipped += 1  # older than the window: by the step order rule, not written again
                    continue
                added += 1
            elif old == value or _same_value(old, value):
                if t > newest:  # noqa: PLR1730 - cheaper than a max() call per point
                    newest = t
                continue  # re-sent unchanged
            elif t < newest:
                self.late_points += 1  # an older value of a step that has a newer one (a retry arriving late)
                continue
            elif record:
                self._changed_gauges.append((len(new_rows), steps, step, old))
            if t > newest:  # noqa: PLR1730
                newest = t
            steps[step] = value
            append(row)
            if record:
                if steps is not recorded:
                    recorded = steps
                    new_at.append(len(new_rows))
                new_rows.append(row)
        if newest != newest_before:
            if time_undo is not None:
                time_undo.append((times, tag, newest_before or None))
            times[tag] = newest
        self._gauge_entries += added

    def _sender(self, rank: int, tag: str, sender: str) -> None:
        """Note the sender of a cumulative point. A sender new to the series takes it over (a restarted process
        goes on where the previous one stopped); a point from an earlier sender after another sender's is a
        collision: two processes send the series at once."""
        key = (rank, tag)
        senders = self._senders.get(key)
        if senders is None:
            self._remember("N", self._senders, key, (sender,))
        elif senders[-1] != sender:
            if sender in senders:
                self.collisions += 1
                if len(self.collided) < 10 and tag not in self.collided:
                    self.collided.append(tag)
            kept = tuple(s for s in senders if s != sender)[-(_SENDERS_KEPT - 1):]
            self._remember("N", self._senders, key, (*kept, sender))

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
            seen = (rank, row.tag, row.step, sender, start_unix_nano, row.time_unix_nano)
            if seen in self._delta_seen:
                self.retries_skipped += 1  # the same point again: a sender's retry
                return False
            top = self._tops.get((rank, row.tag))
            if not stepless and top is not None and row.step <= top - self._window:
                self.window_skipped += 1
                return False
            self._set("D", self._delta_seen, seen, 1)
            if stepless:
                row.step = self.resolve_step(rank, row.tag)
            row.value = self._delta(row)
            return True
        if mode in (CUMULATIVE_COUNTER, CUMULATIVE_UPDOWN):
            key = (rank, row.tag, row.step, sender)
            prev = self._cumulative.get(key)
            value = row.value
            t = row.time_unix_nano
            if self._late(prev, start_unix_nano, t):
                return False
            if prev is None and not self._in_window(rank, row.tag, row.step):
                return False
            self._sender(rank, row.tag, sender)
            if prev is None or prev[0] != start_unix_nano or (mode == CUMULATIVE_COUNTER and value < prev[1]):
                increase = value  # a new series or a reset (restarted process): all of it is new
            else:
                increase = value - prev[1]  # an up-down counter may go down
                if increase == 0.0:
                    return False  # a repeat of an unchanged cumulative point
            self._set("C", self._cumulative, key, (start_unix_nano, value, t))
            if stepless:
                row.step = self.resolve_step(rank, row.tag)
            row.value = self.accumulate(row.run, row.tag, increase, True)
            return True
        # GAUGE: the value itself, once per (series, step, value)
        if stepless:
            if row.time_unix_nano < self._gauge_times.get(rank, {}).get(row.tag, 0):
                self.late_points += 1  # older than the value already written: it would show an old value as new
                return False
            last = self._written.get((rank, row.tag))
            if _same_value(last, row.value) and self.current_step < 0:
                return False  # an unchanged step-less value re-sent with no step to tell it apart
            self._remember("W", self._written, (rank, row.tag), row.value)
            row.step = self.resolve_step(rank, row.tag)
        out: list[MetricRow] = []
        self.gauges([row], out.append)
        return bool(out)

    def _delta(self, row: MetricRow) -> float:
        """The running total of a DELTA sum at the row's own step, also when a later step came first."""
        rank, tag, step = row.run.rank, row.tag, row.step
        total = self.accumulate(row.run, tag, row.value, True)
        key = (rank, tag, step)
        self._set("L", self._deltas, key, self._deltas.get(key, 0.0) + row.value)
        top = self._tops.get((rank, tag))
        if top is None or step >= top:
            if top is None or step > top:
                self._set("P", self._tops, (rank, tag), step)
            self._corrections.pop((rank, tag), None)  # this row carries the whole total
            return total
        later = [v for s in range(step + 1, top + 1) if (v := self._deltas.get((rank, tag, s))) is not None]
        self.late_delta_points += 1
        self.stale_totals += len(later)
        if later:  # the series' highest step was written short: written again with the whole total
            self._corrections[(rank, tag)] = dataclasses.replace(row, step=top, value=total)
        return float(total - sum(later))

    def take_corrections(self) -> list[MetricRow]:
        """Rows that write a DELTA series' highest step again with its whole total, after a late point (see the
        module docstring); taken once per request, after its points."""
        if not self._corrections:
            return []
        out = list(self._corrections.values())
        self._corrections.clear()
        self.corrections += len(out)
        return out

    # -- histograms and summaries --------------------------------------------------------------------
    def histogram(self, row: HistogramRow, cumulative: bool, start_unix_nano: int,
                  sender: str = "") -> HistogramRow | None:
        """The increase of a histogram point since its series' previous one, or None for a repeat.

        DELTA points are returned as they are (their step resolved if step-less).
        """
        rank = row.run.rank
        if cumulative:
            key = (rank, row.tag, row.step, sender)
            prev = self._hists.get(key)
            if prev is not None and self._late((prev[0], 0.0, prev[5]), start_unix_nano, row.time_unix_nano):
                return None
            if prev is None and not self._in_window(rank, row.tag, row.step):
                return None
            self._sender(rank, row.tag, sender)
            self._set("H", self._hists, key, (start_unix_nano, row.count, row.sum, tuple(row.explicit_bounds),
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
            key = (rank, row.tag, row.step, sender)
            seen = self._extremes.get(key)
            if seen is not None:
                row = dataclasses.replace(row, min=_combine(min, seen[0], row.min),
                                          max=_combine(max, seen[1], row.max))
            self._set("X", self._extremes, key, (row.min, row.max))
        if row.step == STEPLESS:
            row.step = self.resolve_step(rank, row.tag)
        return row

    def _remember(self, tid: str, table: dict[Any, Any], key: Any, value: Any) -> None:
        """Set an entry of a per-series table (bounded by the number of series; past `max_entries`, the oldest
        series is forgotten)."""
        if len(table) >= self._max and key not in table:
            oldest = next(iter(table))
            self._set(tid, table, oldest, table[oldest])  # recorded, so a rollback brings it back
            del table[oldest]
        self._set(tid, table, key, value)


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _same(value: Any) -> Any:
    return value


def _senders_of(v: Any) -> tuple[str, ...]:
    return (v,) if isinstance(v, str) else tuple(v)  # the previous format kept the first sender alone


def _hist_prev(v: list[Any]) -> tuple[int, int, float, tuple[float, ...], tuple[int, ...], int]:
    return (v[0], v[1], v[2], tuple(v[3]), tuple(v[4]), v[5])


#: How each table's values come back from msgpack (lists to tuples where the table holds tuples).
_VALUE_OF: dict[str, Callable[[Any], Any]] = {
    "T": _same, "P": _same, "C": tuple, "H": _hist_prev, "X": tuple, "L": _same, "D": _same,
    "S": _same, "W": _same, "N": _senders_of, "Q": _same, "O": _same,
}
