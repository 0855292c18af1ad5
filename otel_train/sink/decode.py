"""OTLP requests (protobuf or JSON) -> rows of `otel_train.records`.

Decoding is pure: a request is turned into a `Decoded` batch without touching any state, so a
malformed request fails as a whole and nothing of it is written. Counter totals (DELTA sums ->
running totals) are applied afterwards, by the router, with `Decoded.finish`.

Gauge and sum points of protobuf requests are read from their encoding (`otel_train.sink.points`);
OTLP/JSON, other metric kinds and traces through protobuf's objects.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from otel_train.records import (
    RUN_ID,
    HistogramRow,
    MetricRow,
    MetricsConverter,
    RunInfo,
    SpanRow,
    series_tag,
)
from otel_train.sink.otlp import (
    NO_EXTRA,
    DecodeError,
    attributes,
    lean_metrics_request,
    number_point,
    parse_metrics,
    parse_traces,
    point_attributes,
)
from otel_train.sink.points import DOUBLE, TIME, TIME_DOUBLE, WHOLE, AttributeCache, split_point
from otel_train.step import RANK_ATTRIBUTE, STEP_ATTRIBUTE

__all__ = [
    "DecodeCache", "DecodeError", "Decoded", "decode_metrics", "decode_traces", "parse_metrics",
    "parse_traces",
]

_DELTA = 1  # AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA in the proto enum
_STATUS_ERROR = 2  # Status.STATUS_CODE_ERROR
_SERIES_EXCLUDED = frozenset({STEP_ATTRIBUTE, RANK_ATTRIBUTE})

#: Returns the step for a point without `train.step` (the sink uses the rank's latest step).
DefaultStep = Callable[[RunInfo], int]


class Decoded:
    """The rows of one request, with what the router needs to know of them (computed while decoding,
    so the router does not walk the rows again). Sum points stay pending until `finish` applies
    running totals.

    Attributes:
        runs: Every run (one rank of one training run) that sent data, with its highest step.
        tags: The series tags of each training run (`train.run.id`).
    """

    __slots__ = ("_sums", "histograms", "metrics", "runs", "spans", "tags", "unattributed")

    def __init__(self) -> None:
        self.metrics: list[MetricRow] = []
        self.histograms: list[HistogramRow] = []
        self.spans: list[SpanRow] = []
        # Sum rows holding their point's value, and whether it is a delta, until `finish`.
        self._sums: list[tuple[MetricRow, bool]] = []
        self.runs: dict[RunInfo, int] = {}  # highest step of metric points; -1 for none (spans only)
        self.tags: dict[str, set[str]] = {}
        #: Resources without `train.run.id` (their rows go to the run `unknown-run`).
        self.unattributed = 0

    @classmethod
    def of_rows(cls, metrics: Sequence[MetricRow] = (), spans: Sequence[SpanRow] = ()) -> Decoded:
        """A batch of rows built elsewhere (the compat API, aggregates)."""
        out = cls()
        out.metrics.extend(metrics)
        out.spans.extend(spans)
        for row in metrics:
            out.saw(row.run, row.step)
            out.tags_of(row.run).add(row.tag)
        for sp in spans:
            out.runs.setdefault(sp.run, -1)
        return out

    @property
    def points(self) -> int:
        return len(self.metrics) + len(self._sums) + len(self.histograms)

    def saw(self, run: RunInfo, step: int) -> None:
        if step > self.runs.get(run, -1):
            self.runs[run] = step

    def tags_of(self, run: RunInfo) -> set[str]:
        tags = self.tags.get(run.run_id)
        if tags is None:
            tags = self.tags[run.run_id] = set()
        return tags

    def finish(self, converter: MetricsConverter) -> None:
        """Turn pending sum points into rows with running totals (arrival order, step order inside)."""
        for row, delta in self._sums:  # rows not yet shared with anyone: set in place
            row.value = converter.accumulate(row.run, row.tag, row.value, delta)
            self.metrics.append(row)
        self._sums.clear()

    def split_by_run(self) -> dict[str, Decoded]:
        """One `Decoded` per `train.run.id` (a collector batches several runs into one request)."""
        ids = {run.run_id for run in self.runs}
        if len(ids) <= 1:
            return {next(iter(ids)): self} if ids else {}
        out: dict[str, Decoded] = {}

        def part(run_id: str) -> Decoded:
            d = out.get(run_id)
            if d is None:
                d = out[run_id] = Decoded()
            return d

        for run, step in self.runs.items():
            d = part(run.run_id)
            d.runs[run] = step
            d.tags[run.run_id] = self.tags.get(run.run_id, set())
        for m in self.metrics:
            part(m.run.run_id).metrics.append(m)
        for s in self._sums:
            part(s[0].run.run_id)._sums.append(s)
        for h in self.histograms:
            part(h.run.run_id).histograms.append(h)
        for sp in self.spans:
            part(sp.run.run_id).spans.append(sp)
        return out


def _as_int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class DecodeCache:
    """What decoding learns once and reuses: RunInfo by Resource attributes (every process of every
    run has its own Resource) and decoded point attributes by their encoding. Both bounded."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._runs: dict[tuple[tuple[str, Any], ...], RunInfo] = {}
        self._max = max_entries
        self.points = AttributeCache()

    def run_for(self, resource_attributes: Mapping[str, Any]) -> RunInfo:
        key = tuple(sorted(resource_attributes.items(), key=lambda kv: kv[0]))
        run = self._runs.get(key)
        if run is None:
            if len(self._runs) >= self._max:
                self._runs.clear()
            run = self._runs[key] = RunInfo.from_resource(resource_attributes)
        return run


