"""Spans as a Chrome Trace Event Format timeline (chrome://tracing, Perfetto UI).

One streaming file per rank: ``<dir>/<run_name>/trace/rank<N>.trace.json`` (``rank<N>.1.trace.json``
and so on when a resumed run finds the earlier file there). It uses the JSON
*array* format, written as ``[`` and then one event per line, each followed by ``,``; `close()`
appends a last metadata event and ``]``, so a cleanly closed file is valid JSON. The array format
is the one the trace viewers accept without the closing ``]``, so a file cut off by a crash still
loads (and `otel_train.trace_merge.load_trace` reads it too).

What a span becomes:
    * a complete event (``"ph": "X"``, ``ts``/``dur`` in µs since the Unix epoch);
    * ``pid`` = the rank, so merged ranks sit side by side, with ``process_name``
      ("rank 0 (host pid 1234)") and ``process_sort_index`` metadata;
    * ``tid`` = the thread that started the span (``thread.id``), with ``thread_name`` metadata
      once per thread;
    * ``args`` = the span's attributes (``train.step`` included; ``thread.id``/``thread.name`` are
      dropped, they are the tid and the thread's name);
    * an error status sets ``args.error`` to the status message (or ``true``) and
      ``"cname": "terrible"`` (red in chrome://tracing).

With ``trace_counters`` (`OTEL_TRAIN_TRACE_COUNTERS`, default on), logged scalars become counter
events (``"ph": "C"``, name = the tag, ``args = {"value": v}``), so the loss curve sits under the
timeline. Histogram statistic rows are left out of the counters. NaN and ±inf are exported as they are, as
the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (strict JSON has no such numbers; Perfetto reads a
counter's string value as a number, and `float()` reads them back).

A log record (`logging`, an uncaught exception) becomes an instant event (``"ph": "i"``, ``"s": "t"``,
``"cat": "log"``) on the track of the thread that emitted it (a DataLoader worker's record: the worker's
track), at its time; its name is the message's first line (at most 120 characters); ``args`` hold
``message`` (the whole body), ``level``, ``severity_number``, ``logger``, ``train.step`` and the record's
attributes (``exception.stacktrace`` for an exception); WARN records are ``"cname": "bad"``, ERROR and FATAL
``"terrible"``. Under ``trace_steps`` a record outside the selected steps is left out (one outside any step is kept).

A run that ended on SIGTERM, SIGUSR1 or SIGHUP (preemption) gets a process-wide instant event (``"ph": "i"``,
``"s": "p"``) named ``preempted (SIGTERM)`` at the hand-off.

Long runs: ``trace_steps`` (`OTEL_TRAIN_TRACE_STEPS`, e.g. ``100-120`` or ``every:1000:5``) keeps only
the spans and counters of those steps; ``trace_gzip`` (`OTEL_TRAIN_TRACE_GZIP`) writes
``rank<N>.trace.json.gz``. The gzip stream is sync-flushed after every window, so a file cut off
by a crash still decompresses up to its last window (`otel-train trace merge` reads it and writes a
complete file).

Before each window's append the files and their sizes are reported (`RowExporter.mark_appending`): a window a
killed process appended but had not recorded as written is cut back out of the earlier file (at a line, or with
gzip at a sync-flush point) before the restarted process writes it into its new file, so it is in the trace once.
An append that fails (a full disk) leaves nothing behind and is retried whole when there is space; a run folder
deleted during the run is noticed at the next append, said once, and a new trace file is started where it was
(`otel_train.ship.file_append`).

Example:
    >>> import tempfile
    >>> from otel_train.exporters.base import Window
    >>> from otel_train.config.exporter_options import ExporterOptions
    >>> from otel_train.vocab.rows import SpanRow
    >>> from otel_train.vocab.run_identity import RunInfo
    >>> run = RunInfo("r1", "demo")
    >>> span = SpanRow(run, "forward", 1, 2, None, 1_000_000, 3_000_000, 7, "MainThread", 0, {"train.step": 0})
    >>> with ChromeTraceExporter(ExporterOptions(directory=tempfile.mkdtemp())) as exp:
    ...     exp.export_window(Window(spans=[span]))
    True
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import zlib
from collections.abc import Container, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import RowExporter
from otel_train.ship.file_append import AppendFile, warn_recreated
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import THREAD_ID, THREAD_NAME, RunInfo
from otel_train.vocab.run_paths import run_folder

__all__ = ["ChromeTraceExporter", "trace_path"]

_logger = logging.getLogger(__name__)

_STEP = "train.step"
#: Attributes that become the event's tid and thread name instead of args.
_THREAD_ATTRS = frozenset({"thread.id", "thread.name"})
#: Chrome's reserved color name for errors (red); Perfetto ignores it and shows `args.error`.
ERROR_CNAME = "terrible"



def trace_path(directory: str | os.PathLike[str], run_name: str, rank: int, gzipped: bool = False) -> Path:
    """Where the trace of `rank` of run `run_name` is written."""
    suffix = ".trace.json.gz" if gzipped else ".trace.json"
    return run_folder(directory, run_name) / "trace" / f"rank{rank}{suffix}"


def json_safe(value: Any) -> Any:
    """A value JSON can hold strictly (trace viewers reject NaN): non-finite floats become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    return str(value)


