"""The sink on both protocols, fed by the real SDK OTLP exporters (and raw HTTP for OTLP/JSON)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from sinkkit import make_sink, metrics_data, resource, scalars


def _grpc_metrics(sink: Any) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=f"127.0.0.1:{sink.grpc_port}", insecure=True, timeout=5)


def _http_metrics(sink: Any) -> Any:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=f"http://127.0.0.1:{sink.http_port}/v1/metrics", timeout=5)


def _get(sink: Any, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{sink.http_port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def test_grpc_and_http_interleaved_out_of_order(sink: Any, tmp_path: Path) -> None:
    from opentelemetry.sdk.metrics.export import MetricExportResult

    grpc_exp, http_exp = _grpc_metrics(sink), _http_metrics(sink)
    ok = MetricExportResult.SUCCESS
    # rank 1 of run a sends its later steps first; run b interleaves; both protocols at once.
    assert http_exp.export(metrics_data("a", 1, 2, range(5, 10))) is ok
    assert grpc_exp.export(metrics_data("a", 0, 2, range(10))) is ok
    assert grpc_exp.export(metrics_data("b", 0, 1, range(3), run_name="run-b")) is ok
    assert http_exp.export(metrics_data("a", 1, 2, range(5))) is ok
    assert sink.flush(10)
    runs = tmp_path / "runs"
    rank0, rank1 = scalars(runs / "a" / "rank0"), scalars(runs / "a" / "rank1")
    assert rank0["train/loss"] == [(s, float(s)) for s in range(10)]
    # Rank 1's steps 0-4 came after its steps 5-9: the sink's reorder hold (`--reorder-s`) wrote them first, so
    # TensorBoard holds all ten steps, once, in order (without it, it would skip a step that went back).
    assert rank1["train/loss"] == [(s, 1000.0 + s) for s in range(10)]
    # DELTA counter -> running total. Steps 5-9 were totalled when they arrived, before rank 1's steps 0-4: the
    # sink's late-DELTA rule (`test_ordering`) writes each late step at its own total and counts the rows left
    # short (`late_delta_points` below); the hold then puts them in step order.
    assert rank0["train/tokens"] == [(s, 10.0 * (s + 1)) for s in range(10)]
    assert rank1["train/tokens"] == ([(s, 10.0 * (s + 1)) for s in range(5)]
                                     + [(s, 10.0 * (s - 4)) for s in range(5, 10)]
                                     + [(9, 100.0)])  # the highest step again, with the whole total
    b = scalars(runs / "run-b")
    assert b["train/loss"] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    summary = {r["run_id"]: r for r in _get(sink, "/runs")["runs"]}
    assert summary["a"]["ranks"] == {"0": {"last_step": 9}, "1": {"last_step": 9}}
    assert summary["a"]["series"] == 2 and summary["a"]["points"] == 40
    assert summary["b"]["run_name"] == "run-b" and summary["b"]["last_step"] == 2
    health = _get(sink, "/health")
    assert health["status"] == "ok" and health["points"] == 46 and health["runs_open"] == 2
    assert health["late_delta_points"] == {"a": {"points": 5, "stale_totals": 25}}
    # Nothing skipped for its step, nothing still held.
    assert health["steps_order_skipped"] == {} and health["reorder_held"] == 0
    grpc_exp.shutdown()
    http_exp.shutdown()


def test_spans_over_grpc_reach_the_trace(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_train.trace_merge import load_trace

    sink = make_sink(tmp_path, ("tensorboard", "chrome_trace"))
    try:
        tp = TracerProvider(resource=resource("t", 0, 1))
        tp.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"127.0.0.1:{sink.grpc_port}", insecure=True, timeout=5)))
        tracer = tp.get_tracer("test")
        for step in range(3):
            with tracer.start_as_current_span("forward", attributes={"train.step": step, "thread.id": 7}):
                pass
        tp.shutdown()
        assert sink.flush(10)
    finally:
        sink.stop()
    events = load_trace(tmp_path / "runs" / "t" / "trace" / "rank0.trace.json")
    spans = [e for e in events if e.get("ph") == "X"]
    assert sorted(e["args"]["train.step"] for e in spans) == [0, 1, 2]
    assert {e["name"] for e in spans} == {"forward"} and {e["tid"] for e in spans} == {7}


def test_http_json_metrics_and_traces(sink: Any, tmp_path: Path) -> None:
    res = {"attributes": [{"key": "train.run.id", "value": {"stringValue": "j"}},
                          {"key": "train.rank", "value": {"intValue": "0"}}]}
    metrics = {"resourceMetrics": [{"resource": res, "scopeMetrics": [{"metrics": [
        {"name": "eval/acc", "gauge": {"dataPoints": [
            {"asDouble": 0.5, "timeUnixNano": "1", "attributes": [
                {"key": "train.step", "value": {"intValue": "3"}},
                {"key": "split", "value": {"stringValue": "val"}}]}]}},
        {"name": "train/samples", "sum": {"aggregationTemporality": 1, "isMonotonic": True, "dataPoints": [
            {"asInt": "4", "attributes": [{"key": "train.step", "value": {"intValue": "3"}}]},
            {"asInt": "6", "attributes": [{"key": "train.step", "value": {"intValue": "4"}}]}]}},
    ]}]}]}
    traces = {"resourceSpans": [{"resource": res, "scopeSpans": [{"spans": [
        {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "step",
         "startTimeUnixNano": "1000", "endTimeUnixNano": "2000",
         "attributes": [{"key": "train.step", "value": {"intValue": "3"}}]}]}]}]}
    for path, doc in (("/v1/metrics", metrics), ("/v1/traces", traces)):
        req = urllib.request.Request(f"http://127.0.0.1:{sink.http_port}{path}", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == {}
    assert sink.flush(10)
    got = scalars(tmp_path / "runs" / "j")
    assert got["eval/acc{split=val}"] == [(3, 0.5)]
    assert got["train/samples"] == [(3, 4.0), (4, 10.0)]
    assert sink.router.spans_in == 1


def test_idle_run_is_closed_and_reopened_with_its_totals(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, idle_s=0.2)
    try:
        exp = _grpc_metrics(sink)
        exp.export(metrics_data("idle", 0, 1, range(3)))
        # Woken by the close itself (not by polling `runs_open`, which drops before the close has ended).
        assert sink.router.wait_until(lambda r: r.runs_closed == 1 and not r.runs_closing, 30)
        assert sink.router.runs_open == 0
        assert _get(sink, "/runs")["runs"][0]["open"] is False
        exp.export(metrics_data("idle", 0, 1, range(3, 5)))  # resumes: totals continue
        assert sink.flush(10)
        exp.shutdown()
    finally:
        sink.stop()
    got = scalars(tmp_path / "runs" / "idle")
    assert got["train/loss"] == [(s, float(s)) for s in range(5)]
    assert got["train/tokens"] == [(s, 10.0 * (s + 1)) for s in range(5)]


def test_aggregates_when_all_ranks_reported_or_timeout(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, aggregate=("mean", "min", "max"), aggregate_timeout_s=0.5)
    try:
        exp = _grpc_metrics(sink)
        exp.export(metrics_data("agg", 0, 3, range(4)))
        exp.export(metrics_data("agg", 1, 3, range(4)))
        assert sink.router.aggregate_rows == 0  # rank 2 missing
        exp.export(metrics_data("agg", 2, 3, range(3)))  # step 3 only from ranks 0 and 1
        # steps 0..2 complete at once: 3 steps x 2 series x 3 stats
        assert sink.router.aggregate_rows == 18
        deadline = time.monotonic() + 10
        while sink.router.aggregate_rows < 24 and time.monotonic() < deadline:
            time.sleep(0.05)  # step 3 waits for its timeout
        assert sink.router.aggregate_rows == 24
        assert sink.flush(10)
        exp.shutdown()
    finally:
        sink.stop()
    got = scalars(tmp_path / "runs" / "agg" / "rank0")
    assert got["train/loss/mean"] == [(0, 1000.0), (1, 1001.0), (2, 1002.0), (3, 503.0)]
    assert got["train/loss/min"] == [(s, float(s)) for s in range(4)]
    assert got["train/loss/max"] == [(0, 2000.0), (1, 2001.0), (2, 2002.0), (3, 1003.0)]
    assert got["train/tokens/mean"] == [(s, 10.0 * (s + 1)) for s in range(4)]
    assert "train/loss/mean" not in scalars(tmp_path / "runs" / "agg" / "rank1")