def _zero(_: RunInfo) -> int:
    return 0


def _step(attrs: Mapping[str, Any], run: RunInfo, default_step: DefaultStep) -> int:
    raw = attrs.get(STEP_ATTRIBUTE)
    if raw is None:
        return default_step(run)
    try:
        return int(raw)
    except (TypeError, ValueError):
        return default_step(run)


def _extra(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if k not in _SERIES_EXCLUDED} if attrs else {}


def _one_point(p: Any, name: str, kind: str, run: RunInfo, default_step: DefaultStep) -> MetricRow:
    step, extra = point_attributes(p.attributes)
    if step is None:
        step = default_step(run)
    tag = series_tag(name, extra) if extra else name
    return MetricRow(run, step, name, tag, p.as_double or float(p.as_int), kind, p.time_unix_nano, extra)


def _numbers(points: Any, name: str, kind: str, run: RunInfo, default_step: DefaultStep,
             seen: Decoded) -> list[MetricRow]:
    """Rows of gauge or sum points given as protobuf objects (OTLP/JSON requests)."""
    out: list[MetricRow] = []
    append = out.append
    tags = seen.tags_of(run)
    hi = -1
    for p in points:
        kvs = p.attributes
        if len(kvs) == 1 and (kv := kvs[0]).key == STEP_ATTRIBUTE and (
                (step := kv.value.int_value) or kv.value.WhichOneof("value") == "int_value"):
            row = MetricRow(run, step, name, name, p.as_double or float(p.as_int), kind, p.time_unix_nano, NO_EXTRA)
        else:
            row = _one_point(p, name, kind, run, default_step)
            step = row.step
        tags.add(row.tag)
        if step > hi:  # noqa: PLR1730 - cheaper than a max() call per point
            hi = step
        append(row)
    if out:
        seen.saw(run, hi)
    return out


def _named_metrics(scope_metrics: Any) -> Iterator[tuple[str, str | None, Any]]:
    """(name, data kind, metric) of every metric of a Resource; an empty name fails the request."""
    for sm in scope_metrics:
        for metric in sm.metrics:
            name = metric.name
            if not name:
                raise DecodeError("a metric has an empty name")
            yield name, metric.WhichOneof("data"), metric


