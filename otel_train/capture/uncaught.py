"""Uncaught exceptions (the main thread's `sys.excepthook`, other threads' `threading.excepthook`) as log records.

`UncaughtHooks.install` puts a hook in front of each that captures the exception (type, message, traceback
as text, the step and span it escaped from) and then calls the hook that was there before, so the traceback
is still printed and other tools' hooks still run. `remove` puts the earlier hooks back where ours is still
the one installed; where someone installed a hook over ours since, ours stays in their chain and only
forwards.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from otel_train.capture.log_records import CapturedLog, active_span, captured_exception
from otel_train.capture.step import current_step
from otel_train.vocab import semconv

__all__ = ["LOGGER_NAME", "UncaughtHooks"]

#: The logger name (instrumentation scope) of uncaught-exception records.
LOGGER_NAME = semconv.LOG_UNCAUGHT
_FATAL = 21  # OTel severity FATAL: the main thread's exception ends the process
_ERROR = 17


def _record(exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None,
            thread: threading.Thread | None, severity: tuple[int, str]) -> CapturedLog:
    attributes = captured_exception(exc_type, exc, tb)
    name = thread.name if thread is not None else threading.current_thread().name
    attributes[semconv.THREAD_ID] = (thread.native_id if thread is not None else None) or threading.get_native_id()
    attributes[semconv.THREAD_NAME] = name
    attributes[semconv.EVENT_NAME] = "exception"
    trace_id, span_id = active_span()
    body = f"uncaught {attributes['exception.type']} in thread {name!r}: {attributes['exception.message']}"
    return CapturedLog(time.time_ns(), current_step(), severity[0], severity[1], body, LOGGER_NAME, attributes,
                       trace_id, span_id)


class UncaughtHooks:
    """Chains `sys.excepthook` and `threading.excepthook` to hand uncaught exceptions to `target`.

    Args:
        target: Takes each captured record; never raises into the hook (the earlier hook runs regardless).
    """

    def __init__(self, target: Callable[[CapturedLog], None]) -> None:
        self.target = target
        self.active = False
        self._previous_sys: Callable[..., Any] | None = None
        self._previous_threading: Callable[..., Any] | None = None

    def install(self) -> None:
        if self.active:
            return
        self.active = True
        self._previous_sys = sys.excepthook
        self._previous_threading = threading.excepthook
        sys.excepthook = self._sys_hook
        threading.excepthook = self._threading_hook

    def remove(self) -> None:
        """Stop capturing; the earlier hooks are back where ours is still the installed one (idempotent)."""
        if not self.active:
            return
        self.active = False
        if sys.excepthook == self._sys_hook and self._previous_sys is not None:
            sys.excepthook = self._previous_sys
        if threading.excepthook == self._threading_hook and self._previous_threading is not None:
            threading.excepthook = self._previous_threading

    def _hand(self, record: Callable[[], CapturedLog]) -> None:
        if not self.active:
            return
        try:
            self.target(record())
        except Exception:  # noqa: S110 - the earlier hook (printing the traceback) must run whatever happens here
            pass

    def _sys_hook(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            self._hand(lambda: _record(exc_type, exc, tb, None, (_FATAL, "FATAL")))
        previous = self._previous_sys if self._previous_sys is not None else sys.__excepthook__
        previous(exc_type, exc, tb)

    def _threading_hook(self, args: Any) -> None:
        if args.exc_type is not SystemExit:
            self._hand(lambda: _record(args.exc_type, args.exc_value, args.exc_traceback, args.thread,
                                       (_ERROR, "ERROR")))
        previous = self._previous_threading if self._previous_threading is not None else threading.__excepthook__
        previous(args)
