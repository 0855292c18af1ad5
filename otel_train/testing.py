"""In-memory exporters for tests: what a backend would have received, row by row."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from otel_train.exporters.base import RowExporter
from otel_train.records import ExporterOptions, HistogramRow, MetricRow, SpanRow

__all__ = ["InMemoryRowExporter"]


class InMemoryRowExporter(RowExporter):
    """Keeps every row it is given; `fail_times` makes the first N writes raise (fault injection).

    Example:
        >>> from otel_train.exporters.base import Window
        >>> from otel_train.records import MetricRow, RunInfo
        >>> mem = InMemoryRowExporter()
        >>> _ = mem.export_window(Window([MetricRow(RunInfo("r", "r"), 1, "loss", "loss", 0.5, "gauge", 0)]))
        >>> mem.values("loss")
        {1: 0.5}
    """

    name = "memory"
    handles_metrics = True
    handles_spans = True

    def __init__(self, options: ExporterOptions | None = None, *, fail_times: int = 0) -> None:
        super().__init__(options or ExporterOptions())
        self.metrics: list[MetricRow] = []
        self.histograms: list[HistogramRow] = []
        self.spans: list[SpanRow] = []
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

    def _maybe_fail(self) -> None:
        if self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("injected failure")

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True

    def values(self, tag: str, rank: int | None = None) -> dict[int, float]:
        """Step -> value of one series (the last value when a step repeats)."""
        with self._rows_lock:
            return {r.step: r.value for r in self.metrics if r.tag == tag and (rank is None or r.rank == rank)}
