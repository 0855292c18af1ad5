"""The hang watchdog: one daemon thread per rank process that notices a step running far past its usual time.

It never touches the training thread: every `poll_s` it reads what the training thread already keeps (the step
entered last, `otel_train.capture.step.open_step`; the main thread's open spans,
`otel_train.capture.instrument.open_spans_of`), learns each kind's usual duration from the steps it sees finish
and the spans the reader collects (`take_spans`, on the collector thread), and applies `otel_train.hangs.hang_rule.HangRule`. When work is stuck it records what the rank is
doing (step, open spans, every thread's Python stack) as a WARN log record on the logger ``otel_train.hang``
(``event.name`` ``train.hang``) and in ``hang/rank<N>.json`` (`otel_train.hangs.hang_file`); again each time the
wait doubles; a ``resumed`` record when the work ends, or an ``ended`` one when the rank ends (`stop`, at
shutdown) while still stuck, so the file and the sink do not go on saying it is stuck. It writes the file's heartbeat every `heartbeat_s`, so
the roll call can tell a rank that stopped altogether. Nothing here raises: a failure is logged once.

A training thread that holds the GIL in a C call stops this thread too (it cannot run Python). For that case,
while work is open, each look also (re)arms `faulthandler.dump_traceback_later` for when that work would pass its
limit plus a heartbeat: if this thread has not run by then, faulthandler's own C thread writes every thread's
stack, without the GIL, to ``hang/rank<N>.native.txt``; the heartbeat goes stale, and the roll call names the rank
with its main thread's last Python frame from that dump. (This uses the process's one `dump_traceback_later`
timer: a program that arms its own should set ``OTEL_TRAIN_HANG_AFTER_S=0``, or expect it re-armed. Forks are
safe: `otel_train.hangs.native_timer`.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from otel_train.capture.instrument import SpanRecord, open_spans_of
from otel_train.capture.step import open_step
from otel_train.hangs.hang_file import (
    MAX_HISTORY,
    file_content,
    heartbeat_every_s,
    native_dump_path,
    write_hang_file,
)
from otel_train.hangs.hang_rule import HangRule, Work
from otel_train.hangs.native_timer import NATIVE_TIMER
from otel_train.hangs.stacks import ThreadStack, thread_stacks
from otel_train.vocab import semconv

__all__ = ["HangWatchdog", "Look", "TrainingThreadView"]

_logger = logging.getLogger(__name__)
hang_logger = logging.getLogger("otel_train.hang")
"""Where `train.hang` records go (WARNING), for the logs signal and the user's own handlers."""

STEP_KEY = "step"
_SPAN_SAMPLES = 512  # finished spans of the training thread learned from at a look (the latest)
_SPAN_BATCHES = 8  # collections' latest spans kept between two looks, to find those in
_NATIVE_PAUSE_S = 0.02  # between two looks at the main thread's frame: has it moved?


class Look(NamedTuple):
    """What one look at the training thread saw."""

    step: int | None  # the step entered last
    works: list[Work]  # the open step, then the innermost span opened in it; outside a step, the innermost span
    finished: list[Work]  # steps seen open before and finished since (elapsed_s: its whole duration)
    spans: list[str]  # the main thread's open spans, outermost first


def _span_key(name: str) -> str:
    return f"span {name}"


class TrainingThreadView:
    """Looks at the training (main) thread's step and spans from the watchdog's thread, lock-free."""

    def __init__(self, thread_id: int | None = None) -> None:
        main = threading.main_thread()
        self.thread_id = thread_id if thread_id is not None else (main.native_id or 0)
        self._step: Any = None  # the step seen open at the last look

    def look(self) -> Look:
        finished: list[Work] = []
        works: list[Work] = []
        seen = self._step
        if seen is not None and seen.ended_ns >= seen.started_ns:
            finished.append(Work(STEP_KEY, (seen.ended_ns - seen.started_ns) / 1e9, id(seen)))
            self._step = None
        current = open_step()
        step_elapsed_s: float | None = None
        if current is not None and 0 < current.started_ns and current.ended_ns < current.started_ns:
            self._step = current
            step_elapsed_s = (time.perf_counter_ns() - current.started_ns) / 1e9
            works.append(Work(STEP_KEY, step_elapsed_s, id(current)))
        scopes = open_spans_of(self.thread_id)
        now_ns = time.time_ns()
        innermost = scopes[-1] if scopes else None
        if innermost is not None:
            elapsed_s = (now_ns - innermost.start_ns) / 1e9
            if step_elapsed_s is None or elapsed_s <= step_elapsed_s + 0.001:  # opened inside the step
                works.append(Work(_span_key(innermost.name), elapsed_s, id(innermost)))
        return Look(current.index if current is not None else None, works, finished, [s.name for s in scopes])


