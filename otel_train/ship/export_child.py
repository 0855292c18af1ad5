"""The exporter process's side: build the backends, spool each window and feed them through `Delivery`.

Started by `otel_train.ship.export_process.ExportProcess` as a fresh interpreter (never a fork); the messages
between the two are described there. Also what `otel-train replay` (`otel_train.ship.replay`) rebuilds backends with.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from otel_train._internal import faults
from otel_train._internal.gc_tuning import tune_for_row_churn
from otel_train.backend import RowExporter
from otel_train.config.exporter_options import ExporterOptions, options_to_json
from otel_train.errors import ConfigError
from otel_train.ship import store_env
from otel_train.ship.backend_host import hosted
from otel_train.ship.backend_start import StartingBackend, starting_backends
from otel_train.ship.child_boot import LOG_FILE
from otel_train.ship.delivery import Delivery
from otel_train.ship.framing import encode_resume
from otel_train.ship.log_forward import ForwardLogs, sender
from otel_train.ship.logged_record import open_record
from otel_train.ship.self_metrics import SelfMetrics
from otel_train.ship.span_work import SpanCompleter
from otel_train.ship.spool import Spool, mark_draining
from otel_train.ship.workers import WorkerListener
from otel_train.vocab.run_identity import RunInfo

__all__ = ["ID", "META", "WINDOW", "boot", "child_main", "exports_metrics", "preempt", "set_hparams"]

_logger = logging.getLogger("otel_train")
WINDOW = struct.Struct("<qq")  # a ``W`` frame's seq and max step
ID = struct.Struct("<q")  # a request's id
_ACK_EVERY_S = 0.1  # how often the child confirms what it spooled
_PROGRESS_EVERY_S = 0.1  # how often a waiting trainer hears how far the backends are
#: What `otel-train replay` needs to rebuild a spool's backends, in its folder.
META = "exporters.json"
OLD_META = "exporters.pickle"  # an earlier otel-train's: refused, never unpickled


# -- the child ------------------------------------------------------------------------------------------
def boot(fd: int) -> None:
    """The exporter process's entry point: read its configuration from `fd`, then run `child_main`."""
    conn = Connection(fd)
    try:
        config = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    child_main(conn, config)
    os._exit(0)


