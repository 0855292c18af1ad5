"""Python `logging` records as OTel log records, captured where they are emitted and appended, nothing more.

`LogRecordHandler` hooks `logging.Logger.callHandlers`: on the emitting thread it snapshots what the record will not
keep (the formatted message, the traceback as text, the step, the active span, the thread) into a
`CapturedLog` and hands it to a target (the training process's `LogBuffer`; a forked child's connection to
the exporter process). Everything else (rows, encoding, backends) happens off that thread, as for `ot.log`.

Which records: every record a logger hands to its handlers (any logger, propagating or not) at or above
`OTEL_TRAIN_LOG_LEVEL`; a logger's own level still applies (a record it does not emit is never seen). otel-train's own diagnostics (loggers ``otel_train`` and ``otel_train.*``) are left out, so a
failing backend cannot feed itself its own warnings; a record of ours that carries an ``event.name`` extra
(``train.hang``) is an event meant for the run and is kept.

Bounded: a token bucket (`RateLimit`) passes `rate_per_s` records a second on average (bursts of as many);
what it refuses is counted, never waited for. Events and uncaught exceptions bypass it.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from opentelemetry import trace as otel_trace

from otel_train.capture.step import current_step
from otel_train.vocab import semconv

__all__ = ["EVENT_NAME", "CapturedLog", "LogRecordHandler", "RateLimit", "active_span", "captured_exception",
           "severity_number"]

EVENT_NAME = semconv.EVENT_NAME
#: `logging.LogRecord` fields (and what `Formatter` adds): every other key in a record's ``__dict__`` is an extra.
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_OWN_LOGGER = "otel_train"
_PLAIN = (bool, int, float, str)


class CapturedLog:
    """What a log record holds once it left the emitting thread: plain values only.

    `step` is None outside any step; `trace_id` / `span_id` are 0 without an active span.
    """

    __slots__ = ("attributes", "body", "logger", "severity_number", "severity_text", "span_id", "step",
                 "time_unix_nano", "trace_id")

    def __init__(self, time_unix_nano: int, step: int | None, severity_number: int, severity_text: str,
                 body: str, logger: str, attributes: dict[str, Any], trace_id: int = 0, span_id: int = 0) -> None:
        self.time_unix_nano = time_unix_nano
        self.step = step
        self.severity_number = severity_number
        self.severity_text = severity_text
        self.body = body
        self.logger = logger
        self.attributes = attributes
        self.trace_id = trace_id
        self.span_id = span_id

    def fields(self) -> tuple[Any, ...]:
        """The fields in `otel_train.vocab.rows.LogRow` order (after its run)."""
        return (self.step, self.time_unix_nano, self.severity_number, self.severity_text, self.body, self.logger,
                self.attributes, self.trace_id, self.span_id)


def severity_number(levelno: int) -> int:
    """The OTel severity number of a `logging` level: DEBUG 5, INFO 9, WARNING 13, ERROR 17, CRITICAL 21; levels
    in between take the next numbers of their band (as the OTel SDK's `LoggingHandler` maps them).

    Example:
        >>> [severity_number(n) for n in (10, 20, 25, 30, 40, 50, 60)]
        [5, 9, 12, 13, 17, 21, 24]
    """
    if levelno <= 0:
        return 0
    if levelno < logging.DEBUG:
        return 1 + min(3, levelno * 4 // logging.DEBUG)
    band = min(4, (levelno - logging.DEBUG) // 10)
    return 5 + 4 * band + min(3, levelno - logging.DEBUG - 10 * band)


class RateLimit:
    """A token bucket: `allow` passes `rate_per_s` calls a second on average, bursts of as many; refused calls
    are counted in `dropped` and told to `on_drop` (a forked child's connection, which carries them to the
    trainer's summary). Thread-safe without a lock on the common path's arithmetic being exact (a lost token
    under a race is harmless)."""

    def __init__(self, rate_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = float(rate_per_s)
        self._clock = clock
        self._tokens = self.rate_per_s
        self._last = clock()
        self.dropped = 0
        self.on_drop: Callable[[], None] | None = None

    def restart(self) -> None:
        """A full bucket and nothing dropped: a forked child's own budget (the parent's drops are the parent's)."""
        self._tokens = self.rate_per_s
        self._last = self._clock()
        self.dropped = 0

    def allow(self) -> bool:
        now = self._clock()
        self._tokens = min(self.rate_per_s, self._tokens + (now - self._last) * self.rate_per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop()
        return False


def _plain(value: Any) -> Any:
    return value if isinstance(value, _PLAIN) else str(value)


def active_span() -> tuple[int, int]:
    ctx = otel_trace.get_current_span().get_span_context()
    return (ctx.trace_id, ctx.span_id) if ctx.is_valid else (0, 0)


def captured_exception(exc_type: type[BaseException], exc: BaseException | None, tb: Any) -> dict[str, Any]:
    """The semantic-convention attributes of an exception: ``exception.type``, ``.message``, ``.stacktrace``."""
    return {
        "exception.type": f"{exc_type.__module__}.{exc_type.__qualname__}"
        if exc_type.__module__ not in ("builtins", "__main__") else exc_type.__qualname__,
        "exception.message": str(exc) if exc is not None else "",
        "exception.stacktrace": "".join(traceback.format_exception(exc_type, exc, tb)),
    }


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # arguments that do not fit the format: what was given, never an error
        return f"{record.msg!r} % {record.args!r}"


def _capture(record: logging.LogRecord) -> CapturedLog:
    attributes: dict[str, Any] = {
        "code.file.path": record.pathname,
        "code.function.name": record.funcName,
        "code.line.number": record.lineno,
        semconv.THREAD_ID: threading.get_native_id(),
        semconv.THREAD_NAME: record.threadName or threading.current_thread().name,
    }
    if record.exc_info and record.exc_info[0] is not None:
        attributes.update(captured_exception(*record.exc_info))
    elif record.exc_text:
        attributes["exception.stacktrace"] = record.exc_text
    for key, value in vars(record).items():
        if key not in _RESERVED and not key.startswith("_"):
            attributes[key] = _plain(value)
    step = attributes.pop(semconv.TRAIN_STEP, None)  # `extra={"train.step": s}`: the record's own step wins
    if type(step) is not int or step < 0:
        step = current_step()
    trace_id, span_id = active_span()
    return CapturedLog(int(record.created * 1e9), step, severity_number(record.levelno),
                       record.levelname, _message(record), record.name, attributes, trace_id, span_id)


class LogRecordHandler:
    """Turns `logging` records into `CapturedLog`s handed to `target`; never raises, never blocks.

    Not a `logging.Handler` on the root logger: `install` hooks `logging.Logger.callHandlers`, the one call every
    record takes to its logger's handlers (the way Sentry's logging integration sees records). A handler on the
    root logger would make `logging.basicConfig()` called after `init()` a silent no-op and would stop Python
    printing warnings of a program with no handler (`logging.lastResort`), and would miss loggers that do not
    propagate (Transformers, Lightning); the hook changes none of that and sees each record once.

    Args:
        target: Takes each captured record (the session's: the `LogBuffer`, or a child's worker connection).
        level: The lowest level captured (`OTEL_TRAIN_LOG_LEVEL`).
        rate_per_s: Records a second passed on average (`OTEL_TRAIN_LOG_RATE`); events are never limited.
    """

    def __init__(self, target: Callable[[CapturedLog], None], level: int = logging.WARNING,
                 rate_per_s: float = 500.0) -> None:
        self.level = level
        self.target = target
        self.limit = RateLimit(rate_per_s)
        self.active = False
        self._local = threading.local()  # set while capturing on this thread: a record logged meanwhile is left out
        self._original: Any = None  # `logging.Logger.callHandlers` as it was
        self._hook: Any = None

    def install(self) -> None:
        """Hook `logging.Logger.callHandlers` (idempotent)."""
        if self.active:
            return
        self.active = True
        original = logging.Logger.callHandlers
        handle = self.handle

        local = self._local

        def callHandlers(logger: logging.Logger, record: logging.LogRecord) -> None:
            # While the logger's own handlers print a record that is captured already (or one of ours), the
            # stdout/stderr capture leaves their lines out (`printing`): one record, not two.
            local.printing = handle(record)
            try:
                original(logger, record)
            finally:
                local.printing = False

        self._original, self._hook = original, callHandlers
        logging.Logger.callHandlers = callHandlers  # type: ignore[method-assign,assignment]

    def remove(self) -> None:
        """Stop capturing (idempotent): the earlier `callHandlers` is back where the hook is still the one
        installed; where another hook was installed over it since, it stays in their chain and only forwards."""
        if not self.active:
            return
        self.active = False
        if logging.Logger.callHandlers is self._hook and self._original is not None:
            logging.Logger.callHandlers = self._original  # type: ignore[method-assign]

    def printing(self) -> bool:
        """Whether this thread is in the handlers of a record captured already, or of otel-train's own."""
        return bool(getattr(self._local, "printing", False))

    def handle(self, record: logging.LogRecord) -> bool:
        """Capture `record` if it is at or above the level and not otel-train's own (an event excepted).
        Returns whether the record is captured or otel-train's own (its printed lines are not captured)."""
        if not self.active:
            return False
        event = EVENT_NAME in vars(record)
        if not event and _is_own(record.name):
            return True
        if record.levelno < self.level:
            return False
        local = self._local
        if getattr(local, "busy", False):
            return False  # a record logged while capturing one
        local.busy = True
        try:
            if not event and not self.limit.allow():
                return True  # counted as dropped; printing it again as a line would undo the limit
            self.target(_capture(record))
            return True
        except Exception:  # a log record is never worth an error in the caller's code
            return False
        finally:
            local.busy = False


def _is_own(name: str) -> bool:
    return name == _OWN_LOGGER or name.startswith("otel_train.")
