"""The sink receives OTLP logs (gRPC LogsService, HTTP /v1/logs as protobuf and JSON) and writes each run's records
to its JSONL and Chrome trace: from the OTel Python SDK's own OTLP log exporter (a foreign sender), from raw
requests, from otel-train's `otlp` backend, and through the real rotel collector."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sinkkit import make_sink

from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.trace_merge import load_trace

RESOURCE = {"service.name": "plain-app", "train.run.id": "logs-run", "train.run.name": "logs-run", "train.rank": 1,
            "train.world_size": 2}


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[Any]:
    s = make_sink(tmp_path, ("jsonl", "chrome_trace"))
    try:
        yield s
    finally:
        s.stop()


def _records(tmp_path: Path, run: str = "logs-run", rank: int = 1) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(jsonl_path(tmp_path / "runs", run, rank)) if r["type"] == "log"]


def _sdk_logger(endpoint: str, protocol: str = "grpc") -> tuple[Any, logging.Logger]:
    """A plain OTel app's logging: `LoggerProvider` + batch processor + the SDK's OTLP log exporter, through
    the SDK's own `LoggingHandler` on a logger of its own."""
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.resources import Resource

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

        exporter: Any = OTLPLogExporter(endpoint=endpoint, insecure=True, timeout=5)
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter

        exporter = HttpLogExporter(endpoint=endpoint, timeout=5)
    provider = LoggerProvider(resource=Resource.create(RESOURCE))
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    logger = logging.getLogger(f"plain-app.{protocol}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.handlers = [LoggingHandler(level=logging.INFO, logger_provider=provider)]
    return provider, logger


@pytest.mark.filterwarnings("ignore:`LoggingHandler`:DeprecationWarning")  # the SDK's own, as plain apps use it
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_sdks_own_otlp_log_exporter_lands_at_steps(sink: Any, tmp_path: Path, protocol: str) -> None:
    endpoint = (f"127.0.0.1:{sink.grpc_port}" if protocol == "grpc"
                else f"http://127.0.0.1:{sink.http_port}/v1/logs")
    provider, log = _sdk_logger(endpoint, "grpc" if protocol == "grpc" else "http")
    for step in range(5):
        if step in (1, 3):
            log.warning("loss spiked", extra={"train.step": step})
    try:
        raise ValueError("bad batch")
    except ValueError:
        log.exception("loading failed", extra={"train.step": 4})
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert sink.flush(10)
    records = _records(tmp_path)
    assert [(r["step"], r["severity_text"], r["body"], r["rank"]) for r in records] == [
        (1, "WARN", "loss spiked", 1), (3, "WARN", "loss spiked", 1), (4, "ERROR", "loading failed", 1)]
    assert "ValueError: bad batch" in records[2]["attributes"]["exception.stacktrace"]
    assert {r["logger"] for r in records} == {log.name}
    (trace,) = (tmp_path / "runs" / "logs-run" / "trace").glob("rank1*.trace.json")
    events = [e for e in load_trace(trace) if e.get("cat") == "log"]
    assert [(e["args"]["message"], e["args"]["train.step"], e["pid"]) for e in events] == [
        ("loss spiked", 1, 1), ("loss spiked", 3, 1), ("loading failed", 4, 1)]


def _request(body: str, step: int | None) -> Any:
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    def kv(key: str, value: Any) -> KeyValue:
        return KeyValue(key=key, value=AnyValue(int_value=value) if isinstance(value, int)
                        else AnyValue(string_value=value))

    attrs = [kv("train.step", step)] if step is not None else []
    record = LogRecord(time_unix_nano=1_700_000_000_000_000_000, severity_number=17, severity_text="ERROR",
                       body=AnyValue(string_value=body), attributes=attrs, trace_id=bytes(range(16)),
                       span_id=bytes(range(1, 9)), event_name="train.hang")
    resource = Resource(attributes=[kv(k, v) for k, v in RESOURCE.items()])
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(
        resource=resource, scope_logs=[ScopeLogs(log_records=[record])])])


def _post(sink: Any, data: bytes, content_type: str) -> int:
    from rotel_proc import post_otlp

    return post_otlp(sink.http_port, "/v1/logs", data, content_type)


def test_http_protobuf_and_json_requests(sink: Any, tmp_path: Path) -> None:
    from google.protobuf import json_format

    assert _post(sink, _request("as protobuf", 2).SerializeToString(), "application/x-protobuf") == 200
    doc = json_format.MessageToDict(_request("as json", 5))
    record = doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
    record["traceId"], record["spanId"] = bytes(range(16)).hex(), bytes(range(1, 9)).hex()  # OTLP/JSON: hex ids
    assert _post(sink, json.dumps(doc).encode(), "application/json") == 200
    assert _post(sink, _request("no step: the rank's latest", None).SerializeToString(), "application/x-protobuf") == 200
    assert sink.flush(10)
    records = _records(tmp_path)
    assert [(r["step"], r["body"]) for r in records] == [(2, "as protobuf"), (5, "as json"),
                                                         (None, "no step: the rank's latest")]
    assert {r["trace_id"] for r in records} == {bytes(range(16)).hex()}
    assert {r["attributes"]["event.name"] for r in records} == {"train.hang"}


