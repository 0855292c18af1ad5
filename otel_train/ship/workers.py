"""Child processes (DataLoader workers, `multiprocessing` children) reach the run's exporter process.

A child never writes to the trainer's connection (forked, it shares that socket; spawned, it has none).
The exporter process listens on a Unix socket of its own (`WorkerListener`); each child opens its own
connection on first use (`WorkerClient`): forked children find the address on the session they inherited,
spawned ones in `OTEL_TRAIN_WORKER_ADDRESS`, which the trainer sets for its children. The child's
`ot.log` / `ot.span` only append to a bounded buffer; a sender thread ships it every 0.2 s and at the
child's exit. A child that cannot reach the exporter process drops its data with one warning: data loading
never waits for telemetry.

In the run, child data carries ``worker=N`` (the DataLoader worker id, else the child's pid): metrics as
``name{worker=N}``, spans on their own Chrome trace thread track ``worker N (pid P)``. A value logged
without ``step=`` gets the step the training process was in when the child logged it (its latest step
entered, 0 before the first, as the trainer's own `log`): the trainer writes each step it enters into a
shared 8-byte cell (`StepCell`, a file beside the child socket, mapped by both), which the child reads at the
call. Without the cell (it could not be made) it gets the run's latest step as the exporter process sees it.
Child windows are not spooled: they are delivered once, best effort.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import pickle
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from otel_train._internal.ratelimit import LogOnce
from otel_train._internal.values import REFUSED_PREFIX, refusal, to_float, valid_name, valid_text
from otel_train.capture.attributes import clean_attributes, held_attributes, held_value, refused_reason
from otel_train.capture.log_records import CapturedLog
from otel_train.capture.step import StepOutOfRange, coerce_step
from otel_train.vocab import semconv
from otel_train.vocab.rows import LogRow, MetricRow, SpanRow, Window, series_tag
from otel_train.vocab.run_identity import RunInfo

__all__ = ["LOST_BUFFER", "LOST_LOGS", "LOST_RATE_LIMITED", "LOST_REFUSED_STEP", "LOST_SPANS", "StepCell", "WorkerClient",
           "WorkerListener", "client_from_env", "listen_on", "step_cell_path", "worker_listener"]

_logger = logging.getLogger("otel_train")
_LEN = struct.Struct("<I")
_SEND_EVERY_S = 0.2
#: How long the exporter process still reads children's connections after the trainer died without a hand-off:
#: a child sends what it buffered at least this often.
DIED_GRACE_S = 2 * _SEND_EVERY_S
_CONNECT_TIMEOUT_S = 2.0
_SEND_TIMEOUT_S = 5.0  # a stalled exporter process: give up and drop, never block the worker's exit for long
_MAX_BUFFERED = 100_000  # values + spans held between two sends; more are dropped (counted)
#: New connections a child makes after the exporter process went away: the trainer restarts it once.
_MAX_RECONNECTS = 3
#: At the trainer's hand-off, how long the exporter process waits for connected children to send what they hold
#: (asked with one byte on their connection; a child answers with its buffer and a ``flushed`` frame).
FLUSH_WAIT_S = 0.05
_FLUSH = b"F"
_FLUSHED = ("flushed",)
#: What a child lost, as the trainer's shutdown summary words it (`WorkerListener.lost`).
LOST_REFUSED_STEP = REFUSED_PREFIX + "bad_step"  # refusals: the trainer's summary counts them with its own
LOST_BUFFER = "values over a child process's buffer"
LOST_SPANS = "spans over a child process's buffer"
LOST_LOGS = "log records over a child process's buffer"
LOST_RATE_LIMITED = REFUSED_PREFIX + "log_rate_limited"  # with the trainer's own records over the rate limit


_warn_once = LogOnce(_logger)  # per child process: the first refused step, attribute set and key of each kind


def _connect(address: str, *frames: Any) -> socket.socket:
    """A child's connection to the exporter process at `address`, introduced (``hello``), then `frames` sent.

    Raises:
        OSError: it cannot be reached (nothing is left open).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_CONNECT_TIMEOUT_S)
    try:
        sock.connect(address)
        sock.settimeout(_SEND_TIMEOUT_S)
        for frame in (("hello", _worker_id(), os.getpid()), *frames):
            _send(sock, frame)
    except OSError:
        sock.close()
        raise
    return sock


