"""The backends of the training process, fed by the same `Delivery` as the exporter process's.

Exporter objects passed to `init(exporters=[...])` (otel-train backends and plain OTel exporters alike),
third-party entry-point backends, and every named backend under `OTEL_TRAIN_EXPORT_PROCESS=off` run here.
The reader hands this channel each window as it hands the exporter process one (`send_window`,
`send_resume`, `flush`, `close`); here the window is not encoded, it goes straight into a memory-only
`otel_train.ship.delivery.Delivery`: one thread and one bounded queue per backend, windows merged while a
backend is busy, the oldest dropped (and counted) past that, the same retry, flush and shutdown. Plain
OTel exporters are adapted by `otel_train.ship.otel_adapter`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from otel_train.backend import RowExporter, Window
from otel_train.ship.delivery import Delivery
from otel_train.ship.framing import Resume
from otel_train.ship.logged_record import LoggedRecord
from otel_train.ship.otel_adapter import as_row_exporter
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

__all__ = ["LocalDelivery"]

_logger = logging.getLogger(__name__)


class LocalDelivery:
    """In-process backends behind the reader's window channel.

    Args:
        exporters: `RowExporter`s and plain OTel `MetricExporter` / `SpanExporter`s.
        queue_windows: Windows queued per backend (merged while it is busy) before the oldest is dropped.
        resource: The Resource plain OTel exporters' requests carry (the reader's).
        record: Opens the record of what was logged for these backends (`otel_train.ship.logged_record`;
            None, or returning None: no record).
    """

    def __init__(self, exporters: Sequence[Any], queue_windows: int = 16,
                 resource: Callable[[], Resource] | None = None,
                 record: Callable[[Mapping[str, RowExporter]], LoggedRecord | None] | None = None) -> None:
        self.exporters = list(exporters)
        backends: dict[str, RowExporter] = {}
        for exporter in self.exporters:
            row_exporter = as_row_exporter(exporter, resource)
            name, n = row_exporter.name, 1
            while name in backends:  # two exporters of one kind: distinct threads and counters
                n += 1
                name = f"{row_exporter.name}-{n}"
            backends[name] = row_exporter
        self.delivery = Delivery(backends, None, max(1, queue_windows), thread_name="otel-train-export")
        if record is not None:
            self.delivery.record = record(backends)

    def send_window(self, run: RunInfo, points: Sequence[tuple[str, int, float, int]],
                    metrics: Sequence[MetricRow] = (), histograms: Sequence[HistogramRow] = (),
                    spans: Sequence[SpanRow] = (), logs: Sequence[LogRow] = ()) -> None:
        """Queue one window for every backend (never waits)."""
        rows = [MetricRow(run, s, key, key, v, "gauge", t) for key, s, v, t in points]
        rows.extend(metrics)
        if not rows and not histograms and not spans and not logs:
            return
        max_step = max((r.step for r in rows), default=-1)
        self.delivery.put(Window(rows, histograms, spans, logs), max_step)

    def send_resume(self, run: RunInfo, step: int) -> None:
        """The run restarts at `step`: each backend applies it after every window queued before it."""
        self.delivery.put(Resume(run, step, 0), -1)

    def flush(self, deadline: float) -> bool:
        """Wait until every backend has written and flushed everything queued so far, or `deadline`."""
        return self.delivery.flush(deadline)

    def stop(self) -> None:
        """Start the hand-off (each backend delivers what is left, then shuts down); `close` waits for it."""
        self.delivery.stop()

    def close(self, deadline: float) -> bool:
        """Deliver what is left and shut every backend down, by `deadline`; a backend still busy then is
        abandoned (its thread is a daemon) and named in a warning."""
        ok = self.delivery.close(deadline)
        for name in self.delivery.still_running():
            _logger.warning("exporter `%s` did not shut down in time; abandoned", name)
        return ok

    def restart_after_fork(self) -> None:
        self.delivery.restart_after_fork()

    @property
    def dropped_windows(self) -> int:
        """Windows dropped from a full queue, over every backend, and by backends after their retries."""
        return sum(int(s["dropped"]) for s in self.delivery.backend_stats().values())

    def rows_lost(self) -> dict[str, dict[str, int]]:
        """Per backend: rows it did not write, by cause (`Delivery.rows_lost`: its own causes and delivery's)."""
        return self.delivery.rows_lost()

    def failures(self) -> dict[str, int]:
        """Per backend: failed writes."""
        return {name: int(s["failures"]) for name, s in self.delivery.backend_stats().items()}
