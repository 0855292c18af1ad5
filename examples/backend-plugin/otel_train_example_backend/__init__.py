"""An example otel-train backend: every metric row as a line of ``<dir>/<run name>/rank<N>.csv``.

A backend subclasses `RowExporter`, sets its `name`, and implements the hooks for what it writes. The core
calls the hooks on one thread at a time, retries a write that raised, and calls `flush` then `close` once at
shutdown. See "Writing a backend" in the documentation.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from typing import IO

from otel_train.backend import RowExporter
from otel_train.config.exporter_options import ExporterOptions
from otel_train.vocab.rows import HistogramRow, MetricRow
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.run_paths import run_folder

__all__ = ["CsvExporter"]


class CsvExporter(RowExporter):
    """Metric rows as CSV lines: ``step,tag,value`` (histograms and spans are not written)."""

    name = "example_csv"
    handles_metrics = True
    handles_spans = False

    def __init__(self, options: ExporterOptions | None = None) -> None:
        super().__init__(options)  # reads the OTEL_TRAIN_* options; `self.options` holds them
        self._files: dict[RunInfo, IO[str]] = {}

    def _writer(self, run: RunInfo) -> csv.DictWriter[str]:
        f = self._files.get(run)
        if f is None:  # one file per rank of a run, opened at its first row
            folder = run_folder(self.options.directory, run.run_name)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank{run.rank}.csv"
            f = self._files[run] = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115 - closed in close()
            if f.tell() == 0:
                f.write("step,tag,value\n")
        return csv.DictWriter(f, ["step", "tag", "value"])

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        for row in rows:  # one window's rows; raising here makes the core retry the window
            self._writer(row.run).writerow({"step": row.step, "tag": row.tag, "value": repr(row.value)})

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
