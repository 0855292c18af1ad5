"""What each backend holds, read back with that backend's own reader, as LISTS of points.

Every reader returns ``[Point(name, step, value), ...]`` in the order the store gives them (never a dict
per step, so a value written twice shows up twice); a store that was never created holds nothing: ``[]``. Names are as the backend shows them; mapping a
logged key to that name is the caller's business (see tests/differential/test_differential.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reference import Point, SpanPoint

#: W&B's own history keys (a user key may start with `_` too: `_x` is the program's).
_WANDB_SYSTEM_KEYS = frozenset({"_step", "_runtime", "_timestamp"})


# -- TensorBoard: its own event-file loader, every record in file order ----------------------------------
def tensorboard(logdir: Path) -> list[Point]:
    """Every scalar of the event files directly in `logdir` (files in name order, i.e. creation order), as
    the files hold them. Not `EventAccumulator`: it purges a step that comes again after a later one as a
    restart, so a window written twice at the end of a run would read once. A ``SessionLog.START`` at step N
    (a declared resume, `OTEL_TRAIN_RESUME_STEP`) drops what came before it at steps >= N, as TensorBoard does.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog
    from tensorboard.util import tensor_util

    if not logdir.is_dir():
        return []
    out: list[Point] = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                out = [p for p in out if p.step < event.step]
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
def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON: trace viewers reject the file")


def _trace_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = json.loads(path.read_text(), parse_constant=_not_json)
    events: list[dict[str, Any]] = data["traceEvents"] if isinstance(data, dict) else data
    return events


def chrome_counters(path: Path) -> list[Point]:
    """Counter tracks (``"ph": "C"``) of logged scalars; a counter event has a time, no step. NaN and ±inf are
    the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (strict JSON); anything else that is no number fails."""
    out: list[Point] = []
    for e in _trace_events(path):
        if e.get("ph") == "C":
            value = e["args"]["value"]
            assert isinstance(value, (int, float)) or value in ("NaN", "Infinity", "-Infinity"), value
            out.append(Point(e["name"], None, float(value)))
    return out


def chrome_spans(path: Path) -> list[SpanPoint]:
    return [SpanPoint(e["name"], e.get("args", {}).get("train.step")) for e in _trace_events(path)
            if e.get("ph") == "X"]


# -- MLflow: MlflowClient on the store; the run is found by its `train.run.id` tag ----------------------
def mlflow(tracking_uri: str, train_run_id: str) -> list[Point]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = [r for e in client.search_experiments()
            for r in client.search_runs([e.experiment_id], f"tags.`train.run.id` = '{train_run_id}'")]
    assert len(runs) <= 1, f"{len(runs)} MLflow runs tagged train.run.id={train_run_id}"
    if not runs:  # nothing was logged, so no run was opened
        return []
    run_id = runs[0].info.run_id
    return [Point(key, m.step, m.value) for key in runs[0].data.metrics
            for m in client.get_metric_history(run_id, key)]


# -- W&B: the history records of an offline run's `.wandb` file --------------------------------------------
def wandb(path: Path) -> list[Point]:
    from backendkit import wandb_records

    out: list[Point] = []
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        step = items["_step"]
        out.extend(Point(k, step, float(v)) for k, v in items.items() if k not in _WANDB_SYSTEM_KEYS
                   and not k.startswith("_wandb"))
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
        out.extend(Point(k, step, _number(v)) for k, v in entry.items()
                   if k not in ("step", "timestamp") and _is_number(v))
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) or (isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity", "nan",
                                                                         "inf", "-inf"))


def _number(v: Any) -> float:
    return float(v)


# -- ClearML: the offline session's stored events (title/series per scalar) -------------------------------
def clearml_folders(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "offline").glob("*") if p.is_dir())


def clearml(folder: Path) -> list[Point]:
    """Scalars of one offline Task as ``title/series`` names, the iteration as step."""
    out: list[Point] = []
    path = folder / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            out.extend(Point(f"{ev['metric']}/{ev['variant']}", ev["iter"], ev["value"]) for ev in json.loads(line)
                       if ev.get("type") == "training_stats_scalar")
    return out


def finite_only(points: Iterable[Point]) -> list[Point]:
    return [p for p in points if math.isfinite(p.value)]


__all__ = ["chrome_counters", "chrome_spans", "clearml", "clearml_folders", "finite_only", "jsonl", "jsonl_spans",
           "mlflow", "tensorboard", "trackio", "wandb"]

