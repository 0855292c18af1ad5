"""OTLP/JSON as the OTLP spec encodes it, checked with the spec's example payloads (opentelemetry-proto
`examples/metrics.json` and `examples/trace.json`, written out here in their shape): hex trace and span
ids, int64 fields as strings, enums as names or numbers, unknown fields ignored."""

from __future__ import annotations

import json
from typing import Any

from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics, parse_traces
from otel_train.sink.decode.traces import decode_traces
from otel_train.sink.runs.temporality import SeriesLedger


def _attr(key: str, value: str) -> dict[str, Any]:
    return {"key": key, "value": {"stringValue": value}}


_RESOURCE = {"attributes": [_attr("service.name", "my.service")]}
_SCOPE = {"name": "my.library", "version": "1.0.0", "attributes": [_attr("my.scope.attribute", "some scope attribute")]}
_T0, _T1 = "1544712660300000000", "1544712661300000000"

METRICS = {"resourceMetrics": [{"resource": _RESOURCE, "scopeMetrics": [{"scope": _SCOPE, "metrics": [
    {"name": "my.counter", "unit": "1", "description": "I am a Counter", "sum": {
        "aggregationTemporality": 1, "isMonotonic": True, "dataPoints": [
            {"asDouble": 5, "startTimeUnixNano": _T0, "timeUnixNano": _T0,
             "attributes": [_attr("my.counter.attr", "some value")]}]}},
    {"name": "my.gauge", "unit": "1", "description": "I am a Gauge", "gauge": {"dataPoints": [
        {"asDouble": 10, "timeUnixNano": _T0, "attributes": [_attr("my.gauge.attr", "some value")]}]}},
    {"name": "my.histogram", "unit": "1", "description": "I am a Histogram", "histogram": {
        "aggregationTemporality": 1, "dataPoints": [
            {"startTimeUnixNano": _T0, "timeUnixNano": _T0, "count": "2", "sum": 2, "bucketCounts": ["1", "1"],
             "explicitBounds": [1], "min": 0, "max": 2, "attributes": [_attr("my.histogram.attr", "some value")]}]}},
    {"name": "my.exponential.histogram", "unit": "1", "description": "I am an Exponential Histogram",
     "exponentialHistogram": {"aggregationTemporality": 1, "dataPoints": [
         {"startTimeUnixNano": _T0, "timeUnixNano": _T0, "count": "3", "sum": 10, "scale": 0, "zeroCount": "1",
          "positive": {"offset": 1, "bucketCounts": ["0", "2"]}, "min": 0, "max": 5, "zeroThreshold": 0,
          "attributes": [_attr("my.exponential.histogram.attr", "some value")]}]}},
]}]}]}

TRACES = {"resourceSpans": [{"resource": _RESOURCE, "scopeSpans": [{"scope": _SCOPE, "spans": [
    {"traceId": "5B8EFFF798038103D269B633813FC60C", "spanId": "EEE19B7EC3C1B174",
     "parentSpanId": "EEE19B7EC3C1B173", "name": "I'm a server span", "startTimeUnixNano": "1544712660000000000",
     "endTimeUnixNano": "1544712661000000000", "kind": 2, "attributes": [_attr("my.span.attr", "some value")]},
]}]}]}


def _metrics(doc: dict[str, Any]) -> tuple[dict[tuple[str, int], float], list[Any]]:
    decoded = decode_metrics(parse_metrics(json.dumps(doc).encode(), "application/json"), DecodeCache())
    decoded.finish(SeriesLedger())
    return {(r.name, r.step): r.value for r in decoded.metrics}, decoded.histograms


def test_spec_metrics_example() -> None:
    values, histograms = _metrics(METRICS)
    assert values == {
        ("my.counter", 0): 5.0, ("my.gauge", 0): 10.0,
        ("my.histogram/count", 0): 2.0, ("my.histogram/sum", 0): 2.0, ("my.histogram/min", 0): 0.0,
        ("my.histogram/max", 0): 2.0,
        ("my.exponential.histogram/count", 0): 3.0, ("my.exponential.histogram/sum", 0): 10.0,
        ("my.exponential.histogram/min", 0): 0.0, ("my.exponential.histogram/max", 0): 5.0,
    }
    hist, exp = histograms
    assert (hist.explicit_bounds, hist.bucket_counts) == ((1.0,), (1, 1))
    assert (exp.explicit_bounds, exp.bucket_counts) == ((0.0, 4.0, 8.0), (1, 0, 2, 0))
    assert exp.tag == "my.exponential.histogram{my.exponential.histogram.attr=some value}"


def test_spec_trace_example() -> None:
    (span,) = decode_traces(parse_traces(json.dumps(TRACES).encode(), "application/json"), DecodeCache()).spans
    assert span.trace_id == 0x5B8EFFF798038103D269B633813FC60C
    assert (span.span_id, span.parent_span_id) == (0xEEE19B7EC3C1B174, 0xEEE19B7EC3C1B173)
    assert (span.start_unix_nano, span.end_unix_nano) == (1544712660000000000, 1544712661000000000)
    assert span.name == "I'm a server span" and span.attributes == {"my.span.attr": "some value"}
    assert span.run.run_id.startswith("my.service")  # no `train.run.id`: the service name's fallback


def test_enum_names_unknown_fields_and_numbers_as_strings() -> None:
    doc = json.loads(json.dumps(METRICS))
    metrics = doc["resourceMetrics"][0]["scopeMetrics"][0]["metrics"]
    metrics[0]["sum"]["aggregationTemporality"] = "AGGREGATION_TEMPORALITY_CUMULATIVE"
    metrics[0]["sum"]["dataPoints"][0]["asInt"] = "9007199254740993"  # int64 beyond a double, as a string
    del metrics[0]["sum"]["dataPoints"][0]["asDouble"]
    metrics[0]["futureField"] = {"anything": [1, 2]}  # fields of a newer OTLP: ignored
    doc["resourceMetrics"][0]["futureResourceField"] = "x"
    values, _ = _metrics(doc)
    assert values[("my.counter", 0)] == float(9007199254740993)
    traces = json.loads(json.dumps(TRACES))
    traces["resourceSpans"][0]["scopeSpans"][0]["spans"][0].update(kind="SPAN_KIND_SERVER", droppedLinksCount=3,
                                                                  status={"code": "STATUS_CODE_ERROR"})
    (span,) = decode_traces(parse_traces(json.dumps(traces).encode(), "application/json"), DecodeCache()).spans
    assert span.error
