"""TensorBoard backend: event files written with the `tensorboard` package's own writer.

No TensorFlow or torch needed. Layout: ``<dir>/<run name>/`` (so ``tensorboard --logdir <dir>``
lists runs by name); with ``OTEL_TRAIN_RANKS=all`` and several ranks, ``<dir>/<run name>/rank<N>/``.
Scalars are `simple_value` summaries tagged with the series tag (``train/loss``); histograms are
TensorBoard histograms; hyperparameters go to the HParams plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train.exporters.base import RowExporter
from otel_train.records import ExporterOptions, HistogramRow, MetricRow, RunInfo, run_folder

__all__ = ["TensorBoardExporter"]

_logger = logging.getLogger(__name__)


def _use_fast_crc() -> None:
    """Swap TensorBoard's pure-Python record checksum for google-crc32c's C one (same values).

    The checksum dominates TensorBoard's writer cost (measured: the sink writes 45k -> 71k
    points/s with it); the file format is unchanged and TensorBoard's reader verifies it.
    """
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return
    if getattr(record_writer.masked_crc32c, "_otel_train_fast", False):
        return

    def masked_crc32c(data: bytes) -> int:
        x = google_crc32c.value(bytes(data))
        return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    masked_crc32c._otel_train_fast = True  # type: ignore[attr-defined]
    record_writer.masked_crc32c = masked_crc32c


class TensorBoardExporter(RowExporter):
    """Writes scalar and histogram rows to TensorBoard event files.

    Args:
        options: Directory, hyperparameters and rank policy; default from the env vars.
        log_dir: Write every rank's events into exactly this folder instead of ``<dir>/<run name>``.
        flush_secs: How often TensorBoard's writer flushes on its own (we also flush every window
            that `force_flush` asks for and at shutdown).

    Example:
        >>> import tempfile
        >>> from otel_train.exporters.base import Window
        >>> from otel_train.records import ExporterOptions, MetricRow, RunInfo
        >>> d = tempfile.mkdtemp()
        >>> with TensorBoardExporter(ExporterOptions(directory=d)) as tb:
        ...     _ = tb.export_window(Window([MetricRow(RunInfo("r1", "demo"), 0, "loss", "loss", 1.5, "gauge", 0)]))
        >>> sorted(p.name.split(".")[0] for p in (Path(d) / "demo").iterdir())
        ['events']
    """

    name = "tensorboard"
    handles_metrics = True
    handles_spans = False

    def __init__(self, options: ExporterOptions | None = None, *, log_dir: str | Path | None = None,
                 flush_secs: float = 30.0) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as err:
            raise ModuleNotFoundError(
                "TensorBoardExporter needs tensorboard: pip install tensorboard", name="tensorboard"
            ) from err
        _use_fast_crc()
        super().__init__(options)
        self._event_pb2 = event_pb2
        self._summary_pb2 = summary_pb2
        self._writer_cls = EventFileWriter
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._flush_secs = flush_secs
        self._writers: dict[tuple[str, int], Any] = {}

    def run_dir(self, run: RunInfo) -> Path:
        """Where the events of `run` (one rank of one training run) go."""
        if self._log_dir is not None:
            return self._log_dir
        base = run_folder(self.options.directory, run.run_name)
        if self.options.ranks == "all" and run.world_size > 1:
            return base / f"rank{run.rank}"
        return base

    def _writer(self, run: RunInfo) -> Any:
        key = (run.run_id, run.rank)
        writer = self._writers.get(key)
        if writer is None:
            path = self.run_dir(run)
            path.mkdir(parents=True, exist_ok=True)
            writer = self._writer_cls(str(path), max_queue_size=1024, flush_secs=self._flush_secs)
            self._writers[key] = writer
            if self.options.hparams:
                self._write_hparams(writer, self.options.hparams, run)
        return writer

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        Summary = self._summary_pb2.Summary
        Event = self._event_pb2.Event
        # One event per (rank, step): fewer records, same curves.
        grouped: dict[tuple[RunInfo, int], tuple[list[Any], int]] = {}
        for row in rows:
            values, t = grouped.setdefault((row.run, row.step), ([], row.time_unix_nano))
            values.append(Summary.Value(tag=row.tag, simple_value=row.value))
        for h in histograms:
            values, t = grouped.setdefault((h.run, h.step), ([], h.time_unix_nano))
            values.append(Summary.Value(tag=h.tag, histo=self._histogram(h)))
        for (run, step), (values, t) in grouped.items():
            self._writer(run).add_event(Event(wall_time=t / 1e9, step=step, summary=Summary(value=values)))

    def _histogram(self, h: HistogramRow) -> Any:
        bounds = list(h.explicit_bounds)
        counts = list(h.bucket_counts)
        # OTel bounds are upper edges with an implicit +inf bucket; TB wants an edge per bucket.
        limits = bounds + [max(h.max, bounds[-1] if bounds else h.max)]
        return self._summary_pb2.HistogramProto(
            min=h.min, max=h.max, num=h.count, sum=h.sum, sum_squares=0.0,
            bucket_limit=limits[: len(counts)], bucket=counts,
        )

    def _write_hparams(self, writer: Any, hparams: Mapping[str, Any], run: RunInfo) -> None:
        """Record the run's hyperparameters for TensorBoard's HParams plugin (no TF needed)."""
        from tensorboard.plugins.hparams import metadata, plugin_data_pb2

        info = plugin_data_pb2.SessionStartInfo(group_name=run.run_id)
        for key, value in _flatten(hparams).items():
            if isinstance(value, bool):
                info.hparams[key].bool_value = value
            elif isinstance(value, (int, float)):
                info.hparams[key].number_value = float(value)
            else:
                info.hparams[key].string_value = str(value)
        content = plugin_data_pb2.HParamsPluginData(session_start_info=info, version=metadata.PLUGIN_DATA_VERSION)
        meta = self._summary_pb2.SummaryMetadata(
            plugin_data=self._summary_pb2.SummaryMetadata.PluginData(
                plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString()
            )
        )
        value = self._summary_pb2.Summary.Value(tag=metadata.SESSION_START_INFO_TAG, metadata=meta)
        writer.add_event(self._event_pb2.Event(step=0, summary=self._summary_pb2.Summary(value=[value])))

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out
