"""The exporter process: named backends run in a child of the training process, not in it.

The training process encodes each window (`otel_train.framing`) and writes it to a Unix socket;
the child (started with a fresh interpreter, never forked: the trainer may hold CUDA) spools it
(`otel_train.spool`) and feeds every backend through `otel_train.delivery`. The child sits in its own
session, so a Ctrl-C to the job's process group does not reach it; once the trainer hands off or
dies it keeps delivering for at most `OTEL_TRAIN_DRAIN_TIMEOUT_S`, then exits. If it dies, the
trainer restarts it once (it resumes from the spool); if it dies again, the trainer exports in
its own process from the same spool.

Messages, trainer -> child: ``W`` + seq, max step + encoded window (or resume, `framing.encode_resume`); ``F`` + id (flush); ``C`` + id
[+ the preemption signal's name, e.g. ``SIGTERM``: the backends mark their runs preempted] (close); ``P`` + id (progress); ``H`` + pickled hyperparameters (reported after `init()`). Child -> trainer (pickled tuples): ``("ready", last seq)``,
``("error", message)``, ``("spooled", seq)``, ``("durable", id, progress)``, ``("done", id, ok, progress)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from otel_train.delivery import Delivery, Progress
from otel_train.errors import ConfigError
from otel_train.framing import encode_resume, encode_window
from otel_train.records import ExporterOptions, HistogramRow, MetricRow, RunInfo, SpanRow
from otel_train.self_metrics import SelfMetrics
from otel_train.spool import Spool, holder, mark_draining, spool_dir, try_lock
from otel_train.workers import WorkerListener, listen_address

__all__ = ["ExportProcess", "build_backends", "child_main", "replay"]

_logger = logging.getLogger("otel_train")
_WINDOW = struct.Struct("<qq")
_ID = struct.Struct("<q")
_START_TIMEOUT_S = 60.0  # building W&B / ClearML runs can take seconds; a stuck start must not hang init()
_BACKLOG = 4096  # windows kept until the child confirms they are spooled (a restart resends them)
_BACKLOG_BYTES = 64 * 1024 * 1024  # ... and at most this many bytes of them
_ACK_EVERY_S = 0.1  # how often the child confirms what it spooled
_META = "exporters.pickle"
#: The exporter process's stdout/stderr, in the rank's spool folder: its messages once the trainer is gone.
LOG_FILE = "exporter.log"
_BOOT = ("import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
         "from otel_train.export_process import _boot; _boot(int(sys.argv[1]))")


def build_backends(names: Sequence[str], options: ExporterOptions) -> dict[str, Any]:
    """Build the named exporters (the registry's classes); on failure shut the built ones down.

    Raises:
        ConfigError: one line naming the exporter that could not start.
    """
    from otel_train.registry import check_available, get_spec, load_class

    specs = [get_spec(name) for name in names]  # unknown names fail before anything is built
    for spec in specs:
        check_available(spec)
    built: dict[str, Any] = {}
    for spec in specs:
        try:
            built[spec.name] = load_class(spec)(options)
        except Exception as err:
            for ex in built.values():
                ex.shutdown()
            if isinstance(err, (ImportError, ConfigError)):
                raise
            raise ConfigError(f"OTEL_TRAIN_EXPORTERS: exporter {spec.name!r} could not start: "
                              f"{type(err).__name__}: {err}") from err
    return built


class ExportProcess:
    """The training process's end: starts the child, sends windows, waits for flushes.

    Args:
        names: Exporter names the child builds (checked here first).
        options: What every backend is told besides the rows.
        run: This process's run and rank (names the spool).
        drain_timeout_s: How long the child may keep delivering after a hand-off.
        cpus: CPUs the child pins itself to (empty: inherit).
        nice: Niceness the child adds.
        self_metrics: Add otel-train's own health rows to every window (`otel_train.self_metrics`).
        lock_fd: The run folder's lock (`otel_train.spool.claim_run`): the child inherits it and holds the
            claim until it has drained (-1: none).

    Raises:
        ConfigError: an unknown name, a missing package, or a backend that failed to start in the child.
    """

    def __init__(self, names: Sequence[str], options: ExporterOptions, run: RunInfo, *,
                 drain_timeout_s: float = 120.0, cpus: Sequence[int] = (), nice: int = 0,
                 self_metrics: bool = True, lock_fd: int = -1) -> None:
        from otel_train.registry import check_available, get_spec

        for spec in [get_spec(n) for n in names]:
            check_available(spec)
        self.names = tuple(names)
        self.spool_path = spool_dir(options.directory, run.run_name, run.rank)
        #: Where the exporter process writes its stdout/stderr (its messages once the trainer is gone).
        self.log_path = self.spool_path / LOG_FILE
        self._lock_fd = lock_fd
        self._options = options
        #: Where child processes (DataLoader workers) connect to this run (`otel_train.workers`).
        self.worker_address = listen_address(self.spool_path)
        self._config = {"names": list(names), "options": options, "spool": str(self.spool_path),
                        "drain_timeout_s": drain_timeout_s, "cpus": list(cpus), "nice": nice,
                        "run": run, "workers": self.worker_address, "self_metrics": self_metrics,
                        "lock_fd": lock_fd, "export_metrics": _exports_metrics(run, options)}
        self._lock = threading.RLock()  # one sender at a time; held across restarts
        self._backlog: deque[tuple[int, int, bytes]] = deque()
        self._backlog_bytes = 0
        self._backlog_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        self._reply_cv = threading.Condition()
        self._closing = False
        self._handoff = False  # close() asked: the child's exit after its answer is not a death
        self._pid = os.getpid()
        self.restarts = 0
        self.dropped = 0
        self.fallback: Delivery | None = None
        self.last_progress = Progress()
        #: The preemption signal's name when the training process ends on one (set before `close`).
        self.preempted: str | None = None
        self._conn, self._proc, self._seq = self._start()
        self._earlier_seq = self._seq  # the spool's windows up to here are an earlier attempt's (see `send_resume`)
        # The first child told each backend about a resume; a restarted child or the fallback must not
        # tell it again (TensorBoard would purge, W&B rewind, the steps delivered since).
        self._options = dataclasses.replace(options, resume_step=None)
        self._config["options"] = self._options
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    # -- starting -------------------------------------------------------------------------------
    def _start(self) -> tuple[Connection, subprocess.Popen[bytes], int]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = (theirs.fileno(),) + ((self._lock_fd,) if self._lock_fd >= 0 else ())
        try:
            self.spool_path.mkdir(parents=True, exist_ok=True)
            # Never the trainer's stdout/stderr: a `| tee`, a CI step or `subprocess.run(capture_output=True)`
            # waits for their EOF, which must come when the trainer exits, not after the drain.
            with open(self.log_path, "ab") as log:
                proc = subprocess.Popen(  # a fresh interpreter (never a fork), in its own session
                    [sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(sys.path)],
                    pass_fds=fds, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                )
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        conn.send(self._config)
        reply: Any = None
        if conn.poll(_START_TIMEOUT_S):
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                reply = None
        if not (isinstance(reply, tuple) and reply[0] == "ready"):
            conn.close()
            if proc.poll() is None:
                proc.kill()
            if isinstance(reply, tuple) and reply[0] == "error":
                raise ConfigError(reply[1])
            raise ConfigError(f"OTEL_TRAIN_EXPORT_PROCESS: the exporter process did not start within "
                              f"{_START_TIMEOUT_S:.0f} s (exit code {proc.poll()}); set "
                              "OTEL_TRAIN_EXPORT_PROCESS=off to export in the training process")
        threading.Thread(target=self._receive, args=(conn, proc), name="otel-train-export-replies",
                         daemon=True).start()
        return conn, proc, int(reply[1])

    def _after_fork(self) -> None:
        # A forked DataLoader worker must neither write to the socket nor keep it open (the child
        # would never see the trainer's end).
        self._closing = True
        try:
            self._conn.close()
        except OSError:
            pass

    @property
    def pid(self) -> int:
        return self._proc.pid

    # -- sending (collector thread) --------------------------------------------------------------
    def send_window(self, run: RunInfo, points: Sequence[tuple[str, int, float, int]],
                    metrics: Sequence[MetricRow] = (), histograms: Sequence[HistogramRow] = (),
                    spans: Sequence[SpanRow] = ()) -> None:
        """Encode one window and hand it to the child (or the fallback)."""
        if os.getpid() != self._pid or not (points or metrics or histograms or spans):
            return
        payload, max_step = encode_window(run, points, metrics, histograms, spans)
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
            with self._backlog_lock:
                self._backlog.append((seq, max_step, payload))
                self._backlog_bytes += len(payload)
                while len(self._backlog) > _BACKLOG or self._backlog_bytes > _BACKLOG_BYTES:
                    self._backlog_bytes -= len(self._backlog.popleft()[2])
                    self.dropped += 1  # only a restart would have needed it
            self._send(b"W" + _WINDOW.pack(seq, max_step) + payload)

    def add_config(self, config: Mapping[str, Any]) -> None:
        """Hyperparameters reported after `init()`: every backend of the child gets them (see `Session.add_config`)."""
        self._options = dataclasses.replace(self._options, hparams=dict(config))
        self._config["options"] = self._options  # a restarted child starts with them
        with self._lock:
            if self.fallback is not None:
                _set_hparams(self.fallback.exporters(), config)
            else:
                self._send(b"H" + pickle.dumps(dict(config)))

    def _send(self, frame: bytes) -> bool:
        try:
            self._conn.send_bytes(frame)
            return True
        except (OSError, ValueError):
            return False  # the child is gone: the reply thread restarts it and resends the backlog

    def _request(self, kind: bytes, extra: bytes = b"") -> int:
        rid = next(self._ids)
        with self._lock:
            if self.fallback is None:
                self._send(kind + _ID.pack(rid) + extra)
        return rid

    def _wait(self, rid: int, key: str, deadline: float) -> dict[str, Any] | None:
        with self._reply_cv:
            self._reply_cv.wait_for(lambda: key in self._replies.get(rid, {}) or self.fallback is not None,
                                    timeout=max(0.0, deadline - time.monotonic()))
            return self._replies.get(rid)

    # -- replies (reply thread) -------------------------------------------------------------------
    def _receive(self, conn: Connection, proc: subprocess.Popen[bytes]) -> None:
        while True:
            try:
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
            spooled = msg[1] if kind == "spooled" else msg[-1].spooled
            with self._backlog_lock:  # never the send lock: a sender blocked on a full socket holds it
                while self._backlog and self._backlog[0][0] <= spooled:
                    self._backlog_bytes -= len(self._backlog.popleft()[2])
            if kind in ("durable", "done", "progress"):
                self.last_progress = msg[-1]
                with self._reply_cv:
                    entry = self._replies.setdefault(msg[1], {})
                    entry[kind] = msg[2] if kind == "done" else True
                    self._reply_cv.notify_all()
        if conn is self._conn and not self._closing and not self._handoff:
            proc.wait()
            self._on_child_death(proc.returncode)

    def _on_child_death(self, code: int | None) -> None:
        with self._lock:
            if self._closing:
                return
            if self.restarts == 0:
                self.restarts = 1
                _logger.warning("otel-train: the exporter process exited (code %s); restarting it once; "
                                "windows it had spooled are delivered from the spool", code)
                try:
                    self._conn, self._proc, _ = self._start()
                    with self._backlog_lock:
                        backlog = list(self._backlog)
                    for seq, step, payload in backlog:
                        self._send(b"W" + _WINDOW.pack(seq, step) + payload)
                    return
                except ConfigError as err:
                    _logger.warning("otel-train: restarting the exporter process failed: %s", err)
            _logger.warning("otel-train: the exporter process exited again (code %s); exporting in the "
                            "training process from now on", code)
            try:
                backends = build_backends(self.names, self._options)
                fallback = Delivery(backends, Spool(self.spool_path))
                if self._config["self_metrics"]:
                    fallback.annotate = SelfMetrics(fallback.backend_stats, lambda: fallback.spool_failed_appends)
                self.fallback = fallback
                with self._backlog_lock:
                    backlog = list(self._backlog)
                    self._backlog.clear()
                    self._backlog_bytes = 0
                for seq, step, payload in backlog:
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
            _preempt(fallback.exporters(), cause)
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
        if not ok and rid:
            durable = self._wait(rid, "durable", time.monotonic() + 0.2)  # sent before delivery starts
            state = "durable in the spool" if durable else "NOT confirmed durable"
            _logger.warning("otel-train: shutdown timed out; data is %s; %s; the exporter process (pid %d) keeps "
                            "delivering for up to OTEL_TRAIN_DRAIN_TIMEOUT_S, and `otel-train replay %s` "
                            "finishes the rest", state, self.last_progress.summary(), self._proc.pid,
                            self.spool_path.parent.parent)
        self._closing = True
        try:
            self._conn.close()
        except OSError:
            pass
        return ok

    def progress(self, timeout_s: float = 5.0) -> Progress:
        """The child's progress: windows spooled, and per backend the last durable window and step."""
        if self.fallback is not None:
            return self.fallback.progress()
        if self._closing:
            return self.last_progress
        rid = self._request(b"P")
        self._wait(rid, "progress", time.monotonic() + timeout_s)
        return self.last_progress


# -- the child ------------------------------------------------------------------------------------------
def _boot(fd: int) -> None:
    conn = Connection(fd)
    try:
        config = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    child_main(conn, config)
    os._exit(0)


def _place(cpus: Sequence[int], nice: int) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(cpus))
        except OSError as err:
            _logger.warning("OTEL_TRAIN_EXPORT_CPUS: cannot pin the exporter process to %s: %s", list(cpus), err)
    if nice:
        try:
            os.nice(nice)
        except OSError as err:
            _logger.warning("OTEL_TRAIN_EXPORT_NICE: cannot renice the exporter process: %s", err)


