"""A short hold in front of the sink's backends that cannot store an older step.

A collector with several consumers reorders requests, and one that was down re-sends what it kept: a point can
reach the sink after a later step of its series. TensorBoard and W&B (`RowExporter.stores_older_steps` False)
skip such a point (`otel_train.vocab.step_order`). `ReorderHold` wraps such a backend of one run: it keeps metric and
histogram rows for `reorder_s` seconds (spans pass at once) and hands them over sorted by step, so a point late
by less than that is written in its place.

The release rule, per (run, rank): once a held row has been held `reorder_s`, it goes out, and with it every
held row of its (run, rank) whose step is at most the highest step going out, in step order. A lower step that
came late and is still held therefore goes out before, never after, a higher one; what stays held is only
above every step released. A row arriving after a higher step of its series was released is skipped and
counted by the backend's step-order rule, as without the hold. So is a second value at a step the series
already has, arriving after a higher step of the series (a sender that starts over from an earlier step: a job
restarted from a checkpoint without declaring it), when both are held: TensorBoard would show both, so the
backend keeps the series as first logged, as it does when the first values were already written.

Rows are released by the backend's own feed, never by another thread, on `force_flush`: delivery flushes at
least every second while the run's spool holds windows the backend has not made durable (held rows keep it from
doing so); without a spool the sink's housekeeping asks for a flush (`on_due`). An explicit flush after
`drain_at_next_flush`, and `shutdown` (idle or least-recently-used close, sink stop), release everything;
`export_window` releases early only past `MAX_HELD_ROWS`.

Durability: the wrapper is never `kill_safe_writes`, and its `durable_step` is one below the lowest step it
holds (or the backend's own, if lower): the sink's spool cursor never passes a held row, so a sink killed with
rows held hands them over again from the spool after a restart. Releasing only in a flush lets delivery move the
cursor over the released rows right after writing them (`BackendFeed._acknowledge`). The cursor follows the
lowest step held over the whole run, so while its ranks are at steps far apart, windows whose rows for a faster
rank were written stay unacknowledged: with `remember_released` (the sink does it for every spooled run) the
hold records the highest step written per (rank, series) after each flush (`otel_train.sink.runs.released`), and
after a restart skips a row the spool hands over again at or below it (counted in `redelivered`, not as a
step-order skip), so nothing is written twice. The record follows the backend's write: for a backend that reports
its appends (TensorBoard) an intent record precedes each write, and a restarted hold first cuts the backend's
files back to where they were before writes a killed sink did not record (W&B cannot be cut back: see the limits
in `otel_train.sink.runs.released`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from otel_train._internal import faults
from otel_train.backend import Window
from otel_train.sink.runs.released import ReleasedSteps

if TYPE_CHECKING:
    from pathlib import Path

    from otel_train.backend import RowExporter
    from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow
    from otel_train.vocab.run_identity import RunInfo

__all__ = ["MAX_HELD_ROWS", "ReorderHold", "needs_hold"]

#: Rows one backend of one run holds at most: past it the oldest are released early (memory stays bounded for
#: a run sending faster than ~50,000 points/s with the default hold; it only shortens the hold).
MAX_HELD_ROWS = 250_000

_Key = tuple[str, int]  # (run id, rank)
_Span = tuple[bool, int, int]  # a chunk's (late, lowest step, highest step) as released
_by_step = attrgetter("step")
_by_order = itemgetter(0)


def needs_hold(exporter: Any) -> bool:
    """Whether `exporter` skips a row that comes after a later step of its series: a backend that cannot
    store an older step (TensorBoard, W&B), or any metric backend under ``OTEL_TRAIN_STEP_ORDER=drop/raise``."""
    if not getattr(exporter, "handles_metrics", True):
        return False
    order = getattr(exporter, "step_order", None)
    policy = getattr(order, "policy", "warn")
    return getattr(exporter, "stores_older_steps", True) is False or policy != "warn"


class _Chunk:
    """Rows of one (run, rank) from one window, held since `arrival`; `low` is their lowest step."""

    __slots__ = ("arrival", "high", "histograms", "key", "late", "low", "metrics", "order")

    def __init__(self, arrival: float, key: _Key, metrics: list[MetricRow],
                 histograms: list[HistogramRow], order: int = 0) -> None:
        self.arrival = arrival
        self.order = order  # arrival order: rows of one step go out in the order they came
        self.key = key
        self.metrics = metrics
        self.histograms = histograms
        steps = [r.step for r in metrics] + [h.step for h in histograms]
        self.low = min(steps)
        self.high = max(steps)
        self.late = False  # it came after a higher step of its (run, rank): it may repeat a held step

    def __len__(self) -> int:
        return len(self.metrics) + len(self.histograms)


class ReorderHold:
    """Holds a backend's metric rows `reorder_s` seconds and releases them in step order (module docstring).

    Everything else of the backend (`name`, `step_order`, `rows_lost`, ...) is the wrapped backend's.

    Args:
        inner: The backend (a `RowExporter`).
        reorder_s: Seconds a row is held (> 0).
        clock: Monotonic seconds (tests pass their own).

    Example:
        >>> from otel_train.vocab.rows import MetricRow
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> from otel_train.testing import InMemoryRowExporter
        >>> now = [0.0]
        >>> mem = InMemoryRowExporter()
        >>> hold = ReorderHold(mem, 5.0, clock=lambda: now[0])
        >>> run = RunInfo("r", "r")
        >>> rows = lambda steps: Window([MetricRow(run, s, "loss", "loss", float(s), "gauge", 0) for s in steps])
        >>> hold.export_window(rows([5, 6])), hold.export_window(rows([3, 4])), hold.held
        (True, True, 4)
        >>> now[0] = 5.0
        >>> hold.force_flush(), [r.step for r in mem.metrics], hold.held
        (True, [3, 4, 5, 6], 0)
    """

    #: Held rows are not in the backend's files yet: delivery must not record the window as written.
    kill_safe_writes = False
    #: One window per call: a window that comes after a higher step is how a sender starting over is told apart
    #: (`_first_values`); the hold regroups rows itself.
    merges_windows = False

    def __init__(self, inner: RowExporter, reorder_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._inner = inner
        if hasattr(inner, "hold_s"):  # a backend's own hold (W&B's): this one takes its place
            inner.hold_s = 0.0
        self.reorder_s = reorder_s
        self._clock = clock
        self._arrivals: deque[_Chunk] = deque()  # every held chunk, oldest first (emptied ones skipped)
        self._by_key: dict[_Key, list[tuple[int, int, _Chunk]]] = {}  # heap of (low step, tie, chunk) per key
        self._arrived_high: dict[_Key, int] = {}  # per key, the highest step that arrived
        self._tie = itertools.count()
        self._drains_asked = self._drains_done = 0
        #: Rows held now (read by `/health` from another thread: a plain int).
        self.held = 0
        #: Called by the sink's housekeeping when rows are due and nothing else would flush (no spool).
        self.on_due: Callable[[], object] | None = None
        self._released: ReleasedSteps | None = None
        #: Rows skipped because the backend held them before a restart (the spool handed them over again).
        self.redelivered = 0
        #: Called with (run id, rows) for each such skip (the sink's `/health`).
        self.on_redelivered: Callable[[str, int], object] | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def remember_released(self, path: Path) -> None:
        """Record in `path` what the backend holds, and skip what it held before (call before the first window;
        see `otel_train.sink.runs.released`). First, what a killed sink wrote to the backend's files without recording
        it is cut back out (a backend that reports its appends: TensorBoard), so it is written once."""
        released = self._released = ReleasedSteps(path)
        released.cut_unrecorded_appends()
        watch = getattr(self._inner, "watch_appends", None)
        if watch is not None:
            watch(released.intend)

    # -- delivery's calls ---------------------------------------------------------------------------
    def export_window(self, window: Window) -> bool:
        """Hold the window's metric and histogram rows (they go out in a flush); hand its spans and log records over
        at once."""
        now = self._clock()
        metrics: Sequence[MetricRow] = window.metrics
        histograms: Sequence[HistogramRow] = window.histograms
        if self._released is not None and (metrics or histograms):
            metrics, histograms = self._drop_redelivered(metrics, histograms)
        if metrics or histograms:
            self._hold(metrics, histograms, now)
        out_m, out_h = self._take(now, everything=False, by_time=False)  # past the row budget only
        if not (out_m or out_h or window.spans or window.logs):
            return True
        return self._write(out_m, out_h, window.spans, window.logs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Release what is due (everything after `drain_at_next_flush`), then flush the backend; then record
        what it holds (before delivery moves the spool's cursor)."""
        asked = self._drains_asked  # a counter, not a flag: an ask racing this flush is served by the next one
        everything, self._drains_done = asked != self._drains_done, asked
        ok = self._release(everything)
        flushed = bool(self._inner.force_flush(timeout_millis))
        if flushed:
            self._save_released()
        return flushed and ok

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Release everything held, then shut the backend down (safe to call twice)."""
        self._release(everything=True)
        self._inner.shutdown(timeout_millis)
        self._save_released()

    def resume(self, run: RunInfo, step: int) -> bool:
        """A restart of `run`'s rank at `step`: what came before it is written first."""
        self._release(everything=True)
        self._arrived_high.pop((run.run_id, run.rank), None)
        if self._released is not None:
            self._released.forget(run.run_id, run.rank)
        return bool(self._inner.resume(run, step))

    def durable_step(self) -> int | None:
        """One below the lowest step held, or the backend's own if lower (None: nothing is held and the backend's
        store holds everything it was handed)."""
        inner = self._inner.durable_step()
        low = min((heap[0][0] for heap in self._by_key.values() if heap), default=None)
        if low is None:
            return inner
        return low - 1 if inner is None else min(inner, low - 1)

    def forget_pending_after_fork(self) -> None:
        self._arrivals.clear()
        self._by_key.clear()
        self._arrived_high.clear()
        self.held = 0
        self._inner.forget_pending_after_fork()

    # -- the sink's calls (any thread) ------------------------------------------------------------
    def drain_at_next_flush(self) -> None:
        """Have the next `force_flush` release everything held (an explicit flush: write what was received)."""
        self._drains_asked += 1

    def due(self) -> bool:
        """Whether some held row has been held `reorder_s` (racy by design: a hint for housekeeping)."""
        try:
            oldest = self._arrivals[0].arrival
        except IndexError:
            return False
        return self._clock() - oldest >= self.reorder_s

    # -- the hold ---------------------------------------------------------------------------------------
    def _release(self, everything: bool) -> bool:
        metrics, histograms = self._take(self._clock(), everything)
        if not (metrics or histograms):
            return True
        return self._write(metrics, histograms)

    def _write(self, metrics: list[MetricRow], histograms: list[HistogramRow], spans: Sequence[SpanRow] = (),
               logs: Sequence[LogRow] = ()) -> bool:
        released = self._released
        if released is not None:
            released.check_before_write(metrics)
            released.check_before_write(histograms)
        ok = bool(self._inner.export_window(Window(metrics, histograms, spans, logs)))
        if faults.ARMED and (metrics or histograms):  # tests only: a kill between the write and its record
            faults.after_write(self._inner.name, max(r.step for rows in (metrics, histograms) for r in rows))
        if ok and released is not None:  # not written (kept for a retry): never claimed as held
            released.note(metrics)
            released.note(histograms)
        return ok

    def _save_released(self) -> None:
        if self._released is not None:
            try:
                durable = self._inner.durable_step()
            except Exception:  # a backend that cannot say: claim nothing now (a repeat, never a loss)
                return
            self._released.save(durable)

    def _drop_redelivered(self, metrics: Sequence[MetricRow], histograms: Sequence[HistogramRow]
                          ) -> tuple[Sequence[MetricRow], Sequence[HistogramRow]]:
        assert self._released is not None
        first = metrics[0] if metrics else histograms[0]  # the sink feeds a hold the rows of one run
        metrics, n = self._released.drop_redelivered(metrics)
        histograms, h = self._released.drop_redelivered(histograms)
        if n + h:
            self.redelivered += n + h
            if self.on_redelivered is not None:
                self.on_redelivered(first.run.run_id, n + h)
        return metrics, histograms

    def _hold(self, metrics: Sequence[MetricRow], histograms: Sequence[HistogramRow], now: float) -> None:
        groups: dict[_Key, tuple[list[MetricRow], list[HistogramRow]]] = {}
        run: RunInfo | None = None
        into: list[Any] = []
        for row in metrics:
            if row.run is not run:  # rows come in long stretches of one rank: one lookup per stretch
                run = row.run
                into = groups.setdefault((run.run_id, run.rank), ([], []))[0]
            into.append(row)
        run = None
        for h in histograms:
            if h.run is not run:
                run = h.run
                into = groups.setdefault((run.run_id, run.rank), ([], []))[1]
            into.append(h)
        for key, (ms, hs) in groups.items():
            tie = next(self._tie)
            chunk = _Chunk(now, key, ms, hs, tie)
            high = self._arrived_high.get(key)
            chunk.late = high is not None and chunk.low < high
            if high is None or chunk.high > high:
                self._arrived_high[key] = chunk.high
            self._arrivals.append(chunk)
            heapq.heappush(self._by_key.setdefault(key, []), (chunk.low, tie, chunk))
            self.held += len(chunk)

    def _first_values(self, chunks: list[tuple[_Span, list[Any]]]) -> list[Any]:
        """The rows of `chunks` ((late, low, high) and rows, in arrival order) less each second value at a step its
        series already has from an earlier chunk, come after a higher step of the series: skipped and counted by
        the backend's step-order rule (`StepOrder.skip`), as when the first value was already written. Only a late
        chunk's rows can be such (the others came above every step before them), and only earlier chunks that reach
        its steps are read for each (one, for a collector's reordered request)."""
        order = getattr(self._inner, "step_order", None)
        kept_rows: list[list[Any]] = []
        for j, ((late, low, high), rows) in enumerate(chunks):
            if late and rows:
                seen: set[tuple[str, int]] = set()  # (series, step) in this chunk's steps, of the earlier chunks
                top: dict[str, int] = {}  # series -> its highest step from this chunk's lowest up, of the earlier
                for i in range(j):
                    if chunks[i][0][2] < low:
                        continue
                    for r in kept_rows[i]:
                        step = r.step
                        if step >= low:
                            if step <= high:
                                seen.add((r.tag, step))
                            if step > top.get(r.tag, -1):
                                top[r.tag] = step
                kept = []
                for r in rows:
                    if (r.tag, r.step) in seen and r.step < top[r.tag]:
                        if order is not None:
                            order.skip(r.run.run_id, r.run.rank, r.tag, r.step, top[r.tag])
                        continue
                    kept.append(r)
                rows = kept
            kept_rows.append(rows)
        return [r for rows in kept_rows for r in rows]

    def _take(self, now: float, everything: bool, by_time: bool = True) -> tuple[list[MetricRow], list[HistogramRow]]:
        """Rows to release now (the rule in the module docstring), each (run, rank) in step order; `by_time`
        False: only what is past `MAX_HELD_ROWS`."""
        if not self._arrivals:
            return [], []
        limits: dict[_Key, float] = {}
        if everything:
            limits = dict.fromkeys(self._by_key, math.inf)
            self._arrivals.clear()
        else:
            cutoff = now - self.reorder_s if by_time else -math.inf
            excess = self.held - MAX_HELD_ROWS
            arrivals = self._arrivals
            while arrivals and (arrivals[0].arrival <= cutoff or excess > 0):
                chunk = arrivals.popleft()
                if not len(chunk):
                    continue  # released earlier with a due chunk of its (run, rank)
                excess -= len(chunk)
                limits[chunk.key] = max(limits.get(chunk.key, -math.inf), chunk.high)
        metrics: list[MetricRow] = []
        histograms: list[HistogramRow] = []
        for key, limit in limits.items():
            heap = self._by_key.get(key)
            if not heap:
                continue
            taken: list[tuple[int, list[MetricRow], list[HistogramRow], _Span]] = []
            late = False
            while heap and heap[0][0] <= limit:
                chunk = heapq.heappop(heap)[2]
                before = len(chunk)
                late = late or chunk.late
                if chunk.high <= limit:
                    taken.append((chunk.order, chunk.metrics, chunk.histograms, (chunk.late, chunk.low, chunk.high)))
                    chunk.metrics, chunk.histograms = [], []
                else:  # part of it is above the limit: that part stays, with its arrival time
                    taken.append((chunk.order, [r for r in chunk.metrics if r.step <= limit],
                                  [h for h in chunk.histograms if h.step <= limit], (chunk.late, chunk.low, int(limit))))
                    chunk.metrics = [r for r in chunk.metrics if r.step > limit]
                    chunk.histograms = [h for h in chunk.histograms if h.step > limit]
                    chunk.low = min([r.step for r in chunk.metrics] + [h.step for h in chunk.histograms])
                    heapq.heappush(heap, (chunk.low, next(self._tie), chunk))
                self.held -= before - len(chunk)
            if not heap:
                del self._by_key[key]
            taken.sort(key=_by_order)
            if late:  # a chunk came after a higher step: it may repeat steps held with it (a sender starting over)
                ms = self._first_values([(span, rows) for _, rows, _, span in taken])
                hs = self._first_values([(span, hists) for _, _, hists, span in taken])
            else:
                ms = [r for _, rows, _, _ in taken for r in rows]
                hs = [h for _, _, hists, _ in taken for h in hists]
            ms.sort(key=_by_step)  # stable: rows of one step keep the order they came in
            hs.sort(key=_by_step)
            metrics += ms
            histograms += hs
        return metrics, histograms
