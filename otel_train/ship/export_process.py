"""The exporter process: named backends run in a child of the training process, not in it.

The training process encodes each window (`otel_train.ship.framing`) and writes it to a Unix socket;
the child (started with a fresh interpreter, never forked: the trainer may hold CUDA) spools it
(`otel_train.ship.spool`) and feeds every backend through `otel_train.ship.delivery`. The child sits in its own
session, so a Ctrl-C to the job's process group does not reach it; once the trainer hands off or
dies it keeps delivering for at most `OTEL_TRAIN_DRAIN_TIMEOUT_S`, then exits. If it dies, the
trainer restarts it once (it resumes from the spool); if it dies again, the trainer exports in
its own process from the same spool.

Nobody waits for the child to start: `ExportProcess()` reads the spool's last window seq (`spool.last_seq`: the
trainer holds the run's claim, so nobody else writes there) to number windows on from it, spawns the child and
returns. What the trainer sends before the child's ``ready`` goes into the child's socket at once: the kernel holds
it, and the child reads it once its spool is open, also after a ``kill -9`` of the trainer. Only a frame the
socket could not take without blocking waits in the trainer, in order, until ``ready`` (bounded: past `_BACKLOG`
frames or `_BACKLOG_BYTES`, the sender waits for the child instead). The child says ``ready`` once its spool is
open and starts each backend on a thread of its own (`otel_train.ship.backend_start`), so a window waits in the
spool until its backend is up.

Messages, trainer -> child: ``W`` + seq, max step + encoded window (or resume, `framing.encode_resume`); ``F`` + id (flush); ``C`` + id
[+ the preemption signal's name, e.g. ``SIGTERM``: the backends mark their runs preempted] (close); ``P`` + id (progress); ``H`` + pickled hyperparameters (reported after `init()`). Child -> trainer (pickled tuples): ``("ready", last seq)``,
``("error", message)``, ``("spooled", seq)``, ``("durable", id, progress)``, ``("done", id, ok, progress)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
import select
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from otel_train._internal.at_fork import after_fork_in_child
from otel_train.backend import RowExporter
from otel_train.collect.window_builder import WindowParts
from otel_train.config.exporter_options import ExporterOptions
from otel_train.ship.backend_start import starting_backends
from otel_train.ship.child_boot import LOG_FILE, Booted, boot_child, reap_ended
from otel_train.ship.delivery import Delivery, Progress
from otel_train.ship.export_child import (
    ID,
    WINDOW,
    child_main,
    exports_metrics,
    preempt,
    set_hparams,
)
from otel_train.ship.framing import encode_resume, encode_window, pack_span_records
from otel_train.ship.logged_record import open_record
from otel_train.ship.replay import replay
from otel_train.ship.self_metrics import SelfMetrics
from otel_train.ship.span_work import SpanCompleter
from otel_train.ship.spool import Spool, last_seq, spool_dir
from otel_train.ship.workers import worker_listener
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

__all__ = ["ExportProcess", "child_main", "replay"]

_logger = logging.getLogger("otel_train")
_START_TIMEOUT_S = 60.0  # a child that has not said ``ready`` by then is killed (then restarted once)
_BACKLOG = 4096  # windows kept until the child confirms they are spooled (a restart resends them)
_BACKLOG_BYTES = 64 * 1024 * 1024  # ... and at most this many bytes of them


class Backlog:
    """Windows sent to the exporter process and not yet confirmed spooled there (a restarted child is sent
    them again), bounded by `_BACKLOG` windows and `_BACKLOG_BYTES` bytes. Its own lock: the reply thread
    confirms while a sender blocked on a full socket holds the send lock."""

    def __init__(self) -> None:
        self._items: deque[tuple[int, int, bytes]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._forgotten: deque[int] = deque()  # seqs forgotten unconfirmed: lost only if the child dies before it
        self.dropped = 0  # windows a restart needed that were forgotten: lost

    def add(self, seq: int, max_step: int, payload: bytes) -> None:
        with self._lock:
            self._items.append((seq, max_step, payload))
            self._bytes += len(payload)
            while len(self._items) > _BACKLOG or self._bytes > _BACKLOG_BYTES:
                forgotten, _, data = self._items.popleft()
                self._bytes -= len(data)
                self._forgotten.append(forgotten)

    def confirm(self, spooled: int) -> None:
        """The child spooled every window up to `spooled`."""
        with self._lock:
            while self._items and self._items[0][0] <= spooled:
                self._bytes -= len(self._items.popleft()[2])
            while self._forgotten and self._forgotten[0] <= spooled:  # spooled after all: nothing lost
                self._forgotten.popleft()

    def pending(self, clear: bool = False) -> list[tuple[int, int, bytes]]:
        """The unconfirmed windows, oldest first (and forgotten, with `clear`), for a restarted child or the
        fallback: the windows forgotten unconfirmed before them are lost now, and counted in `dropped`."""
        with self._lock:
            self.dropped += len(self._forgotten)
            self._forgotten.clear()
            items = list(self._items)
            if clear:
                self._items.clear()
                self._bytes = 0
            return items


class ExportProcess:
    """The training process's end: starts the child, sends windows, waits for flushes.

    Args:
        names: Exporter names the child builds (checked here first).
        options: What every backend is told besides the rows.
        run: This process's run and rank (names the spool).
        drain_timeout_s: How long the child may keep delivering after a hand-off.
        cpus: CPUs the child pins itself to (empty: inherit).
        nice: Niceness the child adds.
        self_metrics: Add otel-train's own health rows to every window (`otel_train.ship.self_metrics`).
        backend_processes: Backends with a heavy client each in a process of their own where two or more are
            named (`OTEL_TRAIN_BACKEND_PROCESSES`, `otel_train.ship.backend_host`).
        lock_fd: The run folder's lock (`otel_train.ship.spool.claim_run`): the child inherits it and holds the
            claim until it has drained (-1: none).
        record_bytes: The cap of the record of what was logged (`otel_train.ship.logged_record`; 0: none).
        listener: The address child processes connect to and its listening socket (`worker_listener`), when
            the caller bound it already (so that children started meanwhile find the run); default: bound here.
        booted: The exporter process, started already by `otel_train.ship.child_boot.boot_child` with this
            rank's spool folder, `lock_fd` and `listener`'s socket; sent its configuration here. Default: started
            here.

    Raises:
        ConfigError: an unknown name or a missing package (a backend that fails to start in the child is
            logged and counted there; its windows stay in the spool).
    """

    def __init__(self, names: Sequence[str], options: ExporterOptions, run: RunInfo, *,
                 drain_timeout_s: float = 120.0, cpus: Sequence[int] = (), nice: int = 0,
                 self_metrics: bool = True, backend_processes: bool = True, lock_fd: int = -1, record_bytes: int = 0,
                 listener: tuple[str, socket.socket | None] | None = None, booted: Booted | None = None) -> None:
        from otel_train.config.registry import check_available, get_spec

        for spec in [get_spec(n) for n in names]:
            check_available(spec)
        self.names = tuple(names)
        self.spool_path = spool_dir(options.directory, run.run_name, run.rank)
        #: Where the exporter process writes its stdout/stderr (its messages once the trainer is gone).
        self.log_path = self.spool_path / LOG_FILE
        self._lock_fd = lock_fd
        self._options = options
        self._run = run
        self._record_bytes = record_bytes
        #: Where child processes (DataLoader workers) connect to this run (`otel_train.ship.workers`).
        # Bound here (or by the caller, `listener`) and handed to each child: a DataLoader worker may connect
        # before the child is up.
        self.worker_address, self._worker_sock = listener if listener is not None else worker_listener(self.spool_path)
        self._config: dict[str, Any] = {"names": list(names), "options": options, "spool": str(self.spool_path),
                        "drain_timeout_s": drain_timeout_s, "cpus": list(cpus), "nice": nice,
                        "run": run, "workers": self.worker_address if self._worker_sock is not None else None,
                        "workers_fd": self._worker_sock.fileno() if self._worker_sock is not None else -1,
                        "self_metrics": self_metrics, "backend_processes": backend_processes,
                        "lock_fd": lock_fd, "export_metrics": exports_metrics(run, options),
                        "record_bytes": record_bytes}
        self._lock = threading.RLock()  # one sender at a time; held across restarts
        self._backlog = Backlog()
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        self._reply_cv = threading.Condition()
        self._closing = False
        self._handoff = False  # close() asked
        self._close_request: tuple[int, bytes] | None = None  # the close's request id and frame, once sent
        self._pid = os.getpid()
        self.restarts = 0
        self.fallback: Delivery | None = None
        self._points_added_before = 0  # phase points added by exporter processes that ended
        self.last_progress = Progress()
        #: The preemption signal's name when the training process ends on one (set before `close`).
        self.preempted: str | None = None
        # The last window's seq, numbered on from the spool's (a resume takes the next one: the child spools it
        # first). The spool's windows up to here are an earlier attempt's (see `send_resume`).
        self._seq = last_seq(self.spool_path) + (options.resume_step is not None)
        self._earlier_seq = self._seq
        self._ready = False  # the first child said ``ready`` (or the fallback took over)
        #: Frames the socket could not take without blocking before ``ready``, in order (windows are in the
        #: backlog too); with their bytes.
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._sndbuf = 0  # the socket's send buffer: a frame of up to a quarter of it never blocks when writable
        with self._lock:  # the child's `ready` may come before `_conn` is set: `_on_ready` waits for it
            self._conn, self._proc = self._start(booted)
        # The first child told each backend about a resume; a restarted child or the fallback must not
        # tell it again (TensorBoard would purge, W&B rewind, the steps delivered since).
        self._options = dataclasses.replace(options, resume_step=None)
        self._config["options"] = self._options
        after_fork_in_child(self._after_fork)  # held weakly: a closed handle is freed

    # -- starting -------------------------------------------------------------------------------
    def _start(self, booted: Booted | None = None) -> Booted:
        """Send the exporter process (`booted`, or one started here) its configuration, without waiting for it (it
        answers ``ready`` with the last window seq its spool holds, or ``error``)."""
        conn, proc = booted or boot_child(self.spool_path, self._lock_fd, self._worker_sock, self._config["cpus"],
                                          self._config["nice"])
        try:
            conn.send(dict(self._config))
        except OSError:
            conn.close()  # it cannot be told what to do: it ends (and is restarted, as after a crash)
            proc.kill()
            raise
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            self._sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        threading.Thread(target=self._receive, args=(conn, proc), name="otel-train-export-replies",
                         daemon=True).start()
        return conn, proc

    def _hold(self, frame: bytes) -> bool:
        """Before ``ready``: keep `frame` here if the socket might not take it without blocking (or frames wait
        already: order); False when it goes out now. Past the bound, what waits goes out, blocking. Lock held."""
        if self._ready or self.fallback is not None:
            return False
        if not self._held and len(frame) <= self._sndbuf // 4 and self._writable():
            return False
        self._held.append(frame)
        self._held_bytes += len(frame)
        if len(self._held) > _BACKLOG or self._held_bytes > _BACKLOG_BYTES:
            self._send_held()  # the child reads them once it is up: the sender waits for it, as after ``ready``
        return True

    def _writable(self) -> bool:
        """Whether the socket has room: a Unix socket is writable while at most a quarter of its buffer is used."""
        try:
            poller = select.poll()
            poller.register(self._conn.fileno(), select.POLLOUT)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True  # a closed socket: the send fails and the reply thread restarts the child

    def _send_held(self) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        for frame in held:
            self._write(frame)

    def _on_ready(self, conn: Connection, last_seq: int) -> None:
        """A child is ready: what waited here goes out."""
        with self._lock:
            if conn is not self._conn or self._ready:
                return  # a restarted child: the backlog was sent to it when it was spawned
            self._ready = True
            if last_seq > self._earlier_seq:  # only if another process wrote the spool meanwhile
                _logger.warning("otel-train: the spool %s held window %d when the exporter process opened it, "
                                "not %d as read before it started; windows numbered at or below it are skipped",
                                self.spool_path, last_seq, self._earlier_seq)
            self._send_held()

    def _after_fork(self) -> None:
        # A forked DataLoader worker must neither write to the socket nor keep it open (the child
        # would never see the trainer's end).
        self._closing = True
        try:
            self._conn.close()
        except OSError:
            pass
        if self._worker_sock is not None:  # the child holds its own copy of the listening socket
            self._worker_sock.close()

    @property
    def dropped(self) -> int:
        """Windows a restarted child (or the fallback) needed that were forgotten before the child confirmed them."""
        return self._backlog.dropped

    @property
    def pid(self) -> int:
        return self._proc.pid

    # -- sending (collector thread) --------------------------------------------------------------
    def send_window(self, run: RunInfo, points: Sequence[tuple[str, int, float, int]],
                    metrics: Sequence[MetricRow] = (), histograms: Sequence[HistogramRow] = (),
                    spans: Sequence[SpanRow] = (), logs: Sequence[LogRow] = ()) -> None:
        """Encode one window and hand it to the child (or the fallback)."""
        if os.getpid() != self._pid or not (points or metrics or histograms or spans or logs):
            return
        payload, max_step = encode_window(run, points, metrics, histograms, spans, logs)
        self._send_encoded(max_step, payload)

    def send_window_with_spans(self, window: WindowParts) -> None:
        """`send_window`, for a window whose `ot.span` records the child makes rows and phase timings of
        (`otel_train.ship.span_work`), and whose `ot.log` points may come as groups (`WindowParts.groups`)."""
        records = window.span_records or []
        if os.getpid() != self._pid or not (records or window.points or window.groups or window.metrics
                                            or window.histograms or window.spans or window.logs):
            return
        payload, max_step = encode_window(window.run, window.points, window.metrics, window.histograms, window.spans,
                                          window.logs, window.groups or ())
        if records or window.phases:  # phase timings also need the step ends of a window without spans
            payload = pack_span_records(payload, records, window.phase_spans, window.phases)
        self._send_encoded(max_step, payload)

    def send_resume(self, run: RunInfo, step: int) -> None:
        """The run restarts at `step`: sent, spooled and acknowledged like a window, so every backend applies
        it once, in order; the earlier attempt's windows still undelivered lose their rows at steps >= `step`."""
        if os.getpid() != self._pid:
            return
        self._send_encoded(-1, encode_resume(run, step, self._earlier_seq))

    def _send_encoded(self, max_step: int, payload: bytes) -> None:
        with self._lock:
            self._seq += 1
            seq = self._seq
            if self.fallback is not None:
                self.fallback.submit(seq, max_step, payload)
                return
            self._backlog.add(seq, max_step, payload)
            self._send(b"W" + WINDOW.pack(seq, max_step) + payload)

    @property
    def points_added(self) -> int:
        """Points the exporter processes (and the fallback) added to the windows sent: phase timings."""
        fallback = self.fallback.spans.points_added if self.fallback is not None and self.fallback.spans else 0
        return self._points_added_before + self.last_progress.points_added + fallback

    def add_config(self, config: Mapping[str, Any]) -> None:
        """Hyperparameters reported after `init()`: every backend of the child gets them (see `Session.add_config`)."""
        self._options = dataclasses.replace(self._options, hparams=dict(config))
        self._config["options"] = self._options  # a restarted child starts with them
        with self._lock:
            if self.fallback is not None:
                set_hparams(self.fallback.exporters(), config)
            else:
                self._send(b"H" + pickle.dumps(dict(config)))

    def _send(self, frame: bytes) -> bool:
        """Send `frame` to the child, or keep it here until ``ready`` (`_hold`). Lock held."""
        return True if self._hold(frame) else self._write(frame)

    def _write(self, frame: bytes) -> bool:
        try:
            self._conn.send_bytes(frame)
            return True
        except (OSError, ValueError):
            return False  # the child is gone: the reply thread restarts it and resends the backlog

    def _request(self, kind: bytes, extra: bytes = b"") -> int:
        rid = next(self._ids)
        frame = kind + ID.pack(rid) + extra
        with self._lock:
            if kind == b"C":  # a child that dies before it answers is restarted and asked again
                self._close_request = (rid, frame)
            if self.fallback is None:
                self._send(frame)
        return rid

    def _close_answered(self) -> bool:
        """Whether the child answered the trainer's close: its exit after that is not a death."""
        if self._close_request is None:
            return False
        with self._reply_cv:
            return "done" in self._replies.get(self._close_request[0], {})

    def _wait(self, rid: int, key: str, deadline: float) -> dict[str, Any] | None:
        with self._reply_cv:
            self._reply_cv.wait_for(lambda: key in self._replies.get(rid, {}) or self.fallback is not None,
                                    timeout=max(0.0, deadline - time.monotonic()))
            return self._replies.get(rid)

    # -- replies (reply thread) -------------------------------------------------------------------
    def _receive(self, conn: Connection, proc: subprocess.Popen[bytes]) -> None:
        ready = False
        while True:
            try:
                if not ready and not conn.poll(_START_TIMEOUT_S):
                    _logger.warning("otel-train: the exporter process did not start within %.0f s; ending it",
                                    _START_TIMEOUT_S)
                    proc.kill()
                    break
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a reply we cannot read must not end the thread
                _logger.debug("unreadable reply from the exporter process", exc_info=True)
                continue
            kind = msg[0]
            if kind == "log":  # the child's warnings, re-emitted here: the user's logging sees them
                logging.getLogger(msg[2]).log(msg[1], "%s", msg[3])
                continue
            if kind == "ready":
                ready = True
                self._on_ready(conn, int(msg[1]))
                continue
            if kind == "error":  # it exits now: the death below restarts it, or exports here
                _logger.warning("otel-train: the exporter process could not start: %s", msg[1])
                continue
            spooled = msg[1] if kind == "spooled" else msg[-1].spooled
            self._backlog.confirm(spooled)  # never the send lock: a sender blocked on a full socket holds it
            if kind in ("durable", "done", "progress"):
                self.last_progress = msg[-1]
                with self._reply_cv:
                    entry = self._replies.setdefault(msg[1], {})
                    entry[kind] = msg[2] if kind == "done" else True
                    self._reply_cv.notify_all()
        with self._lock:  # set by then (the spawner holds the lock until it is)
            current = conn is self._conn
        if current and not self._closing and not self._close_answered():
            proc.wait()
            self._on_child_death(proc.returncode)

    def _on_child_death(self, code: int | None) -> None:
        with self._lock:
            if self._closing:
                return
            # The phase points it added, as last reported (a restarted child counts from 0).
            self._points_added_before += self.last_progress.points_added
            self.last_progress = dataclasses.replace(self.last_progress, points_added=0)
            if self.restarts == 0:
                self.restarts = 1
                _logger.warning("otel-train: the exporter process exited (code %s); restarting it once; "
                                "windows it had spooled are delivered from the spool", code)
                try:
                    self._conn, self._proc = self._start()
                    # Requests that waited here go after the windows; the windows that waited are in the backlog.
                    close = self._close_request[1] if self._close_request is not None else None
                    held = [f for f in self._held if f[:1] != b"W" and f != close]
                    self._held, self._held_bytes = [], 0
                    for seq, step, payload in self._backlog.pending():
                        self._send(b"W" + WINDOW.pack(seq, step) + payload)
                    for frame in held:
                        self._send(frame)
                    if close is not None:  # it died while closing: the new one closes
                        self._send(close)
                    return
                except OSError as err:
                    _logger.warning("otel-train: restarting the exporter process failed: %s", err)
            _logger.warning("otel-train: the exporter process exited again (code %s); exporting in the "
                            "training process from now on", code)
            try:
                # Each backend starts on a thread of its own, as in the exporter process: this thread and the
                # backends already up never wait for the slowest client's import; windows wait in the spool.
                starting = starting_backends(self.names, self._options, spooled=True)
                backends = dict[str, RowExporter](starting)
                fallback = Delivery(backends, Spool(self.spool_path))
                fallback.spans = SpanCompleter(fallback.count_lost)  # windows made whole, as in the exporter process
                fallback.record = open_record(backends, self._run, self._options.directory, self._record_bytes)
                if self._config["self_metrics"]:
                    fallback.annotate = SelfMetrics(fallback.backend_stats, lambda: fallback.spool_failed_appends)
                self.fallback = fallback
                for backend in starting.values():
                    backend.start()
                # Windows that waited here are in the backlog; hyperparameters are in `self._options`; a flush
                # or close that waited is answered by the fallback (`_ask`).
                self._held, self._held_bytes = [], 0
                for seq, step, payload in self._backlog.pending(clear=True):
                    self.fallback.submit(seq, step, payload)
            except Exception as err:
                _logger.error("otel-train: in-process export failed to start (%s); named backends get no "
                              "more data; `otel-train replay` delivers what was spooled", err)
                self._closing = True
        with self._reply_cv:
            self._reply_cv.notify_all()

    # -- flush / close / progress (any thread) -------------------------------------------------------
    def _ask(self, kind: bytes, deadline: float) -> tuple[int, bool]:
        """Flush (``F``) or close (``C``) and wait for the answer: (request id, every backend done).
        The id is 0 when the in-process fallback answered."""
        cause = self.preempted if kind == b"C" else None
        if self.fallback is None:
            # Say how long the trainer waits: a flush waits that long; a close drains OTEL_TRAIN_DRAIN_TIMEOUT_S after.
            rid = self._request(kind, f"{cause or ''}\n{max(0.0, deadline - time.monotonic()):.3f}".encode())
            reply = self._wait(rid, "done", deadline)
            if self.fallback is None:
                return rid, bool(reply and reply.get("done"))
        fallback = self.fallback
        if kind == b"F":
            return 0, fallback.flush(deadline)
        if cause:
            preempt(fallback.exporters(), cause)
        return 0, fallback.close(deadline)

    def flush(self, deadline: float) -> bool:
        """Wait until every backend has everything sent so far, or `deadline` (then: durable, and warn)."""
        if self._closing or os.getpid() != self._pid:
            return True
        rid, ok = self._ask(b"F", deadline)
        if not ok and rid:
            _logger.warning("otel-train: flush timed out: %s; the exporter process keeps delivering",
                            self.last_progress.summary())
        return ok

    def close(self, deadline: float) -> bool:
        """Hand off: wait for every backend up to `deadline`, else for the spool to be durable; the child
        keeps draining on its own for up to its drain timeout."""
        if os.getpid() != self._pid:
            return True
        self._handoff = True
        rid, ok = self._ask(b"C", deadline)
        with self._lock:
            unsent = len(self._held) if not self._ready else 0
        if unsent:
            _logger.error("otel-train: the exporter process did not start before the shutdown deadline; %d "
                          "window(s) and request(s) its socket could not take meanwhile never reached it", unsent)
        if not ok and rid:
            durable = self._wait(rid, "durable", time.monotonic() + 0.2)  # sent before delivery starts
            held = durable and not self.last_progress.spool_failed_appends  # not: windows the spool never held
            state = "durable in the spool" if held else "NOT confirmed durable"
            if time.monotonic() >= deadline:
                _logger.warning("otel-train: shutdown timed out; data is %s; %s; the exporter process (pid %d) keeps "
                                "delivering for up to OTEL_TRAIN_DRAIN_TIMEOUT_S, and `otel-train replay %s` "
                                "finishes the rest", state, self.last_progress.summary(), self._proc.pid,
                                self.spool_path.parent.parent)
            else:  # the exporter process closed its backends: nothing is left to drain
                _logger.warning("otel-train: a backend ended without everything; data is %s; %s; `otel-train replay "
                                "%s` delivers the rest once it can", state, self.last_progress.summary(),
                                self.spool_path.parent.parent)
        self._closing = True
        try:
            self._conn.close()
        except OSError:
            pass
        if self._worker_sock is not None:  # the child holds its own copy of the listening socket
            self._worker_sock.close()
        reap_ended()  # earlier sessions' exporter processes that are done draining
        return ok

    def end(self, timeout_s: float) -> None:
        """Stop the exporter process within `timeout_s`, nothing left running (a failed `init()`): close if
        not closed yet, wait for the child to exit, else kill it."""
        if os.getpid() != self._pid:
            return
        if not self._closing:
            self.close(time.monotonic() + timeout_s / 2)
        try:
            self._proc.wait(timeout_s / 2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def progress(self, timeout_s: float = 5.0) -> Progress:
        """The child's progress: windows spooled, and per backend the last durable window and step."""
        if self.fallback is not None:
            return self.fallback.progress()
        if self._closing:
            return self.last_progress
        rid = self._request(b"P")
        self._wait(rid, "progress", time.monotonic() + timeout_s)
        return self.last_progress
