"""The one delivery engine: windows in, a spool, one thread and one durable cursor per backend.

Every backend is fed by it, wherever it runs: in the exporter process and `otel-train replay` (encoded
windows, spool-backed: `submit`), in the training process (`otel_train.ship.local_delivery`: memory only,
never waiting: `put`, a busy backend's windows merged, the oldest dropped past its queue) and, one per
run, in `otel-train sink` (memory only: `submit_window` waits for room instead, so a full queue pushes
back on the sender and the sender's own retry takes the place of the spool). Each backend
runs on its own thread (a slow or hanging one stalls only itself); while it is busy, new windows
merge into one bigger write. A backend's cursor moves only after its `force_flush()` succeeded, so
whatever it has not made durable is fed again from the spool after a crash or by `otel-train replay`;
a backend that appends to its own files (`RowExporter.kill_safe_writes`) also records after every
write how far its writes reached the OS (`Spool.advance`), so a killed process writes nothing twice; one that
reports its appends (`RowExporter.mark_appending`: JSONL, TensorBoard) gets an intent record before every write
(its files and their sizes, `Spool.intent`), so a process killed between a write and that record has the write
cut back out of the files when delivery resumes (`Spool.cut_unrecorded_appends`) and writes it once.
A backend whose client writes its store on its own schedule (W&B's service process) says how far its
store holds the data (`RowExporter.durable_step`): its cursor moves only over the windows up to that step
(an explicit flush still succeeds once such a backend has everything and flushed: the spool keeps the rest
until its store holds it).
The single entry into a backend is `RowExporter.export_window`.

With a `record` (`otel_train.ship.logged_record`), every window the backends are handed here is recorded as
they get it (spooled, in-process and child windows; a seq already spooled is not recorded again; the exporter
process's self-telemetry rows are not, as replay cannot deliver them again), and each backend's losses at every
flush and at close: what `otel-train verify` compares the backends with.

A child process's window (a DataLoader worker's values, `submit_side`) is not spooled; it is handed to each
backend in stream order, right after the last window queued when it arrived, so its values (stamped with
that window's step) never reach a backend after later steps (W&B drops writes to earlier steps).

A `Resume` in the stream (`otel_train.ship.framing`) is applied by each backend in order (`RowExporter.resume`)
and then acknowledged like a window. Windows of the earlier attempt (seq <= its `cut_after`) that a backend
is handed once the resume is known lose their rows at steps >= the resume step (`framing.cut_window`): after
a `kill -9`, the earlier attempt's undelivered windows must not bring back steps the new attempt supersedes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from otel_train._internal import faults
from otel_train.backend import RowExporter, Window
from otel_train.ship.backend_feed import BackendFeed, BackendPool
from otel_train.ship.framing import Resume, decode_window, is_resume
from otel_train.ship.logged_record import LoggedRecord
from otel_train.ship.span_work import SpanCompleter
from otel_train.ship.spool import Spool

__all__ = ["WINDOWS_UNREADABLE", "BackendPool", "Delivery", "Progress"]

_logger = logging.getLogger(__name__)
#: The loss cause (with its unit) of a window that could not be decoded where it was delivered.
WINDOWS_UNREADABLE = "windows unreadable in the exporter process"


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
    #: Per backend: rows it did not write, by cause (`otel_train.backend.LOSS_CAUSES`; only non-zero).
    rows_lost: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    #: What was lost before any backend could have it, by cause with its unit: values child processes lost before
    #: sending them (a refused step, a full buffer: `workers`), windows unreadable here, spans whose rows could
    #: not be made (`span_work`).
    children_lost: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Points the delivering process added to the windows it spooled (phase timings; the summary counts them).
    points_added: int = 0

    def behind(self) -> dict[str, int]:
        """Backends that lack windows, with how many steps they are behind."""
        return {name: max(0, self.spooled_step - self.delivered_step.get(name, -1))
                for name, seq in self.delivered.items() if seq < self.spooled}

    def summary(self) -> str:
        behind = self.behind()
        if not behind:
            return f"{self.spooled} window(s), every one delivered to every backend"
        return ", ".join(f"`{name}` behind by {steps} step(s) ({self.spooled - self.delivered[name]} window(s) "
                         f"after step {self.delivered_step.get(name, -1)} not held)" for name, steps in behind.items())


def _order_counts(exporter: Any) -> dict[str, int]:
    """A backend's step-order counters: rows that went backwards, and rows it did not write for their step
    (the policy's drops plus the backend's own: W&B's older steps, a resumed run's held steps)."""
    order = getattr(exporter, "step_order", None)
    backwards, dropped = (order.backwards, order.dropped) if order is not None else (0, 0)
    return {"backwards": int(backwards), "order_dropped": int(dropped) + int(getattr(exporter, "steps_dropped", 0))}


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


class Delivery:
    """Encoded windows in; every backend fed from memory or the spool, each with its own cursor.

    Args:
        backends: Backend name -> exporter.
        spool: Where windows are written ahead (None: memory only, oldest dropped when a backend stalls).
        queue_windows: Windows held in memory per backend before it reads from the spool instead.
        on_error: Called (on the backend's thread) with its name when a backend did not write a window.
        thread_name: Prefix of the backends' thread names.
        pool: Runs the backends' work on its bounded threads (the sink's many runs); None: a thread per backend.
        row_filter: (backend name, window) -> the part of it that backend is handed (`otel-train replay`'s
            `wanted`); None: all of it.
    """

    def __init__(self, backends: Mapping[str, RowExporter], spool: Spool | None, queue_windows: int = 16,
                 on_error: Callable[[str], None] | None = None, thread_name: str = "otel-train-deliver",
                 pool: BackendPool | None = None, row_filter: Callable[[str, Window], Window] | None = None) -> None:
        self.spool = spool
        self._lock = threading.Lock()
        self._last_seq = spool.last_seq if spool is not None else 0
        self._last_step = spool.last_step if spool is not None else -1
        if spool is not None:
            spool.backends = list(backends)
        #: (cut_after, step) of every resume in the stream (`framing.Resume`); the spool's are known up front.
        self._cuts = _spooled_cuts(spool, list(backends)) if spool is not None else []
        self._backends = [BackendFeed(name, ex, spool, queue_windows, on_error, thread_name, self._cuts, pool,
                                      row_filter) for name, ex in backends.items()]
        self._queued_seq = self._last_seq  # the last window queued to every backend (children follow it)
        #: Called with each decoded window and its max step; returns the window the backends get
        #: (the exporter process adds its self-telemetry rows here; they are not spooled).
        self.annotate: Callable[[Window, int], Window] | None = None
        self._side_lost: dict[str, int] = {}
        self._side_lost_lock = threading.Lock()
        #: Where the windows handed to the backends are recorded for `otel-train verify` (None: nowhere).
        self.record: LoggedRecord | None = None
        #: Makes a window that arrives with its `ot.span` records whole (their rows and phase timings) before it is
        #: recorded and spooled (`otel_train.ship.span_work`); None: windows arrive whole.
        self.spans: SpanCompleter | None = None

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
            if self.spans is not None:  # a seq spooled already (sent again after a restart) is not made again
                payload, window = self.spans.complete(payload)
            # Recorded before the spool: a kill between the two leaves a window recorded twice when a next writer
            # gets it again (verify counts a seq once), and, when the whole job died with it, a window no spool
            # holds, which verify counts as lost to the kill (the record's ``c`` entry tells a writer that ended).
            if self.record is not None:
                self._record_payload(seq, payload, window)
                if faults.KILL_RECORDED_SEQ is not None and self.spool is not None:  # tests only
                    faults.after_record(seq)
            spooled = True
            if self.spool is not None:
                failed = self.spool.failed_appends
                self.spool.append(seq, max_step, payload)
                spooled = self.spool.failed_appends == failed  # a full disk: memory is the window's only copy
            self._last_seq = seq
            self._last_step = max(self._last_step, max_step)
        if window is None:
            try:
                window = decode_window(payload)
            except Exception as err:
                _logger.error("window %d unreadable (%s); skipped", seq, err)
                self.count_lost(WINDOWS_UNREADABLE, 1)
                return
        if isinstance(window, Resume):
            self._cuts.append((window.cut_after, window.step))  # before any backend can be handed it
        else:
            if self.annotate is not None:
                try:
                    window = self.annotate(window, max_step)
                except Exception as err:  # self-telemetry must never cost a window
                    _logger.debug("self-telemetry failed: %s", err)
        for b in self._backends:
            b.submit(seq, max_step, window, spooled)
        self._queued_seq = seq

    def _record_payload(self, seq: int, payload: bytes, window: Window | None) -> None:
        """Record a spooled window as spooled (the self-telemetry rows `annotate` adds are not: replay cannot
        deliver them again)."""
        record = self.record
        if record is None:
            return
        try:
            decoded = window if window is not None else decode_window(payload)
        except Exception:
            return  # unreadable: `submit` says so
        if isinstance(decoded, Resume):
            record.note_resume(decoded.run.rank, decoded.step)
        else:
            record.add(decoded, seq=seq)

    def submit_window(self, window: Window, max_step: int, wait_s: float) -> bool:
        """Queue a decoded window for every backend (memory only, no spool), waiting up to `wait_s`
        for room in every backend's queue. Returns False, queueing nothing, if some queue stayed full.
        Callers serialize their calls (the sink does, per run)."""
        deadline = time.monotonic() + wait_s
        if not all(b.wait_room(deadline) for b in self._backends):
            return False
        seq = self._next_seq(max_step)
        for b in self._backends:
            b.submit(seq, max_step, window)
        self._queued_seq = max(self._queued_seq, seq)
        return True

    def _next_seq(self, max_step: int) -> int:
        """The next window's sequence number (memory-only windows; spooled ones take the spool's)."""
        with self._lock:
            self._last_seq += 1
            self._last_step = max(self._last_step, max_step)
            return self._last_seq

    def put(self, window: Window, max_step: int) -> None:
        """Queue a decoded window for every backend, memory only, never waiting (the in-process backends:
        `otel_train.ship.local_delivery`). A backend whose queue is full merges it into its last queued window
        (at most `_MERGE_ROWS` rows), else drops its oldest window (counted)."""
        seq = self._next_seq(max_step)
        if self.record is not None:
            if isinstance(window, Resume):
                self.record.note_resume(window.run.rank, window.step)
            else:
                self.record.add(window)
        for b in self._backends:
            b.submit(seq, max_step, window)
        self._queued_seq = seq

    def restart_after_fork(self) -> None:
        """In a forked child: every backend's thread restarted with nothing queued (see `BackendFeed.restart_after_fork`)."""
        self._lock = threading.Lock()
        for b in self._backends:
            b.restart_after_fork()

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
        """Metric and histogram rows every backend took (writes that failed not counted)."""
        return min((b.rows_written for b in self._backends), default=0)

    def submit_side(self, window: Window) -> None:
        """Hand every backend a window that is not spooled (a child process's data): best effort, once, right
        after the last window queued so far (its rows carry that window's step)."""
        if window:
            if self.record is not None:
                self.record.add(window, side=True)
            after = self._queued_seq
            for b in self._backends:
                b.submit_side(window, after)

    def backend_stats(self) -> dict[str, dict[str, float]]:
        """Per backend: windows not yet handed to it, export calls and their seconds, rows handed, failures, drops."""
        return {b.name: {"backlog": max(0, self._last_seq - b.handed), "exports": b.exports, "export_s": b.export_s, "rows": b.rows,
                         "rows_written": b.rows_written, "rows_failed": b.rows_failed,
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
            if b.lost_side_rows:
                lost["gave_up"] = lost.get("gave_up", 0) + b.lost_side_rows
            if b.lost_unspooled_rows:
                lost["disk_full"] = lost.get("disk_full", 0) + b.lost_unspooled_rows
            if b.abandoned_rows:
                lost["abandoned"] = lost.get("abandoned", 0) + b.abandoned_rows
            if lost:
                out[b.name] = lost
        return out

    @property
    def spool_failed_appends(self) -> int:
        """Windows the spool could not write ahead (disk full): delivered from memory only."""
        return self.spool.failed_appends if self.spool is not None else 0

    def sync(self) -> bool:
        """Make every submitted window durable in the spool; whether they all are (`Spool.sync`; False without one)."""
        with self._lock:
            return self.spool.sync() if self.spool is not None else False

    def flush(self, deadline: float) -> bool:
        """Spool durable, then wait until every backend has made everything durable (or `deadline`)."""
        self.sync()
        target = self._last_seq
        tickets = [b.request_flush() for b in self._backends]
        ok = all([b.wait_flushed(target, t, deadline) for b, t in zip(self._backends, tickets)])
        self._note_losses()
        return ok

    def _note_losses(self) -> None:
        if self.record is not None:
            self.record.note_losses(self.rows_lost(), {n: int(s["order_dropped"])
                                                       for n, s in self.backend_stats().items()})

    def stop(self) -> None:
        """Ask every backend to deliver what is left and shut down, without waiting (`close` waits)."""
        for b in self._backends:
            b.stop()

    def close(self, deadline: float) -> bool:
        """Deliver what is left, shut the backends down, drop acknowledged segments; bounded by `deadline`."""
        self.sync()
        target = self._last_seq
        self.stop()
        done = all([b.wait_acked(target, deadline) for b in self._backends])
        for b in self._backends:
            b.done.wait(timeout=max(0.0, deadline - time.monotonic()))
        for b in self._backends:
            if not b.done.is_set():
                b.abandon()
        self._note_losses()
        if self.record is not None:
            self.record.close()
        if self.spool is not None:
            self.spool.close()
            self.spool.remove_acknowledged()
            behind = self.progress().behind()
            if behind:
                _logger.warning("%s; those windows stay in the spool %s until each backend holds them: "
                                "`otel-train replay %s` retries them", self.progress().summary(), self.spool.path,
                                self.spool.path.parent.parent)
        return done and all(b.done.is_set() for b in self._backends)

    def still_running(self) -> list[str]:
        """Backends whose thread has not ended (after `close`: the ones abandoned, hanging in a call)."""
        return [b.name for b in self._backends if not b.done.is_set()]

    def progress(self) -> Progress:
        stats = self.backend_stats()
        return Progress(self._last_seq, self._last_step, {b.name: b.acked for b in self._backends},
                        {b.name: b.acked_step for b in self._backends},
                        {n: int(s["failures"]) for n, s in stats.items()},
                        {n: int(s["dropped"]) for n, s in stats.items()},
                        {n: int(s["backwards"]) for n, s in stats.items()},
                        {n: int(s["order_dropped"]) for n, s in stats.items()},
                        self.spool_failed_appends, self.rows_lost(), self._children_lost_now(),
                        self.spans.points_added if self.spans is not None else 0)

    def count_lost(self, cause: str, n: int) -> None:
        """Count `n` of what was lost before any backend could have it (`Progress.children_lost`): values a child
        process lost before sending (`WorkerListener`'s ``lost``), spans whose rows could not be made; any thread."""
        with self._side_lost_lock:
            self._side_lost[cause] = self._side_lost.get(cause, 0) + n

    def _children_lost_now(self) -> dict[str, int]:
        with self._side_lost_lock:
            return dict(self._side_lost)

    def exporters(self) -> list[Any]:
        return [b.exporter for b in self._backends]