def counter_value(value: float) -> float | str:
    """A counter's value in strict JSON: the number, or ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``.

    Example:
        >>> [counter_value(v) for v in (0.5, math.nan, math.inf, -math.inf)]
        [0.5, 'NaN', 'Infinity', '-Infinity']
    """
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _us(unix_nano: int) -> float:
    """Nanoseconds since the epoch as the format's microseconds (a double: ~0.25 µs resolution today).

    Absolute times, not times since the run start, so the ranks' files line up when merged.
    """
    return round(unix_nano / 1000.0, 3)


def span_event(row: SpanRow, pid: int, tid: int) -> dict[str, Any]:
    """The complete event (``"ph": "X"``) of a finished span; errors carry the status and a red colour."""
    args = {k: json_safe(v) for k, v in row.attributes.items() if k not in _THREAD_ATTRS}
    if row.step is not None:
        args.setdefault(_STEP, row.step)
    event: dict[str, Any] = {"name": row.name, "cat": "span", "ph": "X", "ts": _us(row.start_unix_nano),
                             "dur": _us(max(0, row.end_unix_nano - row.start_unix_nano)), "pid": pid,
                             "tid": tid, "args": args}
    if row.error:
        args["error"] = row.status_message or True
        event["cname"] = ERROR_CNAME
    return event


def span_event_marks(row: SpanRow, pid: int, tid: int) -> list[dict[str, Any]]:
    """The span's own events (``add_event``, ``record_exception``) as instant events on its thread track."""
    return [{"name": name, "cat": "span_event", "ph": "i", "s": "t", "ts": _us(t), "pid": pid, "tid": tid,
             "args": {k: json_safe(v) for k, v in attrs.items()}} for name, t, attrs in row.events]


_LOG_NAME_CHARS = 120


