"""What each local backend holds, read back with that backend's own reader, as LISTS of points.

Every reader returns ``[Point(name, step, value), ...]`` in the order the store gives them (never a dict per
step, so a value written twice shows up twice); a store that was never created holds nothing: ``[]``. Names are
as the backend shows them. Heavy imports (TensorBoard, W&B, MLflow, Trackio) happen inside each reader.

- TensorBoard: its own event-file loader, every record of every file in file order (not `EventAccumulator`,
  which reads a step written twice at the end of a run once); a ``SessionLog.START`` at step N drops what came
  before it at steps >= N, as TensorBoard does.
- JSONL: `otel_train.exporters.jsonl.read_jsonl` (a torn last line is skipped).
- Chrome trace: the JSON file; a trace cut off by a crash (no closing ``]``) is read up to its last whole event.
- W&B: the history records of an offline run's ``.wandb`` file (LevelDB log of protobuf records).
- MLflow: `MlflowClient` on the store; the run is found by its ``train.run.id`` tag.
- Trackio: its SQLite storage, pointed at the store the run wrote.
- ClearML: the offline session's ``metrics.jsonl`` (title/series per scalar, the iteration as step).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["Point", "SpanPoint", "chrome_counters", "chrome_spans", "clearml", "clearml_folders", "finite_only",
           "jsonl", "jsonl_spans", "mlflow", "tensorboard", "trace_events", "trackio", "wandb", "wandb_records"]


class Point(NamedTuple):
    """One logged value as a backend holds it; `step` is None where a backend keeps no step."""

    name: str
    step: int | None
    value: float


class SpanPoint(NamedTuple):
    name: str
    step: int | None


#: W&B's own history keys (a user key may start with `_` too: `_x` is the program's).
_WANDB_SYSTEM_KEYS = frozenset({"_step", "_runtime", "_timestamp"})


# -- TensorBoard: its own event-file loader, every record in file order ----------------------------------
def tensorboard(logdir: Path) -> list[Point]:
    """Every scalar of the event files directly in `logdir` (files in name order, i.e. creation order), as
    the files hold them."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog
    from tensorboard.util import tensor_util

    if not logdir.is_dir():
        return []
    out: list[Point] = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                out = [p for p in out if p.step is None or p.step < event.step]
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    value = v.simple_value
                elif v.metadata.plugin_data.plugin_name == "scalars":  # as the loader migrates simple values
                    value = tensor_util.make_ndarray(v.tensor).item()
                else:
                    continue
                out.append(Point(v.tag, int(event.step), float(value)))
    return out


# -- JSON lines (the `jsonl` backend, and the sink's) ------------------------------------------------------
def _jsonl_records(path: Path) -> list[dict[str, Any]]:
    from otel_train.exporters.jsonl import read_jsonl

    return list(read_jsonl(path)) if path.exists() else []


def jsonl(path: Path) -> list[Point]:
    return [Point(r["tag"], r["step"], r["value"]) for r in _jsonl_records(path) if r["type"] == "metric"]


def jsonl_spans(path: Path) -> list[SpanPoint]:
    return [SpanPoint(r["name"], r.get("step")) for r in _jsonl_records(path) if r["type"] == "span"]


# -- Chrome trace: the JSON file chrome://tracing and Perfetto load ----------------------------------------
class TraceNotJSON(ValueError):
    """A trace holding a bare ``NaN``/``Infinity``: not JSON, so trace viewers reject the whole file."""


def _not_json(constant: str) -> Any:
    raise TraceNotJSON(f"{constant} is not JSON: trace viewers reject the file")


