"""Rows to the OTel SDK's export objects (`MetricsData`, `ReadableSpan`): our one conversion on the way out.

Whatever consumes the SDK's export objects is fed from rows through this module: the `otlp` backend (the SDK's
own OTLP exporters then encode and send them) and `otel_train.ship.otel_adapter` (a user's plain
`MetricExporter` / `SpanExporter`). It belongs to the core, so both import it from here and no core module
imports a plugin.

Backends run where only rows exist (the exporter process, `otel-train sink`), so the path out is rows ->
SDK objects -> the SDK's exporter, with no representation in between. What each row becomes:

* gauge rows (``ot.log`` values, gauges) -> Gauge points;
* counter / up-down sum rows from DELTA points -> Sum points, DELTA, with the collection's own value
  (`MetricRow.delta`), as the SDK pipeline of the training process sent them; a sum row without it
  (from a CUMULATIVE source) -> a Gauge of its running total;
* histograms -> Histogram points, DELTA (their ``name/count`` ... scalar rows are not sent again); one
  that came as an exponential histogram (`HistogramRow.exponential`) -> an ExponentialHistogram point with
  its own scale and buckets;
* spans -> `ReadableSpan`s with their ids, parent, times, status, attributes, events, kind and links;
* log records -> the SDK's log records (`otel_train._internal.sdk.readable_log_record`): time, severity,
  body, attributes with ``train.step`` (when it has one), the active span's ids; the scope is the logger name.

Each metric keeps the unit and description its rows carry. Names: a key that breaks OTel's instrument-name
rule goes under `otel_train.vocab.names.otlp_name` with the key in the metric's description (in place of the
instrument's own), which `otel-train sink` reads back. Every point carries ``train.step``; every request carries the run's Resource, built as the training
process builds it (`Resource.create` of the run's attributes, so ``OTEL_RESOURCE_ATTRIBUTES`` too).
Requests hold at most `MAX_POINTS` points or spans.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Buckets,
    ExponentialHistogram,
    ExponentialHistogramDataPoint,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from otel_train._internal import sdk
from otel_train.vocab.names import KEY_DESCRIPTION_PREFIX, otlp_name
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.semconv import THREAD_ID, THREAD_NAME
from otel_train.vocab.semconv import TRAIN_STEP as STEP_ATTRIBUTE

__all__ = ["MAX_POINTS", "RowsToSDK"]

#: Points (or spans) per request: well under collectors' default 4 MiB message limit.
MAX_POINTS = 4096
_SCOPE = InstrumentationScope("otel_train")


class RowsToSDK:
    """Builds `MetricsData` and span batches from rows; caches one Resource per run."""

    def __init__(self) -> None:
        self._resources: dict[RunInfo, Resource] = {}

    def resource(self, run: RunInfo) -> Resource:
        res = self._resources.get(run)
        if res is None:
            res = self._resources[run] = Resource.create(run.resource_attributes())
        return res

    def metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> Iterator[MetricsData]:
        """The rows as requests of at most `MAX_POINTS` points."""
        sendable = [r for r in rows if r.kind != "histogram"]  # a histogram's stats go as the histogram
        for start in range(0, len(sendable), MAX_POINTS):
            yield self._metrics_data(sendable[start:start + MAX_POINTS], ())
        for start in range(0, len(histograms), MAX_POINTS):
            yield self._metrics_data((), histograms[start:start + MAX_POINTS])

    def spans(self, rows: Sequence[SpanRow]) -> Iterator[list[ReadableSpan]]:
        """The span rows as batches of at most `MAX_POINTS` `ReadableSpan`s."""
        for start in range(0, len(rows), MAX_POINTS):
            yield [self._span(r) for r in rows[start:start + MAX_POINTS]]

    def logs(self, rows: Sequence[LogRow]) -> Iterator[list[Any]]:
        """The log rows as batches of at most `MAX_POINTS` SDK log records (none where the SDK lacks them)."""
        for start in range(0, len(rows), MAX_POINTS):
            batch = [self._log(r) for r in rows[start:start + MAX_POINTS]]
            yield [b for b in batch if b is not None]

    def _log(self, r: LogRow) -> Any:
        attributes = dict(r.attributes)
        if r.step is not None:
            attributes[STEP_ATTRIBUTE] = r.step
        return sdk.readable_log_record(self.resource(r.run), r.logger, timestamp=r.time_unix_nano,
                                       severity_number=r.severity_number, severity_text=r.severity_text,
                                       body=r.body, attributes=attributes, trace_id=r.trace_id, span_id=r.span_id)

    # -- building ----------------------------------------------------------------------------------
    def _metrics_data(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> MetricsData:
        # (run, metric name, shape) -> (unit, description, points); a dict keeps first-seen order
        groups: dict[tuple[RunInfo, str, str], tuple[str, str, list[Any]]] = {}
        for r in rows:
            attrs = _with_step(r.attributes, r.step)
            if r.kind in ("counter", "sum") and r.delta is not None:
                shape, value = r.kind, r.delta
            else:
                shape, value = "gauge", r.value
            key = (r.run, r.name, shape)
            group = groups.get(key) or groups.setdefault(key, (r.unit, r.description, []))
            group[2].append(NumberDataPoint(attrs, r.time_unix_nano, r.time_unix_nano, value))
        for h in histograms:
            attrs = _with_step(h.attributes, h.step)
            e = h.exponential
            point: HistogramDataPoint | ExponentialHistogramDataPoint
            if e is None:
                shape = "histogram"
                point = HistogramDataPoint(attrs, h.time_unix_nano, h.time_unix_nano, h.count, h.sum,
                                           list(h.bucket_counts), list(h.explicit_bounds), h.min, h.max)
            else:
                shape = "exponential"
                point = ExponentialHistogramDataPoint(
                    attrs, h.time_unix_nano, h.time_unix_nano, h.count, h.sum, e.scale, e.zero_count,
                    Buckets(e.positive_offset, list(e.positive_counts)),
                    Buckets(e.negative_offset, list(e.negative_counts)), 0, h.min, h.max)
            key = (h.run, h.name, shape)
            group = groups.get(key) or groups.setdefault(key, (h.unit, h.description, []))
            group[2].append(point)
        by_run: dict[RunInfo, list[Metric]] = {}
        for (run, name, shape), (unit, own_description, points) in groups.items():
            data: Gauge | Sum | Histogram | ExponentialHistogram
            if shape == "gauge":
                data = Gauge(points)
            elif shape == "histogram":
                data = Histogram(points, AggregationTemporality.DELTA)
            elif shape == "exponential":
                data = ExponentialHistogram(points, AggregationTemporality.DELTA)
            else:
                data = Sum(points, AggregationTemporality.DELTA, is_monotonic=shape == "counter")
            wire = otlp_name(name)
            description = own_description or None if wire == name else KEY_DESCRIPTION_PREFIX + name
            by_run.setdefault(run, []).append(Metric(wire, description, unit or None, data))
        return MetricsData([ResourceMetrics(self.resource(run), [ScopeMetrics(_SCOPE, metrics, "")], "")
                            for run, metrics in by_run.items()])

    def _span(self, r: SpanRow) -> ReadableSpan:
        attrs = dict(r.attributes)
        if r.step is not None:
            attrs.setdefault(STEP_ATTRIBUTE, r.step)
        if r.thread_id:
            attrs.setdefault(THREAD_ID, r.thread_id)
        if r.thread_name:
            attrs.setdefault(THREAD_NAME, r.thread_name)
        flags = TraceFlags(TraceFlags.SAMPLED)
        parent = (None if r.parent_span_id is None
                  else SpanContext(r.trace_id, r.parent_span_id, is_remote=False, trace_flags=flags))
        status = Status(StatusCode.ERROR, r.status_message or None) if r.error else Status(StatusCode.UNSET)
        events = [Event(name, dict(attributes), timestamp=time) for name, time, attributes in r.events]
        links = [Link(SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags), dict(attributes))
                 for trace_id, span_id, attributes in r.links]
        return ReadableSpan(r.name, SpanContext(r.trace_id, r.span_id, is_remote=False, trace_flags=flags), parent,
                            self.resource(r.run), attrs, events, links, SpanKind(r.kind), status=status,
                            start_time=r.start_unix_nano, end_time=r.end_unix_nano, instrumentation_scope=_SCOPE)


def _with_step(attributes: Any, step: int) -> dict[str, Any]:
    attrs = dict(attributes) if attributes else {}
    attrs[STEP_ATTRIBUTE] = step
    return attrs
