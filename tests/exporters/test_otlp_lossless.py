"""OTLP end to end without loss: an exponential histogram, units and descriptions recorded through the OTel API
reach the sink's rows as they were recorded — straight to the sink, and through the real `rotel` collector.

The path: the SDK's own aggregation (a View makes the histogram exponential) -> `OTLPExporter` (rows, then one
OTLP request from them) -> [rotel] -> `otel-train sink` (OTLP decoded into rows, spooled as msgpack, read back)
-> an in-memory backend of the sink.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "sink"))  # the sink tests' helpers

from rotel_proc import Rotel

from otel_train.config.exporter_options import ExporterOptions
from otel_train.sink.settings import SinkSettings
from otel_train.testing import InMemoryRowExporter
from otel_train.vocab.rows import ExponentialBuckets
from otel_train.vocab.rows import explicit_buckets as explicit_buckets_of

VALUES = (0.0, 0.3, 1.0, 1.5, 2.0, 3.0, 7.5, 100.0)  # a histogram takes no negative values


def _sink(tmp_path: Path, received: InMemoryRowExporter) -> Any:
    from otel_train.sink import Sink

    settings = SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0")
    return Sink(settings, lambda: [received], tmp_path / "runs").start()


def _record(port: int, monkeypatch: pytest.MonkeyPatch) -> ExponentialBuckets:
    """Record through the OTel API into a MeterProvider whose reader exports with `OTLPExporter` to `port`."""
    from opentelemetry.sdk.metrics import Histogram, MeterProvider
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        InMemoryMetricReader,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import Resource

    from otel_train.exporters.otlp import OTLPExporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    exporter = OTLPExporter(ExporterOptions())
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    # What the SDK aggregated, read beside: what must arrive.
    sdk = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    provider = MeterProvider(
        metric_readers=[reader, sdk],
        resource=Resource.create({"train.run.id": "lossless", "train.run.name": "lossless"}),
        views=[View(instrument_name="step_time", aggregation=ExponentialBucketHistogramAggregation(max_size=20))],
    )
    meter = provider.get_meter("test")
    hist = meter.create_histogram("step_time", unit="ms", description="time of one step")
    gauge = meter.create_gauge("train/lr", unit="1", description="learning rate")
    for v in VALUES:
        hist.record(v, {"train.step": 3})
    gauge.set(0.25, {"train.step": 3})
    data = sdk.get_metrics_data()
    assert data is not None
    (metric,) = [m for m in data.resource_metrics[0].scope_metrics[0].metrics if m.name == "step_time"]
    (p,) = metric.data.data_points
    provider.force_flush()
    provider.shutdown()
    assert exporter.failures == 0 and exporter.dropped_windows == 0
    return ExponentialBuckets(p.scale, p.zero_count, p.positive.offset, tuple(p.positive.bucket_counts),
                              p.negative.offset, tuple(p.negative.bucket_counts))


def _check(received: InMemoryRowExporter, recorded: ExponentialBuckets) -> None:
    (hist,) = received.histograms
    assert (hist.name, hist.step, hist.unit, hist.description) == ("step_time", 3, "ms", "time of one step")
    assert hist.count == len(VALUES) and hist.sum == sum(VALUES)
    assert (hist.min, hist.max) == (min(VALUES), max(VALUES))
    exp = hist.exponential
    assert exp == recorded  # scale, offsets and every bucket as the SDK aggregated them
    assert exp.zero_count == 1 and sum(exp.positive_counts) == 7 and sum(exp.negative_counts) == 0
    # Every value lies in the bucket the data model puts it in, at the scale the SDK chose.
    base = 2.0 ** (2.0 ** -exp.scale)
    for v in (x for x in VALUES if x > 0):
        index = next(i for i in range(len(exp.positive_counts))
                     if base ** (exp.positive_offset + i) < v <= base ** (exp.positive_offset + i + 1))
        assert exp.positive_counts[index] >= 1
    assert sum(hist.bucket_counts) == len(VALUES)  # the explicit form backends draw holds every value
    lr = [(r.step, r.value, r.unit, r.description) for r in received.metrics if r.name == "train/lr"]
    assert lr == [(3, 0.25, "1", "learning rate")]


def test_exponential_histogram_unit_and_description_reach_the_sink(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    received = InMemoryRowExporter()
    sink = _sink(tmp_path, received)
    try:
        recorded = _record(sink.grpc_port, monkeypatch)
        assert sink.flush(10)
    finally:
        sink.stop()
    _check(received, recorded)


def test_through_rotel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    received = InMemoryRowExporter()
    sink = _sink(tmp_path, received)
    rotel = Rotel(tmp_path / "rotel", sink.grpc_port).start()
    try:
        recorded = _record(rotel.grpc_port, monkeypatch)
        deadline = time.monotonic() + 30
        while not received.histograms and time.monotonic() < deadline:  # rotel batches for 50 ms
            sink.flush(1)
            time.sleep(0.05)
        assert sink.flush(10)
    finally:
        rotel.stop()
        sink.stop()
    _check(received, recorded)


def test_the_exporter_process_hand_off_keeps_them_for_the_one_conversion() -> None:
    """In a training process the rows reach the `otlp` backend through the exporter process's framing; from
    there our one conversion (`RowsToSDK`) builds what the SDK's OTLP exporter encodes: an ExponentialHistogram
    with its scale and buckets, and each metric's unit and description."""
    from opentelemetry.sdk.metrics.export import ExponentialHistogram, Gauge

    from otel_train.ship.framing import decode_window, encode_window
    from otel_train.ship.rows_to_sdk import RowsToSDK
    from otel_train.vocab.rows import HistogramRow, MetricRow
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo("lossless", "lossless")
    buckets = ExponentialBuckets(3, 1, -2, (1, 0, 2), -1, (4,))
    bounds, counts = explicit_buckets_of(buckets)
    hist = HistogramRow(run, 3, "step_time", "step_time", 8, 12.5, -1.0, 7.5, bounds, counts, 10, {}, "ms",
                        "time of one step", buckets)
    lr = MetricRow(run, 3, "train/lr", "train/lr", 0.25, "gauge", 10, {}, None, "1", "learning rate")
    payload, _ = encode_window(run, [], [lr], [hist])
    window = decode_window(payload)
    requests = list(RowsToSDK().metrics(window.metrics, window.histograms))
    metrics = {m.name: m for request in requests for rm in request.resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics}
    assert sorted(metrics) == ["step_time", "train/lr"]
    sent = metrics["step_time"]
    assert (sent.unit, sent.description, type(sent.data)) == ("ms", "time of one step", ExponentialHistogram)
    (p,) = sent.data.data_points
    assert (p.scale, p.zero_count, p.positive.offset, list(p.positive.bucket_counts), p.negative.offset,
            list(p.negative.bucket_counts)) == (3, 1, -2, [1, 0, 2], -1, [4])
    assert (p.count, p.sum, p.min, p.max, dict(p.attributes)) == (8, 12.5, -1.0, 7.5, {"train.step": 3})
    assert (metrics["train/lr"].unit, metrics["train/lr"].description, type(metrics["train/lr"].data)) == (
        "1", "learning rate", Gauge)
