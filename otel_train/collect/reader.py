"""`StepAlignedMetricReader`: one reader, collected at step boundaries, exported off the training thread.

Flow: the training thread only appends to buffers and, at the end of every `export_every`-th
step, wakes the collector thread. The collector collects the SDK's instruments (DELTA, so
per-step attribute sets are freed after each collection), drains the `ot.log` / span buffers,
converts everything once into one window (`ot.log` points, SDK rows, span rows) and hands it to
its channels: the exporter process (`otel_train.ship.export_process`, which encodes it once) and the
backends of this process (`otel_train.ship.local_delivery`). Both feed backends with the one delivery
engine, `otel_train.ship.delivery`: queueing, merging, retry, flush and shutdown do not depend on where
a backend runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from opentelemetry.sdk.metrics.export import MetricReader, MetricsData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from otel_train._internal import sdk
from otel_train._internal.at_fork import after_fork_in_child
from otel_train._internal.ratelimit import LogOnce
from otel_train._internal.values import RefusalCounts
from otel_train.backend import DELTA_TEMPORALITY
from otel_train.capture.instrument import LogBuffer, SpanBuffer
from otel_train.capture.step import STEP_ATTRIBUTE, StepEnd, current_step
from otel_train.collect.window_builder import DropCounter, WindowBuilder, WindowParts, has_points
from otel_train.ship.local_delivery import LocalDelivery
from otel_train.vocab.run_identity import THREAD_ID, THREAD_NAME

__all__ = ["SpanRowsElsewhere", "StepAlignedMetricReader", "ThreadSpanProcessor"]

_logger = logging.getLogger(__name__)
_WAKE_EVERY_S = 0.1  # step ends with only `ot.log` / spans to collect wake the collector at most this often...
#: ...or sooner, once this many records and spans wait in the buffers (fewer where a buffer holds less): drained
#: before Python's cycle collector (its young generation: 700 allocations) moves many of them into its oldest
#: generation. At a ~0.6 ms step the 0.1 s alone brought a full collection of the whole process (~0.15 s, torch
#: imported) every ~20,000 steps and ~11 µs a step of cycle collection in all (bench/collector_gc.py).
_WAKE_RECORDS = 400
_SERIES_PER_STEP = 2000  # the SDK's default cardinality limit, per step of the window


@runtime_checkable
class SpanRowsElsewhere(Protocol):
    """A channel whose receiver makes the rows and phase timings of `ot.span` records itself
    (`otel_train.ship.export_process.ExportProcess`)."""

    def send_window_with_spans(self, window: WindowParts) -> None: ...


class ThreadSpanProcessor(SpanProcessor):
    """For raw OTel spans: stamps thread and step at start, buffers the span at its end."""

    def __init__(self, buffer: SpanBuffer) -> None:
        self._buffer = buffer

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        thread = threading.current_thread()
        span.set_attribute(THREAD_ID, threading.get_native_id())
        span.set_attribute(THREAD_NAME, thread.name)
        if STEP_ATTRIBUTE not in (span.attributes or {}):
            step = current_step()
            if step is not None:
                span.set_attribute(STEP_ATTRIBUTE, step)

    def on_end(self, span: ReadableSpan) -> None:
        self._buffer.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class StepAlignedMetricReader(MetricReader):
    """A `MetricReader` collected every `export_every` steps and every `export_interval_s` seconds.

    Works inside `otel_train.init()` and when plugged into a user's own `MeterProvider` (then call
    `on_step_end` or `otel_train.step`, which the runtime wires, or rely on the interval).

    Args:
        exporters: OTel `MetricExporter`/`SpanExporter`s and otel-train `RowExporter`s; ONE reader
            fans out to all of them.
        export_every: Collect after every N steps.
        export_interval_s: Collect at the latest after this many seconds.
        queue_size: Windows queued per exporter (merged while it is busy) before the oldest is dropped.
        log_buffer: Where `ot.log` records wait for collection.
        span_buffer: Where finished spans wait for collection.
        export_metrics: Whether this process exports metrics (spans always go out).
        resource: The Resource for `ot.log` data; taken from the MeterProvider when registered.
        channel: Where encoded windows go besides `exporters` (the exporter process's
            `send_window` / `flush` / `close`); None for none.
        phases: Add per-step ``phase/<name>_s`` points computed from the spans of each step.
        record: Opens the record of what was logged, for the backends of this process (None: none).
        refusals: Where values refused as they are converted are counted (default: counts of its own).

    Example:
        >>> from opentelemetry.sdk.metrics import MeterProvider
        >>> from otel_train.testing import InMemoryRowExporter
        >>> mem = InMemoryRowExporter()
        >>> reader = StepAlignedMetricReader([mem])
        >>> provider = MeterProvider(metric_readers=[reader])
        >>> provider.get_meter("t").create_gauge("loss").set(0.5, {"train.step": 3})
        >>> reader.force_flush()
        True
        >>> [(r.tag, r.step, r.value) for r in mem.metrics]
        [('loss', 3, 0.5)]
        >>> provider.shutdown()
    """

    def __init__(
        self,
        exporters: Sequence[Any] = (),
        *,
        export_every: int = 1,
        export_interval_s: float = 30.0,
        queue_size: int = 16,
        log_buffer: LogBuffer | None = None,
        span_buffer: SpanBuffer | None = None,
        export_metrics: bool = True,
        resource: Resource | None = None,
        channel: Any = None,
        phases: bool = True,
        record: Callable[[Mapping[str, Any]], Any] | None = None,
        refusals: RefusalCounts | None = None,
    ) -> None:
        limit = _SERIES_PER_STEP * max(1, export_every) + 1
        super().__init__(**sdk.reader_options(DELTA_TEMPORALITY, limit))
        self.export_every = max(1, int(export_every))
        self.export_interval_s = float(export_interval_s)
        self.log_buffer = log_buffer if log_buffer is not None else LogBuffer(100_000)
        self.span_buffer = span_buffer if span_buffer is not None else SpanBuffer(100_000)
        self._resource = resource or Resource.create()
        self._builder = WindowBuilder(export_metrics, phases, refusals)
        #: Values refused as they were converted (no number, no scalar, a bad key, a step out of range), by cause.
        self.refusals = self._builder.refusals
        #: The backends of this process (exporter objects; every named one without an exporter process).
        self._local = LocalDelivery(exporters, queue_size, lambda: self._resource, record) if exporters else None
        self._channel = channel
        self._channels: list[Any] = [c for c in (self._local, channel) if c is not None]
        # Every backend in the exporter process: it makes the span rows and phase timings (`otel_train.ship.span_work`),
        # which at a fast step were most of this thread's work on the training core.
        self._defer_spans: SpanRowsElsewhere | None = (
            channel if self._local is None and isinstance(channel, SpanRowsElsewhere) else None)
        #: Called with every drained batch of finished spans, on the collector thread (the hang watchdog learns
        #: each span name's usual duration from it); None: nobody.
        self.span_listener: Callable[[list[tuple[Any, ...]]], None] | None = None
        self._log = LogOnce(_logger)
        self._drops = DropCounter(self.log_buffer, self.span_buffer,
                                  lambda: self.dropped_windows)
        self._collect_lock = threading.Lock()
        self._steps_since = 0
        self._due = False  # a collection is due but was held back by the wake-up throttle (see `_collector_loop`)
        self._sdk_recorded = True  # stays True unless the SDK's measurements are watched
        self._sdk_watched = False
        self._sdk_storage: Any = None  # the SDK's storage of this reader (emptied in a forked child)
        self._stamped_steps = 0  # distinct steps raw OTel points were stamped with since the last collection
        self._collector_ident = 0
        self._next_wake_s = 0.0
        self._wake_records = max(1, min(_WAKE_RECORDS, self.log_buffer.maxlen // 4, self.span_buffer.maxlen // 4))
        self._log_items, self._span_items = self.log_buffer._items, self.span_buffer._items  # len() in C
        self._last_step: int | None = None
        self._backlog = False  # the buffers hold steps ended before this reader was built (`take_over`)
        self._shutdown = False
        self.windows = 0
        self.points = 0
        #: What shutdown's deadline left unexported: records (values, step ends, log records) and spans not yet
        #: collected, or collected after the hand-off to the backends (the summary counts them as dropped).
        self.unexported = {"records": 0, "spans": 0}
        self._handed_off = False
        self._in_flight = [0, 0]  # records and spans the collection under way drained and has not sent yet
        self._send_lock = threading.Lock()  # a window's send and the hand-off's count never overlap
        #: Whether a forked child keeps exporting (its own data only) or exports nothing (a session's child).
        self.export_in_forked_child = True
        self._start_collector()
        after_fork_in_child(self._after_fork)  # held weakly: a shut-down reader is freed

    # -- threads ------------------------------------------------------------------------------
    def _start_collector(self) -> None:
        self._wake = threading.Event()
        self._stop = False
        self._flush_requests: deque[threading.Event] = deque()
        self._thread = threading.Thread(target=self._collector_loop, name="otel-train-collect", daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        if self._shutdown:
            return
        # A forked child never exports its parent's rows: what the parent had recorded and not yet exported
        # (buffers, the SDK's aggregations; the export queues restart empty) stays the parent's.
        self.log_buffer.drain()
        self.span_buffer.drain()
        self._empty_sdk_storage()
        self._collect_lock = threading.Lock()
        if not self.export_in_forked_child:  # a session's child (closed there): it exports nothing
            self._shutdown = self._stop = True
            sdk.discard_measurements(self._sdk_storage)  # nor keeps what raw OTel instruments record there
            return
        self._start_collector()
        if self._local is not None:
            self._local.restart_after_fork()

    def _empty_sdk_storage(self) -> None:
        """Drop the SDK's pending aggregations of this reader, in a forked child (one thread: no lock is
        taken; locks a parent's thread held at the fork are replaced, as the child would wait on them forever)."""
        sdk.empty_after_fork(self._sdk_storage)

    def _collector_loop(self) -> None:
        self._collector_ident = threading.get_ident()
        check = False
        while not self._stop:
            # After each collection, look once more `_WAKE_EVERY_S` later: a step end in between found a collection
            # due but held it back (the wake-up throttle), and the last steps before a pause (an evaluation, a hang,
            # a crash) have no later step end to wake us. That look comes after the throttle's window has closed.
            woke = self._wake.wait(timeout=min(self.export_interval_s, _WAKE_EVERY_S) if check
                                   else self.export_interval_s)
            self._wake.clear()
            if check and not woke and not self._due and not self._stop:
                check = False
                continue
            check = True
            self._due = False
            requests = []
            while self._flush_requests:
                requests.append(self._flush_requests.popleft())
            self._collect_window()
            for done in requests:
                done.set()

    # -- training-thread side -----------------------------------------------------------------
    def on_step_end(self, info: StepEnd) -> None:
        """Step-end listener (training thread): wake the collector every `export_every` steps, but only
        when a step must be collected now: an SDK instrument recorded since the last collection (its
        points get the step they were recorded in), or `_WAKE_EVERY_S` passed, or `_WAKE_RECORDS` records and
        spans are buffered (a quarter of a smaller buffer). `ot.log` records and spans carry their step, so
        batching them loses nothing, and most step ends wake nobody (a woken collector competes with this
        thread for the GIL)."""
        self._last_step = info.step
        self._steps_since += 1
        if self._steps_since >= self.export_every and (
                self._sdk_recorded or info.time_total_s >= self._next_wake_s
                or len(self._log_items) + len(self._span_items) >= self._wake_records):
            self._steps_since = 0
            self._next_wake_s = info.time_total_s + _WAKE_EVERY_S
            self._wake.set()
        elif self._steps_since >= self.export_every:
            self._due = True

    def step_end_hook(self, steps_since: int = 0) -> Callable[[int, int, int, int, int | None], None]:
        """`on_step_end` plus buffering the step's numbers, as one closure for `otel_train.step`'s hook:
        no `StepEnd` object, no clock read and two calls fewer per step on the training thread (the
        collector rebuilds the `StepEnd` with `StepEnd.from_times` and the time from `end_ns`).
        `steps_since`: steps that ended uncollected before this hook was set (they count toward `export_every`)."""
        append = self._log_items.append
        seq = self.log_buffer._seq
        wake = self._wake.set
        log_items, span_items = self._log_items, self._span_items
        every, records = self.export_every, self._wake_records
        wake_every_ns = int(_WAKE_EVERY_S * 1e9)
        since = steps_since
        next_wake_ns = 0

        def on_step_end(step: int, start_ns: int, end_ns: int, iterations: int, samples: int | None) -> None:
            nonlocal since, next_wake_ns
            append((next(seq), step, (start_ns, end_ns, iterations, samples), 0))
            self._last_step = step
            since += 1
            if since >= every and (self._sdk_recorded or end_ns >= next_wake_ns
                                   or len(log_items) + len(span_items) >= records):
                since = 0
                next_wake_ns = end_ns + wake_every_ns
                wake()
            elif since >= every:
                self._due = True

        return on_step_end

    def take_over(self, last_step: int | None, step_ends: int,
                  logged_steps: int) -> Callable[[int, int, int, int, int | None], None]:
        """Go on from the step ends a session saw before this reader was built (its buffers hold what they
        buffered): `last_step` the latest of them, `step_ends` `otel_train.step` ends, `logged_steps`
        `on_step_end` calls (`otel_train.step_ended`). They count toward `export_every` as if this reader had
        seen them: where that many ended, the collector is woken now. Returns the step-end hook to set
        (`step_end_hook`)."""
        due = max(step_ends, logged_steps) >= self.export_every
        self._backlog = step_ends > self.export_every  # the next collection cuts them into windows as they ended
        if self._last_step is None:
            self._last_step = last_step
        self._steps_since = 0 if due else logged_steps
        hook = self.step_end_hook(0 if due else step_ends)
        if due:
            self._wake.set()
        return hook

    # -- collection (collector thread) ----------------------------------------------------------
    def _set_meter_provider(self, meter_provider: Any) -> None:
        super()._set_meter_provider(meter_provider)
        resource = sdk.provider_resource(meter_provider)
        if resource is not None:
            self._resource = resource
        self._watch_sdk_measurements(meter_provider)

    def _watch_sdk_measurements(self, meter_provider: Any) -> None:
        """Stamp every SDK measurement recorded without `train.step` with the step it is recorded in, and flag
        measurements recorded off the collector thread, so that a step with one ends with a collection (keeping
        the per-step attribute sets within the cardinality limit). Reaches into the SDK's measurement storage;
        where that is not found, points get the step that ends their window, and every `export_every`-th step
        end collects, as if something were always recorded."""
        storage = sdk.reader_storage(meter_provider, self)
        if storage is None:
            return

        # Each stamped step is one more attribute set per series until the next collection: past half the
        # cardinality limit in steps (a collector starved that long), points take the window's step instead of
        # overflowing the SDK's limit (warned once).
        max_steps = (_SERIES_PER_STEP * self.export_every) // 2
        last: list[int | None] = [None]  # the step stamped last

        def stamping(consume: sdk.Consume) -> sdk.Consume:
            def consume_measurement(measurement: Any, *args: Any, **kwargs: Any) -> None:
                # Observable callbacks run in the collection (collector thread): those points get the step that
                # ends the window (`_stamp`). DELTA temporality frees each per-step attribute set at collection.
                if threading.get_ident() != self._collector_ident:
                    self._sdk_recorded = True
                    attrs = measurement.attributes
                    if not attrs or STEP_ATTRIBUTE not in attrs:
                        step = current_step()
                        if step is not None:
                            if step != last[0]:
                                last[0] = step
                                self._stamped_steps += 1
                            if self._stamped_steps <= max_steps:
                                measurement = sdk.with_attribute(measurement, STEP_ATTRIBUTE, step)
                            else:
                                self._log.warning("stamp", "the collector fell %d steps behind: raw OTel points "
                                                  "without `train.step` take the step that ends their window until "
                                                  "it catches up (warned once)", max_steps)
                consume(measurement, *args, **kwargs)

            return consume_measurement

        if sdk.intercept_measurements(storage, stamping):
            self._sdk_storage = storage
            self._sdk_watched = True
            self._sdk_recorded = False

    def _collect_window(self) -> None:
        with self._collect_lock:
            if self._sdk_watched:  # before collecting: what is recorded from here on wakes the next step end
                self._sdk_recorded = False
                self._stamped_steps = 0
            try:
                # The SDK's collect callback directly: `collect()` skips `_receive_metrics` when the
                # SDK has no instruments, but the `ot.log` / span buffers still need draining.
                data = sdk.collect(self, 10_000)
                self._receive_metrics(data)
            except Exception:
                self._log.warning("collect", "collection failed; training goes on", exc_info=True)

    def _receive_metrics(self, metrics_data: MetricsData | None, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        step = self._last_step
        if step is None:
            step = current_step() or 0
        records = self.log_buffer.drain()
        spans = self.span_buffer.drain()
        self._in_flight = [len(records), len(spans)]
        try:
            self._deliver(metrics_data, records, spans, step)
        finally:
            self._in_flight = [0, 0]

    def _deliver(self, metrics_data: MetricsData | None, records: list[tuple[Any, ...]],
                 spans: list[tuple[Any, Any]], step: int) -> None:
        listener = self.span_listener
        if listener is not None and spans:
            try:
                listener(spans)
            except Exception:
                self._log.warning("span_listener", "the span listener failed", exc_info=True)
        self._drops.report(step, records)
        if not self._channels or (not records and not spans and not has_points(metrics_data)):
            return  # no backend wants anything: draining bounded the memory, converting would waste CPU
        if self._backlog:
            self._backlog = False
            *earlier, (records, spans, _) = _cut_backlog(records, spans, self.export_every)
            for part_records, part_spans, part_step in earlier:
                self._send_window(None, part_records, part_spans, part_step)
            if not records and not spans and not has_points(metrics_data):
                return
        self._send_window(metrics_data, records, spans, step)

    def _send_window(self, metrics_data: MetricsData | None, records: list[tuple[Any, ...]],
                     spans: list[tuple[Any, Any]], step: int) -> None:
        if self._handed_off:  # shutdown handed off to the backends: what is left is counted there
            return
        defer = self._defer_spans
        window = self._builder.build(self._builder.run_for(self._resource.attributes), metrics_data, records,
                                     spans, step, defer_spans=defer is not None, grouped=defer is not None)
        with self._send_lock:
            if self._handed_off:  # the hand-off came during the build: counted there
                return
            self.windows += 1
            self.points += window.point_count + len(window.metrics) + len(window.histograms)
            for channel in self._channels:
                try:
                    if defer is not None and window.span_records is not None:
                        defer.send_window_with_spans(window)
                    else:
                        channel.send_window(window.run, window.points, window.metrics, window.histograms,
                                            window.spans, window.logs)
                except Exception:
                    self._log.warning(f"channel:{type(channel).__name__}", "handing a window to %s failed",
                                      "the exporter process" if channel is self._channel else "the backends",
                                      exc_info=True)
            self._in_flight[0] -= len(records)
            self._in_flight[1] -= len(spans)

    def resume(self, step: int) -> None:
        """The run restarts at `step` (`otel_train.resume`): collect what was recorded before (on the calling
        thread), then tell every backend, here and in the exporter process, in order after it. Never waits
        for a backend."""
        if self._shutdown:
            return
        self._collect_window()
        with self._collect_lock:  # no collection in flight: the resume follows every window sent so far
            run = self._builder.run_for(self._resource.attributes)
            for channel in self._channels:
                try:
                    channel.send_resume(run, step)
                except Exception:
                    self._log.warning("channel-resume", "handing a resume to the backends failed", exc_info=True)

    # -- flush / shutdown ---------------------------------------------------------------------
    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Collect now (on the collector thread) and wait until every backend has written it."""
        return self._flush(time.monotonic() + timeout_millis / 1000)

    def _collect_now(self, deadline: float) -> bool:
        """Collect on the collector thread (or here, when that is this thread or gone), by `deadline`."""
        caller_step = current_step()  # a flush inside a step stamps that step, not the previous one
        if caller_step is not None:
            self._last_step = caller_step
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            done = threading.Event()
            self._flush_requests.append(done)
            self._wake.set()
            return done.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._collect_window()
        return True

    def _flush(self, deadline: float) -> bool:
        if self._shutdown:
            return True
        if not self._collect_now(deadline):
            return False
        # Each channel waits on its own state, bounded by `deadline`: no thread per call.
        return all([channel.flush(deadline) for channel in self._channels])  # each, not the first failure

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Collect the last window, then hand off to every backend and shut it down, within `timeout_millis`."""
        if self._shutdown:
            return
        deadline = time.monotonic() + timeout_millis / 1000
        collected = self._collect_now(deadline)
        self._shutdown = True
        self._stop = True
        self._wake.set()
        if not collected:  # the deadline passed with a collection under way (a fast loop's backlog): what it and
            self._hand_off()  # the buffers still hold is counted, never sent after the hand-off
        if self._local is not None:
            self._local.stop()  # delivers while the exporter process does
        if self._channel is not None:
            self._channel.close(deadline)  # waits for the exporter process's backends up to `deadline`
        if self._local is not None:
            self._local.close(deadline)
        if not collected:
            self.unexported["records"] += len(self.log_buffer.drain())
            self.unexported["spans"] += len(self.span_buffer.drain())
            if any(self.unexported.values()):
                _logger.warning("otel-train: shutdown's deadline (OTEL_TRAIN_SHUTDOWN_TIMEOUT_S) passed before the "
                                "last collection: %d records (values, step ends, log records) and %d spans logged "
                                "before it were not exported", self.unexported["records"], self.unexported["spans"])

    def _hand_off(self) -> None:
        """No window goes out from now on; what the collection under way drained and has not sent is counted in
        `unexported` (a send under way finishes first, briefly: it is only handed to the channel)."""
        got = self._send_lock.acquire(timeout=1.0)
        try:
            self._handed_off = True
            records, spans = self._in_flight
            self.unexported["records"] += max(0, records)
            self.unexported["spans"] += max(0, spans)
        finally:
            if got:
                self._send_lock.release()

    @property
    def exporters(self) -> list[Any]:
        """The exporter objects this reader feeds in this process."""
        return list(self._local.exporters) if self._local is not None else []

    def stats(self) -> dict[str, Any]:
        """Counters for the shutdown summary: points, windows, drops, failures per backend of this process."""
        local = self._local
        dropped = self.log_buffer.dropped + self.span_buffer.dropped + (local.dropped_windows if local else 0)
        return {"points": self.points, "windows": self.windows, "dropped": dropped,
                "failures": local.failures() if local is not None else {},
                "rows_lost": local.rows_lost() if local is not None else {}}

    @property
    def dropped_windows(self) -> int:
        """Windows the backends of this process dropped (a full queue, or given up after retries)."""
        return self._local.dropped_windows if self._local is not None else 0

    @property
    def failures(self) -> int:
        return sum(self._local.failures().values()) if self._local is not None else 0


def _cut_backlog(records: list[tuple[Any, ...]], spans: list[tuple[Any, Any]],
                 every: int) -> list[tuple[list[tuple[Any, ...]], list[tuple[Any, Any]], int]]:
    """What the training thread buffered before the reader was built, cut into the windows its step ends would
    have made (one per `every` steps, `step_end_hook`): each part's records up to its last step end, the spans of
    its steps, and that step; the last part takes what follows (and the spans of no step)."""
    parts: list[tuple[list[tuple[Any, ...]], list[tuple[Any, Any]], int]] = []
    start, ends = 0, 0
    for i, record in enumerate(records):
        if type(record[2]) is tuple:  # a step end's numbers (`step_end_hook`)
            ends += 1
            if ends % every == 0:
                parts.append((records[start:i + 1], [], record[1]))
                start = i + 1
    rest: list[tuple[Any, Any]] = []
    for item in spans:
        step = getattr(item[-1], "step", None)
        part = next((p for p in parts if type(step) is int and step <= p[2]), None)
        (part[1] if part is not None else rest).append(item)
    parts.append((records[start:], rest, parts[-1][2] if parts else 0))
    return parts
