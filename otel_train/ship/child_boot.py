"""Starting the exporter process's interpreter, with nothing of otel-train's heavier modules imported.

The training process starts it before it imports and builds the OTel SDK (`otel_train.session.runtime`), so the
child's own start (a fresh interpreter importing the backends' side, most of a short job's fixed cost) runs
beside that instead of after it. The child imports, then waits for its configuration on the connection
(`otel_train.ship.export_child.boot`); `otel_train.ship.export_process.ExportProcess` sends it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

__all__ = ["LOG_FILE", "Booted", "boot_child", "place", "reap_ended"]

_logger = logging.getLogger("otel_train")

#: The exporter process's stdout/stderr, in the rank's spool folder: its messages once the trainer is gone.
LOG_FILE = "exporter.log"
_BOOT = ("import sys, json; sys.path[:0] = json.loads(sys.argv[2]); "
         "from otel_train.ship.export_child import boot; boot(int(sys.argv[1]))")

#: A started exporter process that has not been sent its configuration: the connection to it and the process.
Booted = tuple[Connection, "subprocess.Popen[bytes]"]
#: The exporter processes started here and not known to have ended (`reap_ended`).
_BOOTED: list[subprocess.Popen[bytes]] = []


def reap_ended() -> None:
    """Collect the exit status of the exporter processes started here that have ended (each drains on its own after
    the trainer's hand-off, and nobody waits for it): a process that runs many short sessions (a sweep of trials)
    keeps no zombie per session."""
    _BOOTED[:] = [proc for proc in _BOOTED if proc.poll() is None]


def boot_child(spool: Path, lock_fd: int = -1, listener: socket.socket | None = None, cpus: Sequence[int] = (),
               nice: int = 0) -> Booted:
    """Start the exporter process of the rank whose spool folder is `spool` (its output to `LOG_FILE` there),
    holding the run folder's lock `lock_fd` (`otel_train.ship.spool.claim_run`; -1: none) and the socket child
    processes connect to (`otel_train.ship.workers`; None: none), pinned to `cpus` and `nice` added, without waiting
    for it: it imports what it runs, then waits for its configuration on the returned connection (closing it ends
    the process)."""
    reap_ended()
    fds = [fd for fd in (lock_fd, listener.fileno() if listener is not None else -1) if fd >= 0]
    log_path = spool / LOG_FILE
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Never the trainer's stdout/stderr: a `| tee`, a CI step or `subprocess.run(capture_output=True)`
        # waits for their EOF, which must come when the trainer exits, not after the drain.
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(  # a fresh interpreter (never a fork), in its own session
                [sys.executable, "-c", _BOOT, str(theirs.fileno()), json.dumps(sys.path)],
                pass_fds=(theirs.fileno(), *fds), start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
                stderr=log,
            )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    _BOOTED.append(proc)
    place(proc.pid, cpus, nice)  # pinned before its imports run
    return Connection(ours.detach()), proc


def place(pid: int, cpus: Sequence[int], nice: int) -> None:
    """Pin the exporter process `pid` to `cpus` and add `nice` to its niceness (ours + `nice`)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(pid, set(cpus))
        except OSError as err:
            _logger.warning("OTEL_TRAIN_EXPORT_CPUS: cannot pin the exporter process to %s: %s", list(cpus), err)
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError as err:
            _logger.warning("OTEL_TRAIN_EXPORT_NICE: cannot renice the exporter process: %s", err)
