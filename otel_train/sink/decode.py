"""OTLP requests (protobuf or JSON) -> rows of `otel_train.records`.

Decoding is pure: a request is turned into a `Decoded` batch without touching any state, so a
malformed request fails as a whole and nothing of it is written. Counter totals (DELTA sums ->
running totals) are applied afterwards, by the router, with `Decoded.finish`.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Mapping
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
from otel_train.step import RANK_ATTRIBUTE, STEP_ATTRIBUTE

__all__ = ["DecodeError", "Decoded", "RunCache", "decode_metrics", "decode_traces", "parse_metrics", "parse_traces"]

_DELTA = 1  # AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA in the proto enum
_STATUS_ERROR = 2  # Status.STATUS_CODE_ERROR
_SERIES_EXCLUDED = frozenset({STEP_ATTRIBUTE, RANK_ATTRIBUTE})

#: Returns the step for a point without `train.step` (the sink uses the rank's latest step).
DefaultStep = Callable[[RunInfo], int]


class DecodeError(ValueError):
    """The request is not a valid OTLP payload; the message says why (sent back to the client)."""


class Decoded:
    """The rows of one request. Sum points stay pending until `finish` applies running totals."""

    __slots__ = ("_ids", "_sums", "histograms", "metrics", "spans", "unattributed")

    def __init__(self) -> None:
        self.metrics: list[MetricRow] = []
        self.histograms: list[HistogramRow] = []
        self.spans: list[SpanRow] = []
        # (run, step, name, tag, value, kind, time, extra attrs, delta)
        self._sums: list[tuple[RunInfo, int, str, str, float, str, int, dict[str, Any], bool]] = []
        #: Resources without `train.run.id` (their rows go to the run `unknown-run`).
        self.unattributed = 0
        self._ids: set[str] = set()  # run ids of the decoded Resources (saves a pass over the rows)

    @property
    def points(self) -> int:
        return len(self.metrics) + len(self._sums) + len(self.histograms)

    def finish(self, converter: MetricsConverter) -> None:
        """Turn pending sum points into rows with running totals (arrival order, step order inside)."""
        for run, step, name, tag, value, kind, t, extra, delta in self._sums:
            total = converter.accumulate(run, tag, value, delta)
            self.metrics.append(MetricRow(run, step, name, tag, total, kind, t, extra))
        self._sums.clear()

    def run_ids(self) -> set[str]:
        if self._ids:
            return self._ids
        ids = {r.run.run_id for r in self.metrics}
        ids.update(r[0].run_id for r in self._sums)
        ids.update(r.run.run_id for r in self.histograms)
        ids.update(r.run.run_id for r in self.spans)
        return ids

    def split_by_run(self) -> dict[str, Decoded]:
        """One `Decoded` per `train.run.id` (a collector batches several runs into one request)."""
        ids = self.run_ids()
        if len(ids) <= 1:
            return {next(iter(ids)): self} if ids else {}
        out: dict[str, Decoded] = {}

        def part(run_id: str) -> Decoded:
            d = out.get(run_id)
            if d is None:
                d = out[run_id] = Decoded()
            return d

        for m in self.metrics:
            part(m.run.run_id).metrics.append(m)
        for s in self._sums:
            part(s[0].run_id)._sums.append(s)
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


# -- AnyValue / KeyValue ------------------------------------------------------------------------
def _any(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return tuple(_any(v) for v in value.array_value.values)
    if kind == "kvlist_value":
        return json.dumps({kv.key: _any(kv.value) for kv in value.kvlist_value.values}, default=str)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _any(kv.value) for kv in kvs}


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


def _value(point: Any) -> float:
    return float(point.as_double) if point.WhichOneof("value") == "as_double" else float(point.as_int)


# -- parsing -------------------------------------------------------------------------------------
def _decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    enc = (encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc == "gzip":
        import zlib

        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out = d.decompress(body, limit + 1)
        except zlib.error as err:
            raise DecodeError(f"invalid gzip body: {err}") from None
        if len(out) > limit:
            raise OverflowError(f"decompressed body exceeds {limit} bytes")
        return out
    raise DecodeError(f"unsupported content-encoding {encoding!r}; use gzip or none")


def _hex_ids_to_base64(obj: Any, keys: tuple[str, ...]) -> None:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping expects base64."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in keys and isinstance(v, str) and v:
                try:
                    obj[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise DecodeError(f"`{k}` {v[:40]!r} is not a hex id") from None
            else:
                _hex_ids_to_base64(v, keys)
    elif isinstance(obj, list):
        for v in obj:
            _hex_ids_to_base64(v, keys)


_ID_KEYS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def _parse(message: Any, body: bytes, content_type: str | None) -> Any:
    ctype = (content_type or "application/x-protobuf").split(";")[0].strip().lower()
    if ctype == "application/json":
        from google.protobuf import json_format

        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise DecodeError(f"invalid JSON: {err}") from None
        if not isinstance(data, dict):
            raise DecodeError("invalid OTLP/JSON: expected an object")
        _hex_ids_to_base64(data, _ID_KEYS)
        try:
            json_format.ParseDict(data, message, ignore_unknown_fields=True)
        except (json_format.ParseError, ValueError, TypeError) as err:
            raise DecodeError(f"invalid OTLP/JSON: {str(err)[:200]}") from None
        return message
    if ctype in ("application/x-protobuf", "application/protobuf", "application/octet-stream"):
        from google.protobuf.message import DecodeError as PbDecodeError

        try:
            message.ParseFromString(body)
        except (PbDecodeError, ValueError, RuntimeError) as err:
            raise DecodeError(f"invalid OTLP protobuf: {str(err)[:200] or type(err).__name__}") from None
        return message
    raise DecodeError(f"unsupported content-type {content_type!r}; use application/x-protobuf or application/json")


def parse_metrics(body: bytes, content_type: str | None = None, encoding: str | None = None,
                  limit: int = 1 << 62) -> Any:
    """Parse an `ExportMetricsServiceRequest` from a (possibly gzipped) protobuf or JSON body."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    return _parse(ExportMetricsServiceRequest(), _decompress(body, encoding, limit), content_type)


