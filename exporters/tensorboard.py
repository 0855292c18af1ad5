"""TensorBoard backend: event files in TensorBoard's own record format, read by its own reader.

No TensorFlow or torch needed. Layout: ``<dir>/<run name>/`` (so ``tensorboard --logdir <dir>``
lists runs by name); with ``OTEL_TRAIN_RANKS=all`` and several ranks, ``<dir>/<run name>/rank<N>/``.
Scalars are `simple_value` summaries tagged with the series tag (``train/loss``); histograms are
TensorBoard histograms; hyperparameters go to the HParams plugin. Log records go to the Text plugin under the
tag ``logs``: one text per step of a window (its records as Markdown lines, ``**LEVEL** logger: message``, a
traceback in a code block); a record outside any step shows at the latest step written for its run, and one
that arrives after a later step's text shows at that later step (the ``logs`` series never goes back: see
below). TensorBoard's data server shows one text per step and tag: records of one step that came in two
windows show the later window's. Only the ranks whose metrics it writes (`OTEL_TRAIN_RANKS`) have their records
written. A resumed run
(`OTEL_TRAIN_RESUME_STEP` = N) starts each event file with a ``SessionLog.START`` event at step N, so
TensorBoard's readers purge the steps >= N the earlier attempt wrote; so does `ot.resume(N)` later on.

A step going backwards in a series without a declared restart is skipped here (counted, one warning naming the
series): TensorBoard's data server takes it for a restart and hides the series' later steps already logged
(its Python reader shows a zig-zag instead), so the series shows what was logged first, in every reader.

Protos come from `tensorboard.compat.proto`; each record is framed here in TensorFlow's record format (length,
masked CRC-32C of the length, data, masked CRC-32C of the data; the checksum by google-crc32c's C code), which
TensorBoard's reader verifies. Importing TensorBoard's own `RecordWriter` imports `tensorboard.summary` and its
TensorFlow stub (NumPy, fsspec, every summary plugin): 0.7-0.9 s of the backend's start for four lines of framing
whose checksum is pure Python there. We do not use its `EventFileWriter` either: without TensorFlow it opens and
closes the file for every record and hands each one to a thread of its own, which cost more than everything else
in the sink's path. Each window is appended here in one write instead, on the export thread, after reporting each
event file and its size (`RowExporter.mark_appending`): records a killed process appended but had not recorded
as written are cut back out (at a record boundary) before delivery writes them again, so each lands once.
An append that fails (a full disk) is cut back at once and retried whole when there is space; a run folder
deleted during the run is noticed at the next append, said once, and a new event file is started there
(`otel_train.ship.file_append`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import google_crc32c

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters._runs import wanted
from otel_train.exporters.base import RowExporter
from otel_train.ship.file_append import AppendFile, warn_recreated
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.run_paths import run_folder

__all__ = ["TensorBoardExporter"]

_logger = logging.getLogger(__name__)

_FLOAT32 = struct.Struct("<f")
_crc32c: Callable[[bytes], int] = google_crc32c.value  # its C implementation
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
# The HParams plugin's names (`tensorboard.plugins.hparams.metadata`, whose import pulls in NumPy and the
# TensorFlow stub): tests/exporters/test_tensorboard.py checks them against it.
_HPARAMS_PLUGIN = "hparams"
_HPARAMS_DATA_VERSION = 0
_HPARAMS_SESSION_START_TAG = "_hparams_/session_start_info"
_MAX_TAGS = 100_000  # cached per-tag encodings before the cache is reset
_file_ids = itertools.count()


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data` (the values TensorBoard's reader checks)."""
    x = _crc32c(data)
    return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    """`data` as one TFRecord: little-endian uint64 length, its masked CRC, the data, the data's masked CRC."""
    header = _LENGTH.pack(len(data))
    return header + _CRC.pack(_masked_crc32c(header)) + data + _CRC.pack(_masked_crc32c(data))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class _EventFile:
    """One event file (TensorBoard's naming), appended a window at a time, never held open.

    Not holding the file open keeps a sink with hundreds of runs x ranks within its file limit.
    A failed append is cut back (`otel_train.ship.file_append.AppendFile`), so a retried window neither duplicates
    nor corrupts records, and TensorBoard's reader never meets a torn record mid-file.
    """

    def __init__(self, directory: Path, first_event: bytes) -> None:
        path = directory / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                            f"{os.getpid()}.{next(_file_ids):06d}")  # padded: files sort in creation order
        self._records = bytearray()
        self._file = AppendFile(path, keep_open=False)
        self.path = path
        self.add(first_event)
        try:
            self.flush()
        except OSError:
            path.unlink(missing_ok=True)  # an empty file without its version event: the retry starts another
            raise

    @property
    def size(self) -> int:
        """Bytes on disk (every record a whole one): where the file can be cut back to."""
        return self._file.size

    def unlinked(self) -> bool:
        return self._file.unlinked()

    def add(self, event: bytes) -> None:
        self._records += frame_record(event)

    def flush(self) -> None:
        if not self._records:
            return
        try:
            self._file.append(bytes(self._records))
        finally:
            self._records.clear()  # landed, or cut back: the caller retries the whole window