def log_event(row: LogRow, pid: int, tid: int) -> dict[str, Any]:
    """The instant event (``"ph": "i"``, thread scope) of a log record, on its thread's track."""
    args: dict[str, Any] = {"message": row.body, "level": row.severity_text, "severity_number": row.severity_number,
                            "logger": row.logger}
    if row.step is not None:
        args[_STEP] = row.step
    args.update((k, json_safe(v)) for k, v in row.attributes.items() if k not in _THREAD_ATTRS)
    if row.span_id:
        args["trace_id"] = f"{row.trace_id:032x}"
        args["span_id"] = f"{row.span_id:016x}"
    first = row.body.split("\n", 1)[0]
    event: dict[str, Any] = {"name": first[:_LOG_NAME_CHARS] or row.severity_text or "log", "cat": "log", "ph": "i",
                             "s": "t", "ts": _us(row.time_unix_nano), "pid": pid, "tid": tid, "args": args}
    if row.severity_number >= 17:  # ERROR, FATAL
        event["cname"] = ERROR_CNAME
    elif row.severity_number >= 13:  # WARN
        event["cname"] = "bad"
    return event


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One event as a line of the array (strict JSON, then ``,``)."""
    return json.dumps(event, allow_nan=False, separators=(",", ":")).encode() + b",\n"


def _fallback_tid(thread_name: str) -> int:
    """A stable small tid for spans recorded without `thread.id` (same name -> same tid)."""
    return 1 + zlib.crc32(thread_name.encode()) % 99_999 if thread_name else 1


class _RankTrace:
    """The streaming file of one rank, and which thread names it already holds.

    Events are appended a window at a time (`AppendFile`: a failed append leaves nothing behind); with gzip,
    each window is its own sync-flushed piece of one deflate stream, and a failed one also rewinds the
    compressor (a copy taken before), so the stream goes on as if the window had never been tried.
    """

    def __init__(self, path: Path, run: RunInfo, gzipped: bool = False) -> None:
        self.path = path
        self.pid = run.rank
        self.run = run
        self._threads: set[int] = set()
        self._file = AppendFile(path)
        # wbits 31: a gzip header, then the deflate stream; the trailer comes at `close`.
        self._deflate = zlib.compressobj(6, zlib.DEFLATED, 31) if gzipped else None
        self._pending = bytearray(b"[\n")  # emitted, not appended yet
        label = f"rank {run.rank}"
        if run.host or run.pid:
            label += f" ({run.host or '?'} pid {run.pid})"
        self.emit({"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": label}})
        self.emit({"name": "process_sort_index", "ph": "M", "pid": self.pid, "args": {"sort_index": run.rank}})

    def unlinked(self) -> bool:
        return self._file.unlinked()

    def emit(self, event: Mapping[str, Any]) -> None:
        self._pending += encode_event(event)

    def size_before_append(self) -> int:
        """The file's size in bytes with everything emitted so far appended (a new file's header is appended
        here), i.e. where a window appended next starts: with gzip, at a sync-flush point."""
        self.push()
        return self._file.size

    def emit_all(self, encoded: list[bytes], threads: Mapping[int, str]) -> None:
        """Append events encoded beforehand (one append), after the names of the threads new to the file."""
        head = [encode_event({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                              "args": {"name": name or f"thread {tid}"}})
                for tid, name in threads.items() if tid not in self._threads]
        self._append(b"".join([self._pending, *head, *encoded]))
        self._pending.clear()
        self._threads.update(threads)

    def _append(self, data: bytes, last: bool = False) -> None:
        deflate = self._deflate
        if deflate is None:
            self._file.append(data)
            return
        before = deflate.copy()
        try:
            self._file.append(deflate.compress(data) + deflate.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH))
        except BaseException:
            self._deflate = before
            raise

    def push(self) -> None:
        """Hand what was emitted to the OS: a killed process keeps it (a machine crash needs `sync`)."""
        if self._pending:
            self._append(bytes(self._pending))
            self._pending.clear()

    def sync(self) -> None:
        self.push()
        self._file.sync()

    def close(self) -> None:
        # The last event carries no trailing comma, so the array closes as valid JSON.
        end = {"name": "process_labels", "ph": "M", "pid": self.pid,
               "args": {"labels": f"run {self.run.run_name} ({self.run.run_id})"}}
        try:
            self._append(bytes(self._pending) + (json.dumps(end, separators=(",", ":")) + "\n]\n").encode(),
                         last=True)  # with gzip: the trailer
            self._file.sync()
        finally:
            self._file.close()


class ChromeTraceExporter(RowExporter):
    """Writes spans (and, optionally, scalar counters) as one Chrome trace file per rank.

    Args:
        options: `directory` is the root of the run folders; `trace_counters` turns the counter
            events on; `trace_steps` keeps only those steps; `trace_gzip` compresses. Default: from
            the `OTEL_TRAIN_*` variables.
    """

    name = "chrome_trace"
    kill_safe_writes = True  # every window is appended and handed to the OS before export_window returns
    handles_spans = True
    handles_logs = True

    def __init__(self, options: ExporterOptions | None = None) -> None:
        super().__init__(options)
        self.handles_metrics = bool(self.options.trace_counters)
        self._ranks: dict[tuple[str, int], _RankTrace] = {}
        self._paths: list[Path] = []
        self._steps: Container[int] | None = self.options.trace_steps
        self._gzip = bool(self.options.trace_gzip)
        #: Trace files started again because the run folder was deleted under them (`otel_train.ship.file_append`).
        self.files_recreated = 0

    def _trace(self, run: RunInfo) -> _RankTrace:
        key = (run.run_id, run.rank)
        trace = self._ranks.get(key)
        if trace is not None and trace.unlinked():  # the run folder was deleted: a new trace file there
            warn_recreated(run_folder(self.options.directory, run.run_name), self.name)
            self.files_recreated += 1
            del self._ranks[key]
            trace = None
        if trace is None:
            path = trace_path(self.options.directory, run.run_name, run.rank, self._gzip)
            suffix = path.name[len(f"rank{run.rank}"):]
            n = 0
            while path.exists():  # a resumed run (or a restarted sink) keeps the earlier trace
                n += 1
                path = path.with_name(f"rank{run.rank}.{n}{suffix}")
            trace = self._ranks[key] = _RankTrace(path, run, self._gzip)
            self._paths.append(path)
            _logger.debug("chrome trace of rank %d at %s", run.rank, path)
        return trace

    @property
    def paths(self) -> list[Path]:
        """The trace files written so far (also after `close()`)."""
        return list(self._paths)

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        # Each rank's events are encoded in full, then appended in one write (reported with `mark_written`):
        # a retry after a failure never writes an event twice.
        per_rank: dict[tuple[str, int], tuple[RunInfo, list[bytes], dict[int, str], list[SpanRow]]] = {}
        steps = self._steps
        for row in rows:
            if steps is not None and row.step not in steps:  # a step-less span is in no selection
                continue
            _, encoded, threads, written = per_rank.setdefault((row.run.run_id, row.run.rank),
                                                               (row.run, [], {}, []))
            pid = row.run.rank
            tid = row.thread_id or _fallback_tid(row.thread_name)
            threads.setdefault(tid, row.thread_name)
            encoded.append(encode_event(span_event(row, pid, tid)))
            encoded.extend(encode_event(mark) for mark in span_event_marks(row, pid, tid))
            written.append(row)
        traces = [(self._trace(run), encoded, threads, written) for run, encoded, threads, written in per_rank.values()]
        self._appending([trace for trace, *_ in traces])
        for trace, encoded, threads, written in traces:
            trace.emit_all(encoded, threads)
            trace.push()
            self.mark_written(written)

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        per_rank: dict[tuple[str, int], tuple[RunInfo, list[bytes], dict[int, str], list[LogRow]]] = {}
        steps = self._steps
        for row in rows:
            if steps is not None and row.step is not None and row.step not in steps:
                continue
            _, encoded, threads, written = per_rank.setdefault((row.run.run_id, row.run.rank),
                                                               (row.run, [], {}, []))
            thread_name = str(row.attributes.get(THREAD_NAME, ""))
            tid = _int_or_none(row.attributes.get(THREAD_ID)) or _fallback_tid(thread_name)
            if thread_name:
                threads.setdefault(tid, thread_name)
            encoded.append(encode_event(log_event(row, row.run.rank, tid)))
            written.append(row)
        traces = [(self._trace(run), encoded, threads, written) for run, encoded, threads, written in per_rank.values()]
        self._appending([trace for trace, *_ in traces])
        for trace, encoded, threads, written in traces:
            trace.emit_all(encoded, threads)
            trace.push()
            self.mark_written(written)

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        per_rank: dict[tuple[str, int], tuple[RunInfo, list[bytes], list[MetricRow]]] = {}
        for row in rows:
            if row.kind == "histogram" or not row.time_unix_nano:
                continue
            if self._steps is not None and row.step not in self._steps:
                continue
            _, encoded, written = per_rank.setdefault((row.run.run_id, row.run.rank), (row.run, [], []))
            encoded.append(encode_event({"name": row.tag, "ph": "C", "ts": _us(row.time_unix_nano),
                                         "pid": row.run.rank, "args": {"value": counter_value(row.value)}}))
            written.append(row)
        traces = [(self._trace(run), encoded, written) for run, encoded, written in per_rank.values()]
        self._appending([trace for trace, _, _ in traces])
        for trace, encoded, written in traces:
            trace.emit_all(encoded, {})
            trace.push()
            self.mark_written(written)

    def _appending(self, traces: Sequence[_RankTrace]) -> None:
        """Report the files this write appends to, with their sizes (`RowExporter.mark_appending`): a window a
        killed process appended but had not recorded is cut back out (a restarted process writes a new file)."""
        if traces:
            self.mark_appending([(trace.path, trace.size_before_append()) for trace in traces])

    def mark_preempted(self, cause: str) -> None:
        """A process-wide instant event ``preempted (SIGTERM)`` on each rank's track, at the hand-off."""
        ts = _us(time.time_ns())
        for trace in self._ranks.values():
            trace.emit({"name": f"preempted ({cause})", "cat": "otel_train", "ph": "i", "s": "p", "ts": ts,
                        "pid": trace.pid, "tid": 0, "args": {"signal": cause}})
        self.flush()

    def flush(self) -> None:
        for trace in self._ranks.values():
            trace.sync()

    def close(self) -> None:
        traces, self._ranks = list(self._ranks.values()), {}
        errors: list[BaseException] = []
        for trace in traces:
            try:
                trace.close()
            except OSError as err:  # close the other ranks' files anyway
                errors.append(err)
        if errors:
            raise errors[0]