def trace_events(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file (plain or gzip); one cut off by a crash is read up to its last whole event.

    Raises:
        TraceNotJSON: the file holds a bare ``NaN``/``Infinity`` (viewers reject it).
    """
    if not path.exists():
        return []
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = _gunzip_what_is_there(raw)
    text = raw.decode("utf-8", "replace")
    try:
        data = json.loads(text, parse_constant=_not_json)
    except TraceNotJSON:
        raise
    except ValueError:
        data = _unterminated(text)
    events: list[dict[str, Any]] = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def _gunzip_what_is_there(raw: bytes) -> bytes:
    """What a gzip file holds, also when a crash cut it off: the writer flushes whole events (a sync flush), so the
    stream up to the cut is readable though it has no end marker (`gzip` refuses such a file with EOFError).
    Members written one after another (a trace appended to by a later process) are read in turn."""
    out = []
    while raw:
        unzip = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out.append(unzip.decompress(raw))
        except zlib.error:
            break  # a torn tail: what came before it is kept
        if not unzip.eof:
            break  # cut off: no end marker
        raw = unzip.unused_data
    return b"".join(out)


def _unterminated(text: str) -> list[Any]:
    """The whole events of a JSON array that a crash cut off (as Perfetto and chrome://tracing load it)."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    out: list[Any] = []
    i = start + 1
    while start >= 0:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        out.append(value)
    return out


#: How the trace writes NaN and ±inf counter values (strict JSON has no such numbers).
_NON_FINITE = ("NaN", "Infinity", "-Infinity")


def chrome_counters(path: Path) -> list[Point]:
    """Counter tracks (``"ph": "C"``) of logged scalars; a counter event has a time, no step. NaN and ±inf are
    the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (strict JSON); any other value that is no number fails."""
    out: list[Point] = []
    for e in trace_events(path):
        if e.get("ph") == "C":
            value = e["args"]["value"]
            if not isinstance(value, (int, float)) and value not in _NON_FINITE:
                raise ValueError(f"counter {e['name']!r} holds {value!r}, not a number")
            out.append(Point(e["name"], None, float(value)))
    return out


def chrome_spans(path: Path) -> list[SpanPoint]:
    return [SpanPoint(e["name"], e.get("args", {}).get("train.step")) for e in trace_events(path)
            if e.get("ph") == "X"]


# -- MLflow: MlflowClient on the store; the run is found by its `train.run.id` tag ----------------------
def mlflow(tracking_uri: str, train_run_id: str) -> list[Point]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = [r for e in client.search_experiments()
            for r in client.search_runs([e.experiment_id], f"tags.`train.run.id` = '{train_run_id}'")]
    if len(runs) > 1:
        raise ValueError(f"{len(runs)} MLflow runs tagged train.run.id={train_run_id}")
    if not runs:  # nothing was logged, so no run was opened
        return []
    run_id = runs[0].info.run_id
    return [Point(key, m.step, m.value) for key in runs[0].data.metrics
            for m in client.get_metric_history(run_id, key)]


# -- W&B: the history records of an offline run's `.wandb` file --------------------------------------------
_BLOCK = 32768
_HEADER = 7


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf `Record`s of a ``.wandb`` file (W&B's LevelDB-style log), in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    if (ident, magic) != (b":W&B", 0xBEE1):
        raise ValueError(f"{path} is not a W&B run file")
    off, pending = _HEADER, b""
    while off + _HEADER <= len(data):
        left = _BLOCK - off % _BLOCK
        if left < _HEADER:
            off += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[off:off + _HEADER])
        if kind == 0 and length == 0:  # zero padding up to the block end
            off += left
            continue
        if off + _HEADER + length > len(data):
            return  # a record cut off by a crash or a full disk: the file's readable part ends here (W&B's rule)
        chunk = data[off + _HEADER:off + _HEADER + length]
        off += _HEADER + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()  # type: ignore[attr-defined]  # generated protobuf module
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record
        elif kind == 2:  # FIRST
            pending = chunk
        else:  # MIDDLE
            pending += chunk


def wandb(path: Path) -> list[Point]:
    out: list[Point] = []
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        step = items["_step"]
        out.extend(Point(k, step, float(v)) for k, v in items.items() if k not in _WANDB_SYSTEM_KEYS
                   and not k.startswith("_wandb") and _is_number(v))
    return out


# -- Trackio: its SQLite storage, pointed at the store the run wrote ---------------------------------------
def trackio(trackio_dir: Path, project: str, run: str) -> list[Point]:
    from unittest import mock

    from trackio import sqlite_storage

    # Trackio reads TRACKIO_DIR once, at import; this process may have imported it for another store.
    with mock.patch.object(sqlite_storage, "TRACKIO_DIR", Path(trackio_dir)):
        logs = sqlite_storage.SQLiteStorage.get_logs(project, run)
    out: list[Point] = []
    for entry in logs:
        step = entry["step"]
        out.extend(Point(k, step, float(v)) for k, v in entry.items()
                   if k not in ("step", "timestamp") and _is_number(v))
    return out


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
        isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity", "nan", "inf", "-inf"))


# -- ClearML: the offline session's stored events (title/series per scalar) -------------------------------
def clearml_folders(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "offline").glob("*") if p.is_dir())


def clearml(folder: Path) -> list[Point]:
    """Scalars of one offline Task as ``title/series`` names, the iteration as step."""
    from otel_train.exporters.clearml import offline_scalars

    return [Point(name, step, value) for name, step, value in offline_scalars(folder)]


def finite_only(points: Iterable[Point]) -> list[Point]:
    return [p for p in points if p.value is not None and math.isfinite(p.value)]
