"""A backend in a process of its own, driven from the exporter process.

Importing and starting a backend's client takes seconds (MLflow, ClearML, W&B, Trackio), and in one interpreter
those imports share one GIL: several such backends on their own threads still start about one after the other.
A `HostedBackend` stands in the exporter process for a backend that runs in a fresh interpreter of its own
(`serve`), so that their clients start side by side on as many cores. Delivery does not change: the exporter
process keeps the spool, each backend's cursor and feed; `export_window` hands the (merged, filtered) window over
the connection, in the spool's window encoding (`otel_train.ship.framing`), and returns what the backend's own
`export_window` returned, and each reply brings the backend's counters back (`failures`, `rows_lost`,
`durable_step`, ...).

The host process ends when its connection does: after `shutdown`, or with the exporter process (SIGKILL, the drain
deadline), as a backend inside the exporter process would; what it did not hold then stays in the spool for
`otel-train replay`. A host process that ends early (the OOM killer picks the process with the biggest client) is
said once and started again at the backend's next call, at most `MAX_RESTARTS` times a run; that call fails, and
delivery, told that the backend lost what it was handed (`RowExporter.lost_handed`), hands it again from the spool
from the last window its store holds; the backend, reopening its run as `otel-train replay` does, writes only what
its store lacks. Past that, its writes fail and its windows stay in the spool. Only backends whose writes are not
kill-safe appends are hosted (`RowExporter.heavy_client`; an intent record needs the writer's own process).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from otel_train.backend import RowExporter, Window
from otel_train.config.exporter_options import ExporterOptions
from otel_train.config.registry import ExporterSpec, load_class
from otel_train.ship.backend_start import StartFailed
from otel_train.ship.framing import decode_window, encode_window
from otel_train.ship.log_forward import ForwardLogs, relog, sender
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.step_order import StepOrder

__all__ = ["MAX_RESTARTS", "HostedBackend", "serve"]

_logger = logging.getLogger("otel_train")
_BOOT = ("import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
         "from otel_train.ship.backend_host import serve; serve(int(sys.argv[1]))")
_DEAD_RETRY_S = 60.0  # how often a feed retries a backend whose process ended (each try fails at once)
_RESTART_IN_S = 1.0  # when a feed retries a backend whose process ended and will be started again
#: Host processes started again per backend and run, at most (a client that kills its process every time stops).
MAX_RESTARTS = 3
_PARENT_POLL_S = 0.5
_GONE = object()  # a request's answer when the host process is gone
_NO_RUN = RunInfo("", "")  # the encoding's run of a window without rows


#: The requests after which delivery reads `durable_step` (`BackendFeed._acknowledge`): only their replies read it
#: back (W&B parses its run file, Trackio queries its database), not every write's.
_DURABLE_AFTER = frozenset({"flush", "shutdown"})


def _state(backend: RowExporter, durable: bool = False) -> dict[str, Any]:
    """What the exporter process reads of the backend between calls (sent with each reply); with `durable`, how
    far its store is too."""
    state: dict[str, Any] = {
        "failures": backend.failures, "dropped_windows": backend.dropped_windows,
        "rows_lost": dict(backend.rows_lost), "unwritten_windows": backend.unwritten_windows,
        "retry_in_s": backend.retry_in_s(), "backwards": backend.step_order.backwards,
        "order_dropped": backend.step_order.dropped, "steps_dropped": int(getattr(backend, "steps_dropped", 0)),
    }
    if durable:
        try:
            state["durable_step"] = backend.durable_step()
        except Exception as err:
            state["durable_error"] = f"{type(err).__name__}: {err}"
    return state


class HostedBackend(RowExporter):
    """The backend `target` (``module:Class``) built with `options` in a process of its own.

    Built on the calling thread (a `StartingBackend`'s start thread): starts the process and waits until the
    backend is up there.

    Raises:
        StartFailed: the backend could not start (its error), or its process ended before it was up.
    """

    def __init__(self, name: str, target: str, options: ExporterOptions) -> None:
        # Not `RowExporter.__init__`: the window writer is the hosted backend's, in its process.
        self.name = name
        self._options = options
        self._order = StepOrder(options.step_order, name)
        self._state: dict[str, Any] = {"failures": 0, "dropped_windows": 0, "rows_lost": {}, "unwritten_windows": 0,
                                       "retry_in_s": 0.0, "steps_dropped": 0, "durable_step": None}
        self._retry_at = 0.0
        self._extra_failures = 0
        self._target = target
        self._replies: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._dead: str | None = None  # why the host process is gone
        self._closed = False
        self._call_lock = threading.Lock()  # one request at a time; one-way messages do not wait for it
        self._restarts = 0
        self._lost = False  # started again since delivery last asked (`lost_handed`)
        self._keep_failed = False
        self._preempted: str | None = None
        self._write_held = False  # an explicit flush asked the backend to write what it holds back, not flushed yet
        #: The backend's part of the run's record (`otel_train.ship.logged_record.backend_info`), as it is up.
        self.record_entry: dict[str, Any] = {}
        state, self._options, self.record_entry = self._spawn()
        self._apply(state)

    def _spawn(self) -> tuple[dict[str, Any], ExporterOptions, dict[str, Any]]:
        """Start a host process and build the backend there; its state, options and record entry.

        Raises:
            StartFailed: the backend could not start, or its process ended before it was up.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # the exporter process's stdout/stderr (its log file), CPUs and niceness are inherited
            proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(sys.path)],
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._proc = proc
        self._conn = conn = Connection(ours.detach())
        self._send = sender(conn)  # one-way messages never wait for a request in flight
        replies: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._replies = replies
        self._dead = None
        threading.Thread(target=self._read, args=(conn, proc, replies), name=f"otel-train-host-{self.name}",
                         daemon=True).start()
        self._send("start", self.name, self._target, self._options)
        reply = replies.get()
        if reply[0] == "error":
            raise StartFailed(reply[1])
        if reply[0] == "dead":
            raise StartFailed(f"{self._dead} before the backend was up")
        _, state, options, record_entry = reply
        return state, options, record_entry

    @property
    def pid(self) -> int:
        """The host process's pid."""
        return self._proc.pid

    # -- the connection --------------------------------------------------------------------------------
    def _read(self, conn: Connection, proc: subprocess.Popen[bytes],
              replies: queue.SimpleQueue[tuple[Any, ...]]) -> None:
        """Log records as they come; every other message is the reply of the request in flight."""
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "log":
                relog(msg)
                continue
            if msg[0] == "error":  # the backend did not start: its process ends now, as it should
                self._closed = True
            replies.put(msg)
        conn.close()
        code = proc.wait()
        self._dead = (f"its process (pid {proc.pid}) ended with exit code {code}"
                      if code else f"its process (pid {proc.pid}) ended")
        if not self._closed and self.record_entry:  # up, then gone (before it was up, its start failure says it)
            if self._may_restart():
                _logger.error("otel-train: backend `%s`: %s; it is started again at its next call and handed again, "
                              "from the spool, what its store does not hold", self.name, self._dead)
            else:
                _logger.error("otel-train: backend `%s`: %s; what it does not hold stays in the spool for "
                              "`otel-train replay`", self.name, self._dead)
        replies.put(("dead",))

    def _may_restart(self) -> bool:
        return not self._closed and self._restarts < MAX_RESTARTS

    def _restart(self) -> bool:
        """Start the host process again (the call lock held); whether it is up."""
        if not self._may_restart():
            return False
        self._restarts += 1
        try:
            state, self._options, self.record_entry = self._spawn()
        except Exception as err:  # its start failed (`StartFailed`), or no process could be made (OSError)
            self._dead = str(err) if isinstance(err, StartFailed) else f"{type(err).__name__}: {err}"
            _logger.error("otel-train: backend `%s` could not start again: %s; what it does not hold stays in the "
                          "spool for `otel-train replay`", self.name, err)
            return False
        self._apply(state)
        _logger.warning("otel-train: backend `%s` started again (pid %d, restart %d of at most %d); what its store "
                        "does not hold is handed to it again from the spool", self.name, self._proc.pid,
                        self._restarts, MAX_RESTARTS)
        if self._keep_failed:
            self._send("keep_failed")
        if self._preempted is not None:
            self._send("preempt", self._preempted)
        if self._write_held:  # asked of the process that ended: the next flush writes what it holds back
            self._send("write_held")
        return True

    def lost_handed(self) -> bool:
        lost, self._lost = self._lost, False
        return lost

    def _apply(self, state: dict[str, Any]) -> None:
        if "durable_step" not in state and "durable_error" not in state:  # not read back with this reply: as before
            for key in ("durable_step", "durable_error"):
                if key in self._state:
                    state[key] = self._state[key]
        self._state = state
        self._retry_at = time.monotonic() + float(state.get("retry_in_s", 0.0))
        self._order.backwards = int(state.get("backwards", 0))
        self._order.dropped = int(state.get("order_dropped", 0))

    def _call(self, op: str, *args: Any) -> Any:
        """Send request `op` and return the backend's answer; `_GONE` when its process is gone (a failure). A
        process that ended is started again instead, and the call fails: what the old one was handed is lost
        (`lost_handed`), so delivery hands it again before anything new."""
        with self._call_lock:
            if self._dead is not None and self._restart():
                self._lost = True
                self._extra_failures += 1
                return _GONE
            if self._dead is None and self._send(op, *args):
                reply = self._replies.get()
                if op == "flush" and reply[0] != "dead":
                    self._write_held = False
                if reply[0] == "reply":
                    self._apply(reply[2])
                    return reply[1]
                if reply[0] == "raised":
                    self._apply(reply[2])
                    raise RuntimeError(reply[1])
            self._extra_failures += 1
            self._state["unwritten_windows"] = max(1, int(self._state.get("unwritten_windows", 0)))
            self._retry_at = time.monotonic() + (_RESTART_IN_S if self._may_restart() else _DEAD_RETRY_S)
            return _GONE

    # -- what delivery calls ---------------------------------------------------------------------------
    def export_window(self, window: Window) -> bool:
        rows = (window.metrics, window.histograms, window.spans, window.logs)
        run = next((group[0].run for group in rows if group), _NO_RUN)  # every row names its own run
        payload, _ = encode_window(run, (), window.metrics, window.histograms, window.spans, window.logs)
        return self._call("window", payload) is True

    def resume(self, run: RunInfo, step: int) -> bool:
        return self._call("resume", run, step) is True

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._call("flush", timeout_millis) is True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if self._closed:
            return
        self._closed = True  # a process that ended is not started again to be closed (delivery's last flush is)
        self._call("shutdown", timeout_millis)

    def durable_step(self) -> int | None:
        if "durable_error" in self._state:
            raise RuntimeError(self._state["durable_error"])
        step = self._state.get("durable_step")
        return int(step) if step is not None else None

    def preempt_at_close(self, cause: str) -> None:
        self._preempted = cause
        self._send("preempt", cause)  # one-way: never waits behind a write in flight

    def keep_failed_windows(self) -> None:
        self._keep_failed = True
        self._send("keep_failed")

    def retry_in_s(self) -> float:
        return max(0.0, self._retry_at - time.monotonic())

    def write_held_at_next_flush(self) -> None:
        """An explicit flush: a backend that holds rows back (W&B) writes them all at the next `force_flush`."""
        self._write_held = True
        self._send("write_held")

    def watch_appends(self, listener: Callable[[Sequence[tuple[str, int]]], None] | None) -> None:
        """Not for a hosted backend: one whose writes are kill-safe appends stays in the exporter process."""

    def forget_pending_after_fork(self) -> None:
        """Nothing to forget: the backend's pending windows are in its own process."""

    @property
    def options(self) -> ExporterOptions:
        return self._options

    @options.setter
    def options(self, value: ExporterOptions) -> None:
        self._options = value  # hyperparameters reported after init(), a resume
        self._send("options", value)

    @property
    def unwritten_windows(self) -> int:
        return int(self._state.get("unwritten_windows", 0))

    @property
    def failures(self) -> int:
        return int(self._state.get("failures", 0)) + self._extra_failures

    @failures.setter
    def failures(self, value: int) -> None:
        self._extra_failures = value - int(self._state.get("failures", 0))

    @property
    def dropped_windows(self) -> int:
        return int(self._state.get("dropped_windows", 0))

    @dropped_windows.setter
    def dropped_windows(self, value: int) -> None:
        pass

    @property
    def rows_lost(self) -> dict[str, int]:
        return dict(self._state.get("rows_lost", {}))

    @property
    def step_order(self) -> StepOrder:
        return self._order

    @property
    def steps_dropped(self) -> int:
        """Rows the backend itself kept one of per series and step (W&B's, Trackio's and MLflow's count)."""
        return int(self._state.get("steps_dropped", 0))


