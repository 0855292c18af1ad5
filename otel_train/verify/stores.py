"""Where one backend of one rank keeps its data, read back with its own reader (`otel_train.verify.readers`), and
the name it shows each recorded series under.

A backend whose store this process cannot read back (W&B online, a remote MLflow URI, ClearML with a server,
OTLP, the console, a third-party backend) is "not checked", never "pass".
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_train.verify import readers
from otel_train.verify.expected import BackendPlan, RankPlan, SeriesKey

__all__ = ["Held", "read_backend"]


@dataclasses.dataclass
class Held:
    """What one backend holds for one rank: points by the name it shows (None: scalars are not checked there),
    spans (None: it keeps none)."""

    points: list[readers.Point] | None
    name_of: Callable[[SeriesKey], str]
    spans: list[readers.SpanPoint] | None = None
    float32: bool = False
    where: str = ""
    #: The value the backend stores for a logged one, where it maps some (NaN and ±inf; docs/backends.md).
    stored: Callable[[float], float] | None = None


def _mlflow_stored(value: float) -> float:
    """MLflow stores ±inf as ±1.8e308 (the largest float)."""
    return math.copysign(sys.float_info.max, value) if math.isinf(value) else value


def _clearml_stored(value: float) -> float:
    """ClearML stores NaN and ±inf as 0."""
    return value if math.isfinite(value) else 0.0


def read_backend(plan: RankPlan, backend: BackendPlan) -> Held | str:
    """What `backend` holds for `plan`'s rank, or why it is not checked."""
    reader = _READERS.get(backend.kind)
    if reader is None:
        return f"`{backend.kind}` cannot be read back here"
    held: Held | str = reader(plan, backend)
    return held


def _run_dir(plan: RankPlan, backend: BackendPlan) -> Path:
    return plan.run_dir


def _tag(key: SeriesKey) -> str:
    return key.tag


def _wandb_key(key: SeriesKey) -> str:
    from otel_train.exporters.wandb import wandb_key

    return wandb_key(key.tag)


def _rank_tag(key: SeriesKey) -> str:
    from otel_train.exporters._runs import rank_tag

    return rank_tag(key.tag, key.name, dict(key.attributes), key.rank)


def _tensorboard(plan: RankPlan, backend: BackendPlan) -> Held:
    folder = _run_dir(plan, backend)
    if backend.info.get("ranks") == "all" and plan.world_size > 1:
        folder = folder / f"rank{plan.rank}"
    return Held(readers.tensorboard(folder), _tag, float32=True, where=str(folder))


def _jsonl(plan: RankPlan, backend: BackendPlan) -> Held:
    from otel_train.exporters.jsonl import read_jsonl, resolve_resumes

    path = plan.run_dir / f"rank{plan.rank}.jsonl"
    records = resolve_resumes(read_jsonl(path)) if path.exists() else []  # the run as it stands after a resume
    points = [readers.Point(r["tag"], r["step"], r["value"]) for r in records if r.get("type") == "metric"]
    spans = [readers.SpanPoint(r["name"], r.get("step")) for r in records if r.get("type") == "span"]
    return Held(points, _tag, spans, where=str(path))


def _chrome_trace(plan: RankPlan, backend: BackendPlan) -> Held | str:
    if backend.info.get("trace_steps"):
        return "OTEL_TRAIN_TRACE_STEPS keeps only some steps' spans"
    folder = _run_dir(plan, backend) / "trace"
    spans: list[readers.SpanPoint] = []
    for path in sorted(folder.glob(f"rank{plan.rank}.*json*")):  # a restarted writer's files too
        if path.name.startswith(f"rank{plan.rank}.") and ".trace.json" in path.name:
            spans += readers.chrome_spans(path)
    # Its counter tracks carry a time, not a step: the trace's spans are checked, its scalars are not.
    return Held(None, _tag, spans, where=str(folder))


def _wandb(plan: RankPlan, backend: BackendPlan) -> Held | str:
    from otel_train.exporters.wandb import wandb_run_id
    from otel_train.vocab.run_identity import RunInfo

    mode = plan.env.get("WANDB_MODE", "").strip().lower()
    if mode not in ("offline", "dryrun"):
        return "W&B online: its store is on the server"
    wandb_id = wandb_run_id(RunInfo(plan.run_id, plan.run_name, rank=plan.rank))
    roots = [_run_dir(plan, backend)]
    if plan.env.get("WANDB_DIR"):
        roots.append(Path(plan.env["WANDB_DIR"]))
    from otel_train.exporters.wandb import offline_run_files

    files = list(dict.fromkeys(p for root in roots for p in offline_run_files(root / "wandb", wandb_id)))
    points = [p for path in files for p in readers.wandb(path)]
    return Held(points, _wandb_key, where=", ".join(map(str, files)) or f"no offline run {wandb_id}")


def _mlflow(plan: RankPlan, backend: BackendPlan) -> Held | str:
    from otel_train.exporters._runs import RANK_SUFFIX_KEY, series_name
    from otel_train.exporters.mlflow import mlflow_key, tracking_uri_for

    uri = str(backend.info.get("tracking_uri") or "")
    if not uri:  # recorded before the backend was up, by an earlier version that left the URI out: where it writes
        directory = backend.info.get("directory")
        uri = tracking_uri_for(str(directory), plan.env) if directory else plan.env.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("sqlite:", "file:", "/")):
        return f"MLflow store {uri or '(unknown)'} is not local"

    def name_of(key: SeriesKey) -> str:
        attributes = dict(key.attributes)
        if key.rank:
            attributes[RANK_SUFFIX_KEY] = key.rank
        return mlflow_key(series_name(key.tag, key.name), attributes)

    return Held(readers.mlflow(uri, plan.run_id), name_of, where=uri, stored=_mlflow_stored)


def _trackio(plan: RankPlan, backend: BackendPlan) -> Held | str:
    from otel_train.exporters._runs import safe_name

    store = plan.env.get("TRACKIO_DIR")
    if store is None:
        from trackio import sqlite_storage

        store = str(sqlite_storage.TRACKIO_DIR)  # type: ignore[attr-defined]  # read at its import
    project = str(backend.info.get("project", "otel-train"))
    points = readers.trackio(Path(store), project, plan.run_name)
    if not points:  # a name another run had taken: the run id is appended
        points = readers.trackio(Path(store), project, f"{plan.run_name}-{safe_name(plan.run_id)}")
    return Held(points, _rank_tag, where=f"{store} ({project})")


def _clearml(plan: RankPlan, backend: BackendPlan) -> Held | str:
    from otel_train.exporters.clearml import title_series

    if plan.env.get("CLEARML_API_HOST"):
        return "ClearML with a server: its store is on the server"
    from otel_train.exporters.clearml import offline_sessions_of

    cache = Path(plan.env.get("CLEARML_CACHE_DIR") or Path.home() / ".clearml" / "cache")
    folders = offline_sessions_of(cache / "offline", plan.run_id)
    if not folders:
        return f"no ClearML offline session of this run under {cache}"

    def name_of(key: SeriesKey) -> str:
        title, series = title_series(key.name, _rank_tag(key))
        return f"{title}/{series}"

    return Held([p for f in folders for p in readers.clearml(f)], name_of,
                where=", ".join(map(str, folders)), stored=_clearml_stored)


_READERS: dict[str, Callable[[RankPlan, BackendPlan], Any]] = {
    "tensorboard": _tensorboard, "jsonl": _jsonl, "chrome_trace": _chrome_trace, "wandb": _wandb,
    "mlflow": _mlflow, "trackio": _trackio, "clearml": _clearml,
}
