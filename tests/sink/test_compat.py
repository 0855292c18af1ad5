"""The old Metrics Service API on the sink, through `otel_train.compat.MetricsClient` and raw HTTP."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sinkkit import make_sink, scalars

from otel_train.compat import MetricsClient


def test_client_logs_reports_and_writes(tmp_path: Path) -> None:
    from otel_train.trace_merge import load_trace

    sink = make_sink(tmp_path, ("tensorboard", "chrome_trace"))
    try:
        url = f"http://127.0.0.1:{sink.http_port}/metrics"
        client = MetricsClient(url, run_id="old", rank=1, world_size=2)
        assert client.health_check()["status"] == "healthy"
        for step in range(3):
            assert client.log_metric(step=step, metric_name="train/loss", metric_value=1.0 / (step + 1))
            client.log_metrics_batch(step, {"eval/acc": 0.5 + step, "note": "text is ignored"},
                                     tags={"split": "val"})
            client.log_metric(step, "timeline", [{"name": "fwd", "ph": "B", "ts": 1000 * step, "pid": 0, "tid": 3}])
            client.log_metric(step, "timeline", {"name": "fwd", "ph": "E", "ts": 1000 * step + 400, "pid": 0,
                                                 "tid": 3})
            client.log_metric(step, "timeline", [{"name": "opt", "ph": "X", "ts": 1000 * step + 500, "dur": 100,
                                                  "pid": 0, "tid": 3, "args": {"lr": 0.1}}])
        assert client.get_buffered_metrics_count() == 18 and client.get_buffered_metrics_count(step=1) == 6
        client.clear_buffer(step=2)
        for step in range(2):
            result = client.report_step(step)
            assert result["status"] == "success" and result["metrics"] == 2 and result["spans"] == 2
        assert client.get_buffered_metrics_count() == 0 and client.errors == 0
        with urllib.request.urlopen(f"{url}/query_metrics?run_id=old&step=1&metric_name=eval/acc", timeout=5) as r:
            found = json.loads(r.read())
        assert found["count"] == 1 and found["metrics"][0]["metric_value"] == 1.5
        assert found["metrics"][0]["reported"] is True
        assert sink.flush(10)
    finally:
        sink.stop()
    got = scalars(tmp_path / "runs" / "old" / "rank1")
    assert got["train/loss"] == [(0, 1.0), (1, 0.5)]
    assert got["eval/acc{split=val}"] == [(0, 0.5), (1, 1.5)]
    events = load_trace(tmp_path / "runs" / "old" / "trace" / "rank1.trace.json")
    spans = sorted((e["name"], e["args"]["train.step"], e["ts"], e["dur"]) for e in events if e.get("ph") == "X")
    assert spans == [("fwd", 0, 0, 400), ("fwd", 1, 1000, 400), ("opt", 0, 500, 100), ("opt", 1, 1500, 100)]


def _post(port: int, route: str, doc: Any) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics/{route}", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_raw_old_client_requests_default_run_and_errors(tmp_path: Path) -> None:
    sink = make_sink(tmp_path)
    try:
        port = sink.http_port
        # the old client's wire format: {name: value}, no run identity -> run "compat", rank 0
        assert _post(port, "log_metrics_batch", {"step": 7, "metrics": {"loss": 2.0, "bad": None}})[0] == 200
        assert _post(port, "log_metric", {"step": 8, "metric_name": "loss", "metric_value": 1.0})[0] == 200
        assert _post(port, "clear_metrics", {"step": 8}) == (200, {"status": "success", "cleared": 1})
        assert _post(port, "report_step", {"step": 7})[1]["metrics"] == 1
        code, doc = _post(port, "log_metric", {"metric_name": "loss", "metric_value": 1.0})
        assert code == 400 and "step" in doc["message"]
        assert _post(port, "log_metrics_batch", {"step": 1, "metrics": 3})[0] == 400
        assert _post(port, "nope", {})[0] == 404
        assert sink.flush(10)
    finally:
        sink.stop()
    assert scalars(tmp_path / "runs" / "compat") == {"loss": [(7, 2.0)]}


def test_client_never_raises_when_the_sink_is_down(caplog: pytest.LogCaptureFixture) -> None:
    from rotel_proc import free_port

    client = MetricsClient(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="otel_train.compat"):
        assert client.log_metric(1, "loss", 1.0, immediate=True) is False
        assert client.log_metric(1, "loss", 1.0) is True
        assert client.report_step(1)["status"] == "error"
        assert client.report_step(2)["status"] == "error"
        assert client.health_check()["status"] == "error"
    assert client.errors == 4
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1  # logged once, counted every time


def test_report_step_on_a_backlogged_run_refuses_without_losing(tmp_path: Path) -> None:
    """A run whose backend hangs answers report_step 503 (Retry-After) at once, keeps the
    values buffered and the step unreported; the retry after the backend moved writes every value once."""
    import threading

    from otel_train.sink import Sink
    from otel_train.sink.settings import SinkSettings
    from otel_train.testing import InMemoryRowExporter

    release, entered = threading.Event(), threading.Event()

    class Stuck(InMemoryRowExporter):
        def write_metrics(self, rows: Any, histograms: Any) -> None:
            entered.set()
            release.wait(30)
            super().write_metrics(rows, histograms)

    backend = Stuck()
    sink = Sink(SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0", queue_windows=1), lambda: [backend])
    sink.start()
    port = sink.http_port
    try:
        codes = []
        for step in range(4):
            assert _post(port, "log_metric", {"step": step, "metric_name": "loss", "metric_value": step / 2})[0] == 200
            codes.append(_post(port, "report_step", {"step": step})[0])
            if step == 0:  # on a loaded machine the backend's thread may take the first window a moment later
                assert entered.wait(30)
        assert codes[:2] == [200, 200] and 503 in codes  # one in the hung backend, one queued, then refused
        refused = [s for s, c in enumerate(codes) if c == 503]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics/query_metrics", timeout=5) as resp:
            history = json.load(resp)["metrics"]
        assert [h["reported"] for h in history if h["step"] in refused] == [False] * len(refused)
        release.set()
        for step in refused:  # the client's retry
            deadline = time.monotonic() + 10
            while _post(port, "report_step", {"step": step})[0] == 503:
                assert time.monotonic() < deadline
        assert sink.flush(10)
    finally:
        release.set()
        sink.stop()
    assert [(r.step, r.value) for r in backend.metrics if r.name == "loss"] == [(s, s / 2) for s in range(4)]
    # counted in /health `rejected` (as `overloaded`, or `compat_503` where compat errors are counted by code)
    assert sum(n for reason, n in sink.rejected.items() if reason in ("overloaded", "compat_503")) >= len(refused)