class _Forward(logging.Handler):
    """Sends the exporter process's log records to the training process (its own stderr once that is gone)."""

    def __init__(self, reply: Any) -> None:
        super().__init__()
        self._reply = reply

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            if not self._reply("log", record.levelno, record.name, text):  # stderr is `LOG_FILE` in the spool
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                sys.stderr.write(f"{stamp} otel-train exporter process (pid {os.getpid()}): {record.levelname} {text}\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


def child_main(conn: Connection, config: dict[str, Any]) -> None:
    """The exporter process: build the backends, then spool and deliver until the trainer is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we drain on its hand-off
    drain_s = float(config["drain_timeout_s"])
    send_lock = threading.Lock()

    def reply(*msg: Any) -> bool:
        with send_lock:
            try:
                conn.send(msg)
                return True
            except (OSError, ValueError):
                return False  # the trainer is gone; we drain anyway

    logging.basicConfig(level=logging.WARNING, handlers=[_Forward(reply)], force=True)
    _place(config["cpus"], config["nice"])

    try:
        spool = Spool(Path(config["spool"]))
        options = config["options"]
        backends = build_backends(config["names"], dataclasses.replace(options, resume_step=None))
        if options.resume_step is not None:
            _spool_resume(spool, config["run"], options.resume_step, backends)
    except ConfigError as err:
        reply("error", str(err))
        return
    except Exception as err:
        reply("error", f"OTEL_TRAIN_EXPORT_PROCESS: the exporter process could not start: {type(err).__name__}: {err}")
        return
    _write_meta(spool.path, config)
    delivery = Delivery(backends, spool)
    if config.get("self_metrics"):
        delivery.annotate = SelfMetrics(delivery.backend_stats, lambda: delivery.spool_failed_appends)
    listener = None
    if config.get("workers"):
        try:
            listener = WorkerListener(config["workers"], config["run"], delivery.submit_side,
                                      lambda: delivery.last_step, metrics=config.get("export_metrics", True),
                                      lost=delivery.count_side_lost)
        except OSError as err:
            _logger.warning("child processes cannot reach this run: listening on %s failed: %s",
                            config["workers"], err)
    reply("ready", spool.last_seq)

    def flush_later(rid: int, wait_s: float) -> None:
        ok = delivery.flush(time.monotonic() + wait_s)
        reply("done", rid, ok, delivery.progress())

    close_id = None
    trainer_wait_s = 0.0  # a trainer that died waits for nothing
    last_ack = 0.0
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            break
        kind = frame[:1]
        if kind == b"W":
            seq, step = _WINDOW.unpack_from(frame, 1)
            delivery.submit(seq, step, frame[1 + _WINDOW.size:])
            now = time.monotonic()
            if now - last_ack >= _ACK_EVERY_S and not conn.poll(0):  # a few acks a second wake the trainer
                reply("spooled", seq)
                last_ack = now
            continue
        if kind == b"H":
            config["options"] = dataclasses.replace(config["options"], hparams=pickle.loads(frame[1:]))
            _set_hparams(delivery.exporters(), config["options"].hparams)
            _write_meta(spool.path, config)
            continue
        (rid,) = _ID.unpack_from(frame, 1)
        if kind == b"F":
            delivery.sync()
            reply("durable", rid, delivery.progress())
            threading.Thread(target=flush_later, args=(rid, _trainer_wait(frame, drain_s)), daemon=True).start()
        elif kind == b"P":
            reply("progress", rid, delivery.progress())
        elif kind == b"C":
            close_id = rid
            cause = frame[1 + _ID.size:].decode(errors="replace").partition("\n")[0]
            trainer_wait_s = _trainer_wait(frame, 0.0)  # OTEL_TRAIN_DRAIN_TIMEOUT_S counts after the trainer's wait
            if cause:  # the trainer ended on a preemption signal: the backends mark their runs before closing
                _preempt(delivery.exporters(), cause)
            break
    # The trainer handed off (or died): never outlive the drain deadline, whatever a backend does.
    mark_draining(int(config.get("lock_fd", -1)))  # a restarted attempt waits for us instead of mixing in
    if listener is not None:
        listener.close()
    deadline = time.monotonic() + trainer_wait_s + drain_s
    watchdog = threading.Timer(trainer_wait_s + drain_s + 5.0, os._exit, args=(0,))
    watchdog.daemon = True
    watchdog.start()
    delivery.sync()
    if close_id is not None:
        reply("durable", close_id, delivery.progress())
    ok = delivery.close(deadline)
    if close_id is not None:
        reply("done", close_id, ok, delivery.progress())
    if not ok:
        _logger.warning("drain deadline reached: %s; `otel-train replay` delivers the rest",
                        delivery.progress().summary())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _trainer_wait(frame: bytes, default: float) -> float:
    """How long the trainer waits for a flush or close request: the number after the cause (seconds)."""
    waits = frame[1 + _ID.size:].decode(errors="replace").partition("\n")[2]
    try:
        return min(max(0.0, float(waits)), 24 * 3600.0) if waits else default
    except ValueError:
        return default


def _exports_metrics(run: RunInfo, options: ExporterOptions) -> bool:
    """Whether this rank exports metrics (`OTEL_TRAIN_RANKS`, or a backend's `_RANKS=all`), child values included."""
    routes = options.routes or {}
    return run.rank == 0 or options.ranks == "all" or any(r.ranks == "all" for r in routes.values())


def _preempt(exporters: Sequence[Any], cause: str) -> None:
    for exporter in exporters:
        if hasattr(exporter, "preempt_at_close"):
            exporter.preempt_at_close(cause)


def _spool_resume(spool: Spool, run: RunInfo, step: int, backends: Mapping[str, Any]) -> None:
    """`init(resume_step=N)`: spool the resume after the earlier attempt's windows, so that what a `kill -9`
    left undelivered is cut at N and every backend applies the resume once, in order (also after a restart
    or in `otel-train replay`). If the spool cannot be written, each backend applies it when it opens, as
    in-process."""
    earlier = spool.last_seq
    if spool.append(earlier + 1, -1, encode_resume(run, step, earlier)):
        spool.sync()
        return
    for exporter in backends.values():
        options = getattr(exporter, "options", None)
        if isinstance(options, ExporterOptions):
            exporter.options = dataclasses.replace(options, resume_step=step)


def _set_hparams(exporters: Sequence[Any], config: Mapping[str, Any]) -> None:
    for exporter in exporters:
        options = getattr(exporter, "options", None)
        if isinstance(options, ExporterOptions):
            exporter.options = dataclasses.replace(options, hparams=dict(config))


def _write_meta(path: Path, config: dict[str, Any]) -> None:
    """What `otel-train replay` needs to rebuild the backends of this spool (pickled: options hold paths,
    routes and step selections; read only by the same otel-train)."""
    tmp = path / (_META + ".tmp")
    options = dataclasses.replace(config["options"], resume_step=None)  # a replay never resumes the run again
    tmp.write_bytes(pickle.dumps({"names": config["names"], "options": options}))
    os.replace(tmp, path / _META)


def replay(run_dir: Path, timeout_s: float = 600.0, stall_s: float = 60.0,
           report_every_s: float = 10.0) -> dict[str, Progress]:
    """Deliver every spooled window a backend has not acknowledged, for each rank under `run_dir`.

    Idempotent: each backend resumes after its durable cursor, so a second replay writes nothing. Every
    `report_every_s` it logs, per rank and backend, how many windows are left; a backend that makes no
    progress for `stall_s` is given up on (its windows stay in the spool for a later replay), so a backend
    that cannot deliver costs `stall_s`, not `timeout_s`. A rank whose folder another process is writing
    (a training or draining exporter process holds its lock) is skipped with a warning.

    Returns:
        Spool folder name -> progress after the replay.
    """
    results: dict[str, Progress] = {}
    for meta_file in sorted(Path(run_dir).glob(f"spool/*/{_META}")):
        rank_dir = meta_file.parent
        fd = try_lock(rank_dir)
        if fd is None:
            who = holder(rank_dir)
            _logger.warning("%s: skipped: another process (pid %s on %s, %s) is writing it; replay once it has "
                            "exited", rank_dir.name, who.get("pid", "?"), who.get("host", "?"),
                            who.get("state", "state unknown"))
            continue
        try:
            meta = pickle.loads(meta_file.read_bytes())  # written by our own exporter process
            delivery = Delivery(build_backends(meta["names"], meta["options"]), Spool(rank_dir))
            results[rank_dir.name] = _replay_rank(rank_dir.name, delivery, timeout_s, stall_s, report_every_s)
        finally:
            os.close(fd)
    return results


def _replay_rank(label: str, delivery: Delivery, timeout_s: float, stall_s: float,
                 report_every_s: float) -> Progress:
    """Wait while some backend still makes progress (see `replay`), saying what is left; then close."""
    start = time.monotonic()
    deadline = start + timeout_s
    acked: dict[str, int] = {}
    moved_at: dict[str, float] = {}
    given_up: set[str] = set()
    next_report = start + report_every_s
    next_flush = start
    while True:
        now = time.monotonic()
        progress = delivery.progress()
        left = {name: progress.spooled - seq for name, seq in progress.delivered.items() if seq < progress.spooled}
        for name, n_left in left.items():
            if acked.get(name) != progress.delivered[name]:
                acked[name], moved_at[name] = progress.delivered[name], now
            if name not in given_up and now - moved_at[name] >= stall_s:
                given_up.add(name)
                _logger.warning("%s: giving up on `%s`: no progress for %.0f s (%d failure(s)); its %d window(s) "
                                "left stay in the spool for a later `otel-train replay`", label, name, stall_s,
                                progress.failures.get(name, 0), n_left)
        if not left or set(left) <= given_up or now >= deadline:
            break
        if now >= next_flush:  # as often as delivery flushes a backend on its own (a failing one is retried)
            next_flush = now + 1.0
            if delivery.flush(time.monotonic() + 0.1):
                # Every window handed and flushed: a backend whose store lags (W&B keeps its last step open until
                # `finish`) has the rest once closed, so waiting for its cursor would only run into `stall_s`.
                left = {}
                break
        if now >= next_report:
            next_report = now + report_every_s
            waiting = ", ".join(f"`{name}` {n} window(s) left" for name, n in left.items() if name not in given_up)
            _logger.info("%s: waiting for %s (%.0f s of at most %.0f s)", label, waiting, now - start, timeout_s)
        time.sleep(0.1)
    # Given up (or out of time): closing only shuts the backends down, briefly.
    delivery.close(min(deadline, time.monotonic() + (5.0 if left else timeout_s)))
    progress = delivery.progress()
    if progress.behind():
        _logger.warning("%s: %s", label, progress.summary())
    return progress
