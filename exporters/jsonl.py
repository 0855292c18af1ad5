"""Every row as one JSON line: the durable local record of a run.

Rows of rank N are appended to ``<dir>/<run_name>/rank<N>.jsonl``; each line has a ``type``
(``metric``, ``histogram``, ``span`` or ``log``), the run identity (``run_id``, ``run_name``, ``rank``) and
the row's fields (a span with events has ``events``: name, time, attributes; ``kind`` when not internal,
``links`` when it has some). A log record has ``step`` (null outside any step), ``time_unix_nano``,
``severity_number``, ``severity_text``, ``body``, ``logger``, ``attributes`` (``exception.stacktrace`` and
the others of docs/semantic-conventions.md) and, when a span was active, ``trace_id`` / ``span_id``. Lines are handed to the OS after every window and fsynced on flush. Before each
append the file and its size are reported (`RowExporter.mark_appending`): a window a killed process appended
but had not recorded as written is cut back out before delivery writes it again, so it is in the file once.
An append that fails (a full disk) leaves nothing behind and is retried whole once there is space; a run folder
deleted during the run is noticed at the next append, said once, and a new file is started where it was
(`otel_train.ship.file_append`).

A run that ended on SIGTERM, SIGUSR1 or SIGHUP (preemption) ends with ``{"type": "preempted", "signal": "SIGTERM"}``.
A resumed run (`OTEL_TRAIN_RESUME_STEP` = N) first appends a ``{"type": "resume", "step": N}`` record:
rows after it supersede the earlier attempt's rows at steps >= N (`resolve_resumes` applies that).

Non-finite floats are written as Python's ``json`` writes them, the literals ``NaN``,
``Infinity`` and ``-Infinity`` (not strict JSON, but `json.loads` and `read_jsonl` read them back
to the same floats). Trace and span ids are lower-case hex, as in OTLP/JSON.

Example:
    >>> import tempfile
    >>> from otel_train.exporters.base import Window
    >>> from otel_train.config.exporter_options import ExporterOptions
    >>> from otel_train.vocab.rows import MetricRow
    >>> from otel_train.vocab.run_identity import RunInfo
    >>> d = tempfile.mkdtemp()
    >>> row = MetricRow(RunInfo("r1", "demo"), 3, "train/loss", "train/loss", 0.5, "gauge", 1)
    >>> with JsonlExporter(ExporterOptions(directory=d)) as exp:
    ...     _ = exp.export_window(Window(metrics=[row]))
    >>> [(r["type"], r["step"], r["value"]) for r in read_jsonl(exp.paths[0])]
    [('metric', 3, 0.5)]
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import RowExporter
from otel_train.ship.file_append import AppendFile, warn_recreated
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.run_paths import run_folder

__all__ = ["JsonlExporter", "jsonl_path", "read_jsonl", "resolve_resumes"]



def jsonl_path(directory: str | os.PathLike[str], run_name: str, rank: int) -> Path:
    """Where the rows of `rank` of run `run_name` are appended."""
    return run_folder(directory, run_name) / f"rank{rank}.jsonl"


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of a file written by `JsonlExporter`; a line cut off by a killed writer is skipped
    (the last line, or one a later writer ended before appending, see `JsonlExporter`)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # written when the process died
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # torn by a kill; the window it belonged to was written again after it
                yield record


def _torn_tail(path: Path) -> bool:
    """Whether the file ends in the middle of a line."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


