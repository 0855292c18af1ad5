"""Chaos: several senders at once, through the real rotel collector and directly, with random
refusals, duplicated and reordered requests, a stalled backend on one run and restarted senders. Every
backend read back (JSONL and TensorBoard, as lists of (step, value)) equals one clean delivery of what
was sent (TensorBoard through the sink's reorder hold, at its default), and `/health`'s counters add up. Bounded to well under a minute."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from backendkit import approx_points
from rotel_proc import Rotel
from sinkkit import scalars

from otel_train.config.exporter_options import ExporterOptions
from otel_train.sink.settings import SinkSettings
from otel_train.testing import OtlpPoint, metrics_request

STALL_S = 3.0  # the `sdk` run's backends hang this long at the start: the sink must hold, not refuse or lose
REFUSE = 0.2  # share of the direct senders' requests refused at random (on top of any real refusal)

OURS = """
import sys, otel_train as ot
first, last = int(sys.argv[1]), int(sys.argv[2])
ot.init()
for i in ot.steps(range(first, last), start=first):
    with ot.span("forward"):
        ot.log({"ours/loss": i * 0.5})
ot.shutdown()
"""


class _Stall:
    """A backend whose writes for run `sdk` hang until `until` (a stalled backend of one run)."""

    def __init__(self, inner: Any, until: float) -> None:
        self._inner = inner
        self._until = until

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def export_window(self, window: Any) -> Any:
        rows = window.metrics or window.spans
        if rows and rows[0].run.run_id == "sdk":
            time.sleep(max(0.0, self._until - time.monotonic()))
        return self._inner.export_window(window)


def _ours(tmp_path: Path, rotel: Rotel, first: int, last: int) -> None:
    """otel-train's own `otlp` exporter (DELTA) in a process of its own, through rotel; run twice = a restart."""
    script = tmp_path / "ours.py"
    script.write_text(OURS)
    env = {**os.environ, "OTEL_TRAIN_RUN_ID": "ours", "OTEL_TRAIN_EXPORTERS": "otlp",
           "OTEL_TRAIN_DIR": str(tmp_path / "unused"),
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rotel.grpc_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    done = subprocess.run([sys.executable, str(script), str(first), str(last)], check=False, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def _sdk(grpc_port: int, steps: range) -> None:
    """The OTel Python SDK with its defaults (CUMULATIVE, its own retries), straight to the sink over gRPC."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=200)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"train.run.id": "sdk"}))
    meter = provider.get_meter("chaos")
    tokens, loss = meter.create_counter("sdk/tokens"), meter.create_gauge("sdk/loss")
    for step in steps:
        tokens.add(step + 1, {"train.step": step})
        loss.set(step * 2.0, {"train.step": step})
        time.sleep(0.05)
    provider.shutdown()


def _raw(http_port: int, rng: random.Random, steps: range, start_ns: int) -> int:
    """A raw protobuf client: CUMULATIVE snapshots (every step so far again) and gauges, each request
    possibly duplicated, sent in shuffled order within groups of three; retried on 503. Returns refusals."""
    resource = {"train.run.id": "raw", "service.instance.id": f"raw-{start_ns}"}
    bodies = []
    for last in steps:
        points = [OtlpPoint("raw/count", float(s - steps[0] + 1), step=s, kind="sum", cumulative=True,
                            time_unix_nano=start_ns + last + 1, start_time_unix_nano=start_ns)
                  for s in range(steps[0], last + 1)]
        points.append(OtlpPoint("raw/loss", last / 4, step=last, time_unix_nano=start_ns + last + 1))
        body = metrics_request(resource, points)
        bodies.extend([body, body] if rng.random() < 0.3 else [body])
    refused = 0
    for i in range(0, len(bodies), 3):
        group = bodies[i:i + 3]
        rng.shuffle(group)
        for body in group:
            while True:
                req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/metrics", data=body,
                                             headers={"Content-Type": "application/x-protobuf"})
                try:
                    with urllib.request.urlopen(req, timeout=10):
                        break
                except urllib.error.HTTPError as err:
                    assert err.code == 503 and err.headers.get("Retry-After"), err.code
                    refused += 1
                    time.sleep(0.01)
    return refused


def _jsonl(path: Path) -> dict[str, list[tuple[int, float]]]:
    from otel_train.exporters.jsonl import read_jsonl

    out: dict[str, list[tuple[int, float]]] = {}
    for r in read_jsonl(path):
        if r.get("type") == "metric":
            out.setdefault(r["tag"], []).append((r["step"], r["value"]))
    return {tag: sorted(points) for tag, points in out.items()}


def _running(increments: list[tuple[int, float]]) -> list[tuple[int, float]]:
    total, out = 0.0, []
    for step, inc in increments:
        total += inc
        out.append((step, total))
    return out


def test_chaos_every_backend_equals_one_clean_delivery(tmp_path: Path) -> None:
    from otel_train.sink import Sink, exporter_factory

    out = tmp_path / "runs"
    make = exporter_factory(("jsonl", "tensorboard"), ExporterOptions(directory=out, ranks="all"))
    until = time.monotonic() + STALL_S

    made: list[Any] = []  # every backend the sink opened (one per run and kind), for their step-order counts

    def stalled() -> list[Any]:
        backends = make()
        made.extend(backends)
        return [_Stall(e, until) for e in backends]

    sink = Sink(SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0", spool_dir=tmp_path / "spool",
                             retry_after_s=0.2), stalled).start()
    rng = random.Random(21)
    injected = 0
    real_refusal = sink.router._refusal

    def chaotic(state: Any) -> str | None:  # on the receivers' single loop thread: one rng is safe
        nonlocal injected
        if state.run_id in ("sdk", "raw") and rng.random() < REFUSE:
            injected += 1
            return "chaos: refused at random"
        return real_refusal(state)

    sink.router._refusal = chaotic
    rotel = Rotel(tmp_path / "rotel", sink.grpc_port).start()
    raw_refused: list[int] = []
    errors: list[BaseException] = []

    def guarded(fn: Any, *args: Any) -> threading.Thread:
        def body() -> None:
            try:
                fn(*args)
            except BaseException as err:  # reported by the main thread
                errors.append(err)

        t = threading.Thread(target=body)
        t.start()
        return t

    def raw_sender() -> None:
        raw_rng = random.Random(7)
        raw_refused.append(_raw(sink.http_port, raw_rng, range(15), 1_000_000))
        raw_refused.append(_raw(sink.http_port, raw_rng, range(15, 30), 9_000_000))  # restarted: a new start time

    try:
        threads = [
            guarded(_sdk, sink.grpc_port, range(15)),
            guarded(raw_sender),
            guarded(lambda: (_ours(tmp_path, rotel, 0, 12), _ours(tmp_path, rotel, 12, 24))),
        ]
        for t in threads:
            t.join(90)
        assert not errors, errors
        # the SDK restarted: a new process start time, totals carry on
        guarded(_sdk, sink.grpc_port, range(15, 25)).join(60)
        assert not errors, errors
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            runs = {r["run_id"]: r for r in sink.runs()["runs"]}
            if runs.get("ours", {}).get("last_step") == 23:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # rotel's last batch
    finally:
        rotel.stop()
        sink.stop()
    health = sink.health()

    sdk_tokens = _running([(s, float(s + 1)) for s in range(25)])
    raw_count = _running([(s, float(s - (0 if s < 15 else 15) + 1)) for s in range(30)])
    expected = {
        "ours": {"ours/loss": [(s, s * 0.5) for s in range(24)]},
        "sdk": {"sdk/tokens": sdk_tokens, "sdk/loss": [(s, s * 2.0) for s in range(25)]},
        "raw": {"raw/count": [(s, v) for s, v in raw_count], "raw/loss": [(s, s / 4) for s in range(30)]},
    }
    written = 0
    for run_id, series in expected.items():
        jsonl = _jsonl(out / run_id / "rank0.jsonl")
        tb = scalars(out / run_id)  # one rank: TensorBoard writes in the run's folder
        for tag, points in series.items():
            assert jsonl.get(tag) == points, (run_id, tag, jsonl.get(tag))
            # TensorBoard too, although requests came reordered: the sink's reorder hold writes a late point in its
            # place (without it TensorBoard skips a point that comes after a later step of its series).
            assert tb.get(tag) == approx_points(points), (run_id, tag, tb.get(tag))  # in file order; float32
        written += sum(len(p) for p in jsonl.values())
    assert [e.step_order.counts() for e in made if e.name == "tensorboard"] == [
        {"backwards": 0, "dropped": 0}] * 3  # one TensorBoard per run, none saw a step go back
    from otel_train.exporters.jsonl import read_jsonl

    spans = sorted(r["step"] for r in read_jsonl(out / "ours" / "rank0.jsonl") if r.get("type") == "span")
    assert spans == list(range(24))  # every span once, across the sender's restart
    # /health adds up: every point taken was written once; every refusal was counted.
    assert health["points"] == written
    assert health["rejected"].get("overloaded", 0) == sink.router.refused >= injected > 0
    assert sum(raw_refused) > 0 and health["held_bytes"] == 0 and health["reorder_held"] == 0
    assert health["steps_order_skipped"] == {}
