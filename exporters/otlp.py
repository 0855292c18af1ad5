"""OTLP backend: sends metrics and spans to an OpenTelemetry Collector (or straight to `otel-train sink`).

Not a `RowExporter`: the data leaves as OTLP, unconverted, so it wraps the SDK's standard OTLP
metric and span exporters. The protocol comes from ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or the
``_METRICS_`` / ``_TRACES_`` variants): ``grpc`` (default) or ``http/protobuf``; the SDK only reads
that variable in its auto-configuration, so we pick the class here. Endpoint, headers (e.g.
``authorization=Bearer <token>``), timeout, compression and certificates are read by the SDK
exporters from the other ``OTEL_EXPORTER_OTLP_*`` variables.

A collector that is down must not stall the export thread for long, nor lose data silently:
each attempt is bounded by the timeout (default 2 s here, not the SDK's 10 s), a failed batch is
kept and retried (oldest first) after a backoff, at most `max_pending` batches per signal are
kept, and what is given up is counted in `dropped`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_train._internal.ratelimit import LogOnce
from otel_train.errors import ConfigError
from otel_train.exporters.base import DELTA_TEMPORALITY
from otel_train.records import ExporterOptions

__all__ = ["OTLPExporter"]

_logger = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_TIMEOUT_S = 2.0
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)

def _protocol(signal: str) -> tuple[str, str]:
    """(protocol, variable it came from) for ``METRICS`` or ``TRACES``."""
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = os.environ.get(var)
        if raw is not None and raw.strip():
            value = raw.strip().lower()
            if value not in PROTOCOLS:
                raise ConfigError(f"{var}: {raw!r} is not supported; use one of {', '.join(PROTOCOLS)}")
            return value, var
    return "grpc", ""


def _timeout_s(signal: str) -> float | None:
    """Our bounded default, unless a timeout variable is set (then the SDK exporter reads it)."""
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        if os.environ.get(var, "").strip():
            return None
    return DEFAULT_TIMEOUT_S


def _count_points(data: MetricsData) -> int:
    n = 0
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                n += len(m.data.data_points)
    return n


class _Channel:
    """One signal's inner exporter plus its retry queue. Export calls are serialised per signal."""

    def __init__(self, signal: str, inner: Any, max_pending: int) -> None:
        self.signal = signal
        self.inner = inner
        self.pending: deque[tuple[Any, int]] = deque()
        self.max_pending = max_pending
        self.lock = threading.Lock()
        self.attempts = 0
        self.retry_at = 0.0


