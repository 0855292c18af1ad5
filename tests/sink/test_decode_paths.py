"""The sink reads protobuf metric requests along several paths: each metric walked from its encoding
(`otel_train.sink.decode.metric_walk`), metrics parsed by protobuf with points kept encoded
(`lean_points_request`), and the usual protobuf classes. Whatever arrives, every path gives the same
rows, in the same order, with the same counts, or fails the request with `DecodeError`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from google.protobuf.message import DecodeError as PbDecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric, NumberDataPoint

from otel_train.sink.decode.otlp import lean_metrics_request, lean_points_request
from otel_train.sink.decode.requests import DecodeCache, Decoded, DecodeError, decode_metrics, parse_metrics
from otel_train.sink.runs.temporality import SeriesLedger
from otel_train.testing import OtlpPoint, metrics_request, set_any_value
from otel_train.vocab.names import KEY_DESCRIPTION_PREFIX
from otel_train.vocab.rows import MetricRow

# -- what a decode gives, comparable across paths ----------------------------------------------------


def _plain(value: Any) -> Any:
    """`value` with NaN as a marker (NaN never equals itself), dataclasses and dicts as tuples."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, *(_plain(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if isinstance(value, dict):
        return ("dict", *sorted((k, repr(_plain(v))) for k, v in value.items()))
    if isinstance(value, tuple | list):
        return tuple(_plain(v) for v in value)
    return value


def _outcome(decoded: Decoded) -> tuple[Any, ...]:
    """Everything a decode hands the router: pending rows in order, runs, tags, counts; then the rows of
    each run once its rules are applied."""
    pending = _plain((decoded._gauges, decoded._numbers, decoded._hists, decoded.metrics, decoded.histograms))
    counts = (sorted((repr(run), step) for run, step in decoded.runs.items()),
              # (an empty set of tags, which one path makes for a Resource without points, adds no series)
              sorted((run_id, sorted(tags)) for run_id, tags in decoded.tags.items() if tags),
              sorted(decoded.unattributed.items()), sorted(decoded.unsupported.items()),
              sorted(decoded.refused.items()), decoded.points)
    finished = []
    for run_id, part in sorted(decoded.split_by_run().items()):
        part.finish(SeriesLedger())
        finished.append((run_id, _plain((part.metrics, part.histograms))))
    return pending, counts, finished


def _decode(request_class: Any, body: bytes) -> Any:
    """The outcome of decoding `body` parsed as `request_class`, or ``"DecodeError"``. Decoded twice with
    one cache: the second time every header and point comes from the caches."""
    try:
        try:
            request = request_class.FromString(body)
        except (PbDecodeError, ValueError, RuntimeError) as err:
            raise DecodeError(str(err)) from None
        cache = DecodeCache()
        first = _outcome(decode_metrics(request, cache))
        assert _outcome(decode_metrics(request, cache)) == first
        return first
    except DecodeError:
        return "DecodeError"


def _every_path(body: bytes) -> list[Any]:
    """The outcome along each path: metrics walked, points kept encoded, protobuf's classes, and
    `parse_metrics`' own choice."""
    outcomes = [_decode(lean_metrics_request(), body), _decode(lean_points_request(), body),
                _decode(ExportMetricsServiceRequest, body)]
    try:
        outcomes.append(_outcome(decode_metrics(parse_metrics(body), DecodeCache())))
    except DecodeError:
        outcomes.append("DecodeError")
    return outcomes


def _walked_rows(body: bytes, cache: DecodeCache | None = None) -> list[MetricRow]:
    """The rows of a one-run request, metrics walked."""
    decoded = decode_metrics(lean_metrics_request().FromString(body), cache or DecodeCache())
    decoded.finish(SeriesLedger())
    return decoded.metrics


def _assert_same_everywhere(body: bytes) -> Any:
    walked, points, usual, chosen = _every_path(body)
    assert walked == usual
    assert points == usual
    assert chosen == usual
    return usual


# -- random requests built with the real protobuf classes --------------------------------------------

_utf8 = st.characters(codec="utf-8")
_short_text = st.text(_utf8, max_size=6)
_text = st.one_of(_short_text, st.text(_utf8, min_size=40, max_size=90),  # 90 chars: up to 360 bytes
                  st.sampled_from(["loss", "train/loss", "é" * 70, "x" * 127, "y" * 128, "z" * 300]))