# -- the host process ---------------------------------------------------------------------------------
def serve(fd: int) -> None:
    """The host process: build the backend named in the first message, then run each request until the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; the exporter process closes us
    conn = Connection(fd)
    send = sender(conn)
    logging.basicConfig(level=logging.WARNING, handlers=[ForwardLogs(send, "backend process")], force=True)
    _exit_with_parent()
    try:
        _, name, target, options = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    try:
        backend: RowExporter = load_class(ExporterSpec(name, target))(options)
    except BaseException as err:
        send("error", f"{type(err).__name__}: {err}")
        _exit()
    from otel_train.ship.logged_record import backend_info

    send("up", _state(backend, durable=True), backend.options, backend_info(name, backend))
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):
            _exit()  # the exporter process is gone: write nothing more (what is not held stays in its spool)
        if op == "options":
            backend.options = args[0]
        elif op == "preempt":
            backend.preempt_at_close(args[0])
        elif op == "keep_failed":
            backend.keep_failed_windows()
        elif op == "write_held":
            write_held = getattr(backend, "write_held_at_next_flush", None)  # a backend that holds rows back
            if write_held is not None:
                write_held()
        else:
            try:
                result = _run(backend, op, args)
            except Exception as err:
                send("raised", f"{type(err).__name__}: {err}", _state(backend, op in _DURABLE_AFTER))
            else:
                send("reply", result, _state(backend, op in _DURABLE_AFTER))
            if op == "shutdown":
                _exit()


def _run(backend: RowExporter, op: str, args: list[Any]) -> Any:
    if op == "window":
        return backend.export_window(decode_window(args[0]))
    if op == "resume":
        return backend.resume(args[0], args[1])
    if op == "flush":
        return backend.force_flush(args[0])
    if op == "shutdown":
        return backend.shutdown(args[0])
    raise ValueError(f"unknown request {op!r}")


def _exit() -> Any:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent() -> None:
    """End this process once the exporter process is gone, even while a backend call blocks (a hung client)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="otel-train-host-parent", daemon=True).start()


def hosted(name: str, target: str) -> Callable[[ExporterOptions], RowExporter]:
    """A `StartingBackend` build function: the backend `target` in a process of its own."""

    def build(options: ExporterOptions) -> RowExporter:
        return HostedBackend(name, target, options)

    return build
