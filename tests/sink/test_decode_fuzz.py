"""Property tests of OTLP decoding: whatever arrives, rows are right or the error is a `DecodeError`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_train.records import MetricsConverter
from otel_train.sink.decode import (
    DecodeError,
    RunCache,
    decode_metrics,
    decode_traces,
    parse_metrics,
    parse_traces,
)

_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_points = st.lists(st.tuples(st.integers(0, 10**9), st.floats(allow_nan=False, width=64),
                             st.one_of(st.none(), _names)), min_size=1, max_size=8)


def _request(run: str, rank: int, metrics: dict[str, list[tuple[int, float, str | None]]]) -> bytes:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    for key, value in (("train.run.id", run), ("train.rank", rank)):
        kv = rm.resource.attributes.add(key=key)
        if isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    sm = rm.scope_metrics.add()
    for name, points in metrics.items():
        m = sm.metrics.add(name=name)
        for step, value, split in points:
            p = m.gauge.data_points.add(as_double=value, time_unix_nano=1)
            p.attributes.add(key="train.step").value.int_value = step
            if split is not None:
                p.attributes.add(key="split").value.string_value = split
    return req.SerializeToString()


@settings(max_examples=60, deadline=None)
@given(run=_names, rank=st.integers(0, 512), metrics=st.dictionaries(_names, _points, min_size=1, max_size=4))
def test_valid_requests_decode_to_exact_rows(run: str, rank: int,
                                             metrics: dict[str, list[tuple[int, float, str | None]]]) -> None:
    decoded = decode_metrics(parse_metrics(_request(run, rank, metrics)), RunCache())
    decoded.finish(MetricsConverter())
    expected = sorted((name, step, value, f"{name}{{split={split}}}" if split is not None else name)
                      for name, pts in metrics.items() for step, value, split in pts)
    got = sorted((r.name, r.step, r.value, r.tag) for r in decoded.metrics)
    assert got == expected
    assert {(r.run.run_id, r.run.rank) for r in decoded.metrics} == {(run, rank)}


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=300), cut=st.integers(0, 400), data=st.data())
def test_arbitrary_or_damaged_bytes_never_escape_as_other_errors(body: bytes, cut: int, data: st.DataObject) -> None:
    valid = _request("r", 0, {"loss": [(1, 0.5, "val")]})
    candidates = [body, valid[:cut], valid[:cut] + body]
    for blob in candidates:
        for parse, decode in ((parse_metrics, decode_metrics), (parse_traces, decode_traces)):
            try:
                decoded = decode(parse(blob), RunCache())
            except DecodeError:
                continue
            decoded.finish(MetricsConverter())  # anything that parses decodes into well-formed rows
            for row in decoded.metrics:
                assert isinstance(row.value, float) and isinstance(row.step, int)


@settings(max_examples=60, deadline=None)
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
                            ["resourceMetrics", "scopeMetrics", "metrics", "gauge", "dataPoints", "name",
                             "asDouble", "attributes", "key", "value", "resourceSpans", "spanId"]), c, max_size=3),
                        max_leaves=20))
def test_arbitrary_json_is_rows_or_decode_error(doc: object) -> None:
    import json

    for parse, decode in ((parse_metrics, decode_metrics), (parse_traces, decode_traces)):
        try:
            decode(parse(json.dumps(doc).encode(), "application/json"), RunCache())
        except DecodeError:
            pass