def child_main(conn: Connection, config: dict[str, Any]) -> None:
    """The exporter process: build the backends, then spool and deliver until the trainer is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; we drain on its hand-off
    drain_s = float(config["drain_timeout_s"])
    reply = sender(conn)  # False once the trainer is gone; we drain anyway
    logging.basicConfig(level=logging.WARNING, handlers=[ForwardLogs(reply, "exporter process")], force=True)

    try:
        spool = Spool(Path(config["spool"]))
        options = config["options"]
        # Each backend starts on a thread of its own once delivery holds it; until then its windows wait in the spool.
        backends = starting_backends(config["names"], dataclasses.replace(options, resume_step=None), spooled=True,
                                     hosted=hosted if config.get("backend_processes", True) else None)
        if options.resume_step is not None:
            _spool_resume(spool, config["run"], options.resume_step, backends)
    except ConfigError as err:
        reply("error", str(err))
        return
    except Exception as err:
        reply("error", f"OTEL_TRAIN_EXPORT_PROCESS: the exporter process could not start: {type(err).__name__}: {err}")
        return
    _write_meta(spool.path, config)
    spool.on_recreated += [lambda: _write_meta(spool.path, config), lambda: _reopen_log(spool.path)]
    delivery = Delivery(dict[str, RowExporter](backends), spool)
    delivery.spans = SpanCompleter(delivery.count_lost)  # the rows and phase timings of `ot.span` records
    delivery.record = open_record(backends, config["run"], options.directory, int(config.get("record_bytes", 0)),
                                  options.resume_step)
    for backend in backends.values():
        backend.start()
    threading.Thread(target=_tune_once_started, args=(list(backends.values()),), daemon=True).start()
    if config.get("self_metrics"):
        delivery.annotate = SelfMetrics(delivery.backend_stats, lambda: delivery.spool_failed_appends)
    listener = None
    if config.get("workers"):
        try:  # the training process bound it: children could connect before we were up
            fd = int(config.get("workers_fd", -1))
            sock = socket.socket(fileno=fd) if fd >= 0 else None
            listener = WorkerListener(config["workers"], config["run"], delivery.submit_side,
                                      lambda: delivery.last_step, metrics=config.get("export_metrics", True),
                                      lost=delivery.count_lost, sock=sock)
        except OSError as err:
            _logger.warning("child processes cannot reach this run: listening on %s failed: %s",
                            config["workers"], err)
    faults.before_ready()
    reply("ready", spool.last_seq)

    def report_progress(rid: int, done: threading.Event) -> None:
        """While the trainer waits on request `rid`: the progress every 0.1 s, so that what it says when its wait
        ends (a timeout) is how far the backends are then, not as they were when the request came."""
        while not done.wait(_PROGRESS_EVERY_S):
            reply("progress", rid, delivery.progress())

    def flush_later(rid: int, wait_s: float) -> None:
        done = threading.Event()
        threading.Thread(target=report_progress, args=(rid, done), daemon=True).start()
        ok = delivery.flush(time.monotonic() + wait_s)
        done.set()
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
            seq, step = WINDOW.unpack_from(frame, 1)
            delivery.submit(seq, step, frame[1 + WINDOW.size:])
            now = time.monotonic()
            if now - last_ack >= _ACK_EVERY_S and not conn.poll(0):  # a few acks a second wake the trainer
                reply("spooled", seq)
                last_ack = now
            continue
        if kind == b"H":
            config["options"] = dataclasses.replace(config["options"], hparams=pickle.loads(frame[1:]))
            set_hparams(delivery.exporters(), config["options"].hparams)
            _write_meta(spool.path, config)
            continue
        (rid,) = ID.unpack_from(frame, 1)
        if kind == b"F":
            if delivery.sync():  # said only when true: every window is written ahead and synced
                reply("durable", rid, delivery.progress())
            threading.Thread(target=flush_later, args=(rid, _trainer_wait(frame, drain_s)), daemon=True).start()
        elif kind == b"P":
            reply("progress", rid, delivery.progress())
        elif kind == b"C":
            close_id = rid
            cause = frame[1 + ID.size:].decode(errors="replace").partition("\n")[0]
            trainer_wait_s = _trainer_wait(frame, 0.0)  # OTEL_TRAIN_DRAIN_TIMEOUT_S counts after the trainer's wait
            if cause:  # the trainer ended on a preemption signal: the backends mark their runs before closing
                preempt(delivery.exporters(), cause)
            break
    # The trainer handed off (or died): never outlive the drain deadline, whatever a backend does.
    mark_draining(int(config.get("lock_fd", -1)))  # a restarted attempt waits for us instead of mixing in
    if listener is not None:
        listener.close(trainer_died=close_id is None)
    deadline = time.monotonic() + trainer_wait_s + drain_s
    watchdog = threading.Timer(trainer_wait_s + drain_s + 5.0, os._exit, args=(0,))
    watchdog.daemon = True
    watchdog.start()
    if delivery.sync() and close_id is not None:  # said only when true: every window written ahead and synced
        reply("durable", close_id, delivery.progress())
    draining = threading.Event()
    if close_id is not None:
        threading.Thread(target=report_progress, args=(close_id, draining), daemon=True).start()
    ok = delivery.close(deadline)
    draining.set()
    if close_id is not None:
        reply("done", close_id, ok, delivery.progress())
    if not ok and time.monotonic() >= deadline:  # else a backend closed behind: delivery's close said so
        _logger.warning("drain deadline reached: %s; `otel-train replay` delivers the rest",
                        delivery.progress().summary())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tune_once_started(backends: Sequence[StartingBackend]) -> None:
    """Once every backend's client is imported: freeze them out of the cycle collector's sight."""
    for backend in backends:
        backend.wait_started()
    tune_for_row_churn()


def _trainer_wait(frame: bytes, default: float) -> float:
    """How long the trainer waits for a flush or close request: the number after the cause (seconds)."""
    waits = frame[1 + ID.size:].decode(errors="replace").partition("\n")[2]
    try:
        return min(max(0.0, float(waits)), 24 * 3600.0) if waits else default
    except ValueError:
        return default


def exports_metrics(run: RunInfo, options: ExporterOptions) -> bool:
    """Whether this rank exports metrics (`OTEL_TRAIN_RANKS`, or a backend's `_RANKS=all`), child values included."""
    routes = options.routes or {}
    return run.rank == 0 or options.ranks == "all" or any(r.ranks == "all" for r in routes.values())


def preempt(exporters: Sequence[Any], cause: str) -> None:
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


def set_hparams(exporters: Sequence[Any], config: Mapping[str, Any]) -> None:
    for exporter in exporters:
        options = getattr(exporter, "options", None)
        if isinstance(options, ExporterOptions):
            exporter.options = dataclasses.replace(options, hparams=dict(config))


def _reopen_log(folder: Path) -> None:
    """Our stdout/stderr (`LOG_FILE`) again in the spool folder `folder`, after the folder was deleted and created
    again: the messages after a trainer is gone go where a user looks for them, not to a deleted file."""
    fd = os.open(folder / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for std in (1, 2):
            os.dup2(fd, std)
    finally:
        os.close(fd)


def _write_meta(path: Path, config: dict[str, Any]) -> None:
    """What `otel-train replay` needs to rebuild the backends of this spool, as JSON (reading it runs no code)."""
    tmp = path / (META + ".tmp")
    options = dataclasses.replace(config["options"], resume_step=None)  # a replay never resumes the run again
    # The backends' stores as this run sees them (`store_env`), and where relative paths start: replay uses them.
    tmp.write_text(json.dumps({"names": list(config["names"]), "options": options_to_json(options),
                               "env": store_env.record(), "cwd": os.getcwd()}))
    os.replace(tmp, path / META)