class TensorBoardExporter(RowExporter):
    """Writes scalar and histogram rows to TensorBoard event files.

    Every window is on disk when `export_window` returns (one append per event file).

    Args:
        options: Directory, hyperparameters and rank policy; default from the env vars.
        log_dir: Write every rank's events into exactly this folder instead of ``<dir>/<run name>``.

    Example:
        >>> import tempfile
        >>> from otel_train.exporters.base import Window
        >>> from otel_train.config.exporter_options import ExporterOptions
        >>> from otel_train.vocab.rows import MetricRow
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> d = tempfile.mkdtemp()
        >>> with TensorBoardExporter(ExporterOptions(directory=d)) as tb:
        ...     _ = tb.export_window(Window([MetricRow(RunInfo("r1", "demo"), 0, "loss", "loss", 1.5, "gauge", 0)]))
        >>> sorted(p.name.split(".")[0] for p in (Path(d) / "demo").iterdir())
        ['events']
    """

    name = "tensorboard"
    kill_safe_writes = True  # every window is appended and handed to the OS before export_window returns
    stores_older_steps = False  # TensorBoard's data server would hide the later steps (module docstring)
    display_names = True
    handles_metrics = True
    handles_spans = False
    handles_logs = True

    @classmethod
    def preload(cls) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: F401
        except ImportError as err:
            raise ModuleNotFoundError(
                "TensorBoardExporter needs tensorboard: pip install tensorboard", name="tensorboard"
            ) from err

    def __init__(self, options: ExporterOptions | None = None, *, log_dir: str | Path | None = None) -> None:
        self.preload()
        from tensorboard.compat.proto import event_pb2, summary_pb2

        super().__init__(options)
        self._event_pb2 = event_pb2
        self._summary_pb2 = summary_pb2
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._writers: dict[tuple[str, int], _EventFile] = {}
        #: Event files started again because the run folder was deleted under them (`otel_train.ship.file_append`).
        self.files_recreated = 0
        self._value_prefix: dict[str, bytes] = {}
        self._log_step: dict[tuple[str, int], int] = {}  # per rank: the last step of its ``logs`` text
        # Concatenated encodings of a message merge (repeated fields append): an event is its
        # header, this field key, and the concatenation of one-value summaries.
        self._summary_key = event_pb2.Event(summary=summary_pb2.Summary()).SerializeToString()[:-1]

    def run_dir(self, run: RunInfo) -> Path:
        """Where the events of `run` (one rank of one training run) go."""
        if self._log_dir is not None:
            return self._log_dir
        base = run_folder(self.options.directory, run.run_name)
        if self.options.ranks == "all" and run.world_size > 1:
            return base / f"rank{run.rank}"
        return base

    def _writer(self, run: RunInfo) -> _EventFile:
        key = (run.run_id, run.rank)
        writer = self._writers.get(key)
        if writer is not None and writer.unlinked():  # the run folder was deleted: a new event file there
            warn_recreated(self._log_dir or run_folder(self.options.directory, run.run_name), self.name)
            self.files_recreated += 1
            del self._writers[key]
            writer = None
        if writer is None:
            path = self.run_dir(run)
            path.mkdir(parents=True, exist_ok=True)
            first = self._event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
            writer = _EventFile(path, first.SerializeToString())
            if self.options.hparams:
                self._write_hparams(writer, self.options.hparams, run)
            if self.options.resume_step is not None:
                self._add_start(writer, self.options.resume_step)
            writer.flush()  # on disk before any window: `size` is where a window's records start
            self._writers[key] = writer  # kept once whole: a failure above is retried with a file of its own
        return writer

    def _add_start(self, writer: _EventFile, step: int) -> None:
        # TensorBoard's readers drop every step >= N read before this event (from the earlier attempt,
        # in this file or an earlier one), so a resumed run shows one value per step, not a zig-zag.
        start = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
        writer.add(self._event_pb2.Event(wall_time=time.time(), step=step, session_log=start).SerializeToString())

    def write_resume(self, run: RunInfo, step: int) -> None:
        """A `SessionLog.START` event at `step` in `run`'s event file, now (see `_add_start`)."""
        writer = self._writer(run)
        self.mark_appending([(writer.path, writer.size)])
        self._add_start(writer, step)
        writer.flush()

    def _value(self, tag: str) -> bytes:
        """The encoding of a one-value Summary for `tag`, less its 4-byte float (which comes last)."""
        prefix = self._value_prefix.get(tag)
        if prefix is None:
            Summary = self._summary_pb2.Summary
            prefix = Summary(value=[Summary.Value(tag=tag, simple_value=0.0)]).SerializeToString()[:-4]
            if len(self._value_prefix) >= _MAX_TAGS:
                self._value_prefix.clear()
            self._value_prefix[tag] = prefix
        return prefix

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        # One event per (rank, step): fewer records, same curves. Scalars are encoded from cached
        # per-tag prefixes (building a protobuf per value cost more than all the rest). Each rank's events
        # are encoded in full before its one append, and the append is reported (`mark_written`): a retry
        # after a failure never writes a rank's events twice.
        grouped: dict[RunInfo, tuple[dict[int, tuple[list[bytes], int]], list[MetricRow | HistogramRow]]] = {}
        prefixes = self._value_prefix
        pack = _FLOAT32.pack
        run: RunInfo | None = None
        steps: dict[int, tuple[list[bytes], int]] = {}
        members: list[MetricRow | HistogramRow] = []
        for row in rows:
            if row.run is not run:  # rows come in long stretches of one rank
                run = row.run
                steps, members = grouped.setdefault(run, ({}, []))
            members.append(row)
            event = steps.get(row.step)
            if event is None:
                event = steps[row.step] = ([], row.time_unix_nano)
            prefix = prefixes.get(row.tag) or self._value(row.tag)
            try:
                event[0].append(prefix + pack(row.value))
            except OverflowError:  # beyond float32: infinite, as protobuf stores it
                event[0].append(prefix + pack(math.copysign(math.inf, row.value)))
        Summary = self._summary_pb2.Summary
        for h in histograms:
            run_steps, run_members = grouped.setdefault(h.run, ({}, []))
            run_members.append(h)
            event = run_steps.setdefault(h.step, ([], h.time_unix_nano))
            event[0].append(Summary(value=[Summary.Value(tag=h.tag, histo=self._histogram(h))]).SerializeToString())
        Event = self._event_pb2.Event
        writers = [self._writer(run_) for run_ in grouped]
        self.mark_appending([(w.path, w.size) for w in writers])  # before the first append (kill -9 safety)
        for writer, (events, written) in zip(writers, grouped.values()):
            encoded = []
            # In step order: one event holds every series of a step, so events in the order their steps first came
            # would put a series' step before its earlier one (rows of another series leading), and TensorBoard's
            # data server would hide the later one. Each series reaches here in step order (`stores_older_steps`).
            for step, (values, t) in sorted(events.items()):
                summary = b"".join(values)
                header = Event(wall_time=t / 1e9, step=step).SerializeToString()
                encoded.append(header + self._summary_key + _varint(len(summary)) + summary)
            for record in encoded:
                writer.add(record)
            writer.flush()
            self.mark_written(written)

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

        grouped: dict[RunInfo, dict[int, list[LogRow]]] = {}
        for row in rows:
            if not wanted(self.options, row.run):  # only ranks whose metrics it shows: one run folder per rank set
                continue
            key = (row.run.run_id, row.run.rank)
            last = self._log_step.get(key, 0)
            step = max(last, row.step if row.step is not None else last)
            self._log_step[key] = step
            grouped.setdefault(row.run, {}).setdefault(step, []).append(row)
        Summary = self._summary_pb2.Summary
        meta = self._summary_pb2.SummaryMetadata(
            plugin_data=self._summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        writers = [self._writer(run) for run in grouped]
        self.mark_appending([(w.path, w.size) for w in writers])
        for writer, steps in zip(writers, grouped.values()):
            for step, records in sorted(steps.items()):
                text = "\n\n".join(_markdown(r) for r in records)
                tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                                                string_val=[text.encode("utf-8", "replace")])
                value = Summary.Value(tag="logs", metadata=meta, tensor=tensor)
                event = self._event_pb2.Event(wall_time=records[-1].time_unix_nano / 1e9, step=step,
                                              summary=Summary(value=[value]))
                writer.add(event.SerializeToString())
            writer.flush()
        self.mark_written(rows)

    def _histogram(self, h: HistogramRow) -> Any:
        bounds = list(h.explicit_bounds)
        counts = list(h.bucket_counts)
        # OTel bounds are upper edges with an implicit +inf bucket; TB wants an edge per bucket. An empty
        # overflow bucket is left out; a full one ends at the max (if unknown: one bucket width further).
        if counts and len(counts) == len(bounds) + 1 and counts[-1] == 0:
            counts.pop()
        last = bounds[-1] if bounds else 0.0
        width = last - bounds[-2] if len(bounds) >= 2 else max(1.0, abs(last))
        top = h.max if math.isfinite(h.max) and (not bounds or h.max > last) else last + width
        limits = bounds + [top]
        lo = h.min if math.isfinite(h.min) else (bounds[0] if bounds else 0.0)
        hi = h.max if math.isfinite(h.max) else limits[len(counts) - 1] if counts else lo
        return self._summary_pb2.HistogramProto(
            min=lo, max=hi, num=h.count, sum=h.sum, sum_squares=0.0,
            bucket_limit=limits[: len(counts)], bucket=counts,
        )

    def _write_hparams(self, writer: Any, hparams: Mapping[str, Any], run: RunInfo) -> None:
        """Record the run's hyperparameters for TensorBoard's HParams plugin (no TF needed)."""
        from tensorboard.plugins.hparams import plugin_data_pb2

        info = plugin_data_pb2.SessionStartInfo(group_name=run.run_id)
        for key, value in _flatten(hparams).items():
            if isinstance(value, bool):
                info.hparams[key].bool_value = value
            elif isinstance(value, (int, float)):
                info.hparams[key].number_value = float(value)
            else:
                info.hparams[key].string_value = str(value)
        content = plugin_data_pb2.HParamsPluginData(session_start_info=info, version=_HPARAMS_DATA_VERSION)
        meta = self._summary_pb2.SummaryMetadata(
            plugin_data=self._summary_pb2.SummaryMetadata.PluginData(
                plugin_name=_HPARAMS_PLUGIN, content=content.SerializeToString()
            )
        )
        value = self._summary_pb2.Summary.Value(tag=_HPARAMS_SESSION_START_TAG, metadata=meta)
        writer.add(self._event_pb2.Event(step=0, summary=self._summary_pb2.Summary(value=[value])).SerializeToString())

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        self.flush()
        self._writers.clear()


def _markdown(row: LogRow) -> str:
    """One log record as Markdown: level, logger, message; a traceback in a code block."""
    line = f"**{row.severity_text or row.severity_number}** {row.logger}: {row.body}"
    stack = row.attributes.get("exception.stacktrace")
    return f"{line}\n\n```\n{stack}\n```" if stack else line


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out