def parse_traces(body: bytes, content_type: str | None = None, encoding: str | None = None,
                 limit: int = 1 << 62) -> Any:
    """Parse an `ExportTraceServiceRequest` from a (possibly gzipped) protobuf or JSON body."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return _parse(ExportTraceServiceRequest(), _decompress(body, encoding, limit), content_type)


class RunCache:
    """RunInfo by Resource attributes, bounded (every process of every run has its own Resource)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._runs: dict[tuple[tuple[str, Any], ...], RunInfo] = {}
        self._max = max_entries

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


def _point(kvs: Any, name: str, run: RunInfo, default_step: DefaultStep) -> tuple[int, str, dict[str, Any]]:
    """(step, series tag, extra attributes) of one data point: the hot loop of the sink, kept flat."""
    if len(kvs) == 1:  # the common case: only `train.step`, as the step-aligned reader sends it
        kv = kvs[0]
        if kv.key == STEP_ATTRIBUTE:
            v = kv.value
            if v.WhichOneof("value") == "int_value":
                return v.int_value, name, {}
    step: int | None = None
    extra: dict[str, Any] = {}
    for kv in kvs:
        key = kv.key
        if key == STEP_ATTRIBUTE:
            v = kv.value
            if v.WhichOneof("value") == "int_value":
                step = v.int_value
            else:
                try:
                    step = int(_any(v))
                except (TypeError, ValueError):
                    step = None
        elif key != RANK_ATTRIBUTE:
            extra[key] = _any(kv.value)
    if step is None:
        step = default_step(run)
    return step, (series_tag(name, extra) if extra else name), extra


# -- requests -> rows ----------------------------------------------------------------------------
def _resource_run(resource: Any, has_data: bool, runs: RunCache, out: Decoded) -> RunInfo:
    """The run of one Resource of a request; counts Resources without `train.run.id`."""
    attrs = _attrs(resource.attributes)
    out.unattributed += RUN_ID not in attrs
    run = runs.run_for(attrs)
    if has_data:
        out._ids.add(run.run_id)
    return run