class _Hang(NamedTuple):
    ident: int  # the stuck work (the first of `Look.works`)
    key: str
    next_at_s: float  # the wait at which the next record is due (doubles)


class HangWatchdog:
    """One rank's watchdog thread (see the module docstring).

    Args:
        floor_s: ``OTEL_TRAIN_HANG_AFTER_S`` (> 0).
        factor: ``OTEL_TRAIN_HANG_FACTOR``.
        path: This rank's ``hang/rank<N>.json``.
        identity: Written in the file: rank, world size, run id and name, host, pid.
        view: What it looks at (a fake in tests).
        stacks: Every thread's stack (a fake in tests).
        wall: The wall clock written in records.
    """

    def __init__(self, floor_s: float, factor: float, path: Path, identity: Mapping[str, Any],
                 view: TrainingThreadView | None = None,
                 stacks: Callable[[int | None], list[ThreadStack]] = thread_stacks,
                 wall: Callable[[], float] = time.time) -> None:
        self.rule = HangRule(floor_s, factor)
        self.path = path
        self.identity = {**identity, "main_ident": threading.main_thread().ident}
        self.poll_s = min(1.0, max(0.05, floor_s / 10))
        self.heartbeat_s = heartbeat_every_s(floor_s)
        self._view = view if view is not None else TrainingThreadView()
        self._stacks = stacks
        self._wall = wall
        self._hang: _Hang | None = None
        self._records: list[dict[str, Any]] = []  # of the current (else the last) hang
        self._state = "running"
        self._step: int | None = None
        self._last_write = -float("inf")
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The latest spans of each collection since the last look (at most `_SPAN_SAMPLES` of each, the
        #: latest `_SPAN_BATCHES` collections): the look picks the training thread's.
        self._span_batches: deque[list[tuple[Any, ...]]] = deque(maxlen=_SPAN_BATCHES)
        self._native_file: Any = None  # where faulthandler writes if this thread stops running (`_arm_native`)
        self._armed: tuple[int, float] | None = None  # (the work armed for, when: time.monotonic)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._write()
        try:
            self._native_file = open(native_dump_path(self.path), "w", encoding="utf-8")  # noqa: SIM115 - kept open
        except OSError:
            self._native_file = None
        self._thread = threading.Thread(target=self._run, name="otel-train-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and mark the file ``ended`` (the rank finished; not a hang). Safe to call twice."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        self._thread = None
        self._disarm_native()
        if self._native_file is not None:
            with contextlib.suppress(OSError):
                empty = self._native_file.tell() == 0
                self._native_file.close()
                if empty:
                    native_dump_path(self.path).unlink()
            self._native_file = None
        if self._state != "ended":
            self.check()  # a hang whose step ended since the last look gets its `resumed` record
            if self._hang is not None:  # still stuck as the rank ends (a signal, a launcher's kill): said so
                self._ended_stuck()
            self._state = "ended"
            self._write()

    def take_spans(self, spans: list[tuple[Any, ...]]) -> None:
        """The reader's span listener (collector thread): keep the latest finished spans of a collection, for the
        watchdog thread to learn the durations of the training thread's `ot.span` scopes from at its next look.
        One slice here, the rest at a look (about once a second, where the collector runs ten times a second)."""
        self._span_batches.append(spans[-_SPAN_SAMPLES:])

    def _finished_spans(self) -> list[tuple[str, float]]:
        """The kinds and durations of the training thread's latest `ot.span` scopes collected since the last look
        (at most `_SPAN_SAMPLES`, oldest first). Raw OTel spans and other threads' spans are left out."""
        thread_id = self._view.thread_id
        batches = []
        while self._span_batches:
            batches.append(self._span_batches.popleft())
        latest: list[tuple[str, float]] = []
        for batch in reversed(batches):
            for item in reversed(batch):
                span = item[-1]
                if isinstance(span, SpanRecord) and span.thread_id == thread_id:
                    latest.append((_span_key(span.name), (span.end_ns - span.start_ns) / 1e9))
                    if len(latest) == _SPAN_SAMPLES:
                        return latest[::-1]
        return latest[::-1]

    def remove_file(self) -> None:
        """Remove this rank's file (and the hang folder, once empty): the session's run never was (the rank was
        adopted from the framework before anything went out). Call after `stop`."""
        with contextlib.suppress(OSError):
            self.path.unlink()
            self.path.parent.rmdir()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    # -- one look ------------------------------------------------------------------------------
    def check(self) -> None:
        """Look once, record what is due. Never raises (a failure is logged once)."""
        try:
            self._check()
        except Exception:
            if not self._failed:
                self._failed = True
                _logger.warning("otel-train: the hang watchdog failed (logged once; it goes on)", exc_info=True)

    def _check(self) -> None:
        look = self._view.look()
        first_step = self._step is None and look.step is not None  # written at once: the roll call's "at step"
        self._step = look.step if look.step is not None else self._step
        hang = self._hang
        for key, duration_s in self._finished_spans():
            self.rule.add(key, duration_s)
        for work in look.finished:
            self.rule.add(work.key, work.elapsed_s)
            if hang is not None and work.ident == hang.ident:
                self._resumed(hang, work.elapsed_s)
                hang = None
        if hang is not None and all(w.ident != hang.ident for w in look.works):  # ended unseen (a span dropped)
            self._resumed(hang, None)
            hang = None
        if hang is None and self.rule.stuck(look.works):
            work = look.works[0]
            hang = self._hang = _Hang(work.ident, work.key, 0.0)
            self._records = []
        self._arm_native(look.works)
        if hang is not None:
            waited_s = next(w.elapsed_s for w in look.works if w.ident == hang.ident)
            if waited_s >= hang.next_at_s:
                self._record(look, waited_s)
                return
        if first_step or self._wall() - self._last_write >= self.heartbeat_s:
            self._write()

    def _arm_native(self, works: list[Work]) -> None:
        """While work is open, keep faulthandler's timer set for when it would pass its limit plus a heartbeat:
        re-armed every look (a new timer thread each time, so at most once a second), it fires only if this
        thread stops running."""
        if self._native_file is None or self._stop.is_set():
            return
        if not works:
            self._disarm_native()
            return
        work, now = works[0], time.monotonic()
        armed = self._armed
        if armed is not None and armed[0] == work.ident and now - armed[1] < min(1.0, self.heartbeat_s / 2):
            return
        due_s = max(self.rule.limit_s(work.key) - work.elapsed_s, 0.0) + self.heartbeat_s
        NATIVE_TIMER.arm(due_s, self._native_file)
        self._armed = (work.ident, now)

    def _disarm_native(self) -> None:
        if self._armed is not None:
            NATIVE_TIMER.cancel()
            self._armed = None

    def _record(self, look: Look, waited_s: float) -> None:
        hang = self._hang
        if hang is None:
            return
        stacks = self._stacks(threading.get_ident())
        main = next((s for s in stacks if s.main), None)
        native = False
        if main is not None and main.position is not None:
            time.sleep(_NATIVE_PAUSE_S)
            again = next((s for s in self._stacks(threading.get_ident()) if s.main), None)
            native = again is not None and again.position == main.position
        phase = look.spans[-1] if look.spans else STEP_KEY
        usual_s = self.rule.usual_s(hang.key)
        record: dict[str, Any] = {
            "event.name": semconv.TRAIN_HANG, "state": "stuck", "time": self._wall(), "step": look.step,
            "phase": phase, "spans": look.spans, "waited_s": round(waited_s, 3),
            "limit_s": round(self.rule.limit_s(hang.key), 3),
            "usual_s": None if usual_s is None else round(usual_s, 6),
            "main_frame": main.frames[0] if main is not None and main.frames else None,
            "user_frame": main.user_frame if main is not None else None, "native": native,
            "threads": [{"name": s.name, "thread_id": s.thread_id, "main": s.main, "frames": s.frames}
                        for s in stacks],
        }
        if len(self._records) >= MAX_HISTORY:  # the first records and the latest
            del self._records[MAX_HISTORY // 2:-1]
        self._records.append(record)
        self._hang = hang._replace(next_at_s=max(waited_s * 2, self.poll_s))
        self._state = "stuck"
        self._write()
        self._log(record)

    def _resumed(self, hang: _Hang, duration_s: float | None) -> None:
        last = self._records[-1] if self._records else {}
        ran_s = duration_s if duration_s is not None else last.get("waited_s")
        record = {"event.name": semconv.TRAIN_HANG, "state": "resumed", "time": self._wall(),
                  "step": last.get("step"), "phase": last.get("phase"), "spans": last.get("spans", []),
                  "waited_s": None if ran_s is None else round(ran_s, 3)}
        self._records.append(record)
        self._hang = None
        self._state = "resumed"
        self._write()
        self._log(record)

    def _ended_stuck(self) -> None:
        """The ``ended`` record: the rank ended while its work was still stuck (no ``resumed`` will come). The
        last ``stuck`` record's place, with the wait until now; the file and the sink then read as ended, with
        where it was stuck."""
        last = self._records[-1] if self._records else None
        self._hang = None
        if last is None or last.get("state") != "stuck":
            return
        now = self._wall()
        record = {key: last.get(key) for key in ("step", "phase", "spans", "limit_s", "usual_s", "main_frame",
                                                  "user_frame", "native")}
        record.update({"event.name": semconv.TRAIN_HANG, "state": "ended", "time": now,
                       "waited_s": round(float(last.get("waited_s") or 0.0) + max(0.0, now - float(last["time"])),
                                         3)})
        self._records.append(record)
        self._log(record)

    # -- output ----------------------------------------------------------------------------------
    def _write(self) -> None:
        content = file_content(self.identity, self._state, self._step, self.heartbeat_s, self._records, self._wall())
        self._last_write = self._wall()
        try:
            write_hang_file(self.path, content)
        except OSError as err:
            if not self._failed:
                self._failed = True
                _logger.warning("otel-train: cannot write %s (%s); hang records go to the log only (logged once)",
                                self.path, err)

    def _log(self, record: Mapping[str, Any]) -> None:
        rank = self.identity.get("rank")
        extra: dict[str, Any] = {
            "event.name": semconv.TRAIN_HANG, semconv.TRAIN_STEP: record.get("step"), semconv.TRAIN_RANK: rank,
            semconv.HANG_STATE: record["state"], semconv.HANG_PHASE: record.get("phase"),
            semconv.HANG_SPANS: list(record.get("spans") or []), semconv.HANG_WAITED: record.get("waited_s"),
            semconv.HANG_FILE: str(self.path)}
        if record["state"] == "resumed":
            hang_logger.warning("otel-train rank %s: step %s resumed after %s s (in `%s`)", rank, record.get("step"),
                                record.get("waited_s"), record.get("phase"), extra=extra)
            return
        extra.update({semconv.HANG_LIMIT: record["limit_s"], semconv.HANG_USUAL: record["usual_s"],
                      semconv.HANG_FRAME: record["main_frame"], semconv.HANG_USER_FRAME: record["user_frame"],
                      semconv.HANG_NATIVE: record["native"]})
        where = record["main_frame"] or "an unknown frame"
        if record["native"]:
            where += " (in native code)"
        if record["user_frame"] and record["user_frame"] != record["main_frame"]:
            where += f" (from {record['user_frame']})"
        if record["state"] == "ended":  # the stacks are in the `stuck` records before it
            hang_logger.warning("otel-train rank %s: ended while step %s was stuck for %.1f s in `%s` at %s; every "
                                "thread's stack in %s", rank, record.get("step"), record["waited_s"],
                                record["phase"], where, self.path, extra=extra)
            return
        extra[semconv.HANG_THREADS] = _threads_text(record["threads"])
        usual = "none seen yet" if record["usual_s"] is None else f"usual {record['usual_s']:.3g} s"
        hang_logger.warning("otel-train rank %s: step %s has run %.1f s (%s, limit %.3g s) in `%s` at %s; every "
                            "thread's stack in %s", rank, record.get("step"), record["waited_s"], usual,
                            record["limit_s"], record["phase"], where, self.path, extra=extra)


def _threads_text(threads: list[dict[str, Any]]) -> str:
    """Every thread's stack as text, innermost frame first (the log record's `train.hang.threads`)."""
    lines = []
    for t in threads:
        lines.append(f"Thread {t['name']!r} ({t['thread_id']}){' [main]' if t['main'] else ''}:")
        lines.extend(f"  {frame}" for frame in t["frames"])
    return "\n".join(lines)

