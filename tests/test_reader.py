"""StepAlignedMetricReader: windows, threads, fan-out, bounded queues, isolation of failing backends."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_train as ot
from otel_train.capture.instrument import LogBuffer, SpanRecord
from otel_train.capture.step import StepEnd
from otel_train.collect import reader as reader_module
from otel_train.collect.reader import StepAlignedMetricReader
from otel_train.testing import InMemoryRowExporter


class CapturingMetricExporter(MetricExporter):
    """A plain OTel metric exporter (as OTLP would be): keeps the MetricsData it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[MetricsData] = []

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass

    def points(self) -> list[tuple[str, dict[str, Any], float]]:
        return [
            (m.name, dict(p.attributes or {}), p.value)
            for md in self.batches for rm in md.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics for p in m.data.data_points
        ]


def _end(reader: StepAlignedMetricReader, step: int) -> None:
    reader.on_step_end(StepEnd(step, 0.01, 0.01 * (step + 1), step + 1, None))


class NotifyingRowExporter(InMemoryRowExporter):
    """Wakes a waiting test when rows arrive (no polling with sleeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Condition()

    def write_metrics(self, rows: Sequence[Any], histograms: Sequence[Any]) -> None:
        super().write_metrics(rows, histograms)
        with self.arrived:
            self.arrived.notify_all()

    def wait_for(self, tag: str, n: int, timeout_s: float = 10.0) -> list[tuple[int, float]]:
        """The (step, value) points of `tag` once there are at least `n` (or `timeout_s` passed)."""
        def points() -> list[tuple[int, float]]:
            return [(r.step, r.value) for r in self.metrics if r.tag == tag]

        with self.arrived:
            self.arrived.wait_for(lambda: len(points()) >= n, timeout=timeout_s)
        return points()


def test_export_every_n_steps_windows(run_dir: Path) -> None:
    mem = NotifyingRowExporter()
    session = ot.init(exporters=[mem], dir=run_dir, export_every=4, export_interval_s=3600)
    for i in ot.steps(range(3)):
        ot.log({"loss": float(i)})
    time.sleep(0.15)  # not a wait for a thread: time passing the 0.1 s throttle must not make a window due
    assert session.reader.windows == 0  # three steps: no window due yet
    with ot.step(3):
        ot.log({"loss": 3.0})
    assert mem.wait_for("loss", 4) == [(i, float(i)) for i in range(4)]
    assert session.reader.windows == 1
    for i in ot.steps(range(4, 8), start=4):
        ot.log({"loss": float(i)})
        time.sleep(0.03)
    assert mem.wait_for("loss", 8) == [(i, float(i)) for i in range(8)]
    assert session.reader.windows == 2
    ot.flush()
    assert mem.wait_for("loss", 8) == [(i, float(i)) for i in range(8)]


def test_log_only_step_ends_wake_the_collector_at_most_every_0_1_s() -> None:
    """Steps whose records carry their step (`ot.log`, spans) need no collection of their own: of 20
    step ends 1/32 s apart, one in four wakes the collector; every value still lands at its step."""
    mem = InMemoryRowExporter()
    reader = StepAlignedMetricReader([mem], export_interval_s=3600)
    provider = MeterProvider(metric_readers=[reader])
    wakes = []
    real_set = reader._wake.set
    reader._wake.set = lambda: (wakes.append(1), real_set())[1]  # type: ignore[method-assign]
    for i in range(20):
        reader.log_buffer.append(i, {"loss": float(i)})
        reader.on_step_end(StepEnd(i, 1 / 32, i / 32, i + 1, None))
    assert len(wakes) == 5  # steps 0, 4, 8, 12, 16
    reader.force_flush()
    assert mem.values("loss") == [(i, float(i)) for i in range(20)]
    provider.shutdown()


def test_many_buffered_records_wake_the_collector_before_the_interval() -> None:
    """A step end that finds `_WAKE_RECORDS` records and spans buffered, together, wakes the collector whatever the
    time (they leave the process before the cycle collector moves them into its oldest generation); fewer wait for
    the interval. Every value and span still lands at its step."""
    mem = InMemoryRowExporter()
    reader = StepAlignedMetricReader([mem], export_interval_s=3600)
    provider = MeterProvider(metric_readers=[reader])
    records = reader_module._WAKE_RECORDS // 8 + 1  # per step, as many spans: the fourth step reaches the count
    woken_at: list[int] = []
    step = 0

    def collect_now() -> None:  # each wake collects at once, on this thread: the count starts again from 0
        woken_at.append(step)
        reader._collect_window()

    wake = reader._wake.set
    reader._wake.set = collect_now  # type: ignore[method-assign]
    for step in range(9):
        for k in range(records):
            reader.log_buffer.append(step, {f"m{k}": float(step)})
            reader.span_buffer.append(SpanRecord("work", 1, 1 + k, None, 0, 1, 1, "MainThread", step, None, None))
        reader.on_step_end(StepEnd(step, 0.001, step * 0.001, step + 1, None))  # 9 ms in all: within the 0.1 s
    assert woken_at == [0, 4, 8]
    reader._wake.set = wake  # type: ignore[method-assign]
    reader.force_flush()
    assert all(mem.values(f"m{k}") == [(i, float(i)) for i in range(9)] for k in range(records))
    assert sorted(s.step for s in mem.spans) == [i for i in range(9) for _ in range(records)]
    provider.shutdown()


def test_step_with_a_raw_instrument_without_step_is_collected_at_its_end(run_dir: Path) -> None:
    """A raw OTel gauge set without `train.step` makes its step's end wake the collector, so each
    value gets the step it was recorded in (here: the collector is given time between steps)."""
    mem = InMemoryRowExporter()
    session = ot.init(exporters=[mem], dir=run_dir, export_interval_s=3600)
    gauge = ot.get_meter().create_gauge("gpu/util")
    for i in ot.steps(range(12)):
        deadline = time.monotonic() + 10
        while session.reader.windows < i and time.monotonic() < deadline:
            time.sleep(0.002)  # the previous step's window is out
        gauge.set(float(i))
        if i % 2:
            ot.log({"loss": float(i)})
    ot.flush()
    assert mem.values("gpu/util") == [(i, float(i)) for i in range(12)]
    assert mem.values("loss") == [(i, float(i)) for i in range(1, 12, 2)]


def test_points_from_several_threads(run_dir: Path) -> None:
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, export_every=3)
    gauge = ot.get_meter().create_gauge("worker/value")

    def worker(k: int) -> None:
        for i in range(50):
            ot.log({f"w{k}/x": float(i)}, step=i)
            gauge.set(float(k * 1000 + i), {"train.step": i, "worker": k})

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for i in ot.steps(range(20)):
        ot.log({"main": float(i)})
    for t in threads:
        t.join()
    ot.flush()
    for k in range(4):
        assert mem.values(f"w{k}/x") == [(i, float(i)) for i in range(50)]
        assert mem.values(f"worker/value{{worker={k}}}") == [(i, float(k * 1000 + i)) for i in range(50)]
    assert mem.values("main") == [(i, float(i)) for i in range(20)]


def test_per_step_attributes_do_not_overflow_after_thousands_of_steps() -> None:
    """Under DELTA the SDK frees attribute sets each collection, so step 2,500 is still its own point."""
    mem = InMemoryRowExporter()
    reader = StepAlignedMetricReader([mem], export_every=100, export_interval_s=3600)
    provider = MeterProvider(metric_readers=[reader])
    gauge = provider.get_meter("t").create_gauge("loss")
    for i in range(3000):
        gauge.set(float(i), {"train.step": i})
        if i % 100 == 99:
            reader.force_flush()
    reader.force_flush()
    assert mem.values("loss") == [(i, float(i)) for i in range(3000)]
    assert not any("otel.metric.overflow" in r.attributes for r in mem.metrics)
    provider.shutdown()


def test_plugged_into_users_own_meter_provider() -> None:
    mem = InMemoryRowExporter()
    otel_metrics = CapturingMetricExporter()
    reader = StepAlignedMetricReader([mem, otel_metrics], export_interval_s=3600)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"deployment.environment": "lab"}))
    counter = provider.get_meter("user").create_counter("samples")
    for i in range(3):
        counter.add(10, {"train.step": i})
        _end(reader, i)
        reader.force_flush()
    assert mem.values("samples") == [(0, 10.0), (1, 20.0), (2, 30.0)]
    # The plain OTel exporter gets SDK data (DELTA) with train.step on every point.
    pts = otel_metrics.points()
    assert [(a["train.step"], v) for n, a, v in pts if n == "samples"] == [(0, 10), (1, 10), (2, 10)]
    # ... under the provider's own Resource.
    resources = [rm.resource.attributes for md in otel_metrics.batches for rm in md.resource_metrics]
    assert resources and all(r.get("deployment.environment") == "lab" for r in resources)
    provider.shutdown()


def test_plain_otel_exporters_get_log_gauges_and_spans_with_steps(run_dir: Path) -> None:
    otel_metrics = CapturingMetricExporter()
    otel_spans = InMemorySpanExporter()
    ot.init(exporters=[otel_metrics, otel_spans], dir=run_dir, run_id="r-7")
    for i in ot.steps(range(2)):
        with ot.span("forward", {"layer": 3}):
            ot.log({"train/loss": 2.0 - i})
    ot.flush()
    loss = [(a, v) for n, a, v in otel_metrics.points() if n == "train/loss"]
    assert loss == [({"train.step": 0}, 2.0), ({"train.step": 1}, 1.0)]
    resource = otel_metrics.batches[0].resource_metrics[0].resource.attributes
    assert resource["train.run.id"] == "r-7" and resource["train.rank"] == 0
    spans = otel_spans.get_finished_spans()
    assert [(s.name, s.attributes["train.step"], s.attributes["layer"]) for s in spans] == [
        ("forward", 0, 3), ("forward", 1, 3)]
    assert spans[0].attributes["thread.id"] == threading.get_native_id()
    assert spans[0].resource.attributes["train.run.id"] == "r-7"


def test_failing_exporter_is_isolated_counted_and_logged_once(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = InMemoryRowExporter()
    bad = InMemoryRowExporter(fail_times=10**9)
    session = ot.init(exporters=[good, bad], dir=run_dir)
    with caplog.at_level(logging.ERROR):
        for i in ot.steps(range(20)):
            ot.log({"loss": float(i)})
            ot.flush()
    assert good.values("loss") == [(i, float(i)) for i in range(20)]
    assert bad.failures >= 2  # every flush retries, and counts
    assert session.reader.failures >= bad.failures
    assert sum("exporter `memory` failed" in r.getMessage() for r in caplog.records) == 1


def test_failing_exporter_recovers_and_delivers_pending_windows(run_dir: Path) -> None:
    flaky = InMemoryRowExporter(fail_times=2)
    ot.init(exporters=[flaky], dir=run_dir)
    for i in ot.steps(range(5)):
        ot.log({"loss": float(i)})
        ot.flush()
    assert flaky.values("loss") == [(i, float(i)) for i in range(5)]
    # One failed write of a window: its row, tried alone to find a refused one, failed once more and then landed
    # (a try alone is no failure of its own).
    assert flaky.failures == 1


class HangingExporter(InMemoryRowExporter):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def write_metrics(self, rows: Sequence[Any], histograms: Sequence[Any]) -> None:
        self.entered.set()
        self.release.wait(30)
        super().write_metrics(rows, histograms)


def test_hanging_exporter_blocks_neither_training_nor_other_exporters(run_dir: Path) -> None:
    good = InMemoryRowExporter()
    hang = HangingExporter()
    session = ot.init(exporters=[hang, good], dir=run_dir, queue_size=2, shutdown_timeout_s=1)
    for i in ot.steps(range(8)):
        ot.log({"loss": float(i)})
        ot.flush(timeout_s=0.2)  # bounded even though one backend hangs
    assert hang.entered.is_set()
    assert good.values("loss") == [(i, float(i)) for i in range(8)]
    backend = next(b for b in session.reader._local.delivery._backends if b.exporter is hang)
    # The hanging backend's queue stayed bounded: windows merged into its last one while it was busy.
    assert len(backend._queue) <= 2
    assert sum(len(w.metrics) for _, _, w in backend._queue) <= 8 * 4
    start = time.monotonic()
    ot.shutdown()
    assert time.monotonic() - start < 5  # never hangs the process
    hang.release.set()


def test_flush_with_a_hanging_backend_starts_no_thread_per_call(run_dir: Path) -> None:
    """`ot.flush()` waits on the delivery's own state with its deadline: 50 flushes while a backend hangs leave
    no thread behind (before, each call started one per exporter)."""
    hang = HangingExporter()
    ot.init(exporters=[hang], dir=run_dir, shutdown_timeout_s=1)
    with ot.step(0):
        ot.log({"loss": 0.0})
    assert not ot.flush(timeout_s=0.05) and hang.entered.wait(10)
    before = threading.active_count()
    for _ in range(50):
        assert not ot.flush(timeout_s=0.01)
    assert threading.active_count() == before
    hang.release.set()
    assert ot.flush(timeout_s=10)
    assert hang.values("loss") == [(0, 0.0)]


def test_log_buffer_is_bounded_and_counts_drops(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, buffer_size=10, export_every=1000, export_interval_s=3600)
    with caplog.at_level(logging.WARNING):
        for i in range(25):
            ot.log({"x": float(i)}, step=i)
        ot.flush()
    assert mem.values("x") == [(i, float(i)) for i in range(15, 25)]  # the newest survive
    assert mem.values("otel_train.dropped_records") == [(0, 15.0)]
    assert any("dropped data" in r.getMessage() for r in caplog.records)


def test_drain_reports_gaps() -> None:
    buf = LogBuffer(3)
    for i in range(5):
        buf.append(i, {"x": i})
    items = buf.drain()
    assert [step for _, step, _, _ in items] == [2, 3, 4]
    assert buf.dropped == 2
    buf.append(5, {"x": 5})
    assert len(buf.drain()) == 1 and buf.dropped == 2


def test_interval_collects_without_steps(run_dir: Path) -> None:
    mem = InMemoryRowExporter()
    session = ot.init(exporters=[mem], dir=run_dir, export_every=10**6, export_interval_s=0.05)
    ot.log({"heartbeat": 1.0}, step=0)
    deadline = time.monotonic() + 10
    while not mem.values("heartbeat") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mem.values("heartbeat") == [(0, 1.0)]
    assert session.reader.windows >= 1


def test_flush_and_shutdown_are_idempotent(run_dir: Path) -> None:
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir)
    ot.log({"x": 1.0}, step=0)
    assert ot.flush() and ot.flush()
    ot.shutdown()
    ot.shutdown()
    assert mem.closed and mem.values("x") == [(0, 1.0)]


def test_spans_only_on_ranks_that_do_not_export_metrics(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, run_id="job")
    with ot.step(0), ot.span("forward"):
        ot.log({"loss": 1.0})
    ot.flush()
    assert mem.metrics == []
    assert [(s.name, s.run.rank) for s in mem.spans] == [("forward", 1)]


def test_forked_child_of_a_plain_reader_exports_only_its_own_points() -> None:
    """A reader in the user's own MeterProvider keeps working in a forked child (OTel's readers do), but starts
    empty there: what the parent recorded and had not collected is never exported by the child."""
    import json
    import os

    mem = InMemoryRowExporter()
    buffer = LogBuffer(1000)
    reader = StepAlignedMetricReader([mem], export_interval_s=3600, log_buffer=buffer)
    provider = MeterProvider(metric_readers=[reader])
    gauge = provider.get_meter("t").create_gauge("g")
    gauge.set(1.0, {"train.step": 1})  # pending in the SDK's aggregation
    buffer.append(1, {"logged": 1.0})  # pending in the log buffer
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            gauge.set(2.0, {"train.step": 2})
            reader.force_flush()
            os.write(w, json.dumps(sorted([m.tag, m.step, m.value] for m in mem.metrics)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        child = json.loads(pipe.read())
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert child == [["g", 2, 2.0]]
    assert reader.force_flush()
    assert sorted((m.tag, m.step, m.value) for m in mem.metrics) == [("g", 1, 1.0), ("logged", 1, 1.0)]
    provider.shutdown()
