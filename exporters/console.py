"""A compact table per export window on a terminal stream (default: standard error).

One header line per run and rank with the window's step range, then one line per tag with its last
value in the window. This is a backend, so writing to a stream is its job (the library logs
everything else through `logging`).

Example:
    >>> import io
    >>> from otel_train.exporters.base import Window
    >>> from otel_train.config.exporter_options import ExporterOptions
    >>> from otel_train.vocab.rows import MetricRow
    >>> from otel_train.vocab.run_identity import RunInfo
    >>> out = io.StringIO()
    >>> row = MetricRow(RunInfo("r1", "demo"), 3, "train/loss", "train/loss", 0.25, "gauge", 1)
    >>> with ConsoleExporter(ExporterOptions(), stream=out) as exp:
    ...     _ = exp.export_window(Window(metrics=[row]))
    >>> print(out.getvalue(), end="")
    [otel-train] demo rank 0  step 3
      train/loss  0.25
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import RowExporter
from otel_train.vocab.rows import HistogramRow, MetricRow
from otel_train.vocab.run_identity import RunInfo

__all__ = ["ConsoleExporter"]

#: Tags shown per window; the rest are counted in one line, so a window stays a glance.
MAX_TAGS = 40


class ConsoleExporter(RowExporter):
    """Prints each window's step range and every tag's last value.

    Args:
        options: Unused beyond the base class; default from the `OTEL_TRAIN_*` variables.
        stream: Where to write; default `sys.stderr` (looked up at each write).
    """

    name = "console"
    handles_metrics = True
    handles_spans = False

    def __init__(self, options: ExporterOptions | None = None, *, stream: TextIO | None = None) -> None:
        super().__init__(options)
        self._stream = stream

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        by_run: dict[tuple[str, int], tuple[RunInfo, dict[str, MetricRow], list[int]]] = {}
        for row in rows:
            if row.kind == "histogram":
                continue  # the count/sum/min/max rows of histograms would crowd the table
            _, last, steps = by_run.setdefault((row.run.run_id, row.run.rank), (row.run, {}, []))
            steps.append(row.step)
            seen = last.get(row.tag)
            if seen is None or (row.step, row.time_unix_nano) >= (seen.step, seen.time_unix_nano):
                last[row.tag] = row
        lines: list[str] = []
        for run, last, steps in sorted(by_run.values(), key=lambda item: (item[0].run_name, item[0].rank)):
            lo, hi = min(steps), max(steps)
            span = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
            lines.append(f"[otel-train] {run.run_name} rank {run.rank}  {span}")
            tags = sorted(last)
            width = max(len(t) for t in tags[:MAX_TAGS])
            lines.extend(f"  {tag:<{width}}  {last[tag].value:.6g}" for tag in tags[:MAX_TAGS])
            if len(tags) > MAX_TAGS:
                lines.append(f"  ... {len(tags) - MAX_TAGS} more tag(s)")
        if lines:
            stream = self._stream or sys.stderr
            stream.write("\n".join(lines) + "\n")
            stream.flush()

    def flush(self) -> None:
        (self._stream or sys.stderr).flush()
