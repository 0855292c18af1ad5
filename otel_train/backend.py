"""The backend contract: `Window` (the rows of one export window) and `RowExporter`, the one base class
every otel-train backend derives from. It belongs to the core: `exporters/` are plugins that import it
(``otel_train.exporters.base`` re-exports it for backends written against that path).

It is a real OTel `MetricExporter` *and* `SpanExporter`, so a backend can be plugged into any
OTel SDK pipeline; and it takes pre-converted rows from the step-aligned reader, so one
conversion serves every backend. It isolates the backend: an exception from a write is counted,
logged at most once a minute, and the batch is retried with backoff (bounded); it never propagates.

One bad row never costs a window, and a retried window never writes a row twice:

- Before a write, every row is checked (`row_problem`: the generic checks, plus the backend's own); a row
  it refuses is skipped, counted in `rows_lost` by cause, and warned about once per series.
- A write that raises is followed at once by one row at a time (each row its own write, tried twice): a
  row that fails alone while others land is one the backend refuses (skipped, counted, warned once);
  when none lands the backend is down and the rest of the window is retried with backoff.
- Rows a write has landed are never handed to the backend again: a backend whose window write is not
  all-or-nothing (one client call per step or per value) reports what landed with `mark_written`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from abc import ABC
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_train import routing
from otel_train._internal import sdk
from otel_train._internal.ratelimit import LogOnce
from otel_train.collect.sdk_rows import MetricsConverter, span_rows
from otel_train.exporter_options import ExporterOptions
from otel_train.rows import HistogramRow, MetricRow, SpanRow
from otel_train.run_identity import RunInfo
from otel_train.step_order import StepOrder

if TYPE_CHECKING:
    from types import TracebackType

    from opentelemetry.sdk.trace import ReadableSpan

__all__ = ["DELTA_TEMPORALITY", "LOSS_CAUSES", "RowExporter", "Window"]

_logger = logging.getLogger(__name__)

_SyncGauge = sdk.sync_gauge_class()  # the SDK's temporality-preference env var skips it, so name it here

#: DELTA for every instrument kind: the SDK frees per-step attribute sets after each collection,
#: and the records layer turns DELTA sums back into running totals.
DELTA_TEMPORALITY: dict[type, AggregationTemporality] = {
    kind: AggregationTemporality.DELTA
    for kind in (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter, ObservableGauge,
                 _SyncGauge)
    if kind is not None
}


#: Why a backend did not write a row (`RowExporter.rows_lost`), as the shutdown summary words it.
LOSS_CAUSES: dict[str, str] = {
    "bad_step": "bad step",
    "bad_value": "bad value",
    "refused": "refused by the backend",
    "gave_up": "given up after retries",
}
_NUMBERS = (float, int)
_DOWN_AFTER = 4  # rows failing (twice each), none landing, after which a backend counts as down


class Window:
    """The rows of one export window."""

    __slots__ = ("histograms", "metrics", "spans")

    def __init__(
        self,
        metrics: Sequence[MetricRow] = (),
        histograms: Sequence[HistogramRow] = (),
        spans: Sequence[SpanRow] = (),
    ) -> None:
        self.metrics = metrics
        self.histograms = histograms
        self.spans = spans

    def __bool__(self) -> bool:
        return bool(self.metrics or self.histograms or self.spans)


class RowExporter(MetricExporter, SpanExporter, ABC):
    """Base of every backend. Subclasses override the `write_*` hooks they support.

    Hooks run on one export thread at a time (the base serialises them); they may raise.

    The backend-facing contract (what a backend defines or overrides; nothing else):

    - class attributes `name`, `handles_metrics`, `handles_spans`, `client_module`, `display_names`,
      `kill_safe_writes`, and the retry tuning `max_pending_windows`, `max_attempts`, `backoff_s`,
      `isolate_rows`;
    - `write_metrics`, `write_spans` (one window's rows), `flush`, `close`, and optionally `row_problem`,
      `durable_step`, `write_resume`, `mark_preempted`, `preload`; `mark_written` to call from a write
      that is not all-or-nothing.

    The rest is called by delivery (`otel_train.ship.delivery`) or an OTel pipeline and is not overridden:
    `export_window` (routing, step order, retry, row isolation), `resume`, `force_flush`, `shutdown`,
    `preempt_at_close`, `forget_pending_after_fork`, and the OTel entry point `export`.

    Args:
        options: Directory, project, hyperparameters and rank policy; default from the env vars.
    """

    #: Which kinds of data the backend writes (the reader skips work for the others).
    handles_metrics: bool = True
    handles_spans: bool = False
    #: Registry name, used in log messages.
    name: str = "row"
    #: The backend's client package (an optional extra), imported by `preload`.
    client_module: str | None = None
    #: Dashboards that group by ``/`` show built-in series under their display names (`otel_train.semconv`).
    display_names: bool = False
    #: Every successful `export_window` has appended the window to the backend's own files and handed it to
    #: the OS, so delivery may record it as written at once: a process killed later does not write it again.
    kill_safe_writes: bool = False
    #: Whether the backend holds a row whose step went backwards in its series as logged; False (TensorBoard, W&B):
    #: under `OTEL_TRAIN_STEP_ORDER=warn` such a row is skipped and counted here (`otel_train.step_order`).
    stores_older_steps: bool = True
    #: Failed windows kept for retry before the oldest is dropped, tries of one window before it is dropped
    #: (0: never), and the waits between tries: a backend whose failures are outages (a collector) keeps more.
    max_pending_windows: int = 64
    #: After a failed write, try its rows one at a time to find one the backend refuses (see the module
    #: docstring). None: when `max_attempts` is non-zero; a backend whose failures are outages (retried for
    #: as long as it takes, e.g. a collector that is down) would only pay a timeout per row.
    isolate_rows: bool | None = None
    max_attempts: int = 8
    backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 15.0, 60.0)

    def __init__(self, options: ExporterOptions | None = None) -> None:
        # DELTA, as in our reader: on a plain SDK pipeline a counter with a per-step attribute then
        # still becomes a running total here (and the SDK frees per-step attribute sets).
        MetricExporter.__init__(self, preferred_temporality=dict(DELTA_TEMPORALITY))
        # Routing (`OTEL_TRAIN_<BACKEND>_*`): the backend's own options (its `_RANKS`) and row filter.
        self.options, self._route = routing.bind(
            self.name, options if options is not None else ExporterOptions.from_env(), self.display_names)
        self._converter = MetricsConverter()
        self._lock = threading.RLock()
        self._pending: deque[Window] = deque()
        self._attempts = 0
        self._retry_at = 0.0
        self._closed = False
        self._log = LogOnce(_logger, interval_s=60.0)
        self.failures = 0
        self.dropped_windows = 0
        #: Rows (metric, histogram, span) this backend did not write, by cause (keys of `LOSS_CAUSES`).
        self.rows_lost: dict[str, int] = {}
        self._warned_series: set[tuple[str, str]] = set()
        # ids of the head pending window's rows the backend has landed (a retry skips them).
        self._landed_ids: set[int] = set()
        self._preempted: str | None = None
        #: The step-order policy (`OTEL_TRAIN_STEP_ORDER`) and its counters, applied in `export_window`.
        self.step_order = StepOrder(self.options.step_order, self.name, self.stores_older_steps)

    # -- hooks -------------------------------------------------------------------------------
    @classmethod
    def preload(cls) -> None:
        """Import the backend's client now: backends call it first thing in `__init__`, and the sink
        at start, so that its first run does not pay for the imports. Must not create anything.

        Raises:
            ModuleNotFoundError: the client is not installed (the message has the install line).
        """
        if cls.client_module is None:
            return
        import importlib

        try:
            importlib.import_module(cls.client_module)
        except ImportError as err:
            raise ModuleNotFoundError(f"{cls.__name__} needs {cls.client_module}: "
                                      f"pip install 'otel-train[{cls.client_module}]'", name=cls.client_module) from err

    def row_problem(self, row: MetricRow | HistogramRow) -> str | None:
        """Why this backend cannot write `row` (a `LOSS_CAUSES` key), or None. Called for every metric and
        histogram row before a write; a backend that refuses more (a name, a range) extends it."""
        if type(row.step) is not int:
            return "bad_step"
        if isinstance(row, MetricRow) and (type(row.value) not in _NUMBERS
                                           and not isinstance(row.value, _NUMBERS)):
            return "bad_value"
        return None

    def mark_written(self, rows: Sequence[MetricRow | HistogramRow | SpanRow]) -> None:
        """Record that `rows` (of the window being written) landed: if a later part of the write raises,
        the retry does not hand them to the backend again. Backends whose window write is one
        all-or-nothing append need not call it."""
        self._landed_ids.update(map(id, rows))

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        """Write one window's scalar rows (and full histograms). Runs on the export thread."""

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        """Write one window's finished spans. Runs on the export thread."""

    def write_resume(self, run: RunInfo, step: int) -> None:
        """The run (this rank of it) restarts at `step`: supersede the earlier attempt's steps >= `step`
        the way this backend can. Runs on the export thread, after every row delivered before it.

        The default records it in `options.resume_step`, which run-based backends read when they open
        their run (as for `init(resume_step=)`); a run already open keeps the steps it holds.
        """
        self.options = dataclasses.replace(self.options, resume_step=step)

    def flush(self) -> None:
        """Make everything written so far durable / visible."""

    def durable_step(self) -> int | None:
        """How far this backend's own store holds what it was handed, after `flush`: None when it holds
        everything (the default: writes are synchronous), else the highest step it holds for sure (a client
        that writes its store on its own schedule). Delivery moves the backend's cursor only that far."""
        return None

    def close(self) -> None:
        """Release the backend (close files, finish the run). Called once."""

    def mark_preempted(self, cause: str) -> None:
        """Mark the run as preempted, where the backend has that notion (a tag, a status, a record).

        Called once, on the exporter's own thread, after the last window was written and flushed
        and before `close`, when the training process ended on `cause` (``SIGTERM`` or
        ``SIGUSR1``); never on SIGINT, a normal exit or `otel-train replay`. Default: nothing.
        """

    def preempt_at_close(self, cause: str) -> None:
        """Have `shutdown` call `mark_preempted(cause)` before `close` (any thread; one attribute set,
        so a backend busy in a write never blocks the signal's hand-off)."""
        self._preempted = cause

    # -- the row path (used by the step-aligned reader) ------------------------------------------
    def export_window(self, window: Window) -> bool:
        """Write a window, retrying earlier failed ones first. Returns False if anything failed."""
        with self._lock:
            if self._closed:
                return False
            if window and self._route is not None:
                window = Window(*self._route.apply(window.metrics, window.histograms, window.spans))
            if window:
                if self.handles_metrics and (window.metrics or window.histograms):
                    window = self._in_step_order(window)
                self._pending.append(window)
                while len(self._pending) > self.max_pending_windows:
                    if len(self._pending) > 1 and self._landed_ids:  # the head is partly written: drop the next
                        self._lose_window(self._pending[1], "gave_up")
                        del self._pending[1]
                    else:
                        self._lose_window(self._pending.popleft(), "gave_up")
            return self._drain(force=False)

    def resume(self, run: RunInfo, step: int) -> bool:
        """Apply a resume (`otel_train.resume`) in order: windows still pending first, then `write_resume`;
        the step order of `run`'s rank restarts. Isolated like a write. Returns False if it failed."""
        with self._lock:
            if self._closed:
                return False
            if run.rank and self.options.ranks == "0":
                # This backend writes no metrics of that rank (`OTEL_TRAIN_RANKS`): nothing to supersede, and a
                # marker there could supersede rank 0's steps (TensorBoard reads one folder as one run).
                return True
            ok = self._drain(force=True)
            self.step_order.restart(run.run_id, run.rank)
            try:
                self.write_resume(run, step)
            except Exception as err:
                self.failures += 1
                self._log.error("resume", "exporter `%s` could not record the resume at step %d (%s: %s)",
                                self.name, step, type(err).__name__, err)
                return False
            return ok

    def _in_step_order(self, window: Window) -> Window:
        metrics = self.step_order.filter(window.metrics)
        histograms = self.step_order.filter(window.histograms)
        if metrics is window.metrics and histograms is window.histograms:
            return window
        return Window(metrics, histograms, window.spans)

    def _drain(self, force: bool) -> bool:
        if not self._pending:
            return True
        if not force and self._attempts and time.monotonic() < self._retry_at:
            return False
        while self._pending:
            window = self._pending[0]
            try:
                self._write_window(window)
            except Exception as err:  # isolate the backend: find a refused row, else retry later
                self.failures += 1
                self._attempts += 1
                isolate = self.isolate_rows if self.isolate_rows is not None else bool(self.max_attempts)
                rest = self._one_row_at_a_time(window) if isolate else window
                if rest is None:
                    self._done_with_head()
                    continue
                self._pending[0] = rest
                if self.max_attempts and self._attempts >= self.max_attempts:
                    # A window the backend rejects every time must not hold back every later one.
                    self._done_with_head()
                    self._lose_window(rest, "gave_up")
                    self._log.error(
                        "poison",
                        "exporter `%s` rejected one window %d times (%s: %s); dropped it and moved on "
                        "(logged at most once a minute)",
                        self.name, self.max_attempts, type(err).__name__, err,
                    )
                    continue
                delay = self.backoff_s[min(self._attempts, len(self.backoff_s)) - 1]
                self._retry_at = time.monotonic() + delay
                self._log.error(
                    "write",
                    "exporter `%s` failed (%s: %s); %d failure(s) so far, retrying in %.0f s "
                    "(logged at most once a minute)",
                    self.name, type(err).__name__, err, self.failures, delay,
                )
                return False
            self._done_with_head()
        return True

    def _done_with_head(self) -> None:
        self._pending.popleft()
        self._landed_ids.clear()
        self._attempts = 0

    def _write_window(self, window: Window) -> None:
        """Hand the rows of `window` not landed yet to the backend; the rows it cannot take are lost here."""
        landed = self._landed_ids
        metrics, histograms, spans = window.metrics, window.histograms, window.spans
        if landed:
            metrics = [r for r in metrics if id(r) not in landed]
            histograms = [h for h in histograms if id(h) not in landed]
            spans = [s for s in spans if id(s) not in landed]
        if self.handles_metrics and (metrics or histograms):
            metrics, histograms = self._writable(metrics), self._writable(histograms)
            if metrics or histograms:
                self.write_metrics(metrics, histograms)
                self.mark_written(metrics)
                self.mark_written(histograms)
        if self.handles_spans and spans:
            self.write_spans(spans)
            self.mark_written(spans)

    def _writable(self, rows: Sequence[Any]) -> Sequence[Any]:
        problem = self.row_problem
        bad = [i for i, r in enumerate(rows) if problem(r) is not None]
        if not bad:
            return rows
        for i in bad:
            self._lose(rows[i], problem(rows[i]) or "refused", None)
        skip = set(bad)
        return [r for i, r in enumerate(rows) if i not in skip]

    def _one_row_at_a_time(self, window: Window) -> Window | None:
        """After a failed write: each row not landed yet as a write of its own (tried twice). When some row
        lands, the backend is up: a row that failed alone is one it refuses (lost, counted, warned once).
        When none lands, it is down: the rows from the first failure on are returned for a retry (None:
        nothing is left)."""
        singles: list[Window] = []
        if self.handles_metrics:
            singles += [Window([r]) for r in window.metrics if id(r) not in self._landed_ids]
            singles += [Window((), [h]) for h in window.histograms if id(h) not in self._landed_ids]
        if self.handles_spans:
            singles += [Window(spans=[s]) for s in window.spans if id(s) not in self._landed_ids]
        failed: list[tuple[Window, Exception]] = []
        landed = False
        for single in singles:
            error: Exception | None = None
            for _ in range(2):  # a row that fails twice in a row, alone
                try:
                    self._write_window(single)
                except Exception as err:
                    self.failures += 1
                    error = err
                    continue
                landed, error = True, None
                break
            if error is not None:
                failed.append((single, error))
                if not landed and len(failed) >= _DOWN_AFTER:
                    break
        if not failed:
            return None
        if not landed:
            rest = [_only_row(w) for w in singles[singles.index(failed[0][0]):]]
            return Window([r for r in rest if isinstance(r, MetricRow)],
                          [r for r in rest if isinstance(r, HistogramRow)], [r for r in rest if isinstance(r, SpanRow)])
        for single, why in failed:
            self._lose(_only_row(single), "refused", why)
        return None

    def _lose(self, row: Any, cause: str, err: Exception | None) -> None:
        self.rows_lost[cause] = self.rows_lost.get(cause, 0) + 1
        series = str(getattr(row, "tag", None) or getattr(row, "name", "?"))
        if (cause, series) in self._warned_series:
            return
        self._warned_series.add((cause, series))
        detail = f" ({type(err).__name__}: {err})" if err is not None else ""
        _logger.warning("exporter `%s` skipped a row of series `%s` at step %r: %s%s; the rest of its window is "
                        "written, later rows of this series that fail the same way are counted, not warned "
                        "about", self.name, series, getattr(row, "step", None), LOSS_CAUSES.get(cause, cause), detail)

    def _lose_window(self, window: Window, cause: str) -> None:
        self.dropped_windows += 1
        n = len(window.metrics) + len(window.histograms) + len(window.spans)
        self.rows_lost[cause] = self.rows_lost.get(cause, 0) + n

    # -- MetricExporter / SpanExporter ------------------------------------------------------------
    def export(self, data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:  # type: ignore[override]
        """OTel entry point: `MetricsData` (metric pipeline) or a sequence of spans (trace pipeline)."""
        if isinstance(data, MetricsData):
            rows, hists = self._converter.rows(data)
            ok = self.export_window(Window(rows, hists))
            return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE
        spans: Sequence[ReadableSpan] = data
        ok = self.export_window(Window(spans=span_rows(spans, self._converter)))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        with self._lock:
            if self._closed:
                return True
            ok = self._drain(force=True)
            try:
                self.flush()
            except Exception as err:
                self.failures += 1
                self._log.error("flush", "exporter `%s` flush failed: %s", self.name, err)
                return False
            return ok

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Flush what is pending and close the backend; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._drain(force=True)
            if self._pending:
                _logger.warning(
                    "exporter `%s` closed with %d window(s) it could not write", self.name, len(self._pending)
                )
            self._closed = True
            if self._route is not None:
                self._route.report()  # "pattern ... matched no metric", once
            try:
                self.flush()
            except Exception as err:
                _logger.error("exporter `%s` flush at shutdown failed: %s", self.name, err)
            if self._preempted is not None:
                try:
                    self.mark_preempted(self._preempted)
                except Exception as err:
                    _logger.error("exporter `%s` could not mark the run preempted: %s", self.name, err)
            try:
                self.close()
            except Exception as err:
                _logger.error("exporter `%s` close failed: %s", self.name, err)

    def forget_pending_after_fork(self) -> None:
        """In a forked child: drop the windows waiting for a retry (the parent's rows: the parent writes
        them) and the lock a parent's thread may have held at the fork. Called by delivery."""
        self._lock = threading.RLock()
        self._pending.clear()
        self._landed_ids.clear()
        self._attempts = 0

    @property
    def unwritten_windows(self) -> int:
        """Windows accepted and not written yet (waiting for a retry)."""
        return len(self._pending)

    def __enter__(self) -> RowExporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()


def _only_row(window: Window) -> MetricRow | HistogramRow | SpanRow:
    rows: list[MetricRow | HistogramRow | SpanRow] = [*window.metrics, *window.histograms, *window.spans]
    return rows[0]
