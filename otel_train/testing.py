"""Test helpers: in-memory exporters (what a backend would have received, row by row) and OTLP
request builders (what a sender would have sent)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from otel_train.backend import RowExporter
from otel_train.config.exporter_options import ExporterOptions
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow

__all__ = ["InMemoryRowExporter", "OtlpPoint", "metrics_request", "set_any_value"]


class InMemoryRowExporter(RowExporter):
    """Keeps every row it is given; `fail_times` makes the first N writes raise (fault injection).

    Example:
        >>> from otel_train.backend import Window
        >>> from otel_train.vocab.rows import MetricRow
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> mem = InMemoryRowExporter()
        >>> _ = mem.export_window(Window([MetricRow(RunInfo("r", "r"), 1, "loss", "loss", 0.5, "gauge", 0)]))
        >>> mem.values("loss")
        [(1, 0.5)]
    """

    name = "memory"
    handles_metrics = True
    handles_spans = True
    handles_logs = True

    def __init__(self, options: ExporterOptions | None = None, *, fail_times: int = 0) -> None:
        super().__init__(options or ExporterOptions())
        self.metrics: list[MetricRow] = []
        self.histograms: list[HistogramRow] = []
        self.spans: list[SpanRow] = []
        self.logs: list[LogRow] = []
        self.fail_times = fail_times
        self.closed = False
        self.flushes = 0
        self._rows_lock = threading.Lock()

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        self._maybe_fail()
        with self._rows_lock:
            self.metrics.extend(rows)
            self.histograms.extend(histograms)

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        self._maybe_fail()
        with self._rows_lock:
            self.spans.extend(rows)

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        self._maybe_fail()
        with self._rows_lock:
            self.logs.extend(rows)

    def _maybe_fail(self) -> None:
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("injected failure")

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True

    def values(self, tag: str, rank: int | None = None) -> list[tuple[int, float]]:
        """Every point of one series as (step, value), in the order written: a step written twice shows twice."""
        with self._rows_lock:
            return [(r.step, r.value) for r in self.metrics if r.tag == tag and (rank is None or r.rank == rank)]

    def by_step(self, tag: str, rank: int | None = None) -> dict[int, float]:
        """Step -> value of one series, for looking a step up.

        Raises:
            AssertionError: a step was written more than once (a duplicate is a failure, never hidden).
        """
        out: dict[int, float] = {}
        for step, value in self.values(tag, rank):
            if step in out:
                raise AssertionError(f"{tag!r}: step {step} written twice ({out[step]!r}, then {value!r})")
            out[step] = value
        return out


@dataclasses.dataclass(frozen=True)
class OtlpPoint:
    """One data point of an OTLP metrics request (`metrics_request` groups points into metrics).

    Attributes:
        kind: ``gauge``, ``sum`` or ``histogram`` (then `histogram` holds count, sum, bounds, counts).
        step: The `train.step` attribute; None for a step-less point.
        cumulative: The temporality of a sum or histogram (the OTel SDK default); else DELTA.
    """

    name: str
    value: float | int = 0.0
    step: int | None = None
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    kind: str = "gauge"
    cumulative: bool = False
    monotonic: bool = True
    time_unix_nano: int = 1
    start_time_unix_nano: int = 0
    histogram: tuple[int, float, Sequence[float], Sequence[int]] | None = None


def set_any_value(target: Any, value: Any) -> None:
    """Set an OTLP `AnyValue` from a Python value (bool, int, float or str)."""
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    else:
        target.string_value = str(value)


def metrics_request(resource: Mapping[str, Any], points: Iterable[OtlpPoint]) -> bytes:
    """An encoded `ExportMetricsServiceRequest`: one Resource, one metric per (name, kind, temporality).

    Example:
        >>> body = metrics_request({"train.run.id": "r"}, [OtlpPoint("train/loss", 0.5, step=1)])
        >>> from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics
        >>> decode_metrics(parse_metrics(body), DecodeCache()).points
        1
    """
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    for name, value in resource.items():
        set_any_value(rm.resource.attributes.add(key=name).value, value)
    sm = rm.scope_metrics.add()
    metrics: dict[tuple[str, str, bool, bool], Any] = {}
    for p in points:
        key = (p.name, p.kind, p.cumulative, p.monotonic)
        metric = metrics.get(key)
        if metric is None:
            metric = metrics[key] = sm.metrics.add(name=p.name)
            if p.kind == "sum":
                metric.sum.aggregation_temporality = 2 if p.cumulative else 1
                metric.sum.is_monotonic = p.monotonic
            elif p.kind == "histogram":
                metric.histogram.aggregation_temporality = 2 if p.cumulative else 1
        if p.kind == "histogram":
            count, total, bounds, counts = p.histogram or (0, 0.0, (), ())
            dp = metric.histogram.data_points.add(count=count, sum=total, explicit_bounds=bounds, bucket_counts=counts)
        else:
            dp = (metric.gauge if p.kind == "gauge" else metric.sum).data_points.add()
            if isinstance(p.value, int):
                dp.as_int = p.value
            else:
                dp.as_double = p.value
        dp.time_unix_nano = p.time_unix_nano
        dp.start_time_unix_nano = p.start_time_unix_nano
        if p.step is not None:
            dp.attributes.add(key="train.step").value.int_value = p.step
        for name, value in p.attributes.items():
            set_any_value(dp.attributes.add(key=name).value, value)
    return bytes(req.SerializeToString())