def _send(sock: socket.socket, obj: Any) -> None:
    payload = pickle.dumps(obj, protocol=5)
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv(sock: socket.socket) -> Any:
    head = _recv_exact(sock, _LEN.size)
    return pickle.loads(_recv_exact(sock, _LEN.unpack(head)[0]))  # our own children, same user (socket 0600)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


# -- the trainer's latest step, shared with its children --------------------------------------------------
def step_cell_path(address: str) -> str:
    """The step cell of the run whose child socket is `address` (beside it, so a spawned child finds it too)."""
    return os.path.join(os.path.dirname(address), "workers.step")


class StepCell:
    """An 8-byte file mapped shared: the training process writes the latest step it entered (``view[0]``), its
    children read it when they log without ``step=`` (-1: not written yet).

    Example:
        >>> import tempfile
        >>> cell = StepCell(os.path.join(tempfile.mkdtemp(), "workers.step"))
        >>> cell.view[0] = 7
        >>> read_step(open_step_cell(cell.path))
        7
        >>> cell.close()
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8)
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self.view: memoryview = memoryview(self._map).cast("q")
        self.view[0] = -1

    def close(self) -> None:
        """Unmap and remove the file (children still holding a mapping keep reading the last step)."""
        with contextlib.suppress(Exception):
            self.view.release()
            self._map.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def open_step_cell(path: str) -> memoryview | None:
    """A child's read-only view of the trainer's step cell, or None when the run has none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return memoryview(mmap.mmap(fd, 8, access=mmap.ACCESS_READ)).cast("q")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def read_step(view: memoryview | None) -> int:
    """The trainer's latest step in `view`, or -1 (none yet, or no cell)."""
    return -1 if view is None else int(view[0])