def decode_metrics(request: Any, runs: RunCache, default_step: DefaultStep = _zero) -> Decoded:
    """Rows of an `ExportMetricsServiceRequest`. `runs` only caches RunInfo by Resource."""
    out = Decoded()
    for rm in request.resource_metrics:
        run = _resource_run(rm.resource, bool(rm.scope_metrics), runs, out)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                name = metric.name
                if not name:
                    raise DecodeError("a metric has an empty name")
                kind = metric.WhichOneof("data")
                if kind == "gauge":
                    append = out.metrics.append
                    for p in metric.gauge.data_points:
                        step, tag, extra = _point(p.attributes, name, run, default_step)
                        append(MetricRow(run, step, name, tag, p.as_double or float(p.as_int), "gauge",
                                         p.time_unix_nano, extra))
                elif kind == "sum":
                    s = metric.sum
                    sum_kind = "counter" if s.is_monotonic else "sum"
                    delta = s.aggregation_temporality == _DELTA
                    pts = []
                    for p in s.data_points:
                        step, tag, extra = _point(p.attributes, name, run, default_step)
                        pts.append((step, tag, extra, p))
                    pts.sort(key=lambda x: x[0])  # running totals follow the step order
                    for step, tag, extra, p in pts:
                        out._sums.append((run, step, name, tag, p.as_double or float(p.as_int), sum_kind,
                                          p.time_unix_nano, extra, delta))
                elif kind == "histogram":
                    for p in metric.histogram.data_points:
                        attrs = _attrs(p.attributes)
                        step = _step(attrs, run, default_step)
                        extra = _extra(attrs)
                        total = float(p.sum) if p.HasField("sum") else 0.0
                        lo = float(p.min) if p.HasField("min") else float("nan")
                        hi = float(p.max) if p.HasField("max") else float("nan")
                        if len(p.bucket_counts) not in (0, len(p.explicit_bounds) + 1):
                            raise DecodeError(f"histogram `{name}`: {len(p.bucket_counts)} bucket counts for "
                                              f"{len(p.explicit_bounds)} bounds")
                        out.histograms.append(HistogramRow(
                            run, step, name, series_tag(name, attrs), int(p.count), total, lo, hi,
                            tuple(p.explicit_bounds), tuple(p.bucket_counts), p.time_unix_nano, extra))
                        for stat, value in (("count", float(p.count)), ("sum", total), ("min", lo), ("max", hi)):
                            if stat in ("min", "max") and math.isnan(value):
                                continue  # absent min/max: no row rather than NaN
                            stat_name = f"{name}/{stat}"
                            out.metrics.append(MetricRow(run, step, stat_name, series_tag(stat_name, attrs),
                                                         value, "histogram", p.time_unix_nano, extra))
                elif kind == "summary":
                    for p in metric.summary.data_points:
                        attrs = _attrs(p.attributes)
                        step = _step(attrs, run, default_step)
                        for stat, value in (("count", float(p.count)), ("sum", float(p.sum))):
                            stat_name = f"{name}/{stat}"
                            out.metrics.append(MetricRow(run, step, stat_name, series_tag(stat_name, attrs),
                                                         value, "histogram", p.time_unix_nano, _extra(attrs)))
                # Exponential histograms have no faithful scalar form in every backend; skipped as in-process.
    return out


def _id(raw: bytes, size: int, what: str) -> int:
    if len(raw) != size:
        raise DecodeError(f"{what} has {len(raw)} bytes; expected {size}")
    return int.from_bytes(raw, "big")


def decode_traces(request: Any, runs: RunCache) -> Decoded:
    """Span rows of an `ExportTraceServiceRequest`."""
    out = Decoded()
    for rs in request.resource_spans:
        run = _resource_run(rs.resource, bool(rs.scope_spans), runs, out)
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = _attrs(span.attributes)
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