# An empty name fails the request: rarely, so that most requests are read.
_names = st.integers(0, 19).flatmap(lambda n: st.just("") if n == 0 else _text.filter(bool))
_descriptions = st.one_of(st.just(""), _text, _text.map(lambda key: KEY_DESCRIPTION_PREFIX + key))
_steps = st.one_of(st.integers(0, 2**40), st.integers(-3, -1), st.sampled_from([1e19, 7.0, 2.5, "11", "x", True]))
_attribute_values = st.one_of(_short_text, st.integers(-(2**63), 2**63 - 1), st.floats(), st.booleans())
_attributes = st.tuples(st.one_of(st.none(), _steps),  # train.step
                        st.lists(st.tuples(st.sampled_from(["split", "layer", "train.rank", "k" * 140]),
                                           _attribute_values), max_size=5),
                        st.booleans())  # step before or after the others
_number_point = st.tuples(_attributes, st.one_of(st.floats(), st.floats(), st.none(), st.integers(-(2**63), 2**63 - 1)),
                          st.integers(0, 2**64 - 1), st.sampled_from([0, 0, 1, 2**40]))
_number_points = st.lists(_number_point, min_size=1, max_size=1) | st.lists(_number_point, max_size=4)
_kinds = st.sampled_from(["gauge", "gauge", "gauge", "sum", "sum", "histogram", "exponential_histogram", "summary",
                          "empty"])


def _set_attributes(target: Any, attributes: tuple[Any, list[tuple[str, Any]], bool]) -> None:
    step, extra, step_first = attributes
    if step is not None and step_first:
        set_any_value(target.add(key="train.step").value, step)
    for key, value in extra:
        set_any_value(target.add(key=key).value, value)
    if step is not None and not step_first:
        set_any_value(target.add(key="train.step").value, step)


@st.composite
def _metrics(draw: st.DrawFn, target: Any) -> None:
    if draw(st.booleans()):  # what a step-aligned reader sends each step: a name, a gauge of one point
        name = draw(st.text(_utf8, min_size=1, max_size=8) | st.sampled_from(["train/loss", "x" * 100]))
        value = draw(st.floats() | st.floats() | st.integers(-(2**63), 2**63 - 1))
        p = NumberDataPoint(time_unix_nano=draw(st.integers(0, 2**64 - 1)), start_time_unix_nano=draw(st.sampled_from([0, 0, 5])))
        if isinstance(value, float):
            p.as_double = value
        else:
            p.as_int = value
        step = draw(st.integers(0, 2**40) | _steps)
        _set_attributes(p.attributes, (step, draw(st.lists(st.tuples(st.sampled_from(["split", "train.rank"]),
                                                                          _attribute_values), max_size=2)), False))
        target.add(name=name).gauge.data_points.append(p)
        return
    metric: Metric = target.add(name=draw(_names), description=draw(st.just("") | _descriptions),
                                unit=draw(st.just("") | _text))
    kind = draw(_kinds)
    if kind in ("gauge", "sum"):
        data = metric.gauge if kind == "gauge" else metric.sum
        if kind == "gauge":
            metric.gauge.SetInParent()
        else:
            metric.sum.aggregation_temporality = draw(st.sampled_from([0, 1, 2, 2, 7]))
            metric.sum.is_monotonic = draw(st.booleans())
        for attributes, value, t, start in draw(_number_points):
            p = data.data_points.add(time_unix_nano=t, start_time_unix_nano=start)
            if isinstance(value, float):
                p.as_double = value
            elif isinstance(value, int):
                p.as_int = value
            _set_attributes(p.attributes, attributes)
    elif kind == "histogram":
        metric.histogram.aggregation_temporality = draw(st.sampled_from([1, 2]))
        for attributes in draw(st.lists(_attributes, max_size=3)):
            bounds = draw(st.lists(st.floats(-1e3, 1e3), max_size=4))
            right = st.lists(st.integers(0, 50), min_size=len(bounds) + 1, max_size=len(bounds) + 1)
            counts = draw(right | right | st.just([]) | st.lists(st.integers(0, 5), max_size=2))  # wrong: DecodeError
            p = metric.histogram.data_points.add(count=sum(counts), explicit_bounds=sorted(bounds),
                                                 bucket_counts=counts, time_unix_nano=draw(st.integers(0, 2**40)))
            if draw(st.booleans()):
                p.sum, p.min, p.max = draw(st.floats()), draw(st.floats()), draw(st.floats())
            _set_attributes(p.attributes, attributes)
    elif kind == "exponential_histogram":
        metric.exponential_histogram.aggregation_temporality = draw(st.sampled_from([1, 2]))
        for attributes in draw(st.lists(_attributes, max_size=2)):
            p = metric.exponential_histogram.data_points.add(
                scale=draw(st.integers(-2, 3)), zero_count=draw(st.integers(0, 5)), time_unix_nano=7)
            p.positive.offset = draw(st.integers(-3, 3))
            p.positive.bucket_counts.extend(draw(st.lists(st.integers(0, 9), max_size=4)))
            p.negative.bucket_counts.extend(draw(st.lists(st.integers(0, 9), max_size=2)))
            p.count = p.zero_count + sum(p.positive.bucket_counts) + sum(p.negative.bucket_counts)
            p.sum = draw(st.floats(-1e6, 1e6))
            _set_attributes(p.attributes, attributes)
    elif kind == "summary":
        for attributes in draw(st.lists(_attributes, max_size=2)):
            p = metric.summary.data_points.add(count=draw(st.integers(0, 99)), sum=draw(st.floats()), time_unix_nano=3)
            for q in draw(st.lists(st.floats(0, 1), max_size=3)):
                p.quantile_values.add(quantile=q, value=draw(st.floats()))
            _set_attributes(p.attributes, attributes)
    if draw(st.integers(0, 9)) == 0:  # metadata (field 12, after the data)
        set_any_value(metric.metadata.add(key=draw(_short_text)).value, draw(_attribute_values))


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    req = ExportMetricsServiceRequest()
    for _ in range(draw(st.integers(1, 3))):
        rm = req.resource_metrics.add()
        run = draw(st.one_of(st.none(), st.sampled_from(["run-a", "run-b", "ü" * 50])))
        if run is not None:
            rm.resource.attributes.add(key="train.run.id").value.string_value = run
        if draw(st.booleans()):
            rm.resource.attributes.add(key="train.rank").value.int_value = draw(st.integers(0, 3))
        if draw(st.booleans()):
            rm.resource.attributes.add(key="service.instance.id").value.string_value = draw(_short_text)
        for _ in range(draw(st.integers(0, 2))):
            sm = rm.scope_metrics.add()
            if draw(st.booleans()):
                sm.scope.name = draw(_short_text)
            for _ in range(draw(st.integers(0, 4))):
                draw(_metrics(sm.metrics))
    return bytes(req.SerializeToString())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=_requests())
