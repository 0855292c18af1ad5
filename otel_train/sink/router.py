"""Routes decoded rows to one set of backends per training run.

Rows are grouped by `train.run.id`; each run gets its own exporter instances (one backend run per
training run, all ranks inside it: rows carry their rank) and one worker thread that feeds them,
so a backend never sees two windows at once. Requests are merged into larger windows when they
queue up. A run idle for `idle_s` is closed; data arriving later reopens it (counter totals survive).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from otel_train.records import HistogramRow, MetricRow, SpanRow
from otel_train.sink.aggregate import Aggregator
from otel_train.sink.decode import Decoded
from otel_train.sink.temporality import SeriesLedger

if TYPE_CHECKING:
    from otel_train.exporters.base import RowExporter

__all__ = ["ExporterFactory", "Overloaded", "Router"]

_logger = logging.getLogger(__name__)

#: Builds a fresh list of backends for one run.
ExporterFactory = Callable[[], "list[RowExporter]"]

_MERGE_ROWS = 50_000  # rows merged into one window at most
_KEEP_CLOSED = 10_000  # closed runs whose counter totals are kept, should they resume


class Overloaded(RuntimeError):
    """A run's queue stayed full: the client should retry later (HTTP 503 / gRPC UNAVAILABLE)."""


class _Run:
    """One training run: its backends, its worker and what it has seen."""

    def __init__(self, run_id: str, exporters: list[RowExporter], converter: SeriesLedger,
                 aggregator: Aggregator | None, queue_windows: int, on_error: Callable[[], None]) -> None:
        self.run_id = run_id
        self.run_name = run_id
        self.world_size = 1
        self.exporters = exporters
        self.converter = converter
        self.aggregator = aggregator
        self.lock = threading.Lock()
        self.queue: queue.Queue[Decoded | None] = queue.Queue(maxsize=queue_windows)
        self.last_seen = time.monotonic()
        self.last_step: dict[int, int] = {}
        self.series: set[str] = set()
        self.points = 0
        self.spans = 0
        self.written = 0
        self.write_errors = 0
        self._pending = 0
        self._idle = threading.Condition()
        self._on_error = on_error
        self.worker = threading.Thread(target=self._work, name=f"otel-train-sink[{run_id}]", daemon=True)
        self.worker.start()

    # -- producer side (under self.lock) -------------------------------------------------------
    def put(self, item: Decoded, timeout_s: float) -> None:
        with self._idle:
            self._pending += 1
        try:
            self.queue.put(item, timeout=timeout_s)
        except queue.Full:
            self._done(1)
            raise Overloaded(f"run {self.run_id!r}: backends are behind; retry later") from None

    def _done(self, n: int) -> None:
        with self._idle:
            self._pending -= n
            if self._pending <= 0:
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    @property
    def pending(self) -> int:
        return self._pending

    # -- worker ------------------------------------------------------------------------------
    def _work(self) -> None:
        from otel_train.exporters.base import Window

        while True:
            item = self.queue.get()
            if item is None:
                self._done(1)
                return
            items = [item]
            rows = item.points + len(item.spans)
            stop = False
            while rows < _MERGE_ROWS:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                items.append(nxt)
                rows += nxt.points + len(nxt.spans)
            if len(items) == 1:
                window = Window(item.metrics, item.histograms, item.spans)
            else:
                metrics: list[MetricRow] = []
                hists: list[HistogramRow] = []
                spans: list[SpanRow] = []
                for it in items:
                    metrics.extend(it.metrics)
                    hists.extend(it.histograms)
                    spans.extend(it.spans)
                window = Window(metrics, hists, spans)
            for exporter in self.exporters:
                try:
                    ok = exporter.export_window(window)
                except Exception:  # export_window isolates failures; this is a last resort
                    _logger.exception("exporter `%s` raised", getattr(exporter, "name", exporter))
                    ok = False
                if not ok:
                    self.write_errors += 1
                    self._on_error()
            self.written += len(window.metrics) + len(window.histograms)  # every row written
            self._done(len(items) + (1 if stop else 0))
            if stop:
                return

    def stop(self, timeout_s: float) -> None:
        """Finish the queue, then flush and close the backends."""
        with self._idle:
            self._pending += 1
        self.queue.put(None)
        self.worker.join(timeout_s)
        for exporter in self.exporters:
            try:
                exporter.shutdown(timeout_millis=timeout_s * 1000)
            except Exception:
                _logger.exception("closing exporter `%s` failed", getattr(exporter, "name", exporter))

    def summary(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "run_name": self.run_name,
            "world_size": self.world_size,
            "ranks": {str(r): {"last_step": s} for r, s in sorted(self.last_step.items())},
            "last_step": max(self.last_step.values()) if self.last_step else None,
            "series": len(self.series),
            "points": self.points,
            "spans": self.spans,
            "written": self.written,
            "queued": self._pending,
            "write_errors": self.write_errors,
            "idle_s": round(time.monotonic() - self.last_seen, 1),
            "aggregates_pending": self.aggregator.pending_steps if self.aggregator else 0,
        }


