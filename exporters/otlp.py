"""OTLP backend: sends metrics, spans and log records to an OpenTelemetry Collector (or to `otel-train sink`).

A `RowExporter` like every backend, so it runs in the exporter process and feeds from the spool: the
rows become the SDK's export objects (`otel_train.ship.rows_to_sdk`, which says what each row becomes
on the wire) and the SDK's standard OTLP exporters encode and send them. The protocol comes
from ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or the ``_METRICS_`` / ``_TRACES_`` / ``_LOGS_`` variants): ``grpc``
(default) or ``http/protobuf``; the SDK only reads that variable in its auto-configuration, so we pick
the class here. Endpoint, headers (e.g. ``authorization=Bearer <token>``), timeout, compression and
certificates are read by the SDK exporters from the other ``OTEL_EXPORTER_OTLP_*`` variables.

A collector that is down never loses data: each attempt is bounded by the timeout (default 2 s here,
not the SDK's 10 s), and a window the collector did not take is tried again (backoff up to 30 s) for
as long as it takes; meanwhile it is not acknowledged, so the spool keeps it and everything after it
(`otel-train replay` sends what a run that ended still held). A window counts as written once the
collector took it (`kill_safe_writes`): a killed exporter process does not send it again. Only
`shutdown` past its deadline gives up, counted in `dropped_windows`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_train.backend import RowExporter
from otel_train.config.exporter_options import ExporterOptions
from otel_train.errors import ConfigError
from otel_train.ship.rows_to_sdk import RowsToSDK
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow

__all__ = ["OTLPExporter"]

_logger = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_TIMEOUT_S = 2.0
_SDK_LOGGERS = "opentelemetry.exporter.otlp"


class _HeldSDKLog(logging.Filter):
    """Holds back the SDK exporters' log lines while `_send` runs on this thread.

    They log every failed attempt (one or two lines a second while a collector is down, for as long as
    it is down); the base class counts our failures and logs them once. The last held line is the reason
    our error gives.
    """

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self._local, "holding", False):
            return True
        self._local.last = record.getMessage()
        return False

    @contextmanager
    def holding(self) -> Iterator[None]:
        self._local.holding, self._local.last = True, ""
        try:
            yield
        finally:
            self._local.holding = False

    @property
    def last(self) -> str:
        return str(getattr(self._local, "last", ""))

    def attach(self) -> None:
        """Onto every SDK OTLP exporter logger that exists (their modules are imported by now)."""
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if name.startswith(_SDK_LOGGERS) and isinstance(logger, logging.Logger):
                logger.addFilter(self)  # a no-op when attached already


_SDK_LOG = _HeldSDKLog()


def _protocol(signal: str) -> tuple[str, str]:
    """(protocol, variable it came from) for ``METRICS``, ``TRACES`` or ``LOGS``."""
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


class OTLPExporter(RowExporter):
    """Sends rows as OTLP (gRPC or HTTP/protobuf) through the SDK's OTLP exporters.

    Args:
        options: Like every backend's (routing, step order); the Resource comes from each row's run.

    Raises:
        ConfigError: an unsupported ``OTEL_EXPORTER_OTLP_*PROTOCOL``.
        ModuleNotFoundError: the OTLP exporter package for the protocol is missing.

    Example:
        >>> exporter = OTLPExporter()
        >>> exporter.protocols
        {'metrics': 'grpc', 'traces': 'grpc', 'logs': 'grpc'}
        >>> exporter.shutdown()
    """

    name = "otlp"
    handles_metrics = True
    handles_spans = True
    handles_logs = True
    kill_safe_writes = True  # `export_window` returns True only once the collector took the window
    max_pending_windows = 100_000  # an outage's windows wait here (and in the spool), they are not dropped
    max_attempts = 0  # a collector that is down is retried for as long as it takes
    backoff_s = (1.0, 2.0, 5.0, 10.0, 30.0)

    def __init__(self, options: ExporterOptions | None = None) -> None:
        super().__init__(options)
        m_proto, _ = _protocol("METRICS")
        t_proto, _ = _protocol("TRACES")
        l_proto, _ = _protocol("LOGS")
        self.protocols = {"metrics": m_proto, "traces": t_proto, "logs": l_proto}
        self._metrics = self._build_metrics(m_proto)
        self._traces = self._build_traces(t_proto)
        self._logs = self._build_logs(l_proto)
        _SDK_LOG.attach()
        self._encode = RowsToSDK()
        # What of the window at the head of the retry queue already went out: a retry sends only the rest.
        self._progress: dict[str, tuple[object, int]] = {}
        self.sent = 0  # points and spans the collector took

    @property
    def pending(self) -> int:
        """Windows waiting for the collector to take them."""
        return len(self.window_writer.pending)

    @staticmethod
    def _missing(protocol: str, err: ImportError) -> ModuleNotFoundError:
        pkg = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "opentelemetry-exporter-otlp-proto-http"
        return ModuleNotFoundError(f"OTLPExporter needs {pkg} for `{protocol}`: pip install {pkg}", name=pkg)

    def _build_metrics(self, protocol: str) -> Any:
        timeout = _timeout_s("METRICS")
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

                return Grpc(timeout=timeout)
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

            return Http(timeout=timeout)
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

    def _build_logs(self, protocol: str) -> Any:
        timeout = _timeout_s("LOGS")
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogs

                return GrpcLogs(timeout=timeout)
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogs

            return HttpLogs(timeout=timeout)
        except ImportError as err:
            raise self._missing(protocol, err) from err

    # -- RowExporter -------------------------------------------------------------------------------
    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        self._send(rows, "metrics", self._metrics, list(self._encode.metrics(rows, histograms)))

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        self._send(rows, "traces", self._traces, list(self._encode.spans(rows)))

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        self._send(rows, "logs", self._logs, [batch for batch in self._encode.logs(rows) if batch])

    def _send(self, key: object, signal: str, inner: Any, requests: list[Any]) -> None:
        """Send `requests` in order, skipping those a failed earlier try of the same rows already sent.

        Raises:
            ConnectionError: the collector did not take one (the base class retries the window).
        """
        last = self._progress.get(signal)
        done = last[1] if last is not None and last[0] is key else 0
        for i in range(done, len(requests)):
            request = requests[i]
            with _SDK_LOG.holding():
                result = inner.export(request)
            if result not in (MetricExportResult.SUCCESS, SpanExportResult.SUCCESS, LogRecordExportResult.SUCCESS):
                self._progress[signal] = (key, i)  # keeps `key` alive, so `is` cannot match a new object
                reason = f": {_SDK_LOG.last}" if _SDK_LOG.last else ""
                raise ConnectionError(f"the collector did not take an OTLP {signal} request "
                                      f"({self.protocols[signal]}; endpoint from OTEL_EXPORTER_OTLP_*){reason}")
            self.sent += _items(request)
        self._progress[signal] = (key, len(requests))

    def close(self) -> None:
        for inner in (self._metrics, self._traces, self._logs):
            try:
                inner.shutdown()
            except Exception as err:
                _logger.debug("closing the OTLP exporter failed: %s", err)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """One last try of what is pending if it fits the budget, then close; the rest is counted dropped."""
        w = self.window_writer
        with w.lock:
            if w.pending and timeout_millis / 1000 >= (_timeout_s("METRICS") or 10.0):
                w.drain(force=True)  # the collector may be back; only if a whole attempt fits the budget
            if w.pending:
                self.dropped_windows += len(w.pending)
                _logger.warning("OTLP exporter closed with %d window(s) the collector did not take; unless they "
                                "came from memory only, the spool keeps them: `otel-train replay RUN_DIR` sends "
                                "them", len(w.pending))
                w.pending.clear()
        super().shutdown(timeout_millis, **kwargs)


def _items(request: Any) -> int:
    if isinstance(request, list):
        return len(request)
    return sum(len(m.data.data_points) for rm in request.resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics)