def test_every_path_gives_the_same_rows(body: bytes) -> None:
    _assert_same_everywhere(body)


# -- the shapes the walk takes, and what it leaves to protobuf ------------------------------------


def _request(*metrics: bytes, run: str = "r") -> bytes:
    """An encoded request with one Resource and one scope holding `metrics` (each an encoded Metric)."""
    lean = lean_metrics_request()()
    rm = lean.resource_metrics.add()
    rm.resource.attributes.add(key="train.run.id").value.string_value = run
    rm.scope_metrics.add().metrics.extend(metrics)
    return bytes(lean.SerializeToString())


def _point(step: int, value: float, **attributes: Any) -> NumberDataPoint:
    p = NumberDataPoint(time_unix_nano=5, as_double=value)
    p.attributes.add(key="train.step").value.int_value = step
    for key, v in attributes.items():
        set_any_value(p.attributes.add(key=key).value, v)
    return p


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (payloads under 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def _gauge(*points: NumberDataPoint) -> bytes:
    return b"".join(_field(1, p.SerializeToString()) for p in points)


def test_the_usual_metrics_are_walked_without_protobuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gauges and sums of one or many points, with descriptions, units, long names and attributes
    (lengths over 127 bytes) are read from their encoding: protobuf parses no metric."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="train.run.id").value.string_value = "r"
    metrics = rm.scope_metrics.add().metrics
    metrics.add(name="train/loss").gauge.data_points.append(_point(3, 0.5))
    metrics.add(name="n" * 200, unit="s").gauge.data_points.append(_point(3, 1.5, note="é" * 100))
    described = metrics.add(name="lr", description="the learning rate", unit="1")
    described.gauge.data_points.extend([_point(3, 2.5), _point(4, 3.5)])
    total = metrics.add(name="tokens", description=KEY_DESCRIPTION_PREFIX + "tokens seen")
    total.sum.aggregation_temporality, total.sum.is_monotonic = 1, True
    total.sum.data_points.append(_point(3, 7.0))
    body = req.SerializeToString()
    want = _assert_same_everywhere(body)

    def no_protobuf(raw: bytes) -> None:
        raise AssertionError(f"parsed by protobuf: {raw[:40]!r}")

    monkeypatch.setattr("otel_train.sink.decode.requests.lean_metric", no_protobuf)
    cache = DecodeCache()
    assert _outcome(decode_metrics(lean_metrics_request().FromString(body), cache)) == want
    assert len(cache.headers.usual) == 1  # train/loss: a name and one gauge point
    rows = [(r.name, r.step, r.value, r.unit, r.description, dict(r.attributes)) for r in _walked_rows(body, cache)]
    assert rows == [("train/loss", 3, 0.5, "", "", {}), ("n" * 200, 3, 1.5, "s", "", {"note": "é" * 100}),
                    ("lr", 3, 2.5, "1", "the learning rate", {}), ("lr", 4, 3.5, "1", "the learning rate", {}),
                    ("tokens seen", 3, 7.0, "", "", {})]


def test_the_usual_metric_of_every_kind_of_point_reads_as_protobuf_reads_it() -> None:
    """A name and one gauge point, the shape recognised by its first bytes: every kind of point (extra
    attributes, steps that are no step, no step, int values, start times, no time), read the first time
    (walked) and again from the caches, as protobuf reads it."""
    points = [_point(1, 0.5), _point(2, 0.5, split="val"), _point(3, -1.0, **{"train.rank": 1}), NumberDataPoint(as_double=2.0),
              NumberDataPoint(time_unix_nano=9, as_int=-4), NumberDataPoint(start_time_unix_nano=1, time_unix_nano=2, as_double=1.0),
              NumberDataPoint(time_unix_nano=3)]
    for bad in (2.5, "x", 1e19, "12", 7.0):
        p = NumberDataPoint(time_unix_nano=5, as_double=1.0)
        set_any_value(p.attributes.add(key="train.step").value, bad)
        points.append(p)
    body = _request(*(_field(1, f"m{n}".encode()) + _field(5, _gauge(p)) for n, p in enumerate(points)))
    usual = _assert_same_everywhere(body)
    cache = DecodeCache()
    walked = [_outcome(decode_metrics(lean_metrics_request().FromString(body), cache)) for _ in range(2)]
    assert walked == [usual, usual]
    assert len(cache.headers.usual) == len(points)
    rows = [(r.name, r.step, r.value, r.tag) for r in _walked_rows(body, cache)]
    assert rows[:2] == [("m0", 1, 0.5, "m0"), ("m1", 2, 0.5, "m1{split=val}")]
    assert [r for r in rows if r[0] in ("m7", "m8", "m9", "m10", "m11")] == [("m10", 12, 1.0, "m10"),
                                                                           ("m11", 7, 1.0, "m11")]
    decoded = decode_metrics(lean_metrics_request().FromString(body), cache)
    assert decoded.refused == {("bad_step", "m7"): 1, ("bad_step", "m8"): 1, ("bad_step", "m9"): 1}


def test_every_truncation_of_a_request_decodes_as_protobuf_reads_it() -> None:
    """A body cut anywhere is refused (`DecodeError`) or, where the cut falls between fields, read as
    protobuf reads it, on every path."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="train.run.id").value.string_value = "r"
    metrics = rm.scope_metrics.add().metrics
    metrics.add(name="loss", unit="1").gauge.data_points.append(_point(1, 0.5))
    metrics.add(name="l" * 130).gauge.data_points.extend([_point(1, 0.25), _point(2, 0.125)])
    counter = metrics.add(name="seen")
    counter.sum.aggregation_temporality, counter.sum.is_monotonic = 2, True
    counter.sum.data_points.append(_point(1, 4.0))
    body = req.SerializeToString()
    outcomes = [_assert_same_everywhere(body[:cut]) for cut in range(len(body) + 1)]
    assert outcomes.count("DecodeError") > len(body) // 2
    assert outcomes[-1] != "DecodeError"


@pytest.mark.parametrize("metric", [
    pytest.param(_field(5, _gauge(_point(1, 0.5))) + _field(1, b"loss"), id="data before name"),
    pytest.param(_field(3, b"s") + _field(1, b"loss") + _field(5, _gauge(_point(1, 0.5))), id="unit before name"),
    pytest.param(_field(1, b"old") + _field(1, b"loss") + _field(5, _gauge(_point(1, 0.5))), id="name repeated"),
    pytest.param(_field(1, b"loss") + _field(5, _gauge(_point(1, 0.5))) + _field(5, _gauge(_point(2, 0.25))),
                 id="gauge repeated: points merged"),
    pytest.param(_field(1, b"loss") + _field(5, _gauge(_point(1, 0.5))) + _field(7, _gauge(_point(2, 0.25))),
                 id="gauge then sum: the sum wins"),
    pytest.param(_field(1, b"loss") + _field(5, _gauge(_point(1, 0.5))) + _field(12, _field(1, b"k")),
                 id="metadata after the data"),
    pytest.param(_field(1, b"loss") + _field(5, _gauge(_point(1, 0.5))) + bytes([0x78, 0x01]), id="unknown field"),
    pytest.param(_field(1, b"loss") + _field(5, _gauge(_point(1, 0.5)) + bytes([0x10, 0x01])),
                 id="unknown field in the gauge"),
    pytest.param(_field(1, b"c") + _field(7, bytes([0x18, 0x01, 0x10, 0x01]) + _gauge(_point(1, 2.0))),
                 id="sum: flags before points"),
    pytest.param(_field(1, b"c") + _field(7, _gauge(_point(1, 2.0)) + bytes([0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0x07])),
                 id="sum: a temporality over one byte"),
    pytest.param(_field(1, b"c") + _field(7, _gauge(_point(1, 2.0)) + bytes([0x18, 0x02])), id="sum: monotonic 2"),
    pytest.param(bytes([0x0A, 0x84, 0x00]) + b"loss" + _field(5, _gauge(_point(1, 0.5))), id="overlong varint"),
    pytest.param(_field(1, b"loss") + _field(5, b""), id="gauge without points"),
    pytest.param(_field(1, b"loss"), id="no data"),
    pytest.param(_field(1, b"loss") + _field(5, _gauge(NumberDataPoint(time_unix_nano=1, as_int=3))),
                 id="a point without a step"),
])
def test_shapes_no_encoder_writes_decode_as_protobuf_reads_them(metric: bytes) -> None:
    usual = _field(1, b"loss") + _field(5, _gauge(_point(1, 0.5)))  # learnt first: most cases start like it
    body = _request(usual, metric, _field(1, b"after") + _field(5, _gauge(_point(1, 9.0))))
    assert _assert_same_everywhere(body) != "DecodeError"
    assert ("after", 1, 9.0) in [(r.name, r.step, r.value) for r in _walked_rows(body)]  # and what follows is read


@pytest.mark.parametrize("metric", [
    pytest.param(_field(1, b"") + _field(5, _gauge(_point(1, 0.5))), id="empty name"),
    pytest.param(_field(5, _gauge(_point(1, 0.5))), id="no name"),
    pytest.param(_field(3, b"s") + _field(5, _gauge(_point(1, 0.5))), id="a unit, no name"),
    pytest.param(_field(1, b"\xff\xfe") + _field(5, _gauge(_point(1, 0.5))), id="name not UTF-8"),
    pytest.param(_field(1, b"loss") + _field(2, b"\xc3") + _field(5, _gauge(_point(1, 0.5))),
                 id="description not UTF-8"),
    pytest.param(_field(1, b"loss") + _field(5, _gauge(_point(1, 0.5)))[:-3], id="point cut short"),
    pytest.param(_field(1, b"loss") + bytes([0x2A, 0x05, 0x0A, 0x09, 0x19]), id="point longer than its gauge"),
    pytest.param(_field(1, b"loss") + _field(5, _field(1, b"\x19\x01")), id="point not a NumberDataPoint"),
    pytest.param(_field(1, b"loss") + _field(9, b"\x0a\x02\x08"), id="histogram cut short"),
    pytest.param(b"\x0a", id="one byte"),
])
def test_malformed_metrics_fail_the_request(metric: bytes) -> None:
    """A metric no encoder could have written fails its whole request on every path, the metrics
    before it (already read) included."""
    ok = _field(1, b"before") + _field(5, _gauge(_point(1, 9.0)))
    assert _every_path(_request(ok, metric)) == ["DecodeError"] * 4


def test_wire_examples_run() -> None:
    """The examples in `otel_train.sink.decode.wire` (hand-encoded requests and metrics) hold."""
    import doctest

    import otel_train.sink.decode.wire

    result = doctest.testmod(otel_train.sink.decode.wire)
    assert result.attempted >= 3 and result.failed == 0


def test_threads_decoding_the_first_requests_at_once_all_decode_them() -> None:
    """A sink's first requests arrive on several threads at once (a collector's batch right after a restart):
    each builds nothing of its own, and every request decodes."""
    import sys
    import threading

    from otel_train.sink.decode import otlp

    body = metrics_request({"train.run.id": "r"}, [OtlpPoint(f"m{i}", 1.0, step=1) for i in range(5)])
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside the first build, as under load
    errors: list[str] = []
    points: list[int] = []
    try:
        for _ in range(10):
            otlp._LEAN_SCHEMA.reset()
            barrier = threading.Barrier(4)

            def decode_one(barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    points.append(decode_metrics(parse_metrics(body), DecodeCache()).points)
                except Exception as err:
                    errors.append(repr(err))

            threads = [threading.Thread(target=decode_one) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert points == [5] * 40