def resolve_resumes(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """`records` as the run stands: a ``resume`` record at step N drops the metric and histogram
    records at steps >= N written before it (by an earlier attempt of the same rank).

    Example:
        >>> recs = [{"type": "metric", "rank": 0, "step": s, "value": s} for s in (0, 1, 2)]
        >>> recs += [{"type": "resume", "rank": 0, "step": 1}, {"type": "metric", "rank": 0, "step": 1, "value": 9}]
        >>> [(r["step"], r["value"]) for r in resolve_resumes(recs) if r["type"] == "metric"]
        [(0, 0), (1, 9)]
    """
    out: list[dict[str, Any]] = []
    for record in records:
        if record.get("type") == "resume":
            rank, step = record.get("rank"), record["step"]
            out = [r for r in out if not (r.get("type") in ("metric", "histogram") and r.get("rank") == rank
                                          and r.get("step", -1) >= step)]
        out.append(record)
    return out


def _span_record(s: SpanRow) -> dict[str, Any]:
    record = {
        "type": "span", **_run_fields(s.run), "step": s.step, "name": s.name,
        "trace_id": f"{s.trace_id:032x}", "span_id": f"{s.span_id:016x}",
        "parent_span_id": None if s.parent_span_id is None else f"{s.parent_span_id:016x}",
        "start_unix_nano": s.start_unix_nano, "end_unix_nano": s.end_unix_nano,
        "thread_id": s.thread_id, "thread_name": s.thread_name, "error": s.error,
        "status_message": s.status_message, "attributes": _attrs(s.attributes),
    }
    if s.events:  # only spans that have them (raw OTel spans: `add_event`, `record_exception`)
        record["events"] = [{"name": name, "time_unix_nano": t, "attributes": _attrs(attrs)}
                            for name, t, attrs in s.events]
    if s.kind:  # not internal: `opentelemetry.trace.SpanKind`'s name, lower case
        record["kind"] = _KINDS.get(s.kind, str(s.kind))
    if s.links:
        record["links"] = [{"trace_id": f"{t:032x}", "span_id": f"{i:016x}", "attributes": _attrs(attrs)}
                           for t, i, attrs in s.links]
    return record


def _log_record(g: LogRow) -> dict[str, Any]:
    record = {
        "type": "log", **_run_fields(g.run), "step": g.step, "time_unix_nano": g.time_unix_nano,
        "severity_number": g.severity_number, "severity_text": g.severity_text, "body": g.body,
        "logger": g.logger, "attributes": _attrs(g.attributes),
    }
    if g.span_id:
        record["trace_id"] = f"{g.trace_id:032x}"
        record["span_id"] = f"{g.span_id:016x}"
    return record


_KINDS = {1: "server", 2: "client", 3: "producer", 4: "consumer"}


def _run_fields(run: RunInfo) -> dict[str, Any]:
    return {"run_id": run.run_id, "run_name": run.run_name, "rank": run.rank}


def _attrs(attributes: Any) -> dict[str, Any]:
    return {str(k): list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


class JsonlExporter(RowExporter):
    """Appends metric, histogram, span and log rows as JSON lines, one file per rank.

    Args:
        options: `directory` is the root of the run folders. Default: from the `OTEL_TRAIN_*` variables.
    """

    name = "jsonl"
    kill_safe_writes = True  # every window is appended and handed to the OS before export_window returns
    handles_metrics = True
    handles_spans = True
    handles_logs = True

    def __init__(self, options: ExporterOptions | None = None) -> None:
        super().__init__(options)
        self._files: dict[tuple[str, int], tuple[Path, AppendFile]] = {}
        #: Files started again because the run folder was deleted under them (`otel_train.ship.file_append`).
        self.files_recreated = 0
        self._runs: dict[tuple[str, int], RunInfo] = {}
        self._paths: list[Path] = []

    @property
    def paths(self) -> list[Path]:
        """The files written so far (also after `close()`)."""
        return list(self._paths)

    def _file(self, run: RunInfo) -> AppendFile:
        # Append: a resumed run (or a restarted sink) continues the same record.
        key = (run.run_id, run.rank)
        entry = self._files.get(key)
        if entry is not None and entry[1].unlinked():  # the run folder was deleted: a new file where it was
            warn_recreated(entry[0].parent, self.name)
            self.files_recreated += 1
            del self._files[key]
            entry[1].close()
            entry = None
        if entry is None:
            path = jsonl_path(self.options.directory, run.run_name, run.rank)
            torn = _torn_tail(path)  # a process killed mid-line: the next record starts on a line of its own
            f = AppendFile(path)
            head = [b"\n"] if torn else []
            if self.options.resume_step is not None:
                head.append(self._resume_record(run, self.options.resume_step))
            try:
                f.append(b"".join(head))  # before the file is kept: a failure here is retried with the window
            except OSError:
                f.close()
                raise
            entry = self._files[key] = (path, f)
            if path not in self._paths:
                self._paths.append(path)
            self._runs[key] = run
        return entry[1]

    def _appending(self, files: Sequence[tuple[RunInfo, AppendFile]]) -> None:
        """Report the files about to be appended to, with their sizes (`mark_appending`)."""
        self.mark_appending([(f.path, f.size) for _, f in files])

    @staticmethod
    def _resume_record(run: RunInfo, step: int) -> bytes:
        return (json.dumps({"type": "resume", **_run_fields(run), "step": step}, separators=(",", ":")) + "\n").encode()

    def write_resume(self, run: RunInfo, step: int) -> None:
        """A ``resume`` record for `run`'s rank, now: `resolve_resumes` drops its earlier rows at steps >= `step`."""
        f = self._file(run)
        self._appending([(run, f)])
        f.append(self._resume_record(run, step))

    def _write(self, records: list[tuple[RunInfo, dict[str, Any]]], rows: Sequence[Any]) -> None:
        # Every line is encoded before the first is written, and each rank's file gets its lines in one
        # append (reported with `mark_written`): a retry after a failure never writes a line twice, and a
        # failed append leaves nothing behind (`AppendFile`).
        per_file: dict[tuple[str, int], tuple[RunInfo, list[str], list[Any]]] = {}
        for (run, record), row in zip(records, rows, strict=True):
            # default=str: an attribute value of an unexpected type must not lose the whole window.
            line = json.dumps(record, default=str, separators=(",", ":")) + "\n"
            entry = per_file.setdefault((run.run_id, run.rank), (run, [], []))
            entry[1].append(line)
            entry[2].append(row)
        files = [(run, self._file(run)) for run, _, _ in per_file.values()]
        self._appending(files)
        for (_, f), (_, lines, written) in zip(files, per_file.values()):
            f.append("".join(lines).encode())  # handed to the OS: a killed process keeps every finished window
            self.mark_written(written)

    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        records: list[tuple[RunInfo, dict[str, Any]]] = []
        written: list[MetricRow | HistogramRow] = [*rows, *histograms]
        for r in rows:
            records.append((r.run, {
                "type": "metric", **_run_fields(r.run), "step": r.step, "name": r.name, "tag": r.tag,
                "value": r.value, "kind": r.kind, "time_unix_nano": r.time_unix_nano,
                "attributes": _attrs(r.attributes),
            }))
        for h in histograms:
            records.append((h.run, {
                "type": "histogram", **_run_fields(h.run), "step": h.step, "name": h.name, "tag": h.tag,
                "count": h.count, "sum": h.sum, "min": h.min, "max": h.max,
                "explicit_bounds": list(h.explicit_bounds), "bucket_counts": list(h.bucket_counts),
                "time_unix_nano": h.time_unix_nano, "attributes": _attrs(h.attributes),
            }))
        self._write(records, written)

    def write_spans(self, rows: Sequence[SpanRow]) -> None:
        self._write([(s.run, _span_record(s)) for s in rows], rows)

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        self._write([(g.run, _log_record(g)) for g in rows], rows)

    def mark_preempted(self, cause: str) -> None:
        """Append ``{"type": "preempted", "signal": cause}`` to each rank file this run wrote, durably."""
        now = time.time_ns()
        for key in list(self._files):
            run = self._runs[key]
            record = {"type": "preempted", **_run_fields(run), "signal": cause, "time_unix_nano": now}
            self._file(run).append((json.dumps(record, separators=(",", ":")) + "\n").encode())  # a deleted folder: anew
        self.flush()

    def flush(self) -> None:
        for _, f in self._files.values():
            f.sync()

    def close(self) -> None:
        files, self._files = list(self._files.values()), {}
        for _, f in files:
            f.close()
