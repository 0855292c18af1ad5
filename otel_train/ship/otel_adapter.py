"""Plain OpenTelemetry exporter objects (a user's `MetricExporter` / `SpanExporter`) as row backends.

`init(exporters=[...])` and `StepAlignedMetricReader(exporters=[...])` accept the SDK's own exporters (OTLP,
console, in-memory, a vendor's). They are fed like every other backend, by `otel_train.ship.delivery`: the
adapter is a `RowExporter` that builds the SDK's export objects from each window's rows
(`otel_train.ship.rows_to_sdk`, the conversion the `otlp` backend uses too) and calls the exporter. So they get the same queue, merging, retry,
flush and shutdown as every backend, wherever it runs.

What they receive: `ot.log` values and gauges as Gauge points, counters and up-down counters as DELTA Sum
points with each collection's own increase, histograms as DELTA Histogram points, every point with
`train.step`; spans as `ReadableSpan`s with their ids, times, status, attributes, events, kind and links; the
run's Resource.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_train.backend import RowExporter
from otel_train.config.exporter_options import ExporterOptions
from otel_train.ship.rows_to_sdk import RowsToSDK
from otel_train.vocab.rows import HistogramRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

__all__ = ["OTelExporterAdapter", "as_row_exporter"]


class OTelExporterAdapter(RowExporter):
    """One SDK exporter behind the row contract.

    Args:
        exporter: A `MetricExporter`, a `SpanExporter`, or an object that is both.
        options: Step-order policy and the like (default: `ExporterOptions()`).
        resource: The Resource every request carries (the reader's: the `MeterProvider`'s own); default:
            the one of each row's run, as the `otlp` backend builds it.

    Raises:
        TypeError: `exporter` is neither a `MetricExporter` nor a `SpanExporter`.
    """

    #: A failed export is the exporter's whole request: trying its rows one at a time would only send
    #: one request per row to a collector that is down.
    isolate_rows = False

    def __init__(self, exporter: Any, options: ExporterOptions | None = None,
                 resource: Callable[[], Resource] | None = None) -> None:
        if not isinstance(exporter, (MetricExporter, SpanExporter)):
            raise TypeError(f"exporter {exporter!r} is neither an OTel `MetricExporter` nor a `SpanExporter`")
        self.exporter: Any = exporter
        self.name = str(getattr(exporter, "name", type(exporter).__name__))
        self.handles_metrics = isinstance(exporter, MetricExporter)
        self.handles_spans = isinstance(exporter, SpanExporter)
        super().__init__(options if options is not None else ExporterOptions())
        # The rows -> SDK objects conversion the `otlp` backend uses: one conversion for both.
        class _Rows(RowsToSDK):
            def resource(self, run: RunInfo) -> Resource:
                return resource() if resource is not None else super().resource(run)

        self._to_sdk = _Rows()

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        for data in self._to_sdk.metrics(rows, histograms):
            result = self.exporter.export(data)
            if result is not MetricExportResult.SUCCESS:
                raise RuntimeError(f"{type(self.exporter).__name__}.export returned {result}")

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        for spans in self._to_sdk.spans(rows):
            result = self.exporter.export(spans)
            if result is not SpanExportResult.SUCCESS:
                raise RuntimeError(f"{type(self.exporter).__name__}.export returned {result}")

    def flush(self) -> None:
        if self.exporter.force_flush() is False:
            raise RuntimeError(f"{type(self.exporter).__name__}.force_flush returned False")

    def close(self) -> None:
        if isinstance(self.exporter, MetricExporter):
            self.exporter.shutdown(timeout_millis=10_000)
        else:  # the SDK's SpanExporter.shutdown() takes no timeout
            self.exporter.shutdown()


def as_row_exporter(exporter: Any, resource: Callable[[], Resource] | None = None) -> RowExporter:
    """`exporter` itself when it is a `RowExporter`, else an `OTelExporterAdapter` around it."""
    return exporter if isinstance(exporter, RowExporter) else OTelExporterAdapter(exporter, resource=resource)
