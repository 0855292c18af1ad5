"""Helpers of the sink tests: an in-process sink, SDK telemetry to send, TensorBoard read-back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backendkit import tb_scalars as scalars  # noqa: F401 - the sink tests' name for it

from otel_train.config.exporter_options import ExporterOptions
from otel_train.sink.settings import SinkSettings


def make_sink(tmp_path: Path, exporters: tuple[str, ...] = ("tensorboard",), **settings: Any) -> Any:
    from otel_train.sink import Sink, exporter_factory

    options = ExporterOptions(directory=tmp_path / "runs", ranks="all")
    s = SinkSettings(**{"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", **settings})
    return Sink(s, exporter_factory(exporters, options), options.directory).start()


def resource(run_id: str, rank: int, world_size: int, run_name: str | None = None) -> Any:
    from opentelemetry.sdk.resources import Resource

    return Resource.create({
        "service.name": "test", "train.run.id": run_id, "train.run.name": run_name or run_id,
        "train.rank": rank, "train.world_size": world_size,
    })


def metrics_data(run_id: str, rank: int, world_size: int, steps: range, extra: dict[str, Any] | None = None,
                 run_name: str | None = None) -> Any:
    """MetricsData of one rank: gauge `train/loss` = rank*1000 + step, a DELTA counter `train/tokens` += 10."""
    from opentelemetry.sdk.metrics import Counter, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader

    reader = InMemoryMetricReader(preferred_temporality={Counter: AggregationTemporality.DELTA})
    mp = MeterProvider(metric_readers=[reader], resource=resource(run_id, rank, world_size, run_name))
    meter = mp.get_meter("test")
    gauge = meter.create_gauge("train/loss")
    counter = meter.create_counter("train/tokens")
    for step in steps:
        gauge.set(rank * 1000 + step, {"train.step": step, **(extra or {})})
        counter.add(10, {"train.step": step})
    data = reader.get_metrics_data()
    mp.shutdown()
    return data