# -- the exporter process's end ----------------------------------------------------------------------
class WorkerListener:
    """Accepts child connections in the exporter process and hands their data to delivery.

    Args:
        address: Unix socket path (replaced if a stale one is there).
        sock: The socket already listening there (`listen_on`, bound by the training process so that children
            can connect before the exporter process is up); None: bind it here.
        run: The run every child row belongs to (the trainer's rank and pid track).
        submit: Takes a `Window` of child rows (`Delivery.submit_side`).
        lost: Takes ``(cause, count)`` of values a child lost before sending (`Delivery.count_lost`).
        last_step: The run's latest step, for values logged without one.
        metrics: Whether this rank exports metrics (`OTEL_TRAIN_RANKS`); if not, children's values are dropped
            here like the trainer's own (their spans are kept).
    """

    def __init__(self, address: str, run: RunInfo, submit: Any, last_step: Any, *, metrics: bool = True,
                 lost: Any = None, sock: socket.socket | None = None) -> None:
        self.address = address
        self._lost = lost
        self._metrics = metrics
        self._run = run
        self._submit = submit
        self._last_step = last_step
        self._sock = sock if sock is not None else listen_on(address)
        self._serving: list[threading.Thread] = []
        # The children's connections (ended at `close`), each with the event its child sets when it has answered
        # the flush request (`close`).
        self._conns: dict[socket.socket, threading.Event] = {}
        self._serving_lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, name="otel-train-workers", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._start_serving(conn)

    def _start_serving(self, conn: socket.socket) -> None:
        conn.setblocking(True)
        thread = threading.Thread(target=self._serve, args=(conn,), name="otel-train-worker-conn", daemon=True)
        with self._serving_lock:
            self._serving = [t for t in self._serving if t.is_alive()] + [thread]
            self._conns = {c: e for c, e in self._conns.items() if c.fileno() >= 0}
            self._conns[conn] = threading.Event()
        thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                _, worker, pid = _recv(conn)
                flushed = self._conns.get(conn)
                while True:
                    frame = _recv(conn)
                    if frame == _FLUSHED:  # the child sent all it held when asked (`close`)
                        if flushed is not None:
                            flushed.set()
                        continue
                    points, spans = frame[0], frame[1]
                    logs = frame[3] if len(frame) > 3 else ()
                    if len(frame) > 2 and self._lost is not None:
                        for cause, n in dict(frame[2]).items():
                            self._lost(str(cause), int(n))
                    if points or spans or logs:
                        self._submit(self._window(int(worker), int(pid), points, spans, logs))
            except (EOFError, OSError):
                return
            except Exception as err:  # a malformed frame ends this child's connection only
                _logger.warning("a child process sent unreadable telemetry (%s); its connection is closed", err)

    def _window(self, worker: int, pid: int, points: list[tuple[Any, ...]],
                spans: list[tuple[Any, ...]], logs: Any = ()) -> Window:
        run, attrs = self._run, {"worker": worker}
        last = max(0, int(self._last_step()))
        rows = [_worker_row(run, last, attrs, *point) for point in points] if self._metrics else []
        track = f"worker {worker} (pid {pid})"
        span_rows = [SpanRow(run, name, trace_id, span_id, parent, start, end, pid, track, step,
                             {**attributes, "worker": worker}, error, message)
                     for name, trace_id, span_id, parent, start, end, step, attributes, error, message in spans]
        # Log records on the worker's track (as its spans), at the trainer's step then (else the run's latest).
        log_rows = [LogRow(run, last if step is None or step < 0 else step, t, number, text, body, logger,
                           {**attributes, semconv.THREAD_ID: pid, semconv.THREAD_NAME: track, "worker": worker},
                           trace_id, span_id)
                    for step, t, number, text, body, logger, attributes, trace_id, span_id in logs]
        return Window(rows, [], span_rows, log_rows)

    def close(self, timeout_s: float = 1.0, *, trainer_died: bool = False) -> None:
        """Stop accepting; deliver what connected children have sent (at most `timeout_s`), never waiting for a
        child still alive (a persistent DataLoader worker) to send more or to exit. When the trainer died (no
        hand-off), its children may still hold up to one send interval of values: they get that long to send them."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(OSError):  # children that connected but were not accepted yet: serve them too
            self._sock.setblocking(False)
            while True:
                conn, _ = self._sock.accept()
                self._start_serving(conn)
        with self._serving_lock:
            asked = [(c, e) for c, e in self._conns.items() if c.fileno() >= 0]
        connected = bool(asked)
        if trainer_died and connected:
            time.sleep(min(DIED_GRACE_S, max(0.0, deadline - time.monotonic())))
        elif asked:  # live children (a persistent DataLoader's workers) send what they hold now, not in 0.2 s
            for conn, _ in asked:
                with contextlib.suppress(OSError):
                    conn.send(_FLUSH, socket.MSG_DONTWAIT)
            answer_by = min(deadline, time.monotonic() + FLUSH_WAIT_S)
            for _, answered in asked:  # a child that exited or never answers costs at most FLUSH_WAIT_S in all
                answered.wait(max(0.0, answer_by - time.monotonic()))
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not on Linux)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._acceptor.join(max(0.0, deadline - time.monotonic()))
        with self._serving_lock:
            serving = list(self._serving)
            conns = list(self._conns)
        for conn in conns:  # what each child sent is still read; then its reader sees the end at once
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        for thread in serving:  # children that exited: their last frames are still being read
            thread.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        parent = Path(self.address).parent
        if parent.name.startswith("otel-train-w"):  # our own temporary folder (a long run path)
            with contextlib.suppress(OSError):
                os.unlink(step_cell_path(self.address))  # the trainer's, should it not have removed it yet
            with contextlib.suppress(OSError):
                parent.rmdir()


def _worker_row(run: RunInfo, last: int, worker: dict[str, Any], key: str, s: int, v: float, t: int,
                extra: Mapping[str, Any] | None = None) -> MetricRow:
    """A child's value as a row: ``worker=N`` beside the `attributes=` it was logged with (if any)."""
    attrs = worker if extra is None else {**extra, **worker}
    return MetricRow(run, s if s >= 0 else last, key, series_tag(key, attrs), v, "gauge", t, attrs)


