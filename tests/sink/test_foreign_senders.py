"""Senders we did not write: the Python OTel SDK with its defaults (PeriodicExportingMetricReader,
CUMULATIVE temporality) over OTLP/gRPC to a real sink, read back from TensorBoard."""

from __future__ import annotations

import itertools
import json
import logging
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sinkkit import scalars


def _sdk(sink: Any, resource: dict[str, Any], exponential: bool = True) -> Any:
    """A MeterProvider as a plain OTel app builds it: default reader temporality (CUMULATIVE)."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import Resource

    exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{sink.grpc_port}", insecure=True, timeout=5)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)  # exports on flush
    views = [View(instrument_name="latency", aggregation=ExponentialBucketHistogramAggregation())]
    return MeterProvider(metric_readers=[reader], resource=Resource.create(resource),
                         views=views if exponential else ())


def _get(sink: Any, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{sink.http_port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def test_python_sdk_defaults_every_instrument_kind_and_a_restart(sink: Any, tmp_path: Path) -> None:
    from opentelemetry.metrics import CallbackOptions, Observation

    resource = {"service.name": "plain-app", "train.run.id": "plain", "train.run.name": "plain"}
    gpu_mem = [0.0]

    def observe(_: CallbackOptions) -> list[Observation]:
        return [Observation(gpu_mem[0])]

    def instruments(provider: Any) -> tuple[Any, ...]:
        meter = provider.get_meter("app")
        meter.create_observable_gauge("gpu/mem", callbacks=[observe])
        return (meter.create_counter("train/tokens"), meter.create_gauge("train/loss"),
                meter.create_counter("requests"), meter.create_up_down_counter("queue"),
                meter.create_histogram("train/grad"), meter.create_histogram("latency"))

    provider = _sdk(sink, resource)
    tokens, loss, requests, queue, grad, latency = instruments(provider)
    flushed_at = []
    for step in range(50):
        attrs = {"train.step": step}
        tokens.add(100, attrs)
        loss.set(0.25 * step, attrs)  # exact in float32, as TensorBoard stores it
        requests.add(10)  # no step: the usual OTel way
        queue.add(1 if step % 2 == 0 else -1)
        for v in (0.5, 2.0, 9.0):
            grad.record(v, attrs)
        latency.record(0.25 * (step + 1))
        gpu_mem[0] = float(step // 10)
        if step % 7 == 6 or step == 49:
            assert provider.force_flush(10_000)  # a cumulative export: every series again
            flushed_at.append(step)
    provider.shutdown()
    # The process restarts from its checkpoint at step 50: a new start time, counters from 0 again.
    provider = _sdk(sink, resource)
    tokens, loss, requests, queue, grad, latency = instruments(provider)
    for step in range(50, 60):
        tokens.add(100, {"train.step": step})
        requests.add(10)
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert sink.flush(10)

    tb = scalars(tmp_path / "runs" / "plain")
    assert tb["train/tokens"] == [(s, 100.0 * (s + 1)) for s in range(60)]  # running total, once per step
    assert tb["train/loss"] == [(s, 0.25 * s) for s in range(50)]  # re-sent gauges: once per step
    # step-less counter: written at the run's current step at each export; the restart continues the total
    assert tb["requests"] == [(s, 10.0 * (s + 1)) for s in flushed_at] + [(59, 600.0)]
    assert tb["queue"] == [(s, 0.0 if s % 2 else 1.0) for s in flushed_at]  # up-down: its value
    assert tb["train/grad/count"] == [(s, 3.0) for s in range(50)]
    assert tb["train/grad/sum"] == [(s, 11.5) for s in range(50)]
    # exponential histogram (step-less): count/sum of each export window, min/max as sent
    windows = [flushed_at[0] + 1] + [b - a for a, b in itertools.pairwise(flushed_at)]
    assert tb["latency/count"] == [(s, float(n)) for s, n in zip(flushed_at, windows, strict=True)]
    assert tb["latency/max"][-1] == (49, 12.5)
    # observable gauge without a step: at the current step, written again only when it changes
    assert tb["gpu/mem"] == [(s, float(s // 10)) for s in flushed_at] + [(59, 4.0)]  # the restarted app
    assert _get(sink, "/health")["unsupported"] == {}


def test_apps_without_run_identity_stay_apart_and_are_marked(sink: Any, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_train.sink"):
        for service in ("billing", "search"):
            resource = {"service.name": service, "host.name": "node-1", "service.instance.id": ""}
            provider = _sdk(sink, resource, exponential=False)  # no instance id: service@host
            provider.get_meter("app").create_counter("requests").add(5)
            assert provider.force_flush(10_000)
            provider.shutdown()
        assert sink.flush(10)
    for run in ("billing@node-1", "search@node-1"):
        assert scalars(tmp_path / "runs" / run)["requests"] == [(0, 5.0)]  # not summed into one run
        assert any(run in r.getMessage() and "train.run.id" in r.getMessage() for r in caplog.records)
    runs = {r["run_id"]: r for r in _get(sink, "/runs")["runs"]}
    assert runs["billing@node-1"]["unattributed"] is True and runs["search@node-1"]["unattributed"] is True


def test_refused_requests_are_counted_by_reason(sink: Any) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", sink.http_port, timeout=5)
    conn.request("POST", "/v1/nothing", body=b"x", headers={"Content-Type": "application/x-protobuf"})
    assert conn.getresponse().status == 404
    conn.close()
    assert _get(sink, "/health")["rejected"] == {"not_found": 1}


def test_http_chunked_bodies_keep_alive_gzip_and_the_limit(tmp_path: Path) -> None:
    """What the OTel JavaScript exporters send: HTTP/1.1 chunked bodies on one kept-alive connection."""
    import gzip
    import http.client

    from sinkkit import make_sink

    from otel_train.testing import OtlpPoint, metrics_request

    sink = make_sink(tmp_path, max_body_bytes=4096)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", sink.http_port, timeout=5)
        headers = {"Content-Type": "application/x-protobuf"}
        socks = []
        for step in range(3):
            body = metrics_request({"train.run.id": "chunky"}, [OtlpPoint("loss", step * 0.5, step=step)])
            if step == 2:
                body, headers = gzip.compress(body), {**headers, "Content-Encoding": "gzip"}
            conn.request("POST", "/v1/metrics", body=iter([body[:7], body[7:]]), headers=headers,
                         encode_chunked=True)
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, b"")
            socks.append(conn.sock)
        assert socks[0] is socks[1] is socks[2]  # the same kept-alive connection every time
        conn.request("POST", "/v1/metrics", body=iter([b"\x00" * 3000] * 2), headers=headers, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413 and b"exceeds the limit" in resp.read()
        conn.close()
        assert sink.flush(10)
        assert sink.health()["rejected"] == {"too_large": 1}
    finally:
        sink.stop()
    assert scalars(tmp_path / "runs" / "chunky")["loss"] == [(0, 0.0), (1, 0.5), (2, 1.0)]
