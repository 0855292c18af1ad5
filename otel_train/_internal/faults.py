"""Fault injection for tests only: nothing here does anything unless its variable is set.

``OTEL_TRAIN_TEST_KILL_AFTER_WRITE`` = ``<backend>@<step>[@<marker file>]``: the process sends itself SIGKILL
right after a write to a backend whose name starts with ``<backend>`` handed it rows at step ``<step>`` or
later, before delivery records that write (`otel_train.ship.backend_feed`, `otel_train.sink.runs.reorder`): the worst
moment for a ``kill -9``. With a marker file, only the process that creates it is killed (once per test, however
often the process is restarted). Read once, at import.

``OTEL_TRAIN_TEST_KILL_AFTER_RECORD`` = ``<seq>``: a process that delivers with a spool sends itself SIGKILL right after
it recorded window ``<seq>`` for verify and before its spool holds it (`otel_train.ship.delivery`), every time: the
exporter process, its restart and the training process's fallback alike, so the whole job dies with that window.
Read once, at import.

``OTEL_TRAIN_TEST_SLOW_READY`` = ``<marker file>``: the exporter process, once its spool is open, waits until that
file exists before it says ``ready`` and reads what the trainer sent (a machine slow to start it). Read once, at
import.

``OTEL_TRAIN_TEST_HOLD_START`` = ``<backend>``: that backend's start thread never builds it
(`otel_train.ship.backend_start`): a client that takes longer to import than the job lives. Read once, at import.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["ARMED", "HOLD_START", "KILL_AFTER_RECORD", "KILL_AFTER_WRITE", "SLOW_READY", "after_record",
           "after_write", "before_ready", "before_start"]

#: The variables (tests only).
KILL_AFTER_WRITE = "OTEL_TRAIN_TEST_KILL_AFTER_WRITE"
SLOW_READY = "OTEL_TRAIN_TEST_SLOW_READY"
KILL_AFTER_RECORD = "OTEL_TRAIN_TEST_KILL_AFTER_RECORD"
HOLD_START = "OTEL_TRAIN_TEST_HOLD_START"
_READY_MARKER = os.environ.get(SLOW_READY, "")
_HELD_BACKEND = os.environ.get(HOLD_START, "")


def _parse(spec: str) -> tuple[str, int, str] | None:
    backend, _, rest = spec.partition("@")
    step, _, marker = rest.partition("@")
    try:
        return (backend, int(step), marker) if backend else None
    except ValueError:
        return None


_KILL = _parse(os.environ.get(KILL_AFTER_WRITE, ""))
#: Whether a fault is set: callers skip any work for `after_write` when it is not.
ARMED = _KILL is not None


def after_write(backend: str, max_step: int) -> None:
    """Called right after `backend` was handed rows up to `max_step`, before the write is recorded."""
    if _KILL is None:
        return
    prefix, step, marker = _KILL
    if not backend.startswith(prefix) or max_step < step:
        return
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except OSError:
            return  # killed once already
    os.kill(os.getpid(), signal.SIGKILL)


def _seq(spec: str) -> int | None:
    try:
        return int(spec) if spec else None
    except ValueError:
        return None


#: The window after whose record `after_record` kills (None: none).
KILL_RECORDED_SEQ = _seq(os.environ.get(KILL_AFTER_RECORD, ""))


def after_record(seq: int) -> None:
    """Called right after window `seq` was recorded for verify, before the spool holds it."""
    if seq == KILL_RECORDED_SEQ:
        os.kill(os.getpid(), signal.SIGKILL)


def before_ready() -> None:
    """Called by the exporter process before it says ``ready``: waits for `SLOW_READY`'s file, if set."""
    while _READY_MARKER and not Path(_READY_MARKER).exists():
        time.sleep(0.05)


def before_start(backend: str) -> None:
    """Called on a backend's start thread before it builds: never returns for the backend `HOLD_START` names."""
    while _HELD_BACKEND and backend == _HELD_BACKEND:
        time.sleep(3600)
