"""Raw OTel logs (`opentelemetry._logs`): records emitted through the global `LoggerProvider` join the run.

`init()` sets `SESSION_LOGGER_PROVIDER` as the global logger provider where nobody has set one (as it does for
meters and tracers, `otel_train._internal.global_providers`), and points it at the session's capture; a record
emitted through it (`get_logger(...).emit(...)`, or the SDK's `LoggingHandler` on the global provider) becomes a
log record of the run at the step it was emitted in (its own ``train.step`` attribute wins), with the active
span, rate-limited like `logging` records. Between sessions it drops records. A provider the user set stays
theirs: otel-train never replaces a global.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import _logs
from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.util.types import AnyValue, Attributes

from otel_train.capture.log_records import CapturedLog, active_span
from otel_train.capture.step import current_step
from otel_train.vocab import semconv

__all__ = ["SESSION_LOGGER_PROVIDER", "SessionLoggerProvider", "install_global"]


def _step(attributes: Mapping[str, Any]) -> int | None:
    raw = attributes.get(semconv.TRAIN_STEP)
    if type(raw) is int and raw >= 0:
        return raw
    return current_step()


def _text(body: Any) -> str:
    return "" if body is None else body if isinstance(body, str) else str(body)


class _SessionLogger(_logs.Logger):
    def __init__(self, name: str, provider: SessionLoggerProvider) -> None:
        super().__init__(name)
        self._scope = name
        self._provider = provider

    def enabled(self, *, context: Context | None = None, severity_number: _logs.SeverityNumber | None = None,
                event_name: str | None = None) -> bool:
        return self._provider.target is not None

    def emit(self, record: _logs.LogRecord | None = None, *, timestamp: int | None = None,
             observed_timestamp: int | None = None, context: Context | None = None,
             severity_number: _logs.SeverityNumber | None = None, severity_text: str | None = None,
             body: AnyValue | None = None, attributes: Attributes = None, event_name: str | None = None,
             exception: BaseException | None = None) -> None:
        target = self._provider.target
        if target is None:
            return
        try:
            if record is not None:
                timestamp, severity_number, severity_text = record.timestamp, record.severity_number, record.severity_text
                body, attributes, event_name = record.body, record.attributes, record.event_name
                ids = (record.trace_id or 0, record.span_id or 0)
            else:
                span = otel_trace.get_current_span(context).get_span_context() if context is not None else None
                ids = (span.trace_id, span.span_id) if span is not None and span.is_valid else active_span()
            attrs = {str(k): v for k, v in (attributes or {}).items() if k != semconv.TRAIN_STEP}
            if event_name:
                attrs.setdefault(semconv.EVENT_NAME, event_name)
            number = int(severity_number.value) if severity_number is not None else 0
            captured = CapturedLog(timestamp or observed_timestamp or time.time_ns(), _step(attributes or {}), number,
                                   severity_text or "", _text(body), self._scope, attrs, *ids)
            target(captured, bool(event_name))
        except Exception:  # noqa: S110 - a raw OTel log call never raises into the training loop
            pass


class SessionLoggerProvider(_logs.LoggerProvider):
    """The global logger provider otel-train sets: hands records to the session's capture (`target`)."""

    def __init__(self) -> None:
        #: Takes (record, is an event); None between sessions (records are dropped).
        self.target: Callable[[CapturedLog, bool], None] | None = None

    def get_logger(self, name: str, version: str | None = None, schema_url: str | None = None,
                   attributes: Attributes = None) -> _logs.Logger:
        return _SessionLogger(name, self)


SESSION_LOGGER_PROVIDER = SessionLoggerProvider()


def install_global() -> bool:
    """Set `SESSION_LOGGER_PROVIDER` as the global logger provider unless one is set. Returns whether it is
    the global now."""
    current = _logs.get_logger_provider()
    if current is SESSION_LOGGER_PROVIDER:
        return True
    if type(current).__name__.startswith(("_Proxy", "Proxy", "NoOp")):
        _logs.set_logger_provider(SESSION_LOGGER_PROVIDER)
        return True
    return False
