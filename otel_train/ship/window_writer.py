"""The one retry policy: how a window reaches one backend's `write_*` hooks (`otel_train.backend`).

Every `RowExporter` has one `WindowWriter`, which `export_window`, `resume`, `force_flush` and `shutdown`
hand their work to, whoever calls them: delivery's feed of that backend (`otel_train.ship.backend_feed`) or an
OTel SDK pipeline. It runs the backend's hooks one at a time (its lock) and never lets one raise:

- Routing (`otel_train.config.routing`) filters each window first, then the step-order policy
  (`otel_train.vocab.step_order`) takes out the rows going backwards that the backend is not to get.
- Before a write, every row is checked (`row_problem`: the generic checks, plus the backend's own); a row
  it refuses is skipped, counted in `rows_lost` by cause, and warned about once per series.
- A write that raises is counted in `failures` and followed at once by one row at a time (each row its own
  write, tried twice): a row that fails alone while others land is one the backend refuses (skipped,
  counted, warned once); when none lands the backend is down and the rest of the window waits for a retry.
- Waiting windows are retried in order, with backoff (`backoff_s`), before any new one. Memory only (no
  spool behind the backend), one retried `max_attempts` times is dropped (given up, counted), and past
  `max_pending_windows` the oldest goes. With a spool behind it (`keep_failed`, set by delivery), given up is
  a state, not a loss: the window stays pending (and in the spool, the cursor before it) and is retried with
  a backoff that keeps growing, past `backoff_s`, to `MAX_BACKOFF_S`, for as long as the backend lives.
- Rows a write has landed are never handed to the backend again: a backend whose window write is not
  all-or-nothing (one client call per step or per value) reports what landed with `mark_written`.
- A full disk (`otel_train.ship.file_append.is_disk_full`) is an outage, not a refused row: no row-at-a-time, no
  giving up, a retry every `backoff_s[0]`; windows past `max_pending_windows` or still waiting at close are
  counted as lost to it (``disk_full``).
- A forked child forgets the windows waiting (its parent writes them); at shutdown what is waiting gets one
  last try, then the backend is flushed, marked preempted if the run was, and closed, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

from otel_train._internal.ratelimit import LogOnce
from otel_train.ship.file_append import is_disk_full
from otel_train.vocab.rows import LOSS_CAUSES, HistogramRow, LogRow, MetricRow, SpanRow, Window
from otel_train.vocab.step_order import StepOrder

if TYPE_CHECKING:
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.config.routing import RowFilter
    from otel_train.vocab.run_identity import RunInfo

__all__ = ["BackendHooks", "WindowWriter"]

_logger = logging.getLogger(__name__)
_DOWN_AFTER = 4  # rows failing (twice each), none landing, after which a backend counts as down
#: The longest wait between two tries of a window kept after `max_attempts` (`WindowWriter.keep_failed`).
MAX_BACKOFF_S = 300.0
_STEP, _VALUE = attrgetter("step"), attrgetter("value")
_INT, _NUMBER_TYPES = frozenset({int}), frozenset({float, int})


class BackendHooks(Protocol):
    """What the writer reads and calls on a backend: `otel_train.backend.RowExporter`'s contract as a type, so
    the policy depends on the contract's shape, not on the base class (which builds a writer of its own)."""

    name: str
    options: ExporterOptions
    handles_metrics: bool
    handles_spans: bool
    handles_logs: bool
    stores_older_steps: bool
    max_pending_windows: int
    max_attempts: int
    backoff_s: tuple[float, ...]
    isolate_rows: bool | None

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None: ...
    def write_spans(self, rows: Sequence[SpanRow]) -> None: ...
    def write_logs(self, rows: Sequence[LogRow]) -> None: ...
    def write_resume(self, run: RunInfo, step: int) -> None: ...
    def row_problem(self, row: MetricRow | HistogramRow) -> str | None: ...
    def mark_written(self, rows: Sequence[MetricRow | HistogramRow | SpanRow | LogRow]) -> None: ...
    def mark_preempted(self, cause: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class WindowWriter:
    """Writes windows to one backend through its hooks, with routing, step order, row checks and isolation,
    retry with backoff and loss counting (see the module docstring). The backend's class attributes
    (`max_pending_windows`, `max_attempts`, `backoff_s`, `isolate_rows`, `handles_*`) tune it.

    Args:
        backend: The backend whose hooks it calls.
        route: The backend's row filter (`otel_train.config.routing.bind`); None: every row unchanged.
        plain_rows_only: The backend refuses no row beyond the generic checks (it keeps the base `row_problem`):
            rows are checked in bulk.
    """

    def __init__(self, backend: BackendHooks, route: RowFilter | None, plain_rows_only: bool = False) -> None:
        self.backend = backend
        self.route = route
        #: Held around every hook call (reentrant: a backend's `shutdown` override may hold it around ours).
        self.lock = threading.RLock()
        #: Windows accepted and not written yet, oldest first (the head may be partly written).
        self.pending: deque[Window] = deque()
        self._attempts = 0
        self._retry_at = 0.0
        #: Keep a window past `max_attempts` instead of dropping it (delivery sets it when a spool holds the
        #: windows: the cursor stays before it, and `otel-train replay` retries it if the run ends first).
        self.keep_failed = False
        # ids of the head pending window's rows the backend has landed (a retry skips them).
        self._landed_ids: set[int] = set()
        self.closed = False
        #: The cause `shutdown` marks the run preempted with (`RowExporter.preempt_at_close`).
        self.preempted: str | None = None
        self._log = LogOnce(_logger, interval_s=60.0)
        #: Writes (and resumes, flushes) that raised.
        self.failures = 0
        #: Windows given up on (retried too often, or past `max_pending_windows`).
        self.dropped_windows = 0
        #: Rows (metric, histogram, span) this backend did not write, by cause (keys of `LOSS_CAUSES`).
        self.rows_lost: dict[str, int] = {}
        self._disk_full = False  # the last write failed on a full disk (cleared by the next that lands)
        self._warned_series: set[tuple[str, str]] = set()
        #: The step-order policy (`OTEL_TRAIN_STEP_ORDER`) and its counters.
        self.step_order = StepOrder(backend.options.step_order, backend.name, backend.stores_older_steps)
        self._plain_rows_only = plain_rows_only  # rows checked in bulk (`_writable`)

    # -- what RowExporter hands over ------------------------------------------------------------
    def write(self, window: Window) -> bool:
        """Write a window, retrying earlier failed ones first. Returns False if anything failed."""
        with self.lock:
            if self.closed:
                return False
            if window and self.route is not None:
                window = Window(*self.route.apply(window.metrics, window.histograms, window.spans),
                                self.route.apply_logs(window.logs))
            if window:
                if self.backend.handles_metrics and (window.metrics or window.histograms):
                    window = self._in_step_order(window)
                self.pending.append(window)
                while len(self.pending) > self.backend.max_pending_windows:
                    cause = "disk_full" if self._disk_full else "gave_up"
                    if len(self.pending) > 1 and self._landed_ids:  # the head is partly written: drop the next
                        self._lose_window(self.pending[1], cause)
                        del self.pending[1]
                    else:
                        self._lose_window(self.pending.popleft(), cause)
            return self.drain(force=False)

    def resume(self, run: RunInfo, step: int) -> bool:
        """Windows still pending first, then the backend's `write_resume`; the step order of `run`'s rank
        restarts. Returns False if it failed."""
        backend = self.backend
        with self.lock:
            if self.closed:
                return False
            if run.rank and backend.options.ranks == "0":
                # This backend writes no metrics of that rank (`OTEL_TRAIN_RANKS`): nothing to supersede, and a
                # marker there could supersede rank 0's steps (TensorBoard reads one folder as one run).
                return True
            ok = self.drain(force=True)
            self.step_order.restart(run.run_id, run.rank)
            try:
                backend.write_resume(run, step)
            except Exception as err:
                self.failures += 1
                self._log.error("resume", "exporter `%s` could not record the resume at step %d (%s: %s)",
                                backend.name, step, type(err).__name__, err)
                return False
            return ok

    def flush(self) -> bool:
        """Retry what is pending now (no backoff wait), then the backend's `flush`."""
        with self.lock:
            if self.closed:
                return True
            ok = self.drain(force=True)
            try:
                self.backend.flush()
            except Exception as err:
                self.failures += 1
                self._log.error("flush", "exporter `%s` flush failed: %s", self.backend.name, err)
                return False
            return ok

    def close(self) -> None:
        """One last try of what is pending, then `flush`, `mark_preempted` (if asked) and `close`; once."""
        backend = self.backend
        with self.lock:
            if self.closed:
                return
            self.drain(force=True)
            if self.pending:
                # Kept by a spool, delivery's close says which windows stay there for `otel-train replay`.
                (_logger.debug if self.keep_failed else _logger.warning)(
                    "exporter `%s` closed with %d window(s) it could not write%s", backend.name, len(self.pending),
                    " (disk full)" if self._disk_full else "")
                # Counted: the summary must not read as if they had landed. Kept windows are the spool's (delivery
                # counts those the spool could not write ahead); without a spool (in-process) they are lost here.
                if not self.keep_failed:
                    for window in self.pending:
                        self._lose_window(window, "disk_full" if self._disk_full else "at_close", self._landed_ids)
            self.closed = True
            if self.route is not None:
                self.route.report()  # "pattern ... matched no metric", once
            try:
                backend.flush()
            except Exception as err:
                _logger.error("exporter `%s` flush at shutdown failed: %s", backend.name, err)
            if self.preempted is not None:
                try:
                    backend.mark_preempted(self.preempted)
                except Exception as err:
                    _logger.error("exporter `%s` could not mark the run preempted: %s", backend.name, err)
            try:
                backend.close()
            except Exception as err:
                _logger.error("exporter `%s` close failed: %s", backend.name, err)

    def forget_pending_after_fork(self) -> None:
        """In a forked child: drop the windows waiting for a retry (the parent's rows: the parent writes
        them) and the lock a parent's thread may have held at the fork."""
        self.lock = threading.RLock()
        self.pending.clear()
        self._landed_ids.clear()
        self._attempts = 0

    def mark_landed(self, rows: Sequence[MetricRow | HistogramRow | SpanRow | LogRow]) -> None:
        """`rows` of the head window landed (`RowExporter.mark_written`): a retry skips them."""
        self._landed_ids.update(map(id, rows))

    # -- the retry loop -------------------------------------------------------------------------
    def drain(self, force: bool) -> bool:
        """Write the pending windows in order; False when one failed (it waits for the next try). Without
        `force`, nothing is tried before the backoff of the last failure has passed."""
        if not self.pending:
            return True
        if not force and self._attempts and time.monotonic() < self._retry_at:
            return False
        backend = self.backend
        while self.pending:
            window = self.pending[0]
            try:
                self._write_window(window)
            except Exception as err:  # isolate the backend: find a refused row, else retry later
                self.failures += 1
                self._attempts += 1
                self._disk_full = full = is_disk_full(err)
                if full:  # an outage that ends when space returns: never given up, tried every `backoff_s[0]`
                    self._attempts = 1
                isolate = backend.isolate_rows if backend.isolate_rows is not None else bool(backend.max_attempts)
                rest = self._one_row_at_a_time(window) if isolate and not full else window
                if rest is None:
                    self._done_with_head()
                    continue
                self.pending[0] = rest
                if backend.max_attempts and self._attempts >= backend.max_attempts and not self.keep_failed:
                    # A window the backend rejects every time must not hold back every later one.
                    self._done_with_head()
                    self._lose_window(rest, "gave_up")
                    self._log.error(
                        "poison",
                        "exporter `%s` rejected one window %d times (%s: %s); dropped it and moved on "
                        "(logged at most once a minute)",
                        backend.name, backend.max_attempts, type(err).__name__, err,
                    )
                    continue
                delay = self._backoff_s()
                self._retry_at = time.monotonic() + delay
                if self.keep_failed and self._attempts == backend.max_attempts:
                    self._log.error(
                        "kept", "exporter `%s` failed %d times on one window (%s: %s); it is kept, not dropped: "
                        "retried with a backoff growing to %.0f s while the run lives, left in the spool for "
                        "`otel-train replay` after it", backend.name, self._attempts, type(err).__name__, err,
                        MAX_BACKOFF_S)
                self._log.error(
                    "write",
                    "exporter `%s` failed (%s: %s); %d failure(s) so far, retrying in %.0f s "
                    "(logged at most once a minute)",
                    backend.name, type(err).__name__, err, self.failures, delay,
                )
                return False
            self._done_with_head()
        return True

    def _backoff_s(self) -> float:
        """The wait before the next try: `backoff_s` by attempt; past it and `max_attempts` (a kept window), the
        wait doubles up to `MAX_BACKOFF_S`. A backend retried for as long as it takes (`max_attempts` 0: a
        collector that is down) keeps its own table."""
        table = self.backend.backoff_s
        delay = table[min(self._attempts, len(table)) - 1]
        beyond = self._attempts - max(len(table), self.backend.max_attempts)
        if self.keep_failed and self.backend.max_attempts and beyond > 0:
            delay = min(MAX_BACKOFF_S, max(delay, MAX_BACKOFF_S if beyond >= 16 else delay * 2.0 ** beyond))
        return delay

    def retry_in_s(self) -> float:
        """Seconds until a failed window is due for its next try (0: due now, or nothing failed)."""
        return max(0.0, self._retry_at - time.monotonic()) if self.pending and self._attempts else 0.0

    def _done_with_head(self) -> None:
        self.pending.popleft()
        self._landed_ids.clear()
        self._attempts = 0
        self._disk_full = False

    def _in_step_order(self, window: Window) -> Window:
        metrics = self.step_order.filter(window.metrics)
        histograms = self.step_order.filter(window.histograms)
        if metrics is window.metrics and histograms is window.histograms:
            return window
        return Window(metrics, histograms, window.spans, window.logs)

    def _write_window(self, window: Window) -> None:
        """Hand the rows of `window` not landed yet to the backend; the rows it cannot take are lost here."""
        backend = self.backend
        landed = self._landed_ids
        metrics, histograms, spans, logs = window.metrics, window.histograms, window.spans, window.logs
        if landed:
            metrics = [r for r in metrics if id(r) not in landed]
            histograms = [h for h in histograms if id(h) not in landed]
            spans = [s for s in spans if id(s) not in landed]
            logs = [g for g in logs if id(g) not in landed]
        writes_logs = backend.handles_logs and bool(logs)
        if backend.handles_metrics and (metrics or histograms):
            metrics, histograms = self._writable(metrics), self._writable(histograms)
            if metrics or histograms:
                backend.write_metrics(metrics, histograms)
                if (backend.handles_spans and spans) or writes_logs:  # a later failure retries only the rest
                    backend.mark_written(metrics)
                    backend.mark_written(histograms)
        if backend.handles_spans and spans:
            backend.write_spans(spans)
            backend.mark_written(spans)
        if writes_logs:
            backend.write_logs(logs)
            backend.mark_written(logs)

    def _writable(self, rows: Sequence[Any]) -> Sequence[Any]:
        if self._plain_rows_only and rows and {*map(type, map(_STEP, rows))} <= _INT and (
                not isinstance(rows[0], MetricRow) or {*map(type, map(_VALUE, rows))} <= _NUMBER_TYPES):
            return rows  # every step an int, every value a number: what the base `row_problem` checks, in C
        problem = self.backend.row_problem
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
        if self.backend.handles_metrics:
            singles += [Window([r]) for r in window.metrics if id(r) not in self._landed_ids]
            singles += [Window((), [h]) for h in window.histograms if id(h) not in self._landed_ids]
        if self.backend.handles_spans:
            singles += [Window(spans=[s]) for s in window.spans if id(s) not in self._landed_ids]
        if self.backend.handles_logs:
            singles += [Window(logs=[g]) for g in window.logs if id(g) not in self._landed_ids]
        failed: list[tuple[Window, Exception]] = []
        landed = False
        for single in singles:
            error: Exception | None = None
            for _ in range(2):  # a row that fails twice in a row, alone
                try:
                    self._write_window(single)
                except Exception as err:  # not a failure of its own: the window's failed write is counted once
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
                          [r for r in rest if isinstance(r, HistogramRow)], [r for r in rest if isinstance(r, SpanRow)],
                          [r for r in rest if isinstance(r, LogRow)])
        for single, why in failed:
            self._lose(_only_row(single), "refused", why)
        return None

    # -- loss counting --------------------------------------------------------------------------
    def _lose(self, row: Any, cause: str, err: Exception | None) -> None:
        self.rows_lost[cause] = self.rows_lost.get(cause, 0) + 1
        series = str(getattr(row, "tag", None) or getattr(row, "name", "?"))
        if (cause, series) in self._warned_series:
            return
        self._warned_series.add((cause, series))
        detail = f" ({type(err).__name__}: {err})" if err is not None else ""
        _logger.warning("exporter `%s` skipped a row of series `%s` at step %r: %s%s; the rest of its window is "
                        "written, later rows of this series that fail the same way are counted, not warned "
                        "about", self.backend.name, series, getattr(row, "step", None), LOSS_CAUSES.get(cause, cause),
                        detail)

    def _lose_window(self, window: Window, cause: str, landed: set[int] | None = None) -> None:
        self.dropped_windows += 1
        rows = [*window.metrics, *window.histograms, *window.spans,
                *(window.logs if self.backend.handles_logs else ())]
        n = len(rows) if not landed else sum(id(r) not in landed for r in rows)
        self.rows_lost[cause] = self.rows_lost.get(cause, 0) + n


def _only_row(window: Window) -> MetricRow | HistogramRow | SpanRow | LogRow:
    rows: list[MetricRow | HistogramRow | SpanRow | LogRow] = [*window.metrics, *window.histograms, *window.spans,
                                                              *window.logs]
    return rows[0]
