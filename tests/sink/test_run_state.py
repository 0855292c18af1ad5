"""The sink's per-run series state survives what a shared service lives through: `kill -9`, a graceful restart,
a least-recently-used close, a request sent twice. Real `otel-train sink` processes, fed the bytes the standard
OTel Python SDK encodes (CUMULATIVE, its default: every export re-sends every past step; and DELTA), read back
from TensorBoard's event files in file order and from JSONL, as lists: a point written twice shows twice."""

from __future__ import annotations

import signal
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import readback
from rotel_proc import Rotel, SinkProcess, wait_until

GAUGES = 20


class _SdkSender:
    """One rank of a training run instrumented with the OTel SDK: `GAUGES` gauges and a counter per step, each
    point with its `train.step`; `body()` is what the SDK's OTLP exporter sends for one collection."""

    def __init__(self, run_id: str, temporality: str) -> None:
        from opentelemetry.sdk.metrics import Counter, MeterProvider
        from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
        from opentelemetry.sdk.resources import Resource

        t = AggregationTemporality.CUMULATIVE if temporality == "cumulative" else AggregationTemporality.DELTA
        self.reader = InMemoryMetricReader(preferred_temporality={Counter: t})
        self.provider = MeterProvider(metric_readers=[self.reader], resource=Resource.create(
            {"service.name": "sdk", "train.run.id": run_id, "train.rank": 0, "train.world_size": 1}))
        meter = self.provider.get_meter("t")
        self.gauges = [meter.create_gauge(f"g{i}") for i in range(GAUGES)]
        self.counter = meter.create_counter("tokens")

    def step(self, step: int) -> bytes:
        from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

        for i, gauge in enumerate(self.gauges):
            gauge.set(_gauge(i, step), {"train.step": step})
        self.counter.add(step + 1, {"train.step": step})
        return bytes(encode_metrics(self.reader.get_metrics_data()).SerializeToString())


def _gauge(i: int, step: int) -> float:
    return i * 1000.0 + step


def _expected(steps: int) -> list[tuple[str, int, float]]:
    gauges = [(f"g{i}", s, _gauge(i, s)) for i in range(GAUGES) for s in range(steps)]
    totals = [("tokens", s, float(sum(range(1, s + 2)))) for s in range(steps)]  # step s adds s + 1
    return sorted(gauges + totals)


def _points(points: list[Any]) -> list[tuple[str, int, float]]:
    return sorted((p.name, p.step, p.value) for p in points if p.name == "tokens" or p.name.startswith("g"))


def _kill(sink: SinkProcess) -> None:
    sink.proc.send_signal(signal.SIGKILL)
    sink.proc.wait(10)


def _send(post: Callable[[bytes], None], body: bytes) -> None:
    """As an OTLP exporter with retries: again after a refusal or a connection error (the sink restarting)."""
    for _ in range(300):
        try:
            post(body)
            return
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    raise AssertionError("the request was never taken")


def _check(runs: Path, run_id: str, steps: int) -> None:
    expected = _expected(steps)
    assert _points(readback.jsonl(runs / run_id / "rank0.jsonl")) == expected
    assert _points(readback.tensorboard(runs / run_id)) == expected  # world size 1: the run folder


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_two_kills_and_a_graceful_restart_write_every_point_once_with_the_right_totals(
        tmp_path: Path, temporality: str) -> None:
    runs = tmp_path / "runs"
    args = ("--exporters", "tensorboard,jsonl", "--dir", str(runs), "--reorder-s", "1")
    sender = _SdkSender("job", temporality)
    steps, restarts = 90, {30: _kill, 55: _kill, 75: lambda s: s.terminate()}
    sink = SinkProcess(tmp_path / "sink0", *args).wait_ready()
    try:
        for step in range(steps):
            _send(sink.post_metrics, sender.step(step))
            stop = restarts.get(step)
            if stop is not None:  # right after an acknowledged request: its rows are in the spool, not all written
                stop(sink)
                sink = SinkProcess(tmp_path / f"sink{step}", *args).wait_ready()
        sink.settled_health()
    finally:
        assert sink.terminate() == 0
    _check(runs, "job", steps)


def test_a_cumulative_sender_through_rotel_across_two_kills_every_point_once(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    sink_port = None
    args = ["--exporters", "tensorboard,jsonl", "--dir", str(runs), "--reorder-s", "1"]
    sink = SinkProcess(tmp_path / "sink0", *args).wait_ready()
    sink_port = sink.grpc_port
    rotel = Rotel(tmp_path / "rotel", sink_port).start()
    sender = _SdkSender("job", "cumulative")
    steps = 60
    try:
        for step in range(steps):
            body = sender.step(step)
            _send(lambda b: _post_to(rotel.http_port, b), body)
            if step in (20, 40):
                time.sleep(0.3)  # rotel has handed the request over
                _kill(sink)
                sink = _SinkOnPort(tmp_path / f"sink{step}", sink_port, *args).wait_ready()
        # rotel retries what the killed sink did not acknowledge; wait for the last step's every point
        assert wait_until(lambda: _points(readback.jsonl(runs / "job" / "rank0.jsonl")) == _expected(steps), 60)
        sink.settled_health()
    finally:
        rotel.stop()
        assert sink.terminate() == 0
    _check(runs, "job", steps)


def _post_to(http_port: int, body: bytes) -> None:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/metrics", data=body,
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


class _SinkOnPort(SinkProcess):
    """A sink restarted on the gRPC port the collector sends to."""

    def __init__(self, workdir: Path, grpc_port: int, *args: str) -> None:
        super().__init__(workdir, *args, "--grpc", f"127.0.0.1:{grpc_port}")
        self.grpc_port = grpc_port
