"""Messages to another process over a `multiprocessing` connection: a sender any thread may call (`sender`), and
a `logging` handler that hands each record over it, else to stderr (`ForwardLogs`)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["ForwardLogs", "relog", "sender"]


def sender(conn: Connection) -> Callable[..., bool]:
    """``send(*msg)``: one message on `conn` from any thread, one at a time; False once the other end is gone."""
    lock = threading.Lock()

    def send(*msg: Any) -> bool:
        with lock:
            try:
                conn.send(msg)
                return True
            except (OSError, ValueError):
                return False

    return send


class ForwardLogs(logging.Handler):
    """Sends ``("log", level, logger name, text)`` with `send`; where `send` returns False (the receiver is
    gone), writes the record to this process's stderr, stamped with the process's `role` and pid."""

    def __init__(self, send: Callable[..., bool], role: str) -> None:
        super().__init__()
        self._send = send
        self._role = role

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            if not self._send("log", record.levelno, record.name, text):
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                sys.stderr.write(f"{stamp} otel-train {self._role} (pid {os.getpid()}): {record.levelname} {text}\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


def relog(msg: tuple[Any, ...]) -> None:
    """Log a ``("log", level, logger name, text)`` message received from another process here."""
    _, level, name, text = msg
    logging.getLogger(str(name)).log(int(level), "%s", text)
