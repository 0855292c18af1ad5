"""A sink shared by many jobs on an unkind network: distinct runs stay distinct, a bad point is refused
alone, slow or greedy clients are cut off, and every refusal is counted in `/health`."""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sinkkit import make_sink

from otel_train.exporters.jsonl import read_jsonl
from otel_train.testing import OtlpPoint, metrics_request
from otel_train.vocab.run_paths import run_folder

_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def _post(port: int, body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/metrics") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/x-protobuf", **(headers or {})})
    status = conn.getresponse().status
    conn.close()
    return status


def _post_answer(port: int, body: bytes, path: str = "/v1/metrics") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/x-protobuf"})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def _health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _gauges(path: Path) -> list[tuple[str, int, float]]:
    """Every metric row of a JSONL file as (name, step, value), in file order."""
    return [(r["name"], r["step"], r["value"]) for r in read_jsonl(path) if r.get("type") == "metric"]


def _request(run_id: str, points: list[tuple[str, float, Any]], run_name: str | None = None) -> bytes:
    """A gauge request whose `train.step` attributes are given as any OTLP value (int, double, string)."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from otel_train.testing import set_any_value

    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    for key, value in {"train.run.id": run_id, "train.run.name": run_name or run_id, "train.rank": 0}.items():
        set_any_value(rm.resource.attributes.add(key=key).value, value)
    metrics: dict[str, Any] = {}
    for name, value, step in points:
        metric = metrics.get(name)
        if metric is None:
            metric = metrics[name] = rm.scope_metrics.add().metrics.add(name=name)
        p = metric.gauge.data_points.add(as_double=value, time_unix_nano=1)
        set_any_value(p.attributes.add(key="train.step").value, step)
    return bytes(req.SerializeToString())


def test_run_ids_that_look_alike_stay_distinct(tmp_path: Path) -> None:
    ids = ["team/a", "team_a", ".team_a", "team\\a", " team_a "]
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        for i, run_id in enumerate(ids):
            assert _post(sink.http_port, _request(run_id, [("loss", float(i), 1)])) == 200
        # two run ids, one name: two runs
        assert _post(sink.http_port, _request("job-1", [("loss", 10.0, 1)], run_name="exp")) == 200
        assert _post(sink.http_port, _request("job-2", [("loss", 20.0, 1)], run_name="exp")) == 200
    finally:
        sink.stop()
    runs = tmp_path / "runs"
    files = sorted(runs.glob("*/rank0.jsonl"))
    assert len(files) == len(ids) + 2
    for i, run_id in enumerate(ids):
        assert _gauges(run_folder(runs, run_id) / "rank0.jsonl") == [("loss", 1, float(i))]
    assert _gauges(runs / "exp" / "rank0.jsonl") == [("loss", 1, 10.0)]
    others = [f for f in files if f.parent.name.startswith("exp~")]
    assert len(others) == 1 and _gauges(others[0]) == [("loss", 1, 20.0)]

    # a restarted sink gives each run the folder it had, whichever arrives first
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        assert _post(sink.http_port, _request("job-2", [("loss", 21.0, 2)], run_name="exp")) == 200
        assert _post(sink.http_port, _request("job-1", [("loss", 11.0, 2)], run_name="exp")) == 200
    finally:
        sink.stop()
    assert _gauges(runs / "exp" / "rank0.jsonl") == [("loss", 1, 10.0), ("loss", 2, 11.0)]
    assert _gauges(others[0]) == [("loss", 1, 20.0), ("loss", 2, 21.0)]


def test_run_ids_with_nul_or_over_255_bytes_are_refused_at_the_door(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        assert _post(sink.http_port, _request("a\x00b", [("loss", 1.0, 1)])) == 400
        assert _post(sink.http_port, _request("r" * 256, [("loss", 1.0, 1)])) == 400
        assert _post(sink.http_port, _request("r" * 255, [("loss", 1.0, 1)])) == 200
        assert _health(sink.http_port)["rejected"]["invalid"] == 2
    finally:
        sink.stop()
    assert [f.parent for f in (tmp_path / "runs").glob("*/rank0.jsonl")] == [run_folder(tmp_path / "runs", "r" * 255)]


def test_one_jobs_bad_resource_does_not_cost_the_other_jobs_of_a_collectors_batch(tmp_path: Path) -> None:
    """A collector batches the Resources of many jobs into one request: a job whose Resource or metric the sink
    cannot take (a run id over 255 bytes, a metric without a name, a histogram whose counts do not match its
    bounds) is refused alone, counted; the other jobs' points are written and the sender gets 200 (before: 400
    for the whole batch, which collectors do not retry)."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
        ExportMetricsServiceResponse,
    )

    good = _request("good-job", [("loss", 1.0, 1), ("loss", 2.0, 2)])
    long_id = _request("r" * 300, [("loss", 9.0, 1), ("acc", 9.0, 1)])
    unnamed = ExportMetricsServiceRequest.FromString(_request("unnamed-job", [("", 5.0, 1), ("ok", 5.0, 1)]))
    buckets = ExportMetricsServiceRequest.FromString(_request("hist-job", [("loss", 3.0, 1)]))
    hist = buckets.resource_metrics[0].scope_metrics.add().metrics.add(name="grad")
    hist.histogram.aggregation_temporality = 1  # DELTA
    hist.histogram.data_points.add(count=2, sum=1.0, explicit_bounds=[1.0], bucket_counts=[1, 1], time_unix_nano=1)
    hist.histogram.data_points.add(count=2, sum=1.0, explicit_bounds=[1.0, 2.0], bucket_counts=[2], time_unix_nano=1)
    # A second Resource of the good job, and one without `train.run.id`, both malformed: their series and their
    # count as unattributed go with them.
    good_bad = ExportMetricsServiceRequest.FromString(_request("good-job", [("stray", 7.0, 1), ("", 7.0, 1)]))
    no_run = ExportMetricsServiceRequest.FromString(_request("x", [("", 8.0, 1)]))
    del no_run.resource_metrics[0].resource.attributes[:]
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        # Protobuf messages concatenated are merged: one request of six Resources.
        batch = (long_id + good + unnamed.SerializeToString() + buckets.SerializeToString()
                 + good_bad.SerializeToString() + no_run.SerializeToString())
        status, answer = _post_answer(sink.http_port, batch)
        assert status == 200
        partial = ExportMetricsServiceResponse.FromString(answer).partial_success  # OTLP: the sender is told
        assert partial.rejected_data_points == 8 and "train.run.id" in partial.error_message, partial
        assert _post(sink.http_port, long_id) == 400  # a request of that Resource alone is refused whole, as before
        health = _health(sink.http_port)
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.http_port}/runs", timeout=5) as resp:
            series = {r["run_id"]: r["series"] for r in json.loads(resp.read())["runs"]}
    finally:
        sink.stop()
    assert series["good-job"] == 1 and set(series) == {"good-job", "hist-job"}, series  # loss, not `stray`
    assert health["unattributed_resources"] == 0
    runs = tmp_path / "runs"
    assert _gauges(runs / "good-job" / "rank0.jsonl") == [("loss", 1, 1.0), ("loss", 2, 2.0)]
    assert not (runs / "unnamed-job" / "rank0.jsonl").exists()  # its Resource is refused whole: nothing written
    hist_rows = _gauges(runs / "hist-job" / "rank0.jsonl")
    assert ("loss", 1, 3.0) in hist_rows and ("grad/count", 1, 2.0) in hist_rows
    assert [r for r in hist_rows if r[0] == "grad/count"] == [("grad/count", 1, 2.0)]  # the bad point alone refused
    assert sorted(f.parent.name for f in runs.glob("*/rank0.jsonl")) == ["good-job", "hist-job"]
    assert health["points_refused"] == {"bad_resource": 7, "bad_buckets": 1}
    assert health["rejected"]["invalid"] == 1


