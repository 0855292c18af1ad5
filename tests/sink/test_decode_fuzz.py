"""Property tests of OTLP decoding: whatever arrives, rows are right or the error is a `DecodeError`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_train.sink.decode.requests import (
    DecodeCache,
    DecodeError,
    decode_metrics,
    parse_metrics,
    parse_traces,
)
from otel_train.sink.decode.traces import decode_traces
from otel_train.sink.runs.temporality import SeriesLedger
from otel_train.testing import OtlpPoint, metrics_request
from otel_train.vocab.rows import series_tag

_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
#: A NUL in a run id is refused at the door (tests/sink/test_sink_hardening.py).
_run_ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1,
                   max_size=12)
_points = st.lists(st.tuples(st.integers(0, 10**9), st.floats(allow_nan=False, width=64),
                             st.one_of(st.none(), _names)), min_size=1, max_size=8)


def _request(run: str, rank: int, metrics: dict[str, list[tuple[int, float, str | None]]]) -> bytes:
    return metrics_request({"train.run.id": run, "train.rank": rank}, [
        OtlpPoint(name, value, step=step, attributes={} if split is None else {"split": split})
        for name, points in metrics.items() for step, value, split in points])


@settings(max_examples=60, deadline=None)
@given(run=_run_ids, rank=st.integers(0, 512), metrics=st.dictionaries(_names, _points, min_size=1, max_size=4))
def test_valid_requests_decode_to_exact_rows(run: str, rank: int,
                                             metrics: dict[str, list[tuple[int, float, str | None]]]) -> None:
    decoded = decode_metrics(parse_metrics(_request(run, rank, metrics)), DecodeCache())
    decoded.finish(SeriesLedger())
    expected = sorted((name, step, value, series_tag(name, {"split": split}) if split is not None else series_tag(name, None))
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
                decoded = decode(parse(blob), DecodeCache())
            except DecodeError:
                continue
            decoded.finish(SeriesLedger())  # anything that parses decodes into well-formed rows
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
            decode(parse(json.dumps(doc).encode(), "application/json"), DecodeCache())
        except DecodeError:
            pass


_values = st.one_of(st.floats(allow_nan=False, width=64), st.integers(-(2**63), 2**63 - 1))
_steps = st.one_of(st.none(), st.integers(0, 2**40), st.integers(-5, -1), st.sampled_from(["7", "x", 2.5]))
_point = st.tuples(_steps, _values, st.booleans(), st.integers(0, 2**64 - 1), st.one_of(st.none(), _names),
                   st.booleans())


@settings(max_examples=120, deadline=None)
@given(points=st.lists(_point, min_size=1, max_size=12), kind=st.sampled_from(["gauge", "sum"]),
       delta=st.booleans())
def test_points_read_from_their_encoding_match_protobufs_objects(
        points: list[tuple[object, float | int, bool, int, str | None, bool]], kind: str, delta: bool) -> None:
    """The sink reads gauge/sum points from their bytes (`otel_train.sink.decode.points`); whatever the
    layout (start time, int values, extra or odd attributes), rows equal those of the protobuf objects."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="train.run.id").value.string_value = "r"
    metric = rm.scope_metrics.add().metrics.add(name="m")
    data = metric.gauge if kind == "gauge" else metric.sum
    if kind == "sum":
        data.aggregation_temporality = 1 if delta else 2
        data.is_monotonic = True
    for step, value, with_start, t, split, step_last in points:
        p = data.data_points.add(time_unix_nano=t)
        if with_start:
            p.start_time_unix_nano = 1
        if isinstance(value, float):
            p.as_double = value
        else:
            p.as_int = value
        if split is not None and step_last:
            p.attributes.add(key="split").value.string_value = split
        if step is not None:
            v = p.attributes.add(key="train.step").value
            if isinstance(step, int):
                v.int_value = step
            elif isinstance(step, float):
                v.double_value = step
            else:
                v.string_value = step
        if split is not None and not step_last:
            p.attributes.add(key="split").value.string_value = split
    body = req.SerializeToString()

    def rows(request: object) -> list[tuple[object, ...]]:
        decoded = decode_metrics(request, DecodeCache())
        decoded.finish(SeriesLedger())
        # NaN (a running total of +inf and -inf) never equals itself: compare it as a marker.
        return [(r.step, r.tag, "nan" if r.value != r.value else r.value, r.kind, r.time_unix_nano,
                 dict(r.attributes)) for r in decoded.metrics]

    lean = parse_metrics(body)
    assert type(lean) is not ExportMetricsServiceRequest  # the fast path was taken
    assert rows(lean) == rows(ExportMetricsServiceRequest.FromString(body))


def test_points_in_unusual_field_order_or_with_repeated_fields_are_read_whole() -> None:
    """Encodings no usual encoder writes (attributes first; a value repeated after the attributes,
    where protobuf's last-one-wins applies) still decode exactly as protobuf reads them."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.metrics.v1.metrics_pb2 import NumberDataPoint

    from otel_train.sink.decode.otlp import lean_points_request

    def point(**fields: object) -> bytes:
        p = NumberDataPoint(**fields)  # type: ignore[arg-type]
        return p.SerializeToString()

    def step(n: int) -> bytes:
        p = NumberDataPoint()
        p.attributes.add(key="train.step").value.int_value = n
        return p.SerializeToString()

    encodings = [
        point(time_unix_nano=5, as_double=1.5) + step(3),  # the usual layout
        step(4) + point(time_unix_nano=6, as_double=2.5),  # attributes first
        point(time_unix_nano=7, as_double=3.5) + step(5) + point(as_double=9.0),  # value repeated: 9.0 wins
        point(time_unix_nano=8, as_double=4.5) + step(6) + step(7),  # step repeated: two attributes, last wins
    ]
    lean = lean_points_request()()
    rm = lean.resource_metrics.add()
    rm.resource.attributes.add(key="train.run.id").value.string_value = "r"
    rm.scope_metrics.add().metrics.add(name="m").gauge.data_points.extend(encodings)
    body = lean.SerializeToString()

    got = decode_metrics(parse_metrics(body), DecodeCache())
    want = decode_metrics(ExportMetricsServiceRequest.FromString(body), DecodeCache())
    got.finish(SeriesLedger())
    want.finish(SeriesLedger())
    assert [(r.step, r.value, r.time_unix_nano) for r in got.metrics] == [
        (r.step, r.value, r.time_unix_nano) for r in want.metrics]
    assert [(r.step, r.value) for r in got.metrics][:3] == [(3, 1.5), (4, 2.5), (5, 9.0)]