class OTLPExporter(MetricExporter, SpanExporter):
    """Both an OTel `MetricExporter` and `SpanExporter` that sends OTLP (gRPC or HTTP/protobuf).

    Args:
        options: Unused by OTLP (the Resource carries the run); accepted like every exporter's.
        max_pending: Failed batches kept per signal for retry before the oldest is dropped.

    Raises:
        ConfigError: an unsupported ``OTEL_EXPORTER_OTLP_*PROTOCOL``.
        ModuleNotFoundError: the OTLP exporter package for the protocol is missing.

    Example:
        >>> exporter = OTLPExporter()
        >>> exporter.protocols
        {'metrics': 'grpc', 'traces': 'grpc'}
        >>> exporter.shutdown()
    """

    name = "otlp"
    handles_metrics = True
    handles_spans = True

    def __init__(self, options: ExporterOptions | None = None, *, max_pending: int = 64) -> None:
        MetricExporter.__init__(self, preferred_temporality=dict(DELTA_TEMPORALITY))
        self.options = options
        m_proto, _ = _protocol("METRICS")
        t_proto, _ = _protocol("TRACES")
        self.protocols = {"metrics": m_proto, "traces": t_proto}
        self._metrics = _Channel("metrics", self._build_metrics(m_proto), max_pending)
        self._traces = _Channel("traces", self._build_traces(t_proto), max_pending)
        self._closed = False
        self._log = LogOnce(_logger, interval_s=60.0)
        self.failures = 0
        self.dropped = 0
        self.sent = 0

    @staticmethod
    def _missing(protocol: str, err: ImportError) -> ModuleNotFoundError:
        pkg = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "opentelemetry-exporter-otlp-proto-http"
        return ModuleNotFoundError(f"OTLPExporter needs {pkg} for `{protocol}`: pip install {pkg}", name=pkg)

    def _build_metrics(self, protocol: str) -> Any:
        timeout = _timeout_s("METRICS")
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

                return Grpc(timeout=timeout, preferred_temporality=dict(DELTA_TEMPORALITY))
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

            return Http(timeout=timeout, preferred_temporality=dict(DELTA_TEMPORALITY))
        except ImportError as err:
            raise self._missing(protocol, err) from err

    def _build_traces(self, protocol: str) -> Any:
        timeout = _timeout_s("TRACES")
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcSpans,
                )

                return GrpcSpans(timeout=timeout)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

            return HttpSpans(timeout=timeout)
        except ImportError as err:
            raise self._missing(protocol, err) from err

    # -- export ------------------------------------------------------------------------------------
    def export(self, data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:  # type: ignore[override]
        """`MetricsData` -> the metric exporter; a sequence of spans -> the span exporter. Never raises."""
        if isinstance(data, MetricsData):
            ok = self._send(self._metrics, data, _count_points(data))
            return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE
        spans: Sequence[Any] = list(data)
        ok = self._send(self._traces, spans, len(spans)) if spans else True
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def _send(self, ch: _Channel, data: Any, items: int) -> bool:
        with ch.lock:
            if self._closed:
                self.dropped += items
                return False
            if items:
                ch.pending.append((data, items))
                while len(ch.pending) > ch.max_pending:
                    _, lost = ch.pending.popleft()
                    self.dropped += lost
            return self._drain(ch, force=False)

    def _drain(self, ch: _Channel, force: bool) -> bool:
        """Send pending batches oldest first; stop at the first failure. Caller holds `ch.lock`."""
        if ch.attempts and not force and time.monotonic() < ch.retry_at:
            return False  # collector recently down: don't block the export thread again yet
        while ch.pending:
            data, items = ch.pending[0]
            try:
                result = ch.inner.export(data)
                ok = result in (MetricExportResult.SUCCESS, SpanExportResult.SUCCESS)
            except Exception as err:  # the SDK exporters should not raise; isolate anyway
                ok = False
                self._log.error(f"raise-{ch.signal}", "OTLP %s export raised %s: %s", ch.signal,
                                type(err).__name__, err)
            if not ok:
                self.failures += 1
                ch.attempts += 1
                delay = _BACKOFF_S[min(ch.attempts, len(_BACKOFF_S)) - 1]
                ch.retry_at = time.monotonic() + delay
                self._log.warning(
                    f"fail-{ch.signal}",
                    "OTLP %s export failed; %d batch(es) kept for retry in %.0f s, %d failure(s) and %d "
                    "item(s) dropped so far (logged at most once a minute)",
                    ch.signal, len(ch.pending), delay, self.failures, self.dropped,
                )
                return False
            ch.pending.popleft()
            ch.attempts = 0
            self.sent += items
        return True

    @property
    def pending(self) -> int:
        """Batches waiting for retry (both signals)."""
        return len(self._metrics.pending) + len(self._traces.pending)

    # -- lifecycle -----------------------------------------------------------------------------------
    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Send pending batches now, unless the collector failed at the last attempt (then the next
        export retries after the backoff): flushing must not block on a collector that is down."""
        ok = True
        for ch in (self._metrics, self._traces):
            if not ch.lock.acquire(timeout=max(0.0, timeout_millis / 1000)):
                ok = False
                continue
            try:
                if not self._closed and ch.pending:
                    # The collector failed at the last attempt: don't block the caller on it again.
                    ok = (not ch.attempts and self._drain(ch, force=False)) and ok
            finally:
                ch.lock.release()
        return ok

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """Try once more to send what is pending, then close. Bounded and idempotent.

        The last try is made only if a whole attempt (the exporter timeout) fits in `timeout_millis`;
        what is still not sent is counted in `dropped`.
        """
        deadline = time.monotonic() + timeout_millis / 1000
        for ch in (self._metrics, self._traces):
            if not ch.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                _logger.warning("OTLP %s exporter busy at shutdown; closing without its pending data", ch.signal)
                self._close_inner(ch, deadline)
                continue
            try:
                if self._closed and not ch.pending:
                    continue
                if ch.pending and deadline - time.monotonic() >= self._attempt_s(ch):
                    # one last try (the collector may be back), only if a whole attempt fits the budget
                    self._drain(ch, force=True)
                for _, items in ch.pending:
                    self.dropped += items
                if ch.pending:
                    _logger.warning("OTLP %s exporter closed with %d batch(es) it could not send",
                                    ch.signal, len(ch.pending))
                ch.pending.clear()
                self._close_inner(ch, deadline)
            finally:
                ch.lock.release()
        self._closed = True

    @staticmethod
    def _attempt_s(ch: _Channel) -> float:
        """The longest one attempt of the SDK exporter can block (its timeout, in seconds)."""
        timeout = getattr(ch.inner, "_timeout", None)
        return float(timeout) if isinstance(timeout, (int, float)) else DEFAULT_TIMEOUT_S

    @staticmethod
    def _close_inner(ch: _Channel, deadline: float) -> None:
        try:
            ch.inner.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1000)
        except Exception as err:
            _logger.debug("closing the OTLP %s exporter failed: %s", ch.signal, err)

    def __enter__(self) -> OTLPExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
