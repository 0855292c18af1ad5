"""The backend contract: `Window` (the rows of one export window) and `RowExporter`, the one base class
every otel-train backend derives from. It belongs to the core: `exporters/` are plugins that import it
(``otel_train.exporters.base`` re-exports it for backends written against that path).

A `RowExporter` is a real OTel `MetricExporter` *and* `SpanExporter`, so a backend can be plugged into any
OTel SDK pipeline; and it takes pre-converted rows from the step-aligned reader, so one conversion serves
every backend. A backend only writes: its hooks may raise, and never overlap. How a window reaches them
(routing, step order, row checks, one row at a time after a failed write, retry with backoff, loss counts)
is the one policy every backend gets, `otel_train.ship.window_writer`; the class attributes below tune it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from abc import ABC
from collections.abc import Callable, Sequence
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

from otel_train._internal import sdk
from otel_train._internal.ratelimit import LogOnce
from otel_train.collect.sdk_rows import MetricsConverter, span_rows
from otel_train.config import routing
from otel_train.config.exporter_options import ExporterOptions
from otel_train.ship.window_writer import WindowWriter
from otel_train.vocab.rows import LOSS_CAUSES, HistogramRow, LogRow, MetricRow, SpanRow, Window
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.step_order import StepOrder

if TYPE_CHECKING:
    from types import TracebackType

    from opentelemetry.sdk.trace import ReadableSpan

__all__ = ["DELTA_TEMPORALITY", "LOSS_CAUSES", "RowExporter", "Window"]

_logger = logging.getLogger(__name__)

_SyncGauge = sdk.sync_gauge_class()  # the SDK's temporality-preference env var skips it, so name it here

#: DELTA for every instrument kind: the SDK frees per-step attribute sets after each collection,
#: and the rows converter (`otel_train.collect.sdk_rows.MetricsConverter`) turns DELTA sums back into running totals.
DELTA_TEMPORALITY: dict[type, AggregationTemporality] = {
    kind: AggregationTemporality.DELTA
    for kind in (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter, ObservableGauge,
                 _SyncGauge)
    if kind is not None
}


_NUMBERS = (float, int)


class RowExporter(MetricExporter, SpanExporter, ABC):
    """Base of every backend. Subclasses override the `write_*` hooks they support.

    Hooks run on one export thread at a time (their `window_writer` serialises them); they may raise.

    The backend-facing contract (what a backend defines, overrides or calls; nothing else):

    - class attributes `name`, `handles_metrics`, `handles_spans`, `handles_logs`, `client_module`, `display_names`,
      `kill_safe_writes`, `heavy_client`, and the retry tuning `max_pending_windows`, `max_attempts`, `backoff_s`,
      `isolate_rows`;
    - `write_metrics`, `write_spans`, `write_logs` (one window's rows), `flush`, `close`, and optionally `row_problem`,
      `durable_step`, `write_resume`, `mark_preempted`, `preload`; `mark_written` to call from a write
      that is not all-or-nothing; optionally `mark_appending` to call right before appending to files of its
      own (a kill -9 then never leaves a window in them twice); `options` and `_log` (a rate-limited logger)
      to read.

    The rest is called by delivery (`otel_train.ship.delivery`) or an OTel pipeline, is not overridden, and
    hands its work to `window_writer` (`otel_train.ship.window_writer.WindowWriter`): `export_window`,
    `resume`, `force_flush`, `shutdown`, `preempt_at_close`, `keep_failed_windows`, `retry_in_s`,
    `forget_pending_after_fork`, `unwritten_windows`,
    `watch_appends`, the counters `failures`, `dropped_windows`, `rows_lost`, `step_order`, and the OTel entry point `export`.

    Args:
        options: Directory, project, hyperparameters and rank policy; default from the env vars.
    """

    #: Which kinds of data the backend writes (the reader skips work for the others).
    handles_metrics: bool = True
    handles_spans: bool = False
    #: Whether the backend writes log records (`write_logs`); a backend without a place for them leaves it False.
    handles_logs: bool = False
    #: Registry name, used in log messages.
    name: str = "row"
    #: The backend's client package (an optional extra), imported by `preload`.
    client_module: str | None = None
    #: Dashboards that group by ``/`` show built-in series under their display names (`otel_train.vocab.semconv`).
    display_names: bool = False
    #: Every successful `export_window` has appended the window to the backend's own files and handed it to
    #: the OS, so delivery may record it as written at once: a process killed later does not write it again.
    kill_safe_writes: bool = False
    #: Delivery may hand it the windows that waited while it was busy as one (fewer, bigger writes). False: one
    #: window per call, as they came (the sink's reorder hold tells a sender starting over by its windows).
    merges_windows: bool = True
    #: Its client takes seconds to import and start (W&B, MLflow, ClearML, Trackio): in the exporter process, with
    #: another such backend beside it, each runs in a process of its own (`OTEL_TRAIN_BACKEND_PROCESSES`), so that
    #: their starts run side by side instead of taking turns on one interpreter. Never with `kill_safe_writes`.
    heavy_client: bool = False
    #: Whether the backend holds a row whose step went backwards in its series as logged; False (TensorBoard, W&B):
    #: under `OTEL_TRAIN_STEP_ORDER=warn` such a row is skipped and counted here (`otel_train.vocab.step_order`).
    stores_older_steps: bool = True
    #: Failed windows kept for retry before the oldest is dropped, tries of one window before it is dropped
    #: (0: never), and the waits between tries: a backend whose failures are outages (a collector) keeps more.
    max_pending_windows: int = 64
    #: After a failed write, try its rows one at a time to find one the backend refuses
    #: (`otel_train.ship.window_writer`). None: when `max_attempts` is non-zero; a backend whose failures are
    #: outages (retried for as long as it takes, e.g. a collector that is down) would only pay a timeout per row.
    isolate_rows: bool | None = None
    max_attempts: int = 8
    backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 15.0, 60.0)
    #: Who hears `mark_appending` (`watch_appends`); None: nobody (no spool, an OTel pipeline).
    _append_listener: Callable[[Sequence[tuple[str, int]]], None] | None = None

    def __init__(self, options: ExporterOptions | None = None) -> None:
        # DELTA, as in our reader: on a plain SDK pipeline a counter with a per-step attribute then
        # still becomes a running total here (and the SDK frees per-step attribute sets).
        MetricExporter.__init__(self, preferred_temporality=dict(DELTA_TEMPORALITY))
        # Routing (`OTEL_TRAIN_<BACKEND>_*`): the backend's own options (its `_RANKS`) and row filter.
        self.options, route = routing.bind(
            self.name, options if options is not None else ExporterOptions.from_env(), self.display_names)
        self._converter = MetricsConverter()
        #: Rate-limited logging for the backend's own warnings (once a minute per key).
        self._log = LogOnce(_logger, interval_s=60.0)
        #: How windows reach this backend's hooks: the one retry policy (`otel_train.ship.window_writer`).
        #: With the base `row_problem` (a backend refusing nothing more) rows are checked in bulk.
        self.window_writer = WindowWriter(self, route,
                                          plain_rows_only=type(self).row_problem is RowExporter.row_problem)

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

    @classmethod
    def store_fields(cls, options: ExporterOptions) -> dict[str, str]:
        """What the run's record keeps so that `otel-train verify` finds this backend's store (MLflow: its
        ``tracking_uri``), told from `options` and the environment alone: the record has it from the start, even
        for a job that ends while the backend is still starting. Must not import the client."""
        return {}

    def row_problem(self, row: MetricRow | HistogramRow) -> str | None:
        """Why this backend cannot write `row` (a `LOSS_CAUSES` key), or None. Called for every metric and
        histogram row before a write; a backend that refuses more (a name, a range) extends it."""
        if type(row.step) is not int:
            return "bad_step"
        if isinstance(row, MetricRow) and (type(row.value) not in _NUMBERS
                                           and not isinstance(row.value, _NUMBERS)):
            return "bad_value"
        return None

    def mark_written(self, rows: Sequence[MetricRow | HistogramRow | SpanRow | LogRow]) -> None:
        """Record that `rows` (of the window being written) landed: if a later part of the write raises,
        the retry does not hand them to the backend again. Backends whose window write is one
        all-or-nothing append need not call it."""
        self.window_writer.mark_landed(rows)

    def mark_appending(self, files: Sequence[tuple[str | os.PathLike[str], int]]) -> None:
        """Report, right before appending to files of the backend's own, each file and its size now in bytes
        (0 for one not created yet). Optional, for a backend whose writes are appends (`kill_safe_writes`):
        delivery records it before the append, and if the process is killed after the append but before
        delivery recorded the window as written, the files are cut back to these sizes when delivery resumes,
        so the window is written once (`otel_train.ship.append_intent`). Only appends may follow it until the
        write returns; a backend that never calls it keeps the older behaviour (the one window written just
        before a kill may be written twice)."""
        listener = self._append_listener
        if listener is not None:
            listener([(os.fspath(path), size) for path, size in files])

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        """Write one window's scalar rows (and full histograms). Runs on the export thread."""

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        """Write one window's finished spans. Runs on the export thread."""

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        """Write one window's log records (`handles_logs`). Runs on the export thread."""

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

    # -- what delivery and OTel pipelines call: handed to the backend's `window_writer` ------------------
    def export_window(self, window: Window) -> bool:
        """Write a window (routed, in step order, isolated, retried: `otel_train.ship.window_writer`), after
        earlier failed ones. Returns False if anything failed."""
        return self.window_writer.write(window)

    def resume(self, run: RunInfo, step: int) -> bool:
        """Apply a resume (`otel_train.resume`) in order: windows still pending first, then `write_resume`;
        the step order of `run`'s rank restarts. Isolated like a write. Returns False if it failed."""
        return self.window_writer.resume(run, step)

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
        """Retry what is pending now, then `flush`. Returns False if either failed."""
        return self.window_writer.flush()

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Flush what is pending and close the backend; safe to call twice."""
        self.window_writer.close()

    def preempt_at_close(self, cause: str) -> None:
        """Have `shutdown` call `mark_preempted(cause)` before `close` (any thread; one attribute set,
        so a backend busy in a write never blocks the signal's hand-off)."""
        self.window_writer.preempted = cause

    def watch_appends(self, listener: Callable[[Sequence[tuple[str, int]]], None] | None) -> None:
        """Have `listener` called (on the writing thread, before the append) with what the backend reports
        through `mark_appending`; None: nobody. Called by delivery."""
        self._append_listener = listener

    def keep_failed_windows(self) -> None:
        """A spool holds every window handed: one failing past `max_attempts` stays pending and is retried with a
        growing backoff instead of being dropped (nothing later is written meanwhile). Called by delivery."""
        self.window_writer.keep_failed = True

    def retry_in_s(self) -> float:
        """Seconds until a pending window's next try is due (0: none is waiting)."""
        return float(self.window_writer.retry_in_s())

    def forget_pending_after_fork(self) -> None:
        """In a forked child: drop the windows waiting for a retry (the parent's rows: the parent writes
        them) and the lock a parent's thread may have held at the fork. Called by delivery."""
        self.window_writer.forget_pending_after_fork()

    @property
    def unwritten_windows(self) -> int:
        """Windows accepted and not written yet (waiting for a retry)."""
        return len(self.window_writer.pending)

    def lost_handed(self) -> bool:
        """Whether the backend lost the windows it was handed that its store does not hold (a backend process
        started again, `otel_train.ship.backend_host`), since delivery last asked: delivery then hands them again
        from its spool, from the last window the store holds. Called by delivery after a failed write and at each flush."""
        return False

    # -- the writer's counters, read by delivery and the shutdown summary ------------------------------
    @property
    def failures(self) -> int:
        """Writes (and resumes, flushes) that raised."""
        return self.window_writer.failures

    @failures.setter
    def failures(self, value: int) -> None:
        self.window_writer.failures = value

    @property
    def dropped_windows(self) -> int:
        """Windows given up on after retries."""
        return self.window_writer.dropped_windows

    @dropped_windows.setter
    def dropped_windows(self, value: int) -> None:
        self.window_writer.dropped_windows = value

    @property
    def rows_lost(self) -> dict[str, int]:
        """Rows (metric, histogram, span) this backend did not write, by cause (keys of `LOSS_CAUSES`)."""
        return self.window_writer.rows_lost

    @property
    def step_order(self) -> StepOrder:
        """The step-order policy (`OTEL_TRAIN_STEP_ORDER`) and its counters, applied before a write."""
        return self.window_writer.step_order

    def __enter__(self) -> RowExporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

