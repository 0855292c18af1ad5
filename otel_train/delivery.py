"""Feeding backends: encoded windows in, a spool, one thread and one durable cursor per backend.

Used by the exporter process, by `otel-train replay` and, one per run, by `otel-train sink` (there
without a spool: `submit_window` waits for room instead, so a full queue pushes back on the sender
and the sender's own retry takes the place of the spool). Each backend
runs on its own thread (a slow or hanging one stalls only itself); while it is busy, new windows
merge into one bigger write. A backend's cursor moves only after its `force_flush()` succeeded, so
whatever it has not made durable is fed again from the spool after a crash or by `otel-train replay`;
a backend that appends to its own files (`RowExporter.kill_safe_writes`) also records after every
write how far its writes reached the OS (`Spool.advance`), so a killed process writes nothing twice.
A backend whose client writes its store on its own schedule (W&B's service process) says how far its
store holds the data (`RowExporter.durable_step`): its cursor moves only over the windows up to that step
(an explicit flush still succeeds once such a backend has everything and flushed: the spool keeps the rest
until its store holds it).
The single entry into a backend is `RowExporter.export_window`.

A child process's window (a DataLoader worker's values, `submit_side`) is not spooled; it is handed to each
backend in stream order, right after the last window queued when it arrived, so its values (stamped with
that window's step) never reach a backend after later steps (W&B drops writes to earlier steps).

A `Resume` in the stream (`otel_train.framing`) is applied by each backend in order (`RowExporter.resume`)
and then acknowledged like a window. Windows of the earlier attempt (seq <= its `cut_after`) that a backend
is handed once the resume is known lose their rows at steps >= the resume step (`framing.cut_window`): after
a `kill -9`, the earlier attempt's undelivered windows must not bring back steps the new attempt supersedes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from otel_train._internal.ratelimit import LogOnce
from otel_train.exporters.base import RowExporter, Window
from otel_train.framing import Resume, cut_window, decode_window, is_resume
from otel_train.spool import Spool

__all__ = ["Delivery", "Progress"]

_logger = logging.getLogger(__name__)
_MERGE_ROWS = 50_000  # rows one merged write may hold
_FLUSH_EVERY_S = 1.0  # how stale a backend's durable cursor may get while data flows


@dataclasses.dataclass
class Progress:
    """Where delivery stands: windows spooled, and per backend the last durable window and step."""

    spooled: int = 0
    spooled_step: int = -1
    delivered: dict[str, int] = dataclasses.field(default_factory=dict)
    delivered_step: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Per backend: rows whose step went backwards in their series (`OTEL_TRAIN_STEP_ORDER`, any policy).
    steps_backwards: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Per backend: rows not written because of their step (backwards under ``drop``/``raise``; a step
    #: W&B cannot store under ``warn``; one a resumed run already holds).
    steps_order_dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Windows the spool could not write ahead (disk full), delivered from memory only.
    spool_failed_appends: int = 0
    #: Per backend: rows it did not write, by cause (`otel_train.exporters.base.LOSS_CAUSES`; only non-zero).
    rows_lost: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    #: Values child processes lost before sending them (a refused step, a full buffer), by cause (`workers`).
    children_lost: dict[str, int] = dataclasses.field(default_factory=dict)

    def behind(self) -> dict[str, int]:
        """Backends that lack windows, with how many steps they are behind."""
        return {name: max(0, self.spooled_step - self.delivered_step.get(name, -1))
                for name, seq in self.delivered.items() if seq < self.spooled}

    def summary(self) -> str:
        behind = self.behind()
        if not behind:
            return f"{self.spooled} window(s), every backend up to date"
        return ", ".join(f"`{name}` behind by {steps} step(s)" for name, steps in behind.items())


class _Backend:
    """One backend's thread, queue and cursor."""

    def __init__(self, name: str, exporter: RowExporter, spool: Spool | None, queue_windows: int,
                 on_error: Callable[[str], None] | None = None, thread_name: str = "otel-train-deliver",
                 cuts: list[tuple[int, int]] | None = None) -> None:
        self.name = name
        self._cuts = cuts if cuts is not None else []  # (cut_after, step) of the resumes known (shared)
        self.exporter = exporter
        self.spool = spool
        self.acked = spool.cursor(name) if spool is not None else 0
        self.acked_step = -1
        self.handed = self.acked
        self.handed_step = -1
        self._queue: deque[tuple[int, int, Window]] = deque()
        self._rows = 0
        self._queue_windows = queue_windows
        self._reload = spool is not None and spool.last_seq > self.acked
        self._flush_wanted = False
        self._stop = False
        self._last_flush = time.monotonic()
        self._cv = threading.Condition()
        self._log = LogOnce(_logger, interval_s=60.0)
        self.dropped = 0
        self.dropped_rows = 0  # rows of the windows dropped from a full queue (no spool)
        self.rows_written = 0  # metric and histogram rows handed to the backend
        self._on_error = on_error
        self._kill_safe = spool is not None and bool(getattr(exporter, "kill_safe_writes", False))
        self._flushes_asked = 0
        self._flushes_done = 0
        self._flushed_handed = 0  # windows handed when the last asked-for flush succeeded
        self.exports = 0  # export_window calls, and the seconds they took (self-telemetry)
        self.export_s = 0.0
        self.rows = 0  # rows (points and spans) handed to the backend
        # Child-process windows (not spooled), each with the seq of the window it follows in the stream.
        self._side: deque[tuple[int, Window]] = deque(maxlen=queue_windows * 4)
        self._handed_max: deque[tuple[int, int]] = deque()  # (seq, highest step handed so far), not yet acked
        self._max_step_handed = -1
        self.thread = threading.Thread(target=self._run, name=f"{thread_name}-{name}", daemon=True)
        self.thread.start()

    def submit(self, seq: int, step: int, window: Window) -> None:
        with self._cv:
            if self._reload:
                pass  # the spool holds it; the thread reads it from there
            elif len(self._queue) >= self._queue_windows:
                if self.spool is not None:
                    self._queue.clear()  # stalled: keep memory bounded, read back from the spool later
                    self._reload = True
                else:
                    _, _, gone = self._queue.popleft()
                    self.dropped += 1
                    self.dropped_rows += _rows(gone)
                    self._queue.append((seq, step, window))
            else:
                self._queue.append((seq, step, window))
            self._cv.notify_all()

    def submit_side(self, window: Window, after_seq: int) -> None:
        """Queue a window that is not in the spool, to go right after window `after_seq` (delivered once,
        best effort)."""
        with self._cv:
            self._side.append((after_seq, window))
            self._cv.notify_all()

    def wait_room(self, deadline: float) -> bool:
        """Wait until the in-memory queue can take one more window (no spool: backpressure)."""
        with self._cv:
            return self._cv.wait_for(lambda: len(self._queue) < self._queue_windows or self._stop,
                                     timeout=max(0.0, deadline - time.monotonic())) and not self._stop

    def queued(self) -> int:
        return len(self._queue)

    def request_flush(self) -> int:
        """Ask for a flush; returns a ticket for `wait_flushed`."""
        with self._cv:
            self._flush_wanted = True
            self._flushes_asked += 1
            self._cv.notify_all()
            return self._flushes_asked

    def wait_flushed(self, seq: int, ticket: int, deadline: float) -> bool:
        """Wait until `seq` is durable, or the flush asked for with `ticket` was tried and failed."""
        with self._cv:
            self._cv.wait_for(lambda: self.acked >= seq or self._flushes_done >= ticket,
                              timeout=max(0.0, deadline - time.monotonic()))
            # A backend whose store lags (`durable_step`) has it all once flushed; the spool keeps the rest.
            return self.acked >= seq or (self._flushes_done >= ticket and self._flushed_handed >= seq)

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._flush_wanted = True
            self._cv.notify_all()

    def wait_acked(self, seq: int, deadline: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.acked >= seq, timeout=max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._side or self._reload or self._flush_wanted
                                  or self._stop, timeout=_FLUSH_EVERY_S)
                items = list(self._queue)
                self._queue.clear()
                side = list(self._side)
                self._side.clear()
                reload, self._reload = self._reload, False
                flush, self._flush_wanted = self._flush_wanted, False
                asked = self._flushes_asked
                stop = self._stop
                if items:
                    self._cv.notify_all()  # room in the queue for a producer waiting in `wait_room`
            if reload and self.spool is not None:
                items = self._from_spool() + items
            self._export(items, side)
            # Without a spool there is no cursor to keep fresh: flush only when asked.
            due = (self.spool is not None and self.handed > self.acked
                   and time.monotonic() - self._last_flush >= _FLUSH_EVERY_S)
            flushed = self._flush() if flush or due else False
            if flush:
                with self._cv:
                    self._flushes_done = max(self._flushes_done, asked)
                    if flushed:
                        self._flushed_handed = self.handed
                    self._cv.notify_all()
            if stop:
                with self._cv:
                    if self._queue or self._side or self._reload:
                        continue
                self._close()
                return

    def _from_spool(self) -> list[tuple[int, int, Window]]:
        assert self.spool is not None
        out = []
        for seq, step, payload in self.spool.read(self.handed):
            try:
                out.append((seq, step, decode_window(payload)))
            except Exception as err:  # a window we cannot read must not stop the rest
                self._log.error("decode", "spool window %d unreadable for `%s` (%s); skipped", seq, self.name, err)
        return out

    def _export(self, items: list[tuple[int, int, Window]], side: list[tuple[int, Window]] | None = None) -> None:
        # The spool and the queue may both hold a window around a reload: each seq goes out once.
        fresh: list[tuple[int, int, Window]] = []
        for item in sorted(items, key=lambda i: i[0]):
            if item[0] > (fresh[-1][0] if fresh else self.handed):
                fresh.append(item)
        children = sorted(side or (), key=lambda c: c[0])
        group: list[tuple[int, int, Window]] = []

        def children_after(seq: int) -> None:
            # A child's window goes right after the window it followed (its rows carry that window's step).
            while children and children[0][0] <= seq:
                group.append((seq, -1, children.pop(0)[1]))

        children_after(self.handed)
        for seq, step, window in fresh:
            if isinstance(window, Resume):  # never merged: what came before is written first
                self._export_windows(group)
                group = []
                self._apply_resume(seq, window)
                continue
            for cut_after, resume_step in self._cuts:
                if seq <= cut_after:
                    window = cut_window(window, resume_step)
            group.append((seq, step, window))
            children_after(seq)
        group += [(self.handed if not group else group[-1][0], -1, w) for _, w in children]
        self._export_windows(group)

    def _apply_resume(self, seq: int, resume: Resume) -> None:
        try:
            self.exporter.resume(resume.run, resume.step)  # isolates the backend on its own
        except Exception as err:
            self._log.error("resume", "exporter `%s` resume raised %s: %s", self.name, type(err).__name__, err)
        if self._kill_safe:
            self._advance(seq)
        self._hand(seq, -1)
        # Acknowledged at once: a crash before this applies it again, which every backend tolerates
        # (TensorBoard and JSONL then also supersede what was written twice after it).
        self._flush()

    def _export_windows(self, items: list[tuple[int, int, Window]]) -> None:
        start = 0
        while start < len(items):
            end, rows = start, 0
            while end < len(items) and (end == start or rows + _rows(items[end][2]) <= _MERGE_ROWS):
                rows += _rows(items[end][2])
                end += 1
            batch = items[start:end]
            ok = self._write(batch[0][2] if len(batch) == 1 else _merge([w for _, _, w in batch]))
            last = max(self.handed, batch[-1][0])
            if ok and self._kill_safe and last > self.handed:
                self._advance(last)
            self._hand(last, max(s for _, s, _ in batch))
            start = end

    def _hand(self, seq: int, step: int) -> None:
        """Windows up to `seq` (steps up to `step`) were handed to the backend."""
        self.handed = max(self.handed, seq)
        self.handed_step = max(self.handed_step, step)
        self._max_step_handed = max(self._max_step_handed, step)
        if self._handed_max and self._handed_max[-1][0] == self.handed:
            self._handed_max[-1] = (self.handed, self._max_step_handed)
        else:
            self._handed_max.append((self.handed, self._max_step_handed))

    def _advance(self, seq: int) -> None:
        assert self.spool is not None
        try:
            self.spool.advance(self.name, seq)
        except OSError as err:  # only costs a repeat after a kill: the flush cursor still holds
            self._log.error("written", "cannot record how far `%s` has written: %s", self.name, err)

    def _write(self, window: Window) -> bool:
        started = time.perf_counter()
        try:
            ok = self.exporter.export_window(window)  # isolates and retries on its own
        except Exception as err:
            self._log.error("export", "exporter `%s` raised %s: %s", self.name, type(err).__name__, err)
            ok = False
        if ok is False and self._on_error is not None:
            self._on_error(self.name)
        self.rows_written += len(window.metrics) + len(window.histograms)
        self.export_s += time.perf_counter() - started
        self.exports += 1
        self.rows += _rows(window)
        return ok is not False

    def _flush(self) -> bool:
        self._last_flush = time.monotonic()
        try:
            ok = self.exporter.force_flush()
        except Exception as err:
            self._log.error("flush", "exporter `%s` flush raised %s: %s", self.name, type(err).__name__, err)
            ok = False
        if ok:
            self._acknowledge()
        return bool(ok)

    def _acknowledge(self) -> None:
        """Move the cursor over what the backend's store holds: every window handed, or, for a backend that
        says how far its store is (`durable_step`), the windows whose steps are all in it."""
        seq, step = self.handed, self.handed_step
        try:
            hook = getattr(self.exporter, "durable_step", None)
            durable = hook() if hook is not None else None
        except Exception as err:
            self._log.error("durable", "exporter `%s` cannot say what it holds (%s: %s)", self.name,
                            type(err).__name__, err)
            return
        if durable is not None:
            seq, step = self.acked, self.acked_step
            while self._handed_max and self._handed_max[0][1] <= durable:
                seq, step = self._handed_max.popleft()
        else:
            self._handed_max.clear()
        if seq <= self.acked:
            return
        if self.spool is not None:
            try:
                self.spool.acknowledge(self.name, seq)
            except OSError as err:
                self._log.error("cursor", "cannot save the cursor of `%s`: %s", self.name, err)
        with self._cv:
            self.acked = seq
            self.acked_step = step
            self._cv.notify_all()

    def _close(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception as err:
            _logger.error("exporter `%s` failed to shut down: %s", self.name, err)
            return
        if not getattr(self.exporter, "unwritten_windows", 0):
            self._acknowledge()  # a backend holding data back holds it all once closed


def _order_counts(exporter: Any) -> dict[str, int]:
    """A backend's step-order counters: rows that went backwards, and rows it did not write for their step
    (the policy's drops plus the backend's own: W&B's older steps, a resumed run's held steps)."""
    order = getattr(exporter, "step_order", None)
    backwards, dropped = (order.backwards, order.dropped) if order is not None else (0, 0)
    return {"backwards": int(backwards), "order_dropped": int(dropped) + int(getattr(exporter, "steps_dropped", 0))}


def _rows(window: Window) -> int:
    return len(window.metrics) + len(window.histograms) + len(window.spans)


def _spooled_cuts(spool: Spool, names: list[str]) -> list[tuple[int, int]]:
    """(cut_after, step) of the resumes a backend of `names` has yet to be handed (a restart, a replay)."""
    cuts = []
    for _, _, payload in spool.read(min((spool.cursor(n) for n in names), default=0)):
        if is_resume(payload):
            try:
                resume = decode_window(payload)
            except Exception as err:
                _logger.error("a spooled resume is unreadable (%s); skipped", err)
                continue
            if isinstance(resume, Resume):
                cuts.append((resume.cut_after, resume.step))
    return cuts


def _merge(windows: list[Window]) -> Window:
    return Window([r for w in windows for r in w.metrics], [h for w in windows for h in w.histograms],
                  [s for w in windows for s in w.spans])


class Delivery:
    """Encoded windows in; every backend fed from memory or the spool, each with its own cursor.

    Args:
        backends: Backend name -> exporter.
        spool: Where windows are written ahead (None: memory only, oldest dropped when a backend stalls).
        queue_windows: Windows held in memory per backend before it reads from the spool instead.
        on_error: Called (on the backend's thread) with its name when a backend did not write a window.
        thread_name: Prefix of the backends' thread names.
    """

    def __init__(self, backends: Mapping[str, RowExporter], spool: Spool | None, queue_windows: int = 16,
                 on_error: Callable[[str], None] | None = None, thread_name: str = "otel-train-deliver") -> None:
        self.spool = spool
        self._lock = threading.Lock()
        self._last_seq = spool.last_seq if spool is not None else 0
        self._last_step = spool.last_step if spool is not None else -1
        if spool is not None:
            spool.backends = list(backends)
        #: (cut_after, step) of every resume in the stream (`framing.Resume`); the spool's are known up front.
        self._cuts = _spooled_cuts(spool, list(backends)) if spool is not None else []
        self._backends = [_Backend(name, ex, spool, queue_windows, on_error, thread_name, self._cuts)
                          for name, ex in backends.items()]
        self._queued_seq = self._last_seq  # the last window queued to every backend (children follow it)
        #: Called with each decoded window and its max step; returns the window the backends get
        #: (the exporter process adds its self-telemetry rows here; they are not spooled).
        self.annotate: Callable[[Window, int], Window] | None = None
        self._side_lost: dict[str, int] = {}
        self._side_lost_lock = threading.Lock()

    @property
    def last_step(self) -> int:
        """The highest step of any window submitted so far (-1 before the first)."""
        return self._last_step

    @property
    def names(self) -> list[str]:
        return [b.name for b in self._backends]

    def submit(self, seq: int, max_step: int, payload: bytes, window: Window | None = None) -> None:
        """Spool one encoded window (a seq already spooled is ignored) and queue it for every backend.

        `window`: the decoded `payload` when the caller already holds it (the sink), so it is not decoded again."""
        with self._lock:
            if seq <= self._last_seq:
                return
            if self.spool is not None:
                self.spool.append(seq, max_step, payload)
            self._last_seq = seq
            self._last_step = max(self._last_step, max_step)
        if window is None:
            try:
                window = decode_window(payload)
            except Exception as err:
                _logger.error("window %d unreadable (%s); skipped", seq, err)
                return
        if isinstance(window, Resume):
            self._cuts.append((window.cut_after, window.step))  # before any backend can be handed it
        elif self.annotate is not None:
            try:
                window = self.annotate(window, max_step)
            except Exception as err:  # self-telemetry must never cost a window
                _logger.debug("self-telemetry failed: %s", err)
        for b in self._backends:
            b.submit(seq, max_step, window)
        self._queued_seq = seq

    def submit_window(self, window: Window, max_step: int, wait_s: float) -> bool:
        """Queue a decoded window for every backend (memory only, no spool), waiting up to `wait_s`
        for room in every backend's queue. Returns False, queueing nothing, if some queue stayed full.
        Callers serialize their calls (the sink does, per run)."""
        deadline = time.monotonic() + wait_s
        if not all(b.wait_room(deadline) for b in self._backends):
            return False
        with self._lock:
            self._last_seq += 1
            seq = self._last_seq
            self._last_step = max(self._last_step, max_step)
        for b in self._backends:
            b.submit(seq, max_step, window)
        self._queued_seq = max(self._queued_seq, seq)
        return True

    def has_room(self) -> bool:
        """Whether every backend's in-memory queue can take one more window now (`submit_window` would not wait)."""
        return all(b.queued() < b._queue_windows for b in self._backends)

    def backlogged(self) -> bool:
        """Whether some backend's queue is (nearly) full, so that `submit_window` may have to wait."""
        return any(b.queued() >= b._queue_windows - 1 for b in self._backends)

    @property
    def pending(self) -> int:
        """Windows submitted that some backend has not been handed yet."""
        return self._last_seq - min((b.handed for b in self._backends), default=self._last_seq)

    @property
    def rows_written(self) -> int:
        """Metric and histogram rows every backend was handed."""
        return min((b.rows_written for b in self._backends), default=0)

    def submit_side(self, window: Window) -> None:
        """Hand every backend a window that is not spooled (a child process's data): best effort, once, right
        after the last window queued so far (its rows carry that window's step)."""
        if window:
            after = self._queued_seq
            for b in self._backends:
                b.submit_side(window, after)

    def backend_stats(self) -> dict[str, dict[str, float]]:
        """Per backend: windows not yet handed to it, export calls and their seconds, rows handed, failures, drops."""
        return {b.name: {"backlog": max(0, self._last_seq - b.handed), "exports": b.exports, "export_s": b.export_s, "rows": b.rows,
                         "failures": getattr(b.exporter, "failures", 0),
                         "dropped": b.dropped + getattr(b.exporter, "dropped_windows", 0), **_order_counts(b.exporter)}
                for b in self._backends}

    def rows_lost(self) -> dict[str, dict[str, int]]:
        """Per backend: rows it did not write, by cause (only backends and causes with some)."""
        out: dict[str, dict[str, int]] = {}
        for b in self._backends:
            lost = {cause: n for cause, n in dict(getattr(b.exporter, "rows_lost", {}) or {}).items() if n}
            if b.dropped_rows:
                lost["queue_full"] = lost.get("queue_full", 0) + b.dropped_rows
            if lost:
                out[b.name] = lost
        return out

    @property
    def spool_failed_appends(self) -> int:
        """Windows the spool could not write ahead (disk full): delivered from memory only."""
        return self.spool.failed_appends if self.spool is not None else 0

    def sync(self) -> None:
        """Make every submitted window durable in the spool."""
        with self._lock:
            if self.spool is not None:
                self.spool.sync()

    def flush(self, deadline: float) -> bool:
        """Spool durable, then wait until every backend has made everything durable (or `deadline`)."""
        self.sync()
        target = self._last_seq
        tickets = [b.request_flush() for b in self._backends]
        return all([b.wait_flushed(target, t, deadline) for b, t in zip(self._backends, tickets)])

    def close(self, deadline: float) -> bool:
        """Deliver what is left, shut the backends down, drop acknowledged segments; bounded by `deadline`."""
        self.sync()
        target = self._last_seq
        for b in self._backends:
            b.stop()
        done = all([b.wait_acked(target, deadline) for b in self._backends])
        for b in self._backends:
            b.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.spool is not None:
            self.spool.close()
            self.spool.remove_acknowledged()
        return done and not any(b.thread.is_alive() for b in self._backends)

    def progress(self) -> Progress:
        stats = self.backend_stats()
        return Progress(self._last_seq, self._last_step, {b.name: b.acked for b in self._backends},
                        {b.name: b.acked_step for b in self._backends},
                        {n: int(s["failures"]) for n, s in stats.items()},
                        {n: int(s["dropped"]) for n, s in stats.items()},
                        {n: int(s["backwards"]) for n, s in stats.items()},
                        {n: int(s["order_dropped"]) for n, s in stats.items()},
                        self.spool_failed_appends, self.rows_lost(), self._children_lost_now())

    def count_side_lost(self, cause: str, n: int) -> None:
        """Count `n` values a child process lost before sending (`WorkerListener`'s ``lost``); any thread."""
        with self._side_lost_lock:
            self._side_lost[cause] = self._side_lost.get(cause, 0) + n

    def _children_lost_now(self) -> dict[str, int]:
        with self._side_lost_lock:
            return dict(self._side_lost)

    def exporters(self) -> list[Any]:
        return [b.exporter for b in self._backends]
