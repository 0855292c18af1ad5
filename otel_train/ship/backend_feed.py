"""One backend's feed in `otel_train.ship.delivery`: its thread, its queue and its durable cursor.

The thread takes everything queued at once and hands it to the backend in writes of at most `MERGE_ROWS`
rows (`RowExporter.export_window`, whose `otel_train.ship.window_writer` routes, orders, isolates and retries),
reading back from the spool whatever the queue could not hold; it flushes the backend when asked and at least
every `FLUSH_EVERY_S` while data flows with a spool, and moves the cursor over what the backend's store holds.
A resume in the stream is never merged. For a kill-safe backend with a spool it records each write (`Spool.advance`)
and, before the write, what the backend reports it is about to append to (`_intend`, the intent record); on start
it first cuts back what a killed writer appended without recording it (`Spool.cut_unrecorded_appends`); a cut
drops the row filter (replay's, decided before the cut), so what was cut is handed again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from otel_train._internal import faults
from otel_train._internal.ratelimit import LogOnce
from otel_train.backend import RowExporter, Window
from otel_train.ship.framing import Resume, cut_window, decode_window
from otel_train.ship.spool import Spool

__all__ = ["MERGE_ROWS", "BackendFeed", "BackendPool", "rows_in"]

_logger = logging.getLogger("otel_train.ship.delivery")
#: Windows the spool could not hold kept in memory per backend, per window of its queue (`queue_windows`).
_UNSPOOLED_PER_QUEUED = 64
MERGE_ROWS = 50_000  # rows one merged write may hold
FLUSH_EVERY_S = 1.0  # how stale a backend's durable cursor may get while data flows
_HANDED_KEPT = 4096  # (seq, step) marks kept for a backend whose store lags (`RowExporter.durable_step`)


class BackendPool(Protocol):
    """Runs backends' work on a bounded set of threads instead of one thread per backend (the sink's many runs).

    `register` is given a backend's kind (its name) and its `work` function, which does what is ready and
    returns the seconds until it wants to run again (`math.inf`: only when woken), or None once the backend is
    closed; it returns the function that wakes it. The pool never runs one backend's `work` twice at once.
    """

    def register(self, kind: str, work: Callable[[], float | None]) -> Callable[[], None]: ...


class BackendFeed:
    """One backend's thread (or its turns on a `BackendPool`), queue and cursor."""

    def __init__(self, name: str, exporter: RowExporter, spool: Spool | None, queue_windows: int,
                 on_error: Callable[[str], None] | None = None, thread_name: str = "otel-train-deliver",
                 cuts: list[tuple[int, int]] | None = None, pool: BackendPool | None = None,
                 row_filter: Callable[[str, Window], Window] | None = None) -> None:
        self.name = name
        self._row_filter = row_filter  # which rows of a window this backend is handed (replay); None: all
        self._cuts = cuts if cuts is not None else []  # (cut_after, step) of the resumes known (shared)
        self.exporter = exporter
        self.spool = spool
        self._kill_safe = spool is not None and bool(getattr(exporter, "kill_safe_writes", False))
        self._merges = bool(getattr(exporter, "merges_windows", True))
        #: A window the backend failed to write stays pending in its writer (and in the spool, the cursor before
        #: it) instead of being dropped after `max_attempts`; nothing later is handed to it meanwhile.
        self._keeps_failed = spool is not None
        if self._keeps_failed:
            exporter.keep_failed_windows()
        if self._kill_safe:
            assert spool is not None
            # Before the backend opens a file: what a killed writer appended but did not record goes first.
            if spool.cut_unrecorded_appends(name) and row_filter is not None:
                # What decided the filter (replay's verify, before this cut) saw those bytes: the backend now
                # lacks every row after its cursor, so it is handed all of them, as without a filter.
                self._row_filter = None
            watch = getattr(exporter, "watch_appends", None)
            if watch is not None:
                watch(self._intend)
        self.acked = spool.cursor(name) if spool is not None else 0
        #: The last seq recorded as written or durable (`Spool.cursor`): an intent record names it.
        self._recorded = self.acked
        self._intent_mark = -1  # the mark of the intent record in force (-1: none)
        self._intent_files: dict[str, int] = {}  # its files, with their sizes before the first unrecorded write
        self.acked_step = -1
        self.handed = self.acked
        self.handed_step = -1
        self._queue: deque[tuple[int, int, Window]] = deque()
        self._queue_windows = queue_windows
        self._reload = spool is not None and spool.last_seq > self.acked
        self._flush_wanted = False
        self._stop = False
        self._closed = False  # the backend was shut down (its thread ends)
        self._last_flush = time.monotonic()
        self._cv = threading.Condition()
        self._log = LogOnce(_logger, interval_s=60.0)
        self.dropped = 0
        self.dropped_rows = 0  # rows of the windows dropped from a full queue (no spool)
        self.lost_side_rows = 0  # child-process rows still waiting when the backend closed while it failed
        self.rows_written = 0  # metric and histogram rows the backend took (its write did not fail)
        self.rows_failed = 0  # metric and histogram rows of writes that failed (kept for a retry where spooled)
        self._on_error = on_error
        self._flushes_asked = 0
        self._flushes_done = 0
        self._flushed_handed = 0  # windows handed when the last asked-for flush succeeded
        self.exports = 0  # export_window calls, and the seconds they took (self-telemetry)
        self.export_s = 0.0
        self.rows = 0  # rows (points and spans) handed to the backend
        # Child-process windows (not spooled), each with the seq of the window it follows in the stream.
        self._side: deque[tuple[int, Window]] = deque(maxlen=queue_windows * 4)
        # Windows the spool could not write ahead (a full disk): memory is their only copy, so they are kept here
        # until the backend holds them, whatever the queue does (a stalled backend reads the rest from the spool).
        self._unspooled: dict[int, tuple[int, Window]] = {}
        self._unspooled_max = queue_windows * _UNSPOOLED_PER_QUEUED
        self.lost_unspooled_rows = 0  # rows of such windows past that bound, or not taken by the backend's close
        self.abandoned_rows = 0  # rows it still had when its close ran out of time (no spool: nowhere to keep them)
        self._writing_rows = 0  # rows of the write under way
        self._stuck_from = 0  # the first seq of the write the backend failed and holds (`_stuck`)
        self._handed_max: deque[tuple[int, int]] = deque()  # (seq, highest step handed so far), not yet acked
        self._max_step_handed = -1
        self._thread_name = f"{thread_name}-{name}"
        self._pool = pool
        self._wake: Callable[[], None] | None = None
        self.thread: threading.Thread | None = None
        self._start()

    def _start(self) -> None:
        self.done = threading.Event()  # set once the backend is shut down (its thread ends / leaves the pool)
        if self._pool is not None:
            self._wake = self._pool.register(self.name, self._work)
        else:
            self.thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self.thread.start()

    def _notify(self) -> None:
        """Wake whoever feeds the backend (its cv held): its thread, or its turn on the pool."""
        self._cv.notify_all()
        if self._wake is not None:
            self._wake()

    def restart_after_fork(self) -> None:
        """In a forked child: a fresh thread and lock, nothing queued. What the parent had queued (here and in
        the backend's own retry queue) stays the parent's: a child never hands a backend its parent's rows."""
        self._cv = threading.Condition()
        self._queue.clear()
        self._side.clear()
        self._unspooled.clear()
        self._reload = self._flush_wanted = self._stop = False
        forget = getattr(self.exporter, "forget_pending_after_fork", None)
        if forget is not None:
            forget()
        self._start()

    def submit(self, seq: int, step: int, window: Window, spooled: bool = True) -> None:
        """Queue window `seq` for the backend; `spooled`: the spool holds it (else memory keeps it until held)."""
        with self._cv:
            if not spooled and self.spool is not None:
                self._keep_unspooled(seq, step, window)
            if self._reload:
                pass  # the spool holds it; the thread reads it from there
            elif len(self._queue) >= self._queue_windows:
                if self.spool is not None:
                    self._queue.clear()  # stalled: keep memory bounded, read back from the spool later
                    self._reload = True
                elif self._merge_into_tail(seq, step, window):
                    pass  # memory only and busy: fewer, bigger writes instead of drops
                else:
                    _, _, gone = self._queue.popleft()
                    self.dropped += 1
                    self.dropped_rows += rows_in(gone)
                    self._queue.append((seq, step, window))
            else:
                self._queue.append((seq, step, window))
            self._notify()

    def _merge_into_tail(self, seq: int, step: int, window: Window) -> bool:
        """Merge `window` into the last queued one, within `MERGE_ROWS` rows (never across a resume)."""
        _tail_seq, tail_step, tail = self._queue[-1]
        if isinstance(window, Resume) or isinstance(tail, Resume) or rows_in(tail) + rows_in(window) > MERGE_ROWS:
            return False
        self._queue[-1] = (seq, max(tail_step, step), _merge([tail, window]))
        return True

    def submit_side(self, window: Window, after_seq: int) -> None:
        """Queue a window that is not in the spool, to go right after window `after_seq` (delivered once,
        best effort)."""
        with self._cv:
            self._side.append((after_seq, window))
            self._notify()

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
            self._notify()
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
            self._notify()

    def abandon(self) -> None:
        """Its close ran out of time (its thread hangs in a call: a start or a write): without a spool, the rows it
        still has (queued, the children's, the write under way) are lost, and counted."""
        if self.spool is not None:
            return  # the spool keeps them for `otel-train replay`
        with self._cv:
            self.abandoned_rows = (sum(rows_in(w) for _, _, w in self._queue) + sum(rows_in(w) for _, w in self._side)
                                   + self._writing_rows)

    def wait_acked(self, seq: int, deadline: float) -> bool:
        """Wait until `seq` is durable, or the backend has shut down without it (it cannot get there then)."""
        with self._cv:
            self._cv.wait_for(lambda: self.acked >= seq or self._closed, timeout=max(0.0, deadline - time.monotonic()))
            return self.acked >= seq

    def _run(self) -> None:
        while self._cycle(FLUSH_EVERY_S) is not None:
            pass

    def _work(self) -> float | None:
        """One turn on a `BackendPool`: do what is ready, never wait."""
        return self._cycle(0.0)

    def _cycle(self, wait_s: float) -> float | None:
        """Wait up to `wait_s` for work, do it; None once closed, else the seconds until a flush is due.

        While the backend holds a window it failed to write (`_stuck`), nothing new is handed to it: the
        spool keeps the rest, and the held window is retried (a flush) when its backoff has passed."""
        stuck = self._stuck()
        with self._cv:
            if wait_s > 0:
                self._cv.wait_for(lambda: (not stuck and (self._queue or self._side or self._reload))
                                  or self._flush_wanted or self._stop, timeout=wait_s)
            stop = self._stop
            if stuck:
                items: list[tuple[int, int, Window]] = []
                side: list[tuple[int, Window]] = []
                reload = False
            else:
                items = list(self._queue)
                self._queue.clear()
                side = list(self._side)
                self._side.clear()
                reload, self._reload = self._reload, False
            flush, self._flush_wanted = self._flush_wanted, False
            asked = self._flushes_asked
            if items:
                self._cv.notify_all()  # room in the queue for a producer waiting in `wait_room`
        if reload and self.spool is not None:
            items = self._from_spool() + items
        self._export(items, side)
        if flush:  # an explicit flush (`ot.flush()`, shutdown, replay): a backend's own hold writes all it holds
            write_held = getattr(self.exporter, "write_held_at_next_flush", None)
            if write_held is not None:
                write_held()
        if stuck:
            # The held window's retry is a flush, at its backoff (an explicit flush does not hurry it), and
            # once more before the backend closes.
            flushed = self._flush() if stop or self._retry_in_s() <= 0 else False
        else:
            # Without a spool there is no cursor to keep fresh: flush only when asked.
            due = (self.spool is not None and self.handed > self.acked
                   and time.monotonic() - self._last_flush >= FLUSH_EVERY_S)
            flushed = self._flush() if flush or due else False
        if flush:
            with self._cv:
                self._flushes_done = max(self._flushes_done, asked)
                if flushed:
                    self._flushed_handed = self.handed
                self._cv.notify_all()
        if self._unspooled:
            self._forget_held_unspooled()
        if stop:
            with self._cv:
                if (self._queue or self._side or self._reload) and not self._stuck():
                    return 0.0
                left = list(self._side)
                self._side.clear()
            self.lost_side_rows += sum(rows_in(w) for _, w in left)  # not spooled: nowhere to keep them
            self._close()
            # Kept windows the backend does not hold are lost (the spool has no copy): those it never got, and the
            # one it still failed to write at its close (and those merged with it).
            self._forget_held_unspooled(closing=True, lost_from=self._stuck_from if self._stuck() else self.handed + 1)
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self.done.set()
            return None
        if self._stuck():
            return self._retry_in_s()
        if self.spool is None or self.handed <= self.acked:
            return math.inf
        return max(0.0, FLUSH_EVERY_S - (time.monotonic() - self._last_flush))

    def _stuck(self) -> bool:
        """Whether the backend holds a window it failed to write while a spool holds the rest (`keep_failed`)."""
        return self._keeps_failed and bool(self.exporter.unwritten_windows)

    def _retry_in_s(self) -> float:
        return self.exporter.retry_in_s()

    def _from_spool(self) -> list[tuple[int, int, Window]]:
        """The windows after the last one handed: the spool's, and those it could not hold (`_unspooled`)."""
        assert self.spool is not None
        out = []
        for seq, step, payload in self.spool.read(self.handed):
            try:
                out.append((seq, step, decode_window(payload)))
            except Exception as err:  # a window we cannot read must not stop the rest
                self._log.error("decode", "spool window %d unreadable for `%s` (%s); skipped", seq, self.name, err)
        with self._cv:
            out += [(seq, step, window) for seq, (step, window) in self._unspooled.items() if seq > self.handed]
        return out

    def _keep_unspooled(self, seq: int, step: int, window: Window) -> None:
        """Keep a window the spool could not write ahead until the backend holds it (its cv held); past the bound
        the oldest goes, counted as lost to a full disk."""
        self._unspooled[seq] = (step, window)  # windows come in seq order: the first key is the oldest
        while len(self._unspooled) > self._unspooled_max:
            self.lost_unspooled_rows += rows_in(self._unspooled.pop(next(iter(self._unspooled)))[1])
            self._log.error("unspooled", "`%s` is behind and the spool cannot be written: windows kept in memory "
                            "for it past %d are lost (counted as disk full)", self.name, self._unspooled_max)

    def _forget_held_unspooled(self, closing: bool = False, lost_from: int = 0) -> None:
        """Drop kept windows once the backend holds them (its cursor); at close, those from `lost_from` on (what it
        does not hold) are lost, the spool having no copy for `otel-train replay`, and counted."""
        with self._cv:
            held = [seq for seq in self._unspooled if seq <= self.acked]
            for seq in held:
                del self._unspooled[seq]
            if closing and self._unspooled:
                self.lost_unspooled_rows += sum(rows_in(w) for seq, (_, w) in self._unspooled.items()
                                                if seq >= lost_from)
                self._unspooled.clear()

    def _export(self, items: list[tuple[int, int, Window]], side: list[tuple[int, Window]] | None = None) -> None:
        # The spool and the queue may both hold a window around a reload: each seq goes out once.
        fresh: list[tuple[int, int, Window]] = []
        for item in sorted(items, key=lambda i: i[0]):
            if item[0] > (fresh[-1][0] if fresh else self.handed):
                fresh.append(item)
        children = sorted(side or (), key=lambda c: c[0])
        group: list[tuple[int, int, Window, bool]] = []  # (seq, step, window, a child's window)

        def children_after(seq: int) -> None:
            # A child's window goes right after the window it followed (its rows carry that window's step).
            while children and children[0][0] <= seq:
                group.append((seq, -1, children.pop(0)[1], True))

        children_after(self.handed)
        for seq, step, window in fresh:
            if isinstance(window, Resume):  # never merged: what came before is written first
                if not self._export_windows(group):
                    self._hold_back([(seq, step, window, False)], children)  # it and what follows: the spool's
                    return
                group = []
                self._apply_resume(seq, window)
                if self._reload:  # the backend lost what it was handed (`_rewind_if_lost`): the rest from the spool
                    self._hold_back([], children)
                    return
                continue
            for cut_after, resume_step in self._cuts:
                if seq <= cut_after:
                    window = cut_window(window, resume_step)
            group.append((seq, step, window, False))
            children_after(seq)
        group += [(self.handed if not group else group[-1][0], -1, w, True) for _, w in children]
        self._export_windows(group)

    def _hold_back(self, items: list[tuple[int, int, Window, bool]], children: list[tuple[int, Window]]) -> None:
        """The backend failed a write and holds it (`_stuck`): what was not handed waits, the spool's windows
        in the spool (read back from there), the children's in memory, in their place."""
        held = [(seq, w) for seq, _, w, child in items if child] + children
        with self._cv:
            if any(not child for *_, child in items):
                self._reload = True
            self._side.extendleft(reversed(held))

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

    def _export_windows(self, items: list[tuple[int, int, Window, bool]]) -> bool:
        """Hand `items` to the backend in merged writes; False when it failed one and holds it (`_stuck`): the
        rest is held back (`_hold_back`)."""
        start = 0
        while start < len(items):
            end, rows = start, 0
            while end < len(items) and (end == start or (self._merges and rows + rows_in(items[end][2]) <= MERGE_ROWS)):
                rows += rows_in(items[end][2])
                end += 1
            batch = items[start:end]
            ok = self._write(batch[0][2] if len(batch) == 1 else _merge([w for _, _, w, _ in batch]))
            if not ok and self._rewind_if_lost():
                self._hold_back(items[start:], [])  # the spool's from the last the store holds; the children's
                return False
            last = max(self.handed, batch[-1][0])
            step = max(s for _, s, _, _ in batch)
            if faults.ARMED and self._kill_safe:  # tests only: a kill between the write and its record
                faults.after_write(self.name, step)
            if ok and self._kill_safe and last > self.handed:
                self._advance(last)
            elif ok and self._kill_safe and self._recorded >= self.handed:
                self._children_recorded()
            self._hand(last, step)
            start = end
            if not ok and self._stuck():
                self._stuck_from = batch[0][0]
                self._hold_back(items[start:], [])
                return False
        return True

    def _rewind_if_lost(self) -> bool:
        """After a failed write and at each flush: if the backend lost what it was handed and its store does not hold
        (`RowExporter.lost_handed`), hand it again from the spool, from the last window acknowledged."""
        if self.spool is None or not self.exporter.lost_handed():
            return False
        with self._cv:
            self.handed, self.handed_step = self.acked, self.acked_step
            self._max_step_handed = self.acked_step
            self._handed_max.clear()
            self._queue.clear()  # the spool holds them: read back from there, in order
            self._reload = True
        return True

    def _hand(self, seq: int, step: int) -> None:
        """Windows up to `seq` (steps up to `step`) were handed to the backend."""
        self.handed = max(self.handed, seq)
        self.handed_step = max(self.handed_step, step)
        self._max_step_handed = max(self._max_step_handed, step)
        if self._handed_max and self._handed_max[-1][0] == self.handed:
            self._handed_max[-1] = (self.handed, self._max_step_handed)
        else:
            self._handed_max.append((self.handed, self._max_step_handed))
            if len(self._handed_max) > _HANDED_KEPT:  # no flush for long (memory only): forget the oldest
                self._handed_max.popleft()  # a later entry needs a higher durable step: never claims more

    def _advance(self, seq: int) -> None:
        assert self.spool is not None
        try:
            self.spool.advance(self.name, seq)
        except OSError as err:  # only costs a repeat after a kill: the flush cursor still holds
            self._log.error("written", "cannot record how far `%s` has written: %s", self.name, err)
            return
        self._recorded = max(self._recorded, seq)

    def _children_recorded(self) -> None:
        """A write of child windows only (not spooled, no seq of their own) landed after every recorded window:
        the intent record is cleared, so a later resume never cuts them back out (replay cannot bring them
        back); the next append records the files' sizes afresh."""
        assert self.spool is not None
        if self._intent_mark < 0:
            return  # nothing recorded since the last clear (the backend reported no append)
        self._intent_mark = -1
        self._intent_files.clear()
        self.spool.intent(self.name).clear()

    def _intend(self, files: Sequence[tuple[str, int]]) -> None:
        """The backend is about to append to `files` (`RowExporter.mark_appending`): record it first (in the spool's
        ``written.<backend>``). Until a write is recorded (`_advance`, `_acknowledge`), the record keeps each
        file's size before the first unrecorded write: a failed write's partial append is cut back with it."""
        assert self.spool is not None
        known = self._intent_files
        changed = self._intent_mark != self._recorded
        if changed:  # everything appended so far is recorded: sizes start afresh
            self._intent_mark = self._recorded
            known.clear()
        for path, size in files:
            if path not in known:
                known[path] = size
                changed = True
        if not changed:
            return
        try:
            self.spool.intent(self.name).write(self._intent_mark, known)
        except OSError as err:  # only costs a repeat after a kill, as without the record
            self._intent_mark = -1  # written whole at the next append
            self._log.error("intent", "cannot record the files `%s` is about to append to: %s", self.name, err)

    def _write(self, window: Window) -> bool:
        if self._row_filter is not None:
            window = self._row_filter(self.name, window)
        started = time.perf_counter()
        self._writing_rows = rows_in(window)
        try:
            ok = self.exporter.export_window(window)  # isolates and retries on its own (`window_writer`)
        except Exception as err:
            self._log.error("export", "exporter `%s` raised %s: %s", self.name, type(err).__name__, err)
            ok = False
        self._writing_rows = 0
        if ok is False and self._on_error is not None:
            self._on_error(self.name)
        if ok is False:
            self.rows_failed += len(window.metrics) + len(window.histograms)
        else:
            self.rows_written += len(window.metrics) + len(window.histograms)
        self.export_s += time.perf_counter() - started
        self.exports += 1
        self.rows += rows_in(window)
        return ok is not False

    def _flush(self) -> bool:
        self._last_flush = time.monotonic()
        try:
            ok = self.exporter.force_flush()
        except Exception as err:
            self._log.error("flush", "exporter `%s` flush raised %s: %s", self.name, type(err).__name__, err)
            ok = False
        if self._rewind_if_lost():  # a call since the last flush found its process gone: nothing to acknowledge
            return False
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
                self._recorded = max(self._recorded, seq)
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


def rows_in(window: Window) -> int:
    """Metric, histogram, span and log rows of `window`."""
    return len(window.metrics) + len(window.histograms) + len(window.spans) + len(window.logs)


def _merge(windows: list[Window]) -> Window:
    return Window([r for w in windows for r in w.metrics], [h for w in windows for h in w.histograms],
                  [s for w in windows for s in w.spans], [g for w in windows for g in w.logs])
