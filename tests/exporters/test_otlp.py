"""The `otlp` exporter against the real sink (gRPC and HTTP/protobuf), and with nothing listening.

It is a `RowExporter`: SDK data handed to `export` becomes rows, then the SDK's export objects (`otel_train.ship.rows_to_sdk`) and OTLP."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "sink"))  # the sink tests' helpers

from sinkkit import make_sink, metrics_data, resource, scalars

from otel_train.errors import ConfigError
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.exporters.otlp import OTLPExporter


def _point_to(monkeypatch: pytest.MonkeyPatch, sink: Any, protocol: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    if protocol == "grpc":
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.grpc_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.http_port}")


def test_protocol_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

    exp = OTLPExporter()
    assert exp.protocols == {"metrics": "grpc", "traces": "grpc", "logs": "grpc"}
    assert isinstance(exp._metrics, GrpcMetrics)
    exp.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc")
    exp = OTLPExporter(None)
    assert exp.protocols == {"metrics": "grpc", "traces": "http/protobuf", "logs": "http/protobuf"}
    assert isinstance(exp._traces, HttpSpans)
    exp.shutdown()
    exp.shutdown()  # idempotent
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: 'http/json'"):
        OTLPExporter()


def test_registry_builds_it() -> None:
    from otel_train.config.registry import get_spec, load_class

    cls = load_class(get_spec("otlp"))
    assert cls is OTLPExporter
    cls().shutdown()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_metrics_and_spans_reach_the_sink(protocol: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.metrics.export import MetricExportResult
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
    from opentelemetry.trace import Link, SpanContext, SpanKind

    sink = make_sink(tmp_path, ("tensorboard", "chrome_trace", "jsonl"), token="s3cret")
    try:
        _point_to(monkeypatch, sink, protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20s3cret")
        exp = OTLPExporter()
        assert exp.export(metrics_data("o", 0, 1, range(4))) is MetricExportResult.SUCCESS
        tp = TracerProvider(resource=resource("o", 0, 1))
        tp.add_span_processor(SimpleSpanProcessor(exp))
        linked = SpanContext(0xABC, 0xDEF, is_remote=True)
        with tp.get_tracer("t").start_as_current_span("step", attributes={"train.step": 2}, kind=SpanKind.CLIENT,
                                                      links=[Link(linked, {"why": "batch"})]) as span:
            span.add_event("batch loaded", {"batch": 7})
            span.record_exception(ValueError("bad batch"))
        assert exp.export([]) is SpanExportResult.SUCCESS
        assert exp.sent == 8 + 1 and exp.failures == 0 and exp.dropped_windows == 0
        tp.shutdown()  # shuts the exporter down too
        assert sink.flush(10)
        assert sink.router.spans_in == 1
    finally:
        sink.stop()
    got = scalars(tmp_path / "runs" / "o")
    assert got["train/loss"] == [(s, float(s)) for s in range(4)]
    assert got["train/tokens"] == [(s, 10.0 * (s + 1)) for s in range(4)]
    # The span's events crossed as rows and the wire: what the sink wrote holds them.
    (span_record,) = [r for r in read_jsonl(jsonl_path(tmp_path / "runs", "o", 0)) if r["type"] == "span"]
    events = [(e["name"], e["attributes"]) for e in span_record["events"]]
    assert events[0] == ("batch loaded", {"batch": 7})
    assert events[1][0] == "exception"
    assert events[1][1]["exception.type"] == "ValueError" and events[1][1]["exception.message"] == "bad batch"
    assert span_record["kind"] == "client"
    assert span_record["links"] == [{"trace_id": f"{0xABC:032x}", "span_id": f"{0xDEF:016x}", "attributes": {"why": "batch"}}]


def test_wrong_token_is_a_counted_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = make_sink(tmp_path, token="right")
    try:
        _point_to(monkeypatch, sink, "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20wrong")
        exp = OTLPExporter()
        exp.export(metrics_data("o", 0, 1, range(2)))
        assert exp.failures == 1 and exp.pending == 1 and sink.router.points_in == 0
        assert sink.rejected == {"unauthenticated": 1}
        exp.shutdown(timeout_millis=100)  # no time for another attempt: counted as dropped
        assert exp.dropped_windows == 1 and exp.pending == 0
    finally:
        sink.stop()


def test_collector_down_nothing_dropped_and_all_sent_after_recovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from rotel_proc import free_port

    caplog.set_level(logging.DEBUG)

    port = free_port()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    exp = OTLPExporter()
    exp.backoff_s = (600.0,)  # no retry during the loop below, however slow the machine (a flush forces one)
    t0 = time.monotonic()
    exp.export(metrics_data("down", 0, 1, range(2)))
    assert time.monotonic() - t0 < 30.0  # a hang guard, not a speed check: our 2 s timeout bounds the try
    assert exp.failures == 1 and exp.pending == 1
    for start in range(2, 100, 2):  # in backoff: kept without a try (nothing to block on), none dropped
        exp.export(metrics_data("down", 0, 1, range(start, start + 2)))
    assert exp.pending == 50 and exp.dropped_windows == 0 and exp.failures == 1
    # One line of ours, with the SDK's reason in it; none of the SDK's own per-attempt lines.
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failed) == 1 and "exporter `otlp` failed" in failed[0] and "UNAVAILABLE" in failed[0], failed
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.sink import Sink, exporter_factory
    from otel_train.sink.settings import SinkSettings

    sink = Sink(SinkSettings(grpc=f"127.0.0.1:{port}", http="127.0.0.1:0"),
                exporter_factory(("tensorboard",), ExporterOptions(tmp_path / "runs", ranks="all"))).start()
    try:
        assert exp.force_flush()  # the collector is back: every kept window goes, oldest first
        assert exp.pending == 0 and exp.sent == 200 and exp.dropped_windows == 0
        exp.shutdown()
        assert sink.flush(10)
    finally:
        sink.stop()
    got = scalars(tmp_path / "runs" / "down")
    assert got["train/loss"] == [(s, float(s)) for s in range(100)]
    assert got["train/tokens"] == [(s, 10.0 * (s + 1)) for s in range(100)]


def test_shutdown_with_collector_down_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from rotel_proc import free_port

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    exp = OTLPExporter()
    exp.export(metrics_data("down", 0, 1, range(3)))
    assert exp.failures == 1
    t0 = time.monotonic()
    exp.shutdown(timeout_millis=1000)  # a whole 2 s attempt does not fit: no last try
    assert time.monotonic() - t0 < 30.0  # a hang guard, not a speed check
    assert exp.failures == 1 and exp.dropped_windows == 1  # no try made, the window counted as dropped
    assert exp.export(metrics_data("down", 0, 1, range(1))).name == "FAILURE"  # after shutdown


def test_a_window_half_sent_is_not_sent_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Metrics taken, spans refused: the retry sends only the spans (a DELTA counter re-sent would count twice)."""
    from otel_train.exporters.base import Window
    from otel_train.vocab.rows import MetricRow, SpanRow
    from otel_train.vocab.run_identity import RunInfo

    sink = make_sink(tmp_path)
    try:
        _point_to(monkeypatch, sink, "grpc")
        exp = OTLPExporter()
        real = exp._traces.export
        refusals = [1]

        def refuse_once(spans: Any) -> Any:
            if refusals:
                refusals.pop()
                from opentelemetry.sdk.trace.export import SpanExportResult
                return SpanExportResult.FAILURE
            return real(spans)

        monkeypatch.setattr(exp._traces, "export", refuse_once)
        run = RunInfo("half", "half")
        rows = [MetricRow(run, s, "tokens", "tokens", 10.0 * (s + 1), "counter", 1000 + s, {}, 10.0) for s in range(3)]
        spans = [SpanRow(run, "step", 7, 100 + s, None, 1000, 2000, 1, "main", s, {}) for s in range(3)]
        assert exp.export_window(Window(rows, (), spans)) is False
        assert exp.force_flush() and exp.sent == 6
        exp.shutdown()
        assert sink.flush(10)
        assert sink.router.spans_in == 3
    finally:
        sink.stop()
    assert scalars(tmp_path / "runs" / "half")["tokens"] == [(0, 10.0), (1, 20.0), (2, 30.0)]