def test_the_otlp_backend_sends_log_records_the_sink_writes(sink: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.backend import Window
    from otel_train.exporters.otlp import OTLPExporter
    from otel_train.vocab.rows import LogRow
    from otel_train.vocab.run_identity import RunInfo

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.grpc_port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    run = RunInfo("otlp-run", "otlp-run", rank=0, world_size=1)
    rows = [LogRow(run, s, 1_700_000_000_000_000_000 + s, 13, "WARNING", f"warn {s}", "job",
                   {"exception.stacktrace": "Traceback ..."} if s == 3 else {}) for s in (1, 3)]
    exporter = OTLPExporter()
    assert exporter.export_window(Window(logs=rows))
    exporter.shutdown()
    assert sink.flush(10)
    records = _records(tmp_path, "otlp-run", 0)
    assert [(r["step"], r["body"], r["logger"]) for r in records] == [(1, "warn 1", "job"), (3, "warn 3", "job")]
    assert records[1]["attributes"] == {"exception.stacktrace": "Traceback ..."}  # the step is a field, not repeated


@pytest.mark.filterwarnings("ignore:`LoggingHandler`:DeprecationWarning")
def test_through_the_rotel_collector(tmp_path: Path) -> None:
    from rotel_proc import Rotel, SinkProcess, wait_until

    sink = SinkProcess(tmp_path / "sink", "--dir", str(tmp_path / "runs"), "--exporters", "jsonl").wait_ready()
    rotel = Rotel(tmp_path / "rotel", sink.grpc_port).start()
    try:
        provider, log = _sdk_logger(f"127.0.0.1:{rotel.grpc_port}")
        log.warning("through rotel", extra={"train.step": 6})
        assert provider.force_flush(10_000)
        provider.shutdown()
        path = jsonl_path(tmp_path / "runs", "logs-run", 1)
        assert wait_until(lambda: path.exists() and any(r["type"] == "log" for r in read_jsonl(path)), 30)
    finally:
        rotel.stop()
        sink.stop()
    assert [(r["step"], r["body"]) for r in _records(tmp_path)] == [(6, "through rotel")]


def test_a_logs_request_sent_twice_writes_each_record_once(sink: Any, tmp_path: Path) -> None:
    """A request whose acknowledgement was lost is sent again (over HTTP, then gRPC): every record once; a record
    that differs only in its time (logged again later) is a record of its own."""
    import grpc
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2_grpc import LogsServiceStub

    first = _request("stuck in allreduce", 4)
    second = _request("stuck in allreduce", 4)  # the same record, logged again a second later
    second.resource_logs[0].scope_logs[0].log_records[0].time_unix_nano += 1_000_000_000
    for _ in range(2):
        assert _post(sink, first.SerializeToString(), "application/x-protobuf") == 200
    with grpc.insecure_channel(f"127.0.0.1:{sink.grpc_port}") as channel:
        stub = LogsServiceStub(channel)
        for request in (first, second, second):
            stub.Export(ExportLogsServiceRequest.FromString(request.SerializeToString()), timeout=10)
    assert sink.flush(10)
    assert [(r["step"], r["body"], r["time_unix_nano"]) for r in _records(tmp_path)] == [
        (4, "stuck in allreduce", 1_700_000_000_000_000_000), (4, "stuck in allreduce", 1_700_000_001_000_000_000)]


def test_a_logs_request_sent_again_after_the_sink_was_killed_is_written_once(tmp_path: Path) -> None:
    """The sink took the request (its keys are in the run's state with its spool) and was killed before the
    sender heard back: the restarted sink recognises the retry."""
    import signal

    from rotel_proc import SinkProcess

    args = ("--exporters", "jsonl", "--dir", str(tmp_path / "runs"))
    body = _request("stuck in allreduce", 4).SerializeToString()
    sink = SinkProcess(tmp_path / "sink0", *args).wait_ready()
    try:
        assert _post(sink, body, "application/x-protobuf") == 200
    finally:
        sink.proc.send_signal(signal.SIGKILL)
        sink.proc.wait(10)
    sink = SinkProcess(tmp_path / "sink1", *args).wait_ready()
    try:
        assert _post(sink, body, "application/x-protobuf") == 200  # the retry
        assert _post(sink, _request("resumed", 5).SerializeToString(), "application/x-protobuf") == 200
        sink.settled_health()
    finally:
        assert sink.terminate() == 0
    assert [(r["step"], r["body"]) for r in _records(tmp_path)] == [(4, "stuck in allreduce"), (5, "resumed")]


def test_a_record_without_a_step_takes_the_runs_latest_step_also_after_a_restart(tmp_path: Path) -> None:
    """Before: the latest step was known only to the process that saw it, so after a restart a record without
    a step had none (while a step-less metric point sent with it landed at the run's current step), and `/runs`
    had no `last_step` for the run."""
    from rotel_proc import SinkProcess, post_otlp

    from otel_train.testing import OtlpPoint, metrics_request

    args = ("--exporters", "jsonl", "--dir", str(tmp_path / "runs"))
    steps = metrics_request(RESOURCE, [OtlpPoint("loss", float(s), step=s, time_unix_nano=s + 1) for s in range(10)])
    for i, body in enumerate(("before the restart", "after the restart")):
        sink = SinkProcess(tmp_path / f"sink{i}", *args).wait_ready()
        try:
            if i == 0:
                assert post_otlp(sink.http_port, "/v1/metrics", steps, "application/x-protobuf") == 200
            assert _post(sink, _request(body, None).SerializeToString(), "application/x-protobuf") == 200
            sink.settled_health()
            assert [r["last_step"] for r in sink.get("/runs")["runs"]] == [9]  # before: None after the restart
        finally:
            assert sink.terminate() == 0
    assert [(r["step"], r["body"]) for r in _records(tmp_path)] == [(9, "before the restart"), (9, "after the restart")]