def _lean_resource(scope_metrics: Any, run: RunInfo, default_step: DefaultStep, out: Decoded,
                   cache: AttributeCache) -> None:
    """Rows of one Resource's metrics from a lean request: gauge and sum points are read from their
    encoding (see `otel_train.sink.points`). The sink's hot loop, kept flat: one call per Resource,
    not per metric (a request often holds one point per metric)."""
    entries = cache.entries
    unpack = TIME_DOUBLE.unpack_from
    tags = out.tags_of(run)
    hi = -1
    sums: list[MetricRow] | None
    entry: Any
    for name, kind, metric in _named_metrics(scope_metrics):
        if kind == "gauge":
            points, row_kind, sums = metric.gauge.data_points, "gauge", None
            append = out.metrics.append
        elif kind == "sum":
            s = metric.sum
            points, row_kind, sums = s.data_points, ("counter" if s.is_monotonic else "sum"), []
            append = sums.append
        else:
            if kind in ("histogram", "summary"):
                _histogram_or_summary(metric, kind, name, run, default_step, out)
            # Exponential histograms have no faithful scalar form in every backend; skipped as in-process.
            continue
        plain = False
        for raw in points:
            try:
                time_key, t, value_key, value = unpack(raw)
            except struct.error:  # shorter than the common front
                time_key = value_key = 0
            if time_key == TIME and value_key == DOUBLE:
                rem = raw[18:]
                entry = entries.get(rem)
                if entry is None:
                    entry = cache.decode(rem)
            else:
                parts = split_point(raw)
                if parts is None:
                    entry = WHOLE
                else:
                    t, value, rem = parts
                    entry = entries.get(rem) or cache.decode(rem)
            if entry is WHOLE:
                row = _one_point(number_point(raw), name, row_kind, run, default_step)
                tags.add(row.tag)
                hi = max(hi, row.step)
                append(row)
                continue
            step, extra = entry
            if step is None:
                step = default_step(run)
            if extra is NO_EXTRA:
                plain = True
                tag = name
            else:
                tag = series_tag(name, extra)
                tags.add(tag)
            if step > hi:  # noqa: PLR1730 - cheaper than a max() call per point
                hi = step
            append(MetricRow(run, step, name, tag, value, row_kind, t, extra))
        if plain:
            tags.add(name)
        if sums:
            _add_sums(out, sums, s.aggregation_temporality == _DELTA)
    if hi >= 0:
        out.saw(run, hi)


def _add_sums(out: Decoded, rows: list[MetricRow], delta: bool) -> None:
    rows.sort(key=lambda r: r.step)  # running totals follow the step order
    out._sums.extend((row, delta) for row in rows)


def _histogram_or_summary(metric: Any, kind: str, name: str, run: RunInfo, default_step: DefaultStep,
                          out: Decoded) -> None:
    if kind == "histogram":
        for p in metric.histogram.data_points:
            attrs = attributes(p.attributes)
            step = _step(attrs, run, default_step)
            extra = _extra(attrs)
            total = float(p.sum) if p.HasField("sum") else 0.0
            lo = float(p.min) if p.HasField("min") else float("nan")
            hi = float(p.max) if p.HasField("max") else float("nan")
            if len(p.bucket_counts) not in (0, len(p.explicit_bounds) + 1):
                raise DecodeError(f"histogram `{name}`: {len(p.bucket_counts)} bucket counts for "
                                  f"{len(p.explicit_bounds)} bounds")
            tag = series_tag(name, attrs)
            out.tags_of(run).add(tag)
            out.saw(run, step)
            out.histograms.append(HistogramRow(
                run, step, name, tag, int(p.count), total, lo, hi,
                tuple(p.explicit_bounds), tuple(p.bucket_counts), p.time_unix_nano, extra))
            for stat, value in (("count", float(p.count)), ("sum", total), ("min", lo), ("max", hi)):
                if stat in ("min", "max") and math.isnan(value):
                    continue  # absent min/max: no row rather than NaN
                stat_name = f"{name}/{stat}"
                tag = series_tag(stat_name, attrs)
                out.tags_of(run).add(tag)
                out.metrics.append(MetricRow(run, step, stat_name, tag, value, "histogram",
                                             p.time_unix_nano, extra))
    elif kind == "summary":
        for p in metric.summary.data_points:
            attrs = attributes(p.attributes)
            step = _step(attrs, run, default_step)
            out.saw(run, step)
            for stat, value in (("count", float(p.count)), ("sum", float(p.sum))):
                stat_name = f"{name}/{stat}"
                tag = series_tag(stat_name, attrs)
                out.tags_of(run).add(tag)
                out.metrics.append(MetricRow(run, step, stat_name, tag, value, "histogram",
                                             p.time_unix_nano, _extra(attrs)))