def listen_on(address: str) -> socket.socket:
    """A Unix socket listening at `address` (a stale one there is replaced), for this user only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        os.chmod(address, 0o600)  # only this user's processes may add to the run
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def listen_address(spool_path: Path) -> str:
    """Where the exporter process listens: beside the spool, or in a temporary folder when that path is
    too long for a Unix socket (about 100 bytes)."""
    address = str(spool_path / "workers.sock")
    if len(address.encode()) <= 100:
        return address
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="otel-train-w"), "workers.sock")


def worker_listener(spool_path: Path) -> tuple[str, socket.socket | None]:
    """Where child processes (DataLoader workers) reach the run whose spool is `spool_path`, and the socket
    listening there (None, logged, where it cannot listen: the children's values then go nowhere)."""
    address = listen_address(spool_path)
    try:
        return address, listen_on(address)
    except OSError as err:
        _logger.warning("otel-train: child processes cannot reach this run: listening on %s failed: %s", address, err)
        return address, None


# -- the child's end ------------------------------------------------------------------------------------
class _WorkerSpan:
    """A span in a child process: timed here, shipped as plain fields."""

    def __init__(self, client: WorkerClient, name: str, attributes: Mapping[str, Any] | None, step: Any) -> None:
        self._client = client
        self._name = valid_text(name) if isinstance(name, str) else str(name)
        self._attributes = held_attributes(attributes or {})  # as at the call: sent after the span ends
        self._step = step
        self._start = 0
        self._parent: int | None = None
        self.span_id = secrets.randbits(64) or 1

    def __enter__(self) -> _WorkerSpan:
        self._parent = self._client.enter(self.span_id)
        self._start = time.time_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        end = time.time_ns()
        self._client.leave()
        error = exc_type is not None
        message = f"{exc_type.__name__}: {exc}" if exc_type is not None else ""
        self._client.add_span((self._name, self._client.trace_id, self.span_id, self._parent, self._start, end,
                               self._step, self._attributes, error, message))

    def set_attribute(self, key: str, value: Any) -> None:
        self._attributes[key] = held_value(value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._attributes.update(held_attributes(attributes))


class WorkerClient:
    """A child process's connection to the run (opened on first use, in the child).

    Args:
        address: The exporter process's child socket; None when the run has none
            (`OTEL_TRAIN_EXPORT_PROCESS=off`): then everything is dropped with one warning.
    """

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._points: list[tuple[Any, ...]] = []
        self._spans: list[tuple[Any, ...]] = []
        self._logs: list[tuple[Any, ...]] = []  # `LogRow` fields after its run
        self._wake = threading.Event()  # a log record is sent at once: a crash that follows must not lose it
        self._sock: socket.socket | None = None
        self._state = "new"  # new -> open | dead
        self._warned = False
        self._reconnects = 0  # new connections after the exporter process went away (`_send_again`)
        self._stack = threading.local()
        self.dropped = 0
        #: Lost here and not yet told to the exporter process (which tells the trainer's summary): cause -> count.
        self._lost: dict[str, int] = {}
        #: Log records this child's rate limit dropped (counted without the lock, on the logging thread), and how
        #: many of them were sent: the sender adds the difference to what it tells.
        self._rate_limited = 0
        self._rate_limited_sent = 0
        self.trace_id = secrets.randbits(128) or 1
        self._step_cell: memoryview | None = None  # the trainer's latest step (opened with the connection)

    # -- recording (any thread of the child) ------------------------------------------------------------
    def log(self, mapping: Mapping[str, Any], step: int | None = None,
            attributes: Mapping[str, Any] | None = None) -> None:
        if not self._usable():
            return
        extra: dict[str, Any] | None = None
        if attributes is not None:  # checked as in the training process; what is left out is warned about once
            extra, refused = clean_attributes(attributes)
            if refused:
                self._lose(REFUSED_PREFIX + "bad_attribute", len(refused))
                _warn_once.warning("attributes", "otel_train.log in a child process: %s; left out (warned once)",
                                   refused_reason(attributes, refused[0]))
        t = time.time_ns()
        # Without a step: the step the trainer is in now; -1 (none yet): the exporter process stamps its latest.
        s = read_step(self._step_cell) if step is None else -1
        if step is not None:
            try:
                s = coerce_step(step, "otel_train.log(step=) in a child process")
            except ValueError as err:  # never raised into the child's loop: warned once, its values go nowhere
                out_of_range = isinstance(err, StepOutOfRange)
                self._lose(REFUSED_PREFIX + "step_out_of_range" if out_of_range else LOST_REFUSED_STEP,
                           len(mapping) if isinstance(mapping, Mapping) else 0)
                _warn_once.warning("step", "%s (warned once; such values are not written)", err)
                return
        points = []
        if not isinstance(mapping, Mapping):
            self._lose(REFUSED_PREFIX + "not_a_mapping", 1)
            return
        refusals: list[str] = []
        for key, value in mapping.items():
            v = to_float(value)  # the same rules as `ot.log` in the training process
            if v is None or not valid_name(key):
                refusals.append(REFUSED_PREFIX + ("bad_key" if not valid_name(key) else refusal(value)))
                _warn_once.warning(f"value:{key!r}", "otel_train.log in a child process: %r is not a non-empty "
                                   "string key with a number; skipped (warned once per key)", key)
                continue
            key = valid_text(key)  # a lone surrogate would stop every backend's writes
            points.append((key, s, v, t, extra) if extra else (key, s, v, t))
        with self._lock:
            for cause in refusals:  # counted where the sender takes them (under the lock)
                self._lose(cause, 1)
            if len(self._points) + len(points) > _MAX_BUFFERED:
                self._lose(LOST_BUFFER, len(points))
                return
            self._points.extend(points)

    def _lose(self, cause: str, n: int) -> None:
        self.dropped += n
        self._lost[cause] = self._lost.get(cause, 0) + n

    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> Any:
        from otel_train.capture.instrument import NO_SPAN

        if not self._usable():
            return NO_SPAN
        step = (attributes or {}).get("train.step")
        return _WorkerSpan(self, name, attributes, step)

    def enter(self, span_id: int) -> int | None:
        stack = self._stack.__dict__.setdefault("ids", [])
        parent = stack[-1] if stack else None
        stack.append(span_id)
        return parent

    def leave(self) -> None:
        stack = self._stack.__dict__.get("ids")
        if stack:
            stack.pop()

    def add_span(self, fields: tuple[Any, ...]) -> None:
        with self._lock:
            if len(self._spans) >= _MAX_BUFFERED:
                self._lose(LOST_SPANS, 1)
                return
            self._spans.append(fields)

    def add_log(self, record: CapturedLog) -> None:
        """A log record captured in this child (`otel_train.capture.log_capture`): at the step the trainer is in."""
        if not self._usable():
            return
        step = read_step(self._step_cell)
        record.step = step if step >= 0 else record.step
        with self._lock:
            if len(self._logs) >= _MAX_BUFFERED:
                self._lose(LOST_LOGS, 1)
                return
            self._logs.append(record.fields())
        self._wake.set()

    def count_rate_limited(self) -> None:
        """One log record of this child dropped by the rate limit (`RateLimit.on_drop`): the trainer's summary
        counts it. Opens the connection if nothing else did, so that a child that only dropped still tells."""
        self._rate_limited += 1
        if self._state == "new":
            self._usable()

    # -- connection (the sender thread) ------------------------------------------------------------------
    def _usable(self) -> bool:
        if self._state == "open":
            return True
        if self._state == "dead":
            return False
        with self._lock:
            if self._state == "new":
                self._open()
        return self._state == "open"

    def _open(self) -> None:
        if self._address is None:
            self._die("the run has no exporter process (OTEL_TRAIN_EXPORT_PROCESS=off, or it stopped)")
            return
        try:
            sock = _connect(self._address)
        except OSError as err:
            self._die(f"cannot reach the run's exporter process at {self._address} ({err})")
            return
        self._sock = sock
        self._step_cell = open_step_cell(step_cell_path(self._address))
        self._state = "open"
        self._listen_for_flush(sock)
        threading.Thread(target=self._sender, name="otel-train-worker-send", daemon=True).start()
        # multiprocessing children (DataLoader workers) leave through its finalizers, not atexit.
        import multiprocessing.util

        multiprocessing.util.Finalize(self, self.close, exitpriority=100)
        atexit.register(self.close)

    def _die(self, why: str) -> None:
        self._state = "dead"
        if not self._warned:
            self._warned = True
            _logger.warning("otel-train: telemetry of child process %d dropped: %s (warned once)", os.getpid(), why)

    def _sender(self) -> None:
        while self._state == "open":
            self._wake.wait(_SEND_EVERY_S)
            self._wake.clear()
            self.send_now()

    def send_now(self, answer: bool = False) -> None:
        """Ship what is buffered (drops it with one warning when the exporter process is unreachable); with `answer`,
        then say so (``flushed``): the exporter process asked, at the trainer's hand-off."""
        with self._lock:
            points, spans, lost, logs = self._points, self._spans, self._lost, self._logs
            self._points, self._spans, self._lost, self._logs = [], [], {}, []
            rate_limited = self._rate_limited - self._rate_limited_sent
            if rate_limited:
                self._rate_limited_sent += rate_limited
                lost[LOST_RATE_LIMITED] = lost.get(LOST_RATE_LIMITED, 0) + rate_limited
            sock = self._sock
            if sock is None or self._state != "open":
                return
            if points or spans or lost or logs:
                frame = (points, spans, lost, logs) if logs else (points, spans, lost)
                try:  # log records as a fourth element, only when there are some: the frame earlier versions read
                    _send(sock, frame)
                except OSError as err:
                    self._sock = None
                    sock.close()
                    self._send_again(frame, err)
                    return
            if answer:
                with contextlib.suppress(OSError):
                    _send(sock, _FLUSHED)

    def _send_again(self, frame: tuple[Any, ...], err: OSError) -> None:
        """The exporter process went away as this frame was sent (the lock held): a frame whose sending failed was
        never taken whole, so it goes again, on a new connection to the same address, where the trainer's
        restarted exporter process listens (the trainer holds the listening socket). Without one: dropped, warned
        once."""
        if self._reconnects < _MAX_RECONNECTS and self._address is not None:
            self._reconnects += 1
            try:
                sock = _connect(self._address, frame)
            except OSError:
                pass
            else:
                self._sock = sock
                self._listen_for_flush(sock)
                return
        self._die(f"sending to the run's exporter process failed ({err})")

    def _listen_for_flush(self, sock: socket.socket) -> None:
        """A thread that waits (blocked, no CPU) for the exporter process to ask for what this child holds, at the
        trainer's hand-off: without it, up to one send interval of values would be lost there."""
        def wait_for_asks() -> None:
            while True:
                try:
                    asked = sock.recv(64)
                except OSError:
                    return
                if not asked:
                    return  # the exporter process closed the connection
                self.send_now(answer=True)

        threading.Thread(target=wait_for_asks, name="otel-train-worker-flush", daemon=True).start()

    def close(self) -> None:
        """Send the rest and close (at the child's exit; idempotent)."""
        if os.getpid() != self._pid or self._state != "open":
            return
        self.send_now()
        with self._lock:
            self._state = "closed"
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None


def _worker_id() -> int:
    """The DataLoader worker id when this is a torch worker (torch already imported), else the pid."""
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    return int(info.id) if info is not None else os.getpid()


_from_env: tuple[int, str, WorkerClient | None] | None = None


def client_from_env() -> WorkerClient | None:
    """The client of a spawned child of a run (from `OTEL_TRAIN_WORKER_ADDRESS`), else None."""
    global _from_env
    from otel_train.config.settings import OTEL_TRAIN_WORKER_ADDRESS

    raw = os.environ.get(OTEL_TRAIN_WORKER_ADDRESS, "").strip()
    if _from_env is None or _from_env[:2] != (os.getpid(), raw):
        client = None if not raw else WorkerClient(None if raw in ("none", "disabled") else raw)
        if client is not None and raw == "disabled":  # a disabled run: its children's calls are silent no-ops
            client._state, client._warned = "dead", True
        _from_env = (os.getpid(), raw, client)
    return _from_env[2]
