"""`OTEL_TRAIN_CAPTURE_OUTPUT`: each line the process writes to stdout / stderr as a log record.

`sys.stdout` and `sys.stderr` are replaced by tees that write through to the original stream first (the
terminal sees the text as before) and hand each complete line to the target: stdout lines at severity
INFO, stderr lines at WARN, with the logger name ``stdout`` / ``stderr``. Only writes through `sys.stdout`
/ `sys.stderr` are seen (not a subprocess's, not C code writing to the file descriptor). What `logging`
handlers print for a record that is captured as a log record already (or for otel-train's own diagnostics)
is left out: one record, not two. A partial line waits for its end, at most `_MAX_LINE` characters; the rest is flushed at `remove`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from otel_train.capture.log_records import CapturedLog, RateLimit, active_span
from otel_train.capture.step import current_step
from otel_train.vocab import semconv

__all__ = ["OutputLines"]

_MAX_LINE = 65536


class _LineTee:
    """A text stream that writes through to `stream` and hands each complete line to `hand`."""

    def __init__(self, stream: TextIO, name: str, severity: tuple[int, str], hand: Callable[[CapturedLog], None],
                 limit: RateLimit, skip: Callable[[], bool]) -> None:
        self.stream = stream
        self._skip = skip
        self._name = name
        self._severity = severity
        self._hand = hand
        self._limit = limit
        self._partial = ""
        self._lock = threading.Lock()
        self.active = True

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        if self.active and text and not self._skip():
            try:
                self._lines(text)
            except Exception:  # noqa: S110 - printing never fails because of telemetry
                pass
        return n

    def _lines(self, text: str) -> None:
        with self._lock:
            text = self._partial + text
            *lines, self._partial = text.split("\n")
            if len(self._partial) > _MAX_LINE:
                lines.append(self._partial)
                self._partial = ""
        for line in lines:
            self.emit(line)

    def emit(self, line: str) -> None:
        if not line.strip() or not self._limit.allow():
            return
        thread = threading.current_thread()
        trace_id, span_id = active_span()
        attributes: dict[str, Any] = {semconv.THREAD_ID: threading.get_native_id(),
                                      semconv.THREAD_NAME: thread.name}
        self._hand(CapturedLog(time.time_ns(), current_step(), self._severity[0], self._severity[1],
                               line.rstrip("\r"), self._name, attributes, trace_id, span_id))

    def flush_partial(self) -> None:
        with self._lock:
            rest, self._partial = self._partial, ""
        if rest:
            self.emit(rest)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer ...: the original stream's
        return getattr(self.stream, name)


class OutputLines:
    """Installs the stdout / stderr tees; `remove` restores the streams where the tees are still installed."""

    def __init__(self, hand: Callable[[CapturedLog], None], limit: RateLimit, skip: Callable[[], bool]) -> None:
        self._hand = hand
        self._limit = limit
        self._skip = skip
        self._tees: list[tuple[str, _LineTee]] = []

    def install(self) -> None:
        for attr, severity in (("stdout", (9, "INFO")), ("stderr", (13, "WARN"))):
            tee = _LineTee(getattr(sys, attr), attr, severity, self._hand, self._limit, self._skip)
            setattr(sys, attr, tee)
            self._tees.append((attr, tee))

    def remove(self) -> None:
        for attr, tee in self._tees:
            tee.flush_partial()
            tee.active = False  # a tee someone else still holds writes through, capturing nothing
            if getattr(sys, attr) is tee:
                setattr(sys, attr, tee.stream)
        self._tees = []