# -- requests -> rows ----------------------------------------------------------------------------
def _resource_run(attrs: dict[str, Any], has_data: bool, runs: DecodeCache, out: Decoded) -> RunInfo:
    """The run of one Resource of a request; counts Resources without `train.run.id`."""
    out.unattributed += RUN_ID not in attrs
    run = runs.run_for(attrs)
    if has_data:
        out.runs.setdefault(run, -1)
    return run


def decode_metrics(request: Any, runs: DecodeCache, default_step: DefaultStep = _zero) -> Decoded:
    """Rows of an `ExportMetricsServiceRequest` (the usual class or `parse_metrics`'s lean one)."""
    lean = lean_metrics_request()
    out = Decoded()
    if lean is not None and isinstance(request, lean):
        for rm in request.resource_metrics:
            run = _resource_run(attributes(rm.resource.attributes), bool(rm.scope_metrics), runs, out)
            _lean_resource(rm.scope_metrics, run, default_step, out, runs.points)
        return out
    for rm in request.resource_metrics:
        run = _resource_run(attributes(rm.resource.attributes), bool(rm.scope_metrics), runs, out)
        for name, kind, metric in _named_metrics(rm.scope_metrics):
            if kind == "gauge":
                out.metrics.extend(_numbers(metric.gauge.data_points, name, "gauge", run, default_step, out))
            elif kind == "sum":
                s = metric.sum
                _add_sums(out, _numbers(s.data_points, name, "counter" if s.is_monotonic else "sum", run,
                                        default_step, out), s.aggregation_temporality == _DELTA)
            elif kind in ("histogram", "summary"):
                _histogram_or_summary(metric, kind, name, run, default_step, out)
            # Exponential histograms have no faithful scalar form in every backend; skipped as in-process.
    return out


def _id(raw: bytes, size: int, what: str) -> int:
    if len(raw) != size:
        raise DecodeError(f"{what} has {len(raw)} bytes; expected {size}")
    return int.from_bytes(raw, "big")


def decode_traces(request: Any, runs: DecodeCache) -> Decoded:
    """Span rows of an `ExportTraceServiceRequest`."""
    out = Decoded()
    for rs in request.resource_spans:
        run = _resource_run(attributes(rs.resource.attributes), bool(rs.scope_spans), runs, out)
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = attributes(span.attributes)
                step = attrs.get(STEP_ATTRIBUTE)
                parent = _id(span.parent_span_id, 8, "parent_span_id") if span.parent_span_id else None
                out.spans.append(SpanRow(
                    run=run,
                    name=span.name,
                    trace_id=_id(span.trace_id, 16, "trace_id"),
                    span_id=_id(span.span_id, 8, "span_id"),
                    parent_span_id=parent,
                    start_unix_nano=span.start_time_unix_nano,
                    end_unix_nano=span.end_time_unix_nano or span.start_time_unix_nano,
                    thread_id=_as_int(attrs.get("thread.id")),
                    thread_name=str(attrs.get("thread.name", "")),
                    step=None if step is None else _as_int(step),
                    attributes=attrs,
                    error=span.status.code == _STATUS_ERROR,
                    status_message=span.status.message,
                ))
    return out