def test_windows_merged_behind_a_slow_collector_all_arrive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While an export is in flight, later windows merge into one batch; each window repeats the same
    Resource, which the SDK's OTLP encoder keeps only once (the last), so the merge must not repeat it.
    Every step of every series must reach the sink."""
    import otel_train as ot

    sink = make_sink(tmp_path)
    try:
        _point_to(monkeypatch, sink, "grpc")
        exp = OTLPExporter()
        inner = exp._metrics
        real_export = inner.export
        calls = []

        def slow_first(data: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(data)
            if len(calls) == 1:
                time.sleep(1.0)  # a collector slow to answer: the next windows queue up and merge
            return real_export(data, *args, **kwargs)

        monkeypatch.setattr(inner, "export", slow_first)
        ot.init(exporters=[exp], run_id="merged", run_name="merged", dir=tmp_path / "local")
        for i in ot.steps(range(30)):
            ot.log({"train/loss": float(i), "train/lr": 0.5})
            time.sleep(0.01)
        ot.shutdown()
        assert 2 <= len(calls) < 30  # windows were merged
        assert sink.flush(10)
    finally:
        sink.stop()
    got = scalars(tmp_path / "runs" / "merged")
    assert got["train/loss"] == [(s, float(s)) for s in range(30)]
    assert [s for s, _ in got["train/lr"]] == list(range(30))
