"""Routes decoded rows to one set of backends per training run.

Rows are grouped by `train.run.id`; each run gets its own exporter instances (one backend run per
training run, all ranks inside it: rows carry their rank), fed by `otel_train.ship.delivery.Delivery` —
the code that feeds the exporter process's backends. Runs do not get threads of their own: every
run's backends take turns on a few threads per backend kind (`otel_train.sink.runs.pool.BackendPool`), so a
backend never sees two windows at once, and a slow or hung one stalls only its own run. Requests are
merged into larger windows when they queue up.

Runs are cheap to keep: a run idle for `idle_s` is closed, and at most `max_open_runs` runs hold their
backends (and files) open at once: opening one more closes the least recently used idle run (never one of
the request being admitted). Data arriving later reopens a closed run; its series state (`SeriesLedger`)
survives, with its spool (`otel_train.sink.runs.state`) or, without one, in memory. A request for a run that is
being closed just then, also one that began closing after the request looked it up, is refused with a short
retry-after (a run's spool and files never have two writers, and nothing is written into a closed one).

Accept and hold: with a spool folder, every request is written ahead to its run's spool (the exporter
process's `otel_train.ship.spool.Spool`), so a slow backend only makes its run's spool grow. A run is refused
(`Overloaded`: HTTP 503 / gRPC UNAVAILABLE, with a retry-after hint) only while it holds more than its
budget of bytes its backends have not taken yet, or all runs together more than theirs; without a spool,
while one of its backends has `queue_windows` requests queued. Never by waiting: a refusal is immediate.

A refused request changes nothing: admission of every run of a request is decided before any state
(series ledger, counts, aggregates) is touched, so a sender's retry of the same bytes is exact. A request is
acknowledged only once its rows and its run's ledger changes are written; if the spool cannot be written, the
ledger's changes are undone and the request is refused (a run of a multi-run request already taken is not
taken again on the retry: retries are idempotent, `otel_train.sink.runs.temporality`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train._internal.ratelimit import LogOnce
from otel_train.sink.decode.requests import Decoded
from otel_train.sink.fd_limits import FdBudget
from otel_train.sink.runs.aggregate import Aggregator
from otel_train.sink.runs.feed import RunFeed, spool_folder
from otel_train.sink.runs.pool import BackendPool
from otel_train.sink.runs.temporality import SeriesLedger
from otel_train.vocab.rows import MetricRow

if TYPE_CHECKING:
    from otel_train.backend import RowExporter

__all__ = ["ExporterFactory", "Overloaded", "Router", "spool_folder"]

_logger = logging.getLogger(__name__)
_UNWRITABLE = LogOnce(_logger, interval_s=60.0)

#: Builds a fresh list of backends for one run.
ExporterFactory = Callable[[], "list[RowExporter]"]

_KEEP_CLOSED = 100_000  # closed runs whose counter totals are kept, should they resume (~1 KiB each)
_CLOSING_RETRY_S = 0.2  # the retry-after told to a sender whose run is being closed just then


class Overloaded(RuntimeError):
    """A run's backends are too far behind: the client should retry later (HTTP 503 / gRPC UNAVAILABLE).

    Attributes:
        retry_after_s: How long the client is told to wait before retrying.
    """

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Router:
    """Groups rows by run and feeds each run's backends from one worker.

    Args:
        make_exporters: Builds the backends for a new run.
        aggregate: Cross-rank aggregates (``mean``, ``min``, ``max``); empty for none.
        aggregate_timeout_s: See `Aggregator`.
        idle_s: A run without data for this long is closed by `tick`.
        queue_windows: Requests held in memory per run and backend (without a spool: then refused).
        spool_dir: Where each run's requests are written ahead (None: memory only).
        spool_run_bytes: Bytes one run may hold for its backends before its requests are refused.
        spool_total_bytes: Bytes all runs together may hold before requests of runs holding any are refused.
        retry_after_s: The wait a refused sender is told.
        backend_threads: Threads per backend kind that every run's backends share.
        max_open_runs: Runs whose backends are open at once (the least recently used idle one is closed).
        fd_budget: Checked before a run opens: without descriptors to spare, idle runs are closed and the
            request is refused retryably (None: no check).
    """

    def __init__(self, make_exporters: ExporterFactory, aggregate: Sequence[str] = (),
                 aggregate_timeout_s: float = 30.0, idle_s: float = 300.0, queue_windows: int = 256,
                 spool_dir: Path | None = None, spool_run_bytes: int = 1 << 30, spool_total_bytes: int = 8 << 30,
                 retry_after_s: float = 1.0, backend_threads: int = 4, max_open_runs: int = 1000,
                 fd_budget: FdBudget | None = None) -> None:
        self._make = make_exporters
        self._aggregate = tuple(aggregate)
        self._aggregate_timeout_s = aggregate_timeout_s
        self.idle_s = idle_s
        self._queue_windows = queue_windows
        self._spool_dir = spool_dir
        self._run_budget = spool_run_bytes
        self._total_budget = spool_total_bytes
        self.retry_after_s = retry_after_s
        self.held_bytes = 0  # bytes all open runs hold for their backends (spool only)
        self._runs: OrderedDict[str, RunFeed] = OrderedDict()  # least recently used first
        self._closing: dict[str, RunFeed] = {}
        self._changed = threading.Condition()  # notified when a run has closed
        self.max_open_runs = max(1, max_open_runs)
        self.fds = fd_budget
        self.pool = BackendPool(backend_threads)
        self._closer = ThreadPoolExecutor(4, thread_name_prefix="otel-train-sink-close")
        self._converters: OrderedDict[str, SeriesLedger] = OrderedDict()  # without a spool: every run's ledger
        self._closed_counts: OrderedDict[str, tuple[int, int, int]] = OrderedDict()  # closed runs' ledger counts
        #: Rows closed runs' backends skipped for their step order (a step that went back in its series).
        self._order_skipped_closed: dict[str, dict[str, int]] = {}
        self._closed_summaries: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._counts = threading.Lock()  # the counters below: a `+=` from two threads could lose one
        self._closed = False
        self.points_in = 0
        self.spans_in = 0
        self.logs_in = 0
        self.requests = 0
        self.refused = 0
        self.errors = 0
        self.aggregate_rows = 0
        self.aggregate_dropped = 0
        self.runs_opened = 0
        self.runs_closed = 0

    def _count(self, counter: str, n: int) -> None:
        # Requests are taken on several threads at once (the gRPC receiver's, the event loop's).
        with self._counts:
            setattr(self, counter, getattr(self, counter) + n)

    def _error(self) -> None:
        with self._counts:
            self.errors += 1

    def _run(self, run_id: str, keep: frozenset[str] = frozenset()) -> RunFeed:
        """The open run `run_id`, opened if need be; `keep`: runs not to close to make room (the same request's)."""
        with self._lock:
            if self._closed:
                raise Overloaded("the sink is shutting down", self.retry_after_s)
            state = self._runs.get(run_id)
            if state is not None:
                self._runs.move_to_end(run_id)
            else:
                if run_id in self._closing:
                    raise Overloaded(f"run {run_id!r} is being closed; retry shortly", _CLOSING_RETRY_S)
                self._evict(keep)
                if len(self._runs) + len(self._closing) >= self.max_open_runs:
                    raise Overloaded(f"{len(self._runs):,} runs open and {len(self._closing):,} closing (max open "
                                     f"runs {self.max_open_runs:,}); retry shortly", _CLOSING_RETRY_S)
                short = self.fds.refusal() if self.fds is not None else None
                if short is not None:  # a run's files would take what the listeners and open runs need
                    self._evict(keep, at_least=short[1])
                    raise Overloaded(f"run {run_id!r} cannot open now: {short[0]}", _CLOSING_RETRY_S)
                if self._spool_dir is not None:
                    converter = SeriesLedger(persistent=True)  # read back from the run's spool folder
                else:  # memory only: a closed run's ledger is kept here, should it resume
                    converter = self._converters.pop(run_id) if run_id in self._converters else SeriesLedger()
                    self._converters[run_id] = converter
                    while len(self._converters) > _KEEP_CLOSED:
                        self._converters.popitem(last=False)
                exporters = self._make()
                agg = Aggregator(self._aggregate, self._aggregate_timeout_s) if self._aggregate else None
                spool = self._spool_dir / spool_folder(run_id) if self._spool_dir is not None else None
                state = RunFeed(run_id, exporters, converter, agg, self._queue_windows, self._error, spool,
                             self.pool)
                self._runs[run_id] = state
                self._closed_summaries.pop(run_id, None)
                self.runs_opened += 1
                _logger.info("run %r opened (%d backend(s))", run_id, len(exporters))
            return state

    def open_run(self, run_id: str) -> RunFeed:
        """The open run `run_id`, opened now if it is not (its spool is read again): a restarted sink's replay.

        Raises:
            Overloaded: as for a request (the sink is full of busy runs, or the run is being closed).
        """
        return self._run(run_id)

    def close_if_idle(self, state: RunFeed, since: float, why: str) -> bool:
        """Close `state` now (waiting for it) unless a request reached it after `since` or it has windows
        queued; whether it was closed."""
        with self._lock:
            if self._runs.get(state.run_id) is not state or state.last_seen > since or state.pending:
                return False
            if not state.lock.acquire(blocking=False):  # a request is being taken just now
                return False
            try:
                self._begin_close(state)
            finally:
                state.lock.release()
        self._finish_close(state, 30.0, why)
        return True

    def _evict(self, keep: frozenset[str] = frozenset(), at_least: int = 0) -> None:
        """Start closing least recently used idle runs so that new ones find room (self._lock held), `at_least`
        of them (e.g. to free file descriptors). A run with data still queued, busy in a request, or in `keep`
        (looked up for the request being admitted, which would find it closing) is passed over."""
        # Close a few more than needed: the next new runs then find room while these close in the background.
        headroom = max(1, self.max_open_runs // 8)
        excess = max(at_least, len(self._runs) + len(self._closing) + headroom - self.max_open_runs)
        if excess <= 0:
            return
        for state in list(self._runs.values()):
            if excess <= 0:
                break
            if state.pending or state.run_id in keep or not state.lock.acquire(blocking=False):
                continue
            try:
                if state.pending:
                    continue
                self._begin_close(state)
            finally:
                state.lock.release()
            self._closer.submit(self._finish_close, state, 30.0, "least recently used")
            excess -= 1

    def _begin_close(self, state: RunFeed) -> None:
        """Take `state` out of the open runs (self._lock held); requests for it are refused until it is closed."""
        state.closing = True
        del self._runs[state.run_id]
        self._closing[state.run_id] = state

    def _finish_close(self, state: RunFeed, timeout_s: float, why: str) -> None:
        try:
            self._close_run(state, timeout_s)
            skipped = _order_skipped(state)
            if skipped:
                with self._lock:
                    kept = self._order_skipped_closed.setdefault(state.run_id, {})
                    for name, n in skipped.items():
                        kept[name] = kept.get(name, 0) + n
            _logger.info("run %r closed (%s)", state.run_id, why)
        except Exception:
            _logger.exception("run %r: closing failed", state.run_id)
        finally:
            with self._lock:
                self._closing.pop(state.run_id, None)
            with self._changed:
                self._changed.notify_all()

    def wait_until(self, condition: Callable[[Router], bool], timeout_s: float) -> bool:
        """Wait until `condition(self)` holds, looked at whenever a run has closed (tests, tools)."""
        with self._changed:
            return self._changed.wait_for(lambda: condition(self), timeout_s)

    def backlogged(self) -> bool:
        """Whether some run's queue is (nearly) full."""
        with self._lock:
            states = list(self._runs.values())
        return any(s.backlogged() for s in states)

    def _release(self, state: RunFeed) -> None:
        freed = state.release()
        if freed:
            with self._lock:
                self.held_bytes -= freed

    def _refusal(self, state: RunFeed) -> str | None:
        """Why `state` cannot take a request now (its lock held), or None."""
        self._release(state)
        reason = state.behind(self._run_budget)
        if reason is None and state.held_bytes and self.held_bytes >= self._total_budget:
            reason = f"all runs hold {self.held_bytes:,} bytes for their backends (budget {self._total_budget:,})"
        return reason

    def ingest(self, decoded: Decoded) -> None:
        """Queue one decoded request for its run(s), all or nothing.

        Raises:
            Overloaded: some run of the request is too far behind; nothing of the request was taken.
        """
        parts = decoded.split_by_run()
        try:
            keep = frozenset(parts)
            states = [(self._run(run_id, keep), parts[run_id]) for run_id in sorted(parts)]
        except Overloaded:
            self._count("refused", 1)
            raise
        for state, _ in states:  # one order for every request: no two requests wait on each other's locks
            state.lock.acquire()
        try:
            for state, _ in states:
                if state.closing:  # closed since it was looked up: its spool must not be written now
                    self._count("refused", 1)
                    raise Overloaded(f"run {state.run_id!r} is being closed; retry shortly", _CLOSING_RETRY_S)
            for state, _ in states:
                reason = self._refusal(state)
                if reason is not None:
                    self._count("refused", 1)
                    raise Overloaded(f"run {state.run_id!r}: {reason}; retry later", self.retry_after_s)
            for state, part in states:
                self._take(state, part)
            self._count("requests", 1)
        finally:
            for state, _ in states:
                state.lock.release()

    def _take(self, state: RunFeed, part: Decoded) -> None:
        """Apply the run's rules to one admitted part and queue it (the run's lock held)."""
        run_id = state.run_id
        ledger = state.converter
        collisions, corrections = ledger.collisions, ledger.corrections
        ledger.begin()
        part.finish(ledger)
        if part.spans:
            part.spans = ledger.new_spans(part.spans)
        if part.logs:
            part.logs = ledger.new_logs(part.logs)
        # A record without a step (a foreign sender's): its rank's latest step; where this process has seen none of
        # that rank yet (the sink restarted, the run reopened), the run's current step, which the ledger keeps.
        run_step = ledger.current_step if ledger.current_step >= 0 else None
        for record in part.logs:
            if record.step is None:
                record.step = state.last_step.get(record.run.rank, run_step)
        if state.aggregator is not None and part.metrics:
            agg = state.aggregator.add(part.metrics)
            if agg:
                part.metrics.extend(agg)
                self._count("aggregate_rows", len(agg))
        try:
            self._put(state, part)
        except OSError as err:  # nothing of it was taken (its ledger changes undone): the sender retries
            self._count("refused", 1)
            _log_unwritable(run_id, err)
            raise Overloaded(f"run {run_id!r}: its spool cannot be written ({err}); retry later",
                             self.retry_after_s) from err
        if ledger.collisions and not collisions:
            _logger.warning("run %r: two senders (service.instance.id, else host and pid) send the same cumulative "
                            "series (%s), e.g. two processes with one train.run.id and no train.rank; their "
                            "increases are added up (shown in /health `collisions`)", run_id,
                            ", ".join(ledger.collided[:3]))
        state.last_seen = time.monotonic()
        state.series.update(part.tags.get(run_id, ()))
        for run, step in part.runs.items():
            if step >= 0:
                last = state.last_step.get(run.rank)
                if last is None or step > last:
                    state.last_step[run.rank] = step
            state.run_name = run.run_name
            state.world_size = max(state.world_size, run.world_size)
        npoints = len(part.metrics) + len(part.histograms) - (ledger.corrections - corrections)
        state.points += npoints
        state.spans += len(part.spans)
        with self._counts:
            self.points_in += npoints
            self.spans_in += len(part.spans)
            self.logs_in += len(part.logs)

    def _put(self, state: RunFeed, part: Decoded) -> None:
        held = state.put(part)
        if held:
            with self._lock:
                self.held_bytes += held

    def _put_aggregates(self, state: RunFeed, rows: list[MetricRow]) -> None:
        """Queue aggregate rows (the run's lock held); a spool that cannot be written drops them, logged."""
        try:
            self._put(state, Decoded.of_rows(rows))
        except OSError as err:
            self._count("aggregate_dropped", len(rows))
            _log_unwritable(state.run_id, err)

    def _emit_aggregates(self, state: RunFeed, rows: list[MetricRow]) -> None:
        """Queue aggregate rows (the run's lock held). With a spool they always go in (they are few); without
        one, a full queue drops them, counted."""
        if rows:
            self._count("aggregate_rows", len(rows))
            if state.spool is None and state.behind(self._run_budget) is not None:
                self._count("aggregate_dropped", len(rows))
                _logger.warning("run %r: %d aggregate row(s) dropped, backends are behind", state.run_id, len(rows))
                return
            self._put_aggregates(state, rows)

    def tick(self) -> None:
        """Housekeeping: write timed-out aggregates, close idle runs."""
        now = time.monotonic()
        to_close: list[RunFeed] = []
        with self._lock:
            states = list(self._runs.values())
        for state in states:
            with state.lock:
                self._release(state)
                if state.aggregator is not None:
                    self._emit_aggregates(state, state.aggregator.expire())
                idle = now - state.last_seen >= self.idle_s and state.pending == 0
            if idle:
                with self._lock:
                    if self._runs.get(state.run_id) is state and now - state.last_seen >= self.idle_s:
                        self._begin_close(state)
                        to_close.append(state)
        for state in to_close:
            self._closer.submit(self._finish_close, state, 30.0, f"after {self.idle_s:.0f} s idle")

    def _close_run(self, state: RunFeed, timeout_s: float) -> None:
        with state.lock:
            if state.aggregator is not None:
                self._emit_aggregates(state, state.aggregator.drain())
        complete = state.stop(timeout_s)
        if state.spool_path is not None:
            try:
                if complete:
                    # Every backend holds everything: the spool's cursors and segments have nothing left to give;
                    # the series state stays for the run's next request (a reopen, a restarted sink).
                    state.forget_spool()
                else:
                    state.save_state()
            finally:
                state.close_state()
        with self._lock:
            self.held_bytes -= state.held_bytes
        state.held_bytes = 0
        summary = state.summary()
        summary["open"] = False
        ledger = state.converter
        with self._lock:
            if ledger.collisions or ledger.late_delta_points:
                self._closed_counts[state.run_id] = (ledger.collisions, ledger.late_delta_points, ledger.stale_totals)
                while len(self._closed_counts) > _KEEP_CLOSED:
                    self._closed_counts.popitem(last=False)
            self._closed_summaries[state.run_id] = summary
            while len(self._closed_summaries) > 1000:
                self._closed_summaries.popitem(last=False)
            self.runs_closed += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued request is written, then flush every backend."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            states = list(self._runs.values())
        flushed = all([state.flush(max(0.0, deadline - time.monotonic())) for state in states])
        # A run being closed writes everything it holds first: wait for that too.
        closed = self.wait_until(lambda r: not r.runs_closing, max(0.0, deadline - time.monotonic()))
        return flushed and closed

    def close(self, timeout_s: float = 30.0) -> None:
        """Write pending aggregates, drain every queue, close every backend. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            states = list(self._runs.values())
            self._runs.clear()
        deadline = time.monotonic() + timeout_s
        self._closer.shutdown(wait=True)  # closes already under way end first (each bounded by its timeout)
        for state in states:
            self._close_run(state, max(1.0, deadline - time.monotonic()))
        self.pool.close()

    def _ledger_counts(self) -> dict[str, tuple[int, int, int]]:
        """(collisions, late DELTA points, stale totals) of runs open, closing, or closed and remembered."""
        with self._lock:
            out = dict(self._closed_counts)
            ledgers = [(run_id, ledger) for run_id, ledger in self._converters.items()]
            ledgers += [(s.run_id, s.converter) for s in (*self._closing.values(), *self._runs.values())]
        for run_id, ledger in ledgers:
            out[run_id] = (ledger.collisions, ledger.late_delta_points, ledger.stale_totals)
        return out

    def collisions(self) -> dict[str, int]:
        """Runs (open, or closed and still remembered) with cumulative series sent by two senders."""
        return {run_id: c[0] for run_id, c in self._ledger_counts().items() if c[0]}

    def order_skipped(self) -> dict[str, dict[str, int]]:
        """Per run and backend, rows skipped because their step went back in their series after a later step
        was written (TensorBoard, W&B: `otel_train.vocab.step_order`), e.g. a request reordered by a collector."""
        with self._lock:
            out = {run_id: dict(counts) for run_id, counts in self._order_skipped_closed.items()}
            states = list(self._runs.values()) + list(self._closing.values())
        for state in states:
            for name, n in _order_skipped(state).items():
                out.setdefault(state.run_id, {})[name] = out.get(state.run_id, {}).get(name, 0) + n
        return out

    def late_deltas(self) -> dict[str, dict[str, int]]:
        """Runs (open, or closed and remembered) with DELTA points that came after a later step was written."""
        return {run_id: {"points": c[1], "stale_totals": c[2]} for run_id, c in self._ledger_counts().items() if c[1]}

    @property
    def runs_open(self) -> int:
        return len(self._runs)

    @property
    def runs_closing(self) -> int:
        return len(self._closing)

    def delivery_totals(self) -> dict[str, int]:
        """`/health`'s ``delivery``: rows written, rows of failed writes and requests not yet handed to a backend,
        summed over the open runs' backends, and how many open runs have some pending or failed."""
        with self._lock:
            states = list(self._runs.values())
        written = failed = pending = behind = 0
        for state in states:
            stats = state.delivery.backend_stats().values()
            run_failed = sum(int(b["rows_failed"]) for b in stats)
            run_pending = sum(int(b["backlog"]) for b in stats)
            written += sum(int(b["rows_written"]) for b in stats)
            failed += run_failed
            pending += run_pending
            behind += bool(run_failed or run_pending)
        return {"written": written, "failed": failed, "pending": pending, "runs_behind": behind}

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


def _log_unwritable(run_id: str, err: OSError) -> None:
    _UNWRITABLE.warning("spool", "run %r: its spool cannot be written (%s); its requests are refused with a "
                        "retry-after until it can (logged at most once a minute)", run_id, err)


def _order_skipped(state: RunFeed) -> dict[str, int]:
    """A run's backends' step-order skips (only backends with some)."""
    out: dict[str, int] = {}
    for exporter in state.exporters:
        n = int(getattr(getattr(exporter, "step_order", None), "dropped", 0) or 0)
        if n:
            out[str(getattr(exporter, "name", type(exporter).__name__))] = n
    return out