def test_one_jobs_bad_spans_or_log_records_do_not_cost_the_other_jobs(tmp_path: Path) -> None:
    """The same for traces and logs: a Resource with a span id or trace id of the wrong length is refused alone."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    spans, logs = ExportTraceServiceRequest(), ExportLogsServiceRequest()
    for run_id, span_id in (("good-job", b"\x01" * 8), ("bad-job", b"\x01" * 3)):
        rs = spans.resource_spans.add()
        rs.resource.attributes.add(key="train.run.id").value.string_value = run_id
        rs.scope_spans.add().spans.add(name="fwd", trace_id=b"\x02" * 16, span_id=span_id, start_time_unix_nano=1,
                                       end_time_unix_nano=2)
        rl = logs.resource_logs.add()
        rl.resource.attributes.add(key="train.run.id").value.string_value = run_id
        record = rl.scope_logs.add().log_records.add(time_unix_nano=1, span_id=span_id)
        record.body.string_value = f"hello from {run_id}"
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        status, answer = _post_answer(sink.http_port, spans.SerializeToString(), path="/v1/traces")
        assert status == 200 and ExportTraceServiceResponse.FromString(answer).partial_success.rejected_spans == 1
        assert _post(sink.http_port, logs.SerializeToString(), path="/v1/logs") == 200
        health = _health(sink.http_port)
    finally:
        sink.stop()
    rows = list(read_jsonl(tmp_path / "runs" / "good-job" / "rank0.jsonl"))
    assert [r["name"] for r in rows if r.get("type") == "span"] == ["fwd"]
    assert [r["body"] for r in rows if r.get("type") == "log"] == ["hello from good-job"]
    assert not (tmp_path / "runs" / "bad-job" / "rank0.jsonl").exists()
    assert health["points_refused"] == {"bad_resource": 2}


def test_points_refused_alone_are_named_in_the_grpc_answers_partial_success(tmp_path: Path) -> None:
    """OTLP's partial success over gRPC and HTTP/JSON too: a sender learns how many of its points were refused, and
    why, from the answer (the Python SDK's exporters log it); before, the answer was empty."""
    import grpc
    from google.protobuf import json_format
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2_grpc import MetricsServiceStub

    body = _request("partial", [("loss", 1.0, 1), ("loss", 2.0, 2.5), ("acc", 3.0, "ten")])
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sink.grpc_port}") as channel:
            answer = MetricsServiceStub(channel).Export(ExportMetricsServiceRequest.FromString(body), timeout=10)
        doc = json_format.MessageToJson(ExportMetricsServiceRequest.FromString(body))
        conn = http.client.HTTPConnection("127.0.0.1", sink.http_port, timeout=10)
        conn.request("POST", "/v1/metrics", body=doc, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        as_json = json.loads(resp.read())
        conn.close()
    finally:
        sink.stop()
    assert answer.partial_success.rejected_data_points == 2, answer
    assert "a `train.step` that is no step" in answer.partial_success.error_message
    assert resp.status == 200 and as_json["partialSuccess"]["rejectedDataPoints"] in (2, "2"), as_json


def test_a_point_whose_step_is_no_step_is_refused_alone(tmp_path: Path) -> None:
    bad = [1e19, float("inf"), float("-inf"), float("nan"), 2.5, "ten", "1e30"]
    points = [("loss", 1.0, 1)] + [("loss", 9.0, s) for s in bad] + [("loss", 3.0, 3.0), ("loss", 4.0, "4")]
    sink = make_sink(tmp_path, ("jsonl", "tensorboard"))
    try:
        assert _post(sink.http_port, _request("steps", points)) == 200
        health = _health(sink.http_port)
    finally:
        sink.stop()
    folder = tmp_path / "runs" / "steps"
    assert sorted(_gauges(folder / "rank0.jsonl")) == [("loss", 1, 1.0), ("loss", 3, 3.0), ("loss", 4, 4.0)]
    from sinkkit import scalars

    assert scalars(folder) == {"loss": [(1, 1.0), (3, 3.0), (4, 4.0)]}
    assert health["points_refused"] == {"bad_step": len(bad)}
    assert health["rejected"] == {}


def test_a_histogram_with_millions_of_buckets_is_refused_alone(tmp_path: Path) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    body = metrics_request({"train.run.id": "buckets"}, [OtlpPoint("loss", 0.5, step=1)])
    req = ExportMetricsServiceRequest.FromString(body)
    metric = req.resource_metrics[0].scope_metrics[0].metrics.add(name="latency")
    p = metric.exponential_histogram.data_points.add(count=2_000_000, scale=0, time_unix_nano=1)
    p.positive.bucket_counts.extend([1] * 2_000_000)
    p.attributes.add(key="train.step").value.int_value = 1
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        assert _post(sink.http_port, bytes(req.SerializeToString())) == 200
        health = _health(sink.http_port)
    finally:
        sink.stop()
    assert _gauges(tmp_path / "runs" / "buckets" / "rank0.jsonl") == [("loss", 1, 0.5)]
    assert health["points_refused"] == {"too_many_buckets": 1}


def test_status_codes_of_malformed_requests(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, ("jsonl",), token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    try:
        deep = ("[" * 300 + "]" * 300).encode()
        body = b'{"resourceMetrics": ' + deep + b"}"
        assert _post(sink.http_port, body, {**auth, "Content-Type": "application/json"}) == 400
        conn = http.client.HTTPConnection("127.0.0.1", sink.http_port, timeout=10)
        conn.putrequest("POST", "/v1/metrics")
        conn.putheader("Content-Type", "application/x-protobuf")
        conn.putheader("Authorization", b"Bearer \xff\xfe")  # not UTF-8
        conn.putheader("Content-Length", "0")
        conn.endheaders()
        assert conn.getresponse().status == 401
        conn.close()
        # a gzip body of two members (written in two pieces) is read whole: two protobuf requests one
        # after the other are one request holding both
        one = _request("gz", [("loss", 1.0, 1)])
        two = _request("gz", [("loss", 2.0, 2)])
        assert _post(sink.http_port, gzip.compress(one) + gzip.compress(two), {**auth, "Content-Encoding": "gzip"}) == 200
        # every refusal is counted: unknown routes (GET too), compat errors
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{sink.http_port}/nothing", headers=auth),
                                   timeout=5)
        assert _post(sink.http_port, b"{}", {**auth, "Content-Type": "application/json"},
                     path="/metrics/log_metric") == 400
        rejected = _health(sink.http_port)["rejected"]
    finally:
        sink.stop()
    assert _gauges(tmp_path / "runs" / "gz" / "rank0.jsonl") == [("loss", 1, 1.0), ("loss", 2, 2.0)]
    assert rejected == {"invalid": 1, "unauthenticated": 1, "not_found": 1, "compat_400": 1}


def test_gzip_members_are_all_inflated() -> None:
    from otel_train.sink.decode.otlp import _decompress

    assert _decompress(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 100) == b"abcd"
    with pytest.raises(OverflowError):
        _decompress(gzip.compress(b"a" * 60) + gzip.compress(b"b" * 60), "gzip", 100)


_BODY_PENDING = (b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                 b"Content-Length: 100\r\n\r\nx")


def _serves_again(port: int) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        try:
            return _health(port)
        except (OSError, http.client.HTTPException):
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_trickled_body_is_cut_off(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, ("jsonl",), body_timeout_s=1.0)
    try:
        slow = socket.create_connection(("127.0.0.1", sink.http_port), timeout=10)
        slow.sendall(_BODY_PENDING)
        answer = slow.recv(4096)  # within the body timeout, not never
        assert answer.startswith(b"HTTP/1.1 408")
        deadline = time.monotonic() + 5
        while slow.recv(4096) and time.monotonic() < deadline:  # then the connection is closed
            pass
        slow.close()
        health = _health(sink.http_port)
    finally:
        sink.stop()
    assert health["rejected"]["body_timeout"] == 1


def test_at_the_connection_cap_with_every_connection_in_a_request_a_new_one_is_closed(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, ("jsonl",), max_connections=3)
    try:
        held = [socket.create_connection(("127.0.0.1", sink.http_port), timeout=10) for _ in range(3)]
        for s in held:
            s.sendall(_BODY_PENDING)  # each is in a request, waiting for its body
        time.sleep(0.5)  # let the server take their headers: there is no event to wait on from outside
        extra = socket.create_connection(("127.0.0.1", sink.http_port), timeout=10)
        assert extra.recv(16) == b""  # closed at once
        extra.close()
        for s in held:
            s.close()
        health = _serves_again(sink.http_port)  # once the held ones are gone, the sink serves again
    finally:
        sink.stop()
    assert health["rejected"]["too_many_connections"] >= 1


def _closed_by_the_sink(s: socket.socket) -> bool:
    """Whether the sink closed `s` (an orderly close, or a reset when it still held unread bytes)."""
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True


def test_slow_connections_never_lock_senders_out(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, ("jsonl",), max_connections=16, header_timeout_s=2.0)
    try:
        # Slow-loris: 64 connections that send part of their headers, and one that sends nothing at all.
        silent = socket.create_connection(("127.0.0.1", sink.http_port), timeout=30)
        slow = [socket.create_connection(("127.0.0.1", sink.http_port), timeout=30) for _ in range(64)]
        for s in slow:
            s.sendall(b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\n")
        # A sender still gets in: the oldest connections without a whole request make room.
        assert _post(sink.http_port, metrics_request({"train.run.id": "in"}, [OtlpPoint("loss", 1.0, step=1)])) == 200
        assert _closed_by_the_sink(silent)  # closed to make room, or after the header timeout
        silent.close()
        # Within the header timeout every slow connection is closed, even with the cap not reached.
        few = [socket.create_connection(("127.0.0.1", sink.http_port), timeout=30) for _ in range(3)]
        for s in few:
            s.sendall(b"POST /v1/metrics HTTP/1.1\r\n")
            assert _closed_by_the_sink(s)
            s.close()
        for s in slow:
            s.close()
        sink.flush(30)
        health = _health(sink.http_port)
    finally:
        sink.stop()
    assert _gauges(tmp_path / "runs" / "in" / "rank0.jsonl") == [("loss", 1, 1.0)]
    assert health["rejected"]["header_timeout"] >= 3
    assert health["rejected"]["connection_closed_for_room"] >= 64 + 1 - 16, health["rejected"]
    assert "too_many_connections" not in health["rejected"]


def test_grpc_messages_over_the_limit_are_counted(tmp_path: Path) -> None:
    import grpc

    sink = make_sink(tmp_path, ("jsonl",), max_body_bytes=4096)
    try:
        body = _request("big", [(f"m{i}", 1.0, 1) for i in range(120)])
        assert 4096 < len(body) < 8192
        with grpc.insecure_channel(f"127.0.0.1:{sink.grpc_port}") as channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(_METHOD)(body, timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _health(sink.http_port)["rejected"] == {"too_large": 1}
    finally:
        sink.stop()


def test_grpc_requests_larger_than_the_inline_size_are_written_like_small_ones(tmp_path: Path) -> None:
    """Requests over `INLINE_BYTES` leave the receiver's loop for a thread: written in full all the same, and a
    malformed one is answered INVALID_ARGUMENT (counted) as a small one is."""
    import grpc

    from otel_train.sink.receive.grpc_server import INLINE_BYTES

    sink = make_sink(tmp_path, ("jsonl",))
    try:
        points = [(f"m{i}", float(i), step) for step in range(10) for i in range(1000)]
        big = _request("big", points)
        small = _request("big", [("small", 1.0, 10)])
        assert len(big) > INLINE_BYTES > len(small)
        with grpc.insecure_channel(f"127.0.0.1:{sink.grpc_port}") as channel:
            call = channel.unary_unary(_METHOD)
            call(big, timeout=30)
            call(small, timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                call(big[:-3], timeout=30)  # cut inside its last point
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert sink.flush(30)
        health = _health(sink.http_port)
        assert health["rejected"] == {"invalid": 1}
        rows = [(r["tag"], r["step"], r["value"]) for r in read_jsonl(run_folder(tmp_path / "runs", "big") / "rank0.jsonl")
                if r["type"] == "metric"]
        assert sorted(rows) == sorted([(name, step, value) for name, value, step in points] + [("small", 10, 1.0)])
    finally:
        sink.stop()


def test_a_token_on_the_command_line_is_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "otel_train.sink", "--token", "s3cret", "--dir", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--token: a token on the command line is visible" in run.stderr
    assert "OTEL_TRAIN_SINK_TOKEN" in run.stderr


def test_token_file(tmp_path: Path) -> None:
    from otel_train.errors import ConfigError
    from otel_train.sink.settings import load_sink_settings

    path = tmp_path / "token"
    path.write_text("from-file\n")
    assert load_sink_settings({"OTEL_TRAIN_SINK_TOKEN_FILE": str(path)}).token == "from-file"
    assert load_sink_settings({"OTEL_TRAIN_SINK_TOKEN_FILE": str(path), "OTEL_TRAIN_SINK_TOKEN": "env"}).token == "env"
    assert load_sink_settings({"OTEL_TRAIN_SINK_TOKEN": "env"}, token_file=str(path)).token == "from-file"
    with pytest.raises(ConfigError, match="OTEL_TRAIN_SINK_TOKEN_FILE: cannot read"):
        load_sink_settings({"OTEL_TRAIN_SINK_TOKEN_FILE": str(tmp_path / "missing")})


def test_binding_beyond_loopback_without_a_token_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_train.sink.service"):
        sink = make_sink(tmp_path, ("jsonl",))
        sink.stop()
        assert not [r for r in caplog.records if "without a token" in r.getMessage()]
        sink = make_sink(tmp_path, ("jsonl",), http="0.0.0.0:0")
        sink.stop()
    warned = [r.getMessage() for r in caplog.records if "without a token" in r.getMessage()]
    assert len(warned) == 1 and "0.0.0.0:0" in warned[0] and "OTEL_TRAIN_SINK_TOKEN" in warned[0]


def _jsonl_metrics(folder: Path) -> list[tuple[str, int, float]]:
    """Every metric row of a run's rank-0 JSONL file as (name, step, value), in file order (NaN as a string)."""
    return [(r["name"], r["step"], r["value"] if r["value"] == r["value"] else "nan")
            for r in read_jsonl(folder / "rank0.jsonl") if r.get("type") == "metric"]


def test_infinite_counter_points_are_counted_and_kept_out_of_the_total(tmp_path: Path) -> None:
    inf = float("inf")
    points = [OtlpPoint("tokens", v, step=s, kind="sum") for s, v in enumerate([10, inf, 10, -inf, 10])]
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        assert _post(sink.http_port, metrics_request({"train.run.id": "inf"}, points)) == 200
        sink.flush(30)
        runs = {r["run_id"]: r for r in sink.runs()["runs"]}
    finally:
        sink.stop()
    assert _jsonl_metrics(tmp_path / "runs" / "inf") == [("tokens", 0, 10), ("tokens", 2, 20), ("tokens", 4, 30)]
    assert runs["inf"]["nan_points"] == 2


def test_a_nan_gauge_re_sent_unchanged_is_written_once(tmp_path: Path) -> None:
    nan = float("nan")
    # A cumulative sender re-sends every past point with each export: the NaN at step 1 comes three times.
    exports = [[OtlpPoint("loss", v, step=s) for s, v in enumerate([0.5, nan, 0.25][:n])] for n in (2, 3, 3)]
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        for points in exports:
            assert _post(sink.http_port, metrics_request({"train.run.id": "nan"}, points)) == 200
        sink.flush(30)
    finally:
        sink.stop()
    assert _jsonl_metrics(tmp_path / "runs" / "nan") == [("loss", 0, 0.5), ("loss", 1, "nan"), ("loss", 2, 0.25)]


def test_a_resource_attribute_that_is_no_rank_is_invalid_on_both_protocols(tmp_path: Path) -> None:
    import grpc

    body = metrics_request({"train.run.id": "rank", "train.rank": float("inf")}, [OtlpPoint("loss", 1.0, step=1)])
    sink = make_sink(tmp_path, ("jsonl",))
    try:
        assert _post(sink.http_port, body) == 400
        with grpc.insecure_channel(f"127.0.0.1:{sink.grpc_port}") as channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(_METHOD)(body, timeout=10)
        rejected = _health(sink.http_port)["rejected"]
    finally:
        sink.stop()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED, which senders retry
    assert "train.rank" in str(err.value.details())
    assert rejected == {"invalid": 2}


def test_a_large_http_body_is_taken_off_the_event_loop(tmp_path: Path) -> None:
    import threading

    body = metrics_request({"train.run.id": "big"}, [OtlpPoint(f"m{i % 100}", 1.0, step=i // 100)
                                                      for i in range(20_000)])
    assert len(body) > 256 * 1024
    sink = make_sink(tmp_path, ("jsonl",))
    taking, release = threading.Event(), threading.Event()
    ingest = sink.router.ingest

    def held_ingest(decoded: Any) -> None:  # the large request stays in the sink until /health has answered
        taking.set()
        release.wait(30)
        ingest(decoded)

    sink.router.ingest = held_ingest
    statuses: list[int] = []
    poster = threading.Thread(target=lambda: statuses.append(_post(sink.http_port, body)))
    try:
        poster.start()
        assert taking.wait(30)
        health = _health(sink.http_port)  # answered while the large request is being taken
        release.set()
        poster.join(30)
        sink.flush(30)
    finally:
        release.set()
        sink.stop()
    assert health["status"] == "ok"
    assert statuses == [200]
    assert len(_gauges(tmp_path / "runs" / "big" / "rank0.jsonl")) == 20_000
