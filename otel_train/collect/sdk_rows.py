"""The OTel SDK's export objects as rows: `MetricsData` (`MetricsConverter`) and finished spans (`span_rows`).

Counters arrive as DELTA sums (bounded memory in the SDK); `MetricsConverter` keeps their running
totals, so every backend shows a counter as its cumulative value. Each row keeps its instrument's unit and
description; an exponential histogram keeps its buckets (and is drawn by every backend through the explicit
form of them, `otel_train.vocab.rows.explicit_buckets`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from otel_train.capture.step import STEP_ATTRIBUTE
from otel_train.vocab.rows import (
    ExponentialBuckets,
    HistogramRow,
    MetricRow,
    SpanRow,
    explicit_buckets,
    extra_attributes,
    series_tag,
)
from otel_train.vocab.run_identity import THREAD_ID, THREAD_NAME, RunInfo, as_int

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.trace import ReadableSpan

__all__ = ["MetricsConverter", "span_rows"]


class MetricsConverter:
    """Turns `MetricsData` into rows, keeping running totals of DELTA sums.

    One converter per stream of collections (the reader has one; the sink one per run), since the
    totals are state.
    """

    def __init__(self) -> None:
        self._totals: dict[tuple[str, int, str], float] = {}
        self._runs: dict[tuple[tuple[str, Any], ...], RunInfo] = {}

    def run_for(self, resource_attributes: Mapping[str, Any]) -> RunInfo:
        key = tuple(sorted(resource_attributes.items(), key=lambda kv: kv[0]))
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = RunInfo.from_resource(resource_attributes)
        return run

    def accumulate(self, run: RunInfo, tag: str, value: float, delta: bool) -> float:
        """Running total of a sum series (DELTA points add up; CUMULATIVE points replace)."""
        key = (run.run_id, run.rank, tag)
        total = self._totals.get(key, 0.0) + value if delta else value
        self._totals[key] = total
        return total

    def rows(
        self, data: MetricsData, default_step: int | None = None
    ) -> tuple[list[MetricRow], list[HistogramRow]]:
        """Rows of every point in `data`; points without `train.step` get `default_step` (or 0)."""
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            ExponentialHistogram,
            Gauge,
            Histogram,
            HistogramDataPoint,
            Sum,
        )

        metric_rows: list[MetricRow] = []
        hist_rows: list[HistogramRow] = []
        fallback = 0 if default_step is None else default_step
        for rm in data.resource_metrics:
            run = self.run_for(rm.resource.attributes)
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    d = metric.data
                    name, unit, description = metric.name, metric.unit or "", metric.description or ""
                    if isinstance(d, Gauge):
                        for p in d.data_points:
                            attrs = p.attributes or {}
                            metric_rows.append(
                                MetricRow(run, _step_of(attrs, fallback), name, series_tag(name, attrs),
                                          float(p.value), "gauge", p.time_unix_nano, extra_attributes(attrs),
                                          None, unit, description)
                            )
                    elif isinstance(d, Sum):
                        kind = "counter" if d.is_monotonic else "sum"
                        delta = d.aggregation_temporality == AggregationTemporality.DELTA
                        for p in sorted(d.data_points, key=lambda q: _step_of(q.attributes or {}, fallback)):
                            attrs = p.attributes or {}
                            # A counter's series ignores the step attribute: its total runs across steps.
                            tag = series_tag(name, attrs)
                            total = self.accumulate(run, tag, float(p.value), delta)
                            metric_rows.append(
                                MetricRow(run, _step_of(attrs, fallback), name, tag, total, kind,
                                          p.time_unix_nano, extra_attributes(attrs),
                                          float(p.value) if delta else None, unit, description)
                            )
                    elif isinstance(d, (Histogram, ExponentialHistogram)):
                        for hp in d.data_points:
                            attrs = hp.attributes or {}
                            if isinstance(hp, HistogramDataPoint):
                                exp = None
                                bounds, counts = tuple(hp.explicit_bounds), tuple(hp.bucket_counts)
                            else:
                                exp = ExponentialBuckets(
                                    hp.scale, hp.zero_count, hp.positive.offset, tuple(hp.positive.bucket_counts),
                                    hp.negative.offset, tuple(hp.negative.bucket_counts))
                                bounds, counts = explicit_buckets(exp)
                            step = _step_of(attrs, fallback)
                            extra = extra_attributes(attrs)
                            hist_rows.append(
                                HistogramRow(run, step, name, series_tag(name, attrs), hp.count, float(hp.sum),
                                             float(hp.min), float(hp.max), bounds, counts, hp.time_unix_nano,
                                             extra, unit, description, exp)
                            )
                            for stat, value in (("count", hp.count), ("sum", hp.sum), ("min", hp.min),
                                                ("max", hp.max)):
                                stat_name = f"{name}/{stat}"
                                metric_rows.append(
                                    MetricRow(run, step, stat_name, series_tag(stat_name, attrs), float(value),
                                              "histogram", hp.time_unix_nano, extra)
                                )
        return metric_rows, hist_rows


def _step_of(attributes: Mapping[str, Any], fallback: int) -> int:
    step = attributes.get(STEP_ATTRIBUTE)
    if step is None:
        return fallback
    try:
        return int(step)
    except (TypeError, ValueError):
        return fallback


def span_rows(spans: Iterable[ReadableSpan], runs: MetricsConverter | None = None) -> list[SpanRow]:
    """Rows of SDK spans; `thread.id`/`thread.name`/`train.step` come from their attributes."""
    from opentelemetry.trace import StatusCode

    converter = runs or MetricsConverter()
    out: list[SpanRow] = []
    for span in spans:
        ctx = span.context
        if ctx is None or span.start_time is None:
            continue
        attrs = dict(span.attributes or {})
        parent = span.parent.span_id if span.parent is not None else None
        step = attrs.get(STEP_ATTRIBUTE)
        resource = span.resource.attributes if span.resource is not None else {}
        out.append(
            SpanRow(
                run=converter.run_for(resource),
                name=span.name,
                trace_id=ctx.trace_id,
                span_id=ctx.span_id,
                parent_span_id=parent,
                start_unix_nano=span.start_time,
                end_unix_nano=span.end_time or span.start_time,
                thread_id=as_int(attrs.get(THREAD_ID)),
                thread_name=str(attrs.get(THREAD_NAME, "")),
                step=None if step is None else as_int(step),
                attributes=attrs,
                error=span.status.status_code == StatusCode.ERROR,
                status_message=span.status.description or "",
                events=tuple((e.name, e.timestamp, dict(e.attributes or {})) for e in span.events),
                kind=span.kind.value,
                links=tuple((link.context.trace_id, link.context.span_id, dict(link.attributes or {}))
                            for link in span.links),
            )
        )
    return out