class Router:
    """Groups rows by run and feeds each run's backends from one worker.

    Args:
        make_exporters: Builds the backends for a new run.
        aggregate: Cross-rank aggregates (``mean``, ``min``, ``max``); empty for none.
        aggregate_timeout_s: See `Aggregator`.
        idle_s: A run without data for this long is closed by `tick`.
        queue_windows: Requests queued per run before `ingest` waits (backpressure).
        ingest_timeout_s: How long `ingest` waits on a full queue before raising `Overloaded`.
    """

    def __init__(self, make_exporters: ExporterFactory, aggregate: Sequence[str] = (),
                 aggregate_timeout_s: float = 30.0, idle_s: float = 300.0, queue_windows: int = 256,
                 ingest_timeout_s: float = 10.0) -> None:
        self._make = make_exporters
        self._aggregate = tuple(aggregate)
        self._aggregate_timeout_s = aggregate_timeout_s
        self.idle_s = idle_s
        self._queue_windows = queue_windows
        self._ingest_timeout_s = ingest_timeout_s
        self._runs: dict[str, _Run] = {}
        self._converters: OrderedDict[str, SeriesLedger] = OrderedDict()
        self._closed_summaries: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.points_in = 0
        self.spans_in = 0
        self.requests = 0
        self.errors = 0
        self.aggregate_rows = 0
        self.runs_opened = 0
        self.runs_closed = 0

    def _error(self) -> None:
        self.errors += 1

    def _run(self, run_id: str) -> _Run:
        with self._lock:
            if self._closed:
                raise Overloaded("the sink is shutting down")
            state = self._runs.get(run_id)
            if state is None:
                converter = self._converters.pop(run_id, None) or SeriesLedger()
                self._converters[run_id] = converter
                while len(self._converters) > _KEEP_CLOSED:
                    self._converters.popitem(last=False)
                exporters = self._make()
                agg = Aggregator(self._aggregate, self._aggregate_timeout_s) if self._aggregate else None
                state = _Run(run_id, exporters, converter, agg, self._queue_windows, self._error)
                self._runs[run_id] = state
                self._closed_summaries.pop(run_id, None)
                self.runs_opened += 1
                _logger.info("run %r opened (%d backend(s))", run_id, len(exporters))
            return state

    def backlogged(self) -> bool:
        """Whether some run's queue is (nearly) full, so that `ingest` may have to wait."""
        with self._lock:
            states = list(self._runs.values())
        return any(s.queue.qsize() >= s.queue.maxsize - 1 for s in states)

    def ingest(self, decoded: Decoded) -> None:
        """Queue one decoded request for its run(s). Raises `Overloaded` if a run's queue stays full."""
        self.requests += 1
        for run_id, part in decoded.split_by_run().items():
            state = self._run(run_id)
            with state.lock:
                part.finish(state.converter)
                state.last_seen = time.monotonic()
                state.series.update(part.tags.get(run_id, ()))
                for run, step in part.runs.items():
                    if step >= 0:
                        last = state.last_step.get(run.rank)
                        if last is None or step > last:
                            state.last_step[run.rank] = step
                    state.run_name = run.run_name
                    state.world_size = max(state.world_size, run.world_size)
                npoints = len(part.metrics) + len(part.histograms)
                state.points += npoints
                state.spans += len(part.spans)
                self.points_in += npoints
                self.spans_in += len(part.spans)
                if state.aggregator is not None and part.metrics:
                    agg = state.aggregator.add(part.metrics)
                    if agg:
                        part.metrics.extend(agg)
                        self.aggregate_rows += len(agg)
                state.put(part, self._ingest_timeout_s)

    def _emit_aggregates(self, state: _Run, rows: list[MetricRow]) -> None:
        if rows:
            d = Decoded.of_rows(rows)
            self.aggregate_rows += len(rows)
            try:
                state.put(d, self._ingest_timeout_s)
            except Overloaded:
                self.errors += 1
                _logger.warning("run %r: %d aggregate row(s) dropped, backends are behind", state.run_id, len(rows))

    def tick(self) -> None:
        """Housekeeping: write timed-out aggregates, close idle runs."""
        now = time.monotonic()
        to_close: list[_Run] = []
        with self._lock:
            states = list(self._runs.values())
        for state in states:
            with state.lock:
                if state.aggregator is not None:
                    self._emit_aggregates(state, state.aggregator.expire())
                idle = now - state.last_seen >= self.idle_s and state.pending == 0
            if idle:
                with self._lock:
                    if self._runs.get(state.run_id) is state and now - state.last_seen >= self.idle_s:
                        del self._runs[state.run_id]
                        to_close.append(state)
        for state in to_close:
            self._close_run(state, timeout_s=30.0)
            _logger.info("run %r closed after %.0f s idle", state.run_id, self.idle_s)

    def _close_run(self, state: _Run, timeout_s: float) -> None:
        with state.lock:
            if state.aggregator is not None:
                self._emit_aggregates(state, state.aggregator.drain())
        state.stop(timeout_s)
        state.converter.compact()  # kept for a resumed run: only what its totals need
        summary = state.summary()
        summary["open"] = False
        self._closed_summaries[state.run_id] = summary
        while len(self._closed_summaries) > 1000:
            self._closed_summaries.popitem(last=False)
        self.runs_closed += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued request is written, then flush every backend."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            states = list(self._runs.values())
        ok = True
        for state in states:
            ok = state.wait_idle(max(0.0, deadline - time.monotonic())) and ok
            for exporter in state.exporters:
                ok = bool(exporter.force_flush()) and ok
        return ok

    def close(self, timeout_s: float = 30.0) -> None:
        """Write pending aggregates, drain every queue, close every backend. Idempotent."""
        with self._lock:
            self._closed = True
            states = list(self._runs.values())
            self._runs.clear()
        deadline = time.monotonic() + timeout_s
        for state in states:
            self._close_run(state, max(1.0, deadline - time.monotonic()))

    @property
    def runs_open(self) -> int:
        return len(self._runs)

    def summary(self) -> dict[str, Any]:
        """The `/runs` document: open runs first, then recently closed ones."""
        with self._lock:
            states = list(self._runs.values())
            closed = list(self._closed_summaries.values())
        runs = []
        for state in states:
            s = state.summary()
            s["open"] = True
            runs.append(s)
        return {"runs": runs + closed[::-1]}
