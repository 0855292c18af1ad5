"""Rows: the one shape every backend consumes.

Both paths end here. In-process, the step-aligned reader hands SDK `MetricsData` and spans to
`MetricsConverter` / `span_rows`; in the sink, OTLP protobuf requests are turned into the same rows.
A backend is written once against `MetricRow`, `HistogramRow` and `SpanRow`.

Counters arrive as DELTA sums (bounded memory in the SDK); `MetricsConverter` keeps their running
totals, so every backend shows a counter as its cumulative value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
from collections.abc import Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train import semconv
from otel_train.step import RANK_ATTRIBUTE, STEP_ATTRIBUTE

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.trace import ReadableSpan

    from otel_train.config import Route, Settings

__all__ = [
    "ExporterOptions",
    "HistogramRow",
    "MetricRow",
    "MetricsConverter",
    "RunInfo",
    "SpanRow",
    "config_hash",
    "folder_name",
    "run_folder",
    "series_tag",
    "span_rows",
]

RUN_ID = semconv.TRAIN_RUN_ID
RUN_NAME = semconv.TRAIN_RUN_NAME
LOCAL_RANK = semconv.TRAIN_LOCAL_RANK
WORLD_SIZE = semconv.TRAIN_WORLD_SIZE
CONFIG_HASH = semconv.TRAIN_CONFIG_HASH
THREAD_ID = semconv.THREAD_ID
THREAD_NAME = semconv.THREAD_NAME
PREEMPTED = semconv.RUN_PREEMPTED

#: Attributes that identify a point's step and rank; every other attribute makes a distinct series.
_SERIES_EXCLUDED = frozenset({STEP_ATTRIBUTE, RANK_ATTRIBUTE})


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """Who produced a row: one rank of one training run (from the OTel Resource)."""

    run_id: str
    run_name: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    service_name: str = "otel-train"
    host: str = ""
    pid: int = 0
    config_hash: str = ""

    def __hash__(self) -> int:
        # Rows are grouped by run per point on the export thread: hash once, not per lookup.
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.run_id, self.run_name, self.rank, self.local_rank, self.world_size,
                           self.service_name, self.host, self.pid, self.config_hash))
            object.__setattr__(self, "_hash", cached)
        return cached

    def resource_attributes(self) -> dict[str, Any]:
        """The Resource attributes of DESIGN.md for this run and rank."""
        attrs: dict[str, Any] = {
            semconv.SERVICE_NAME: self.service_name,
            RUN_ID: self.run_id,
            RUN_NAME: self.run_name,
            RANK_ATTRIBUTE: self.rank,
            LOCAL_RANK: self.local_rank,
            WORLD_SIZE: self.world_size,
            semconv.HOST_NAME: self.host or socket.gethostname(),
            semconv.PROCESS_PID: self.pid or os.getpid(),
        }
        if self.config_hash:
            attrs[CONFIG_HASH] = self.config_hash
        return attrs

    @classmethod
    def from_resource(cls, attributes: Mapping[str, Any] | None) -> RunInfo:
        """Read a RunInfo back from Resource attributes (in-process or from OTLP)."""
        attrs = attributes or {}
        run_id = str(attrs.get(RUN_ID) or attrs.get("service.instance.id") or "unknown-run")
        return cls(
            run_id=run_id,
            run_name=str(attrs.get(RUN_NAME) or run_id),
            rank=_as_int(attrs.get(RANK_ATTRIBUTE)),
            local_rank=_as_int(attrs.get(LOCAL_RANK)),
            world_size=max(1, _as_int(attrs.get(WORLD_SIZE), 1)),
            service_name=str(attrs.get("service.name") or "otel-train"),
            host=str(attrs.get("host.name") or ""),
            pid=_as_int(attrs.get("process.pid")),
            config_hash=str(attrs.get(CONFIG_HASH) or ""),
        )


def _as_int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


@dataclasses.dataclass(frozen=True)
class ExporterOptions:
    """What the runtime (or the sink) tells every backend besides the rows."""

    directory: Path = Path("otel-train-runs")
    project: str = "otel-train"
    hparams: Mapping[str, Any] | None = None
    ranks: str = "0"
    trace_counters: bool = True
    #: Per-backend routing by exporter name (`OTEL_TRAIN_<BACKEND>_*`, `init(routes=)`); see `otel_train.routing`.
    routes: Mapping[str, Route] | None = None
    trace_steps: Container[int] | None = None  # steps the Chrome trace keeps (None: all)
    trace_gzip: bool = False
    #: `OTEL_TRAIN_STEP_ORDER`: what a backend does with a step that goes backwards (see `step_order`).
    step_order: str = "warn"
    #: `OTEL_TRAIN_RESUME_STEP`: the run restarts at this step (each backend is told in its own way).
    resume_step: int | None = None

    @classmethod
    def from_env(cls) -> ExporterOptions:
        """Options from the `OTEL_TRAIN_*` variables (for exporters built with no arguments)."""
        from otel_train.config import load_settings

        return cls.from_settings(load_settings())

    @classmethod
    def from_settings(cls, s: Settings, *, directory: Path | None = None, ranks: str | None = None,
                      with_hparams: bool = True) -> ExporterOptions:
        """Options from loaded settings. The sink passes ``ranks="all"`` and no hyperparameters
        (each run brings its own); the runtime passes the directory it checked."""
        return cls(directory or s.dir, s.project, s.config if with_hparams else None, ranks or s.ranks,
                   s.trace_counters, routes=s.routes, trace_steps=s.trace_steps, trace_gzip=s.trace_gzip,
                   step_order=s.step_order, resume_step=s.resume_step if with_hparams else None)  # the sink: per run


@dataclasses.dataclass(slots=True, eq=False)
class MetricRow:
    """One value of one series at one step.

    Rows are shared by every exporter of a window: read them, never change them (not frozen
    only because frozen dataclasses cost ~4x more to build, on the export thread).

    Attributes:
        tag: `name` plus a deterministic ``{k=v,...}`` suffix for extra attributes: the key every
            backend shows (``train/loss``, ``eval/acc{split=val}``).
        kind: ``gauge``, ``counter`` (running total), ``sum`` (up-down running total) or
            ``histogram`` (count/sum/min/max rows of a histogram, tagged ``name/count`` ...).
        delta: For a sum from a DELTA point, that point's own value (what this collection added at
            this step); the `otlp` backend sends it as a DELTA point again. None otherwise.
    """

    run: RunInfo
    step: int
    name: str
    tag: str
    value: float
    kind: str
    time_unix_nano: int
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    delta: float | None = None

    @property
    def rank(self) -> int:
        return self.run.rank


@dataclasses.dataclass(slots=True, eq=False)
class HistogramRow:
    """A full explicit-bucket histogram at one step, for backends that draw histograms."""

    run: RunInfo
    step: int
    name: str
    tag: str
    count: int
    sum: float
    min: float
    max: float
    explicit_bounds: Sequence[float]
    bucket_counts: Sequence[int]
    time_unix_nano: int
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True, eq=False)
class SpanRow:
    """One finished span, with the thread that started it and its step (if any)."""

    run: RunInfo
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    start_unix_nano: int
    end_unix_nano: int
    thread_id: int
    thread_name: str
    step: int | None
    attributes: Mapping[str, Any]
    error: bool = False
    status_message: str = ""
    #: The span's events (``span.add_event``, ``record_exception``) as (name, time_unix_nano, attributes).
    events: tuple[tuple[str, int, Mapping[str, Any]], ...] = ()
    #: `opentelemetry.trace.SpanKind` as its value (0 = internal) and links as (trace_id, span_id, attributes).
    kind: int = 0
    links: tuple[tuple[int, int, Mapping[str, Any]], ...] = ()


def series_tag(name: str, attributes: Mapping[str, Any] | None) -> str:
    """The series key: `name`, plus sorted extra attributes as ``{k=v,...}``.

    Example:
        >>> series_tag("eval/acc", {"split": "val", "train.step": 3})
        'eval/acc{split=val}'
    """
    if not attributes:
        return name
    extra = [(k, v) for k, v in attributes.items() if k not in _SERIES_EXCLUDED]
    if not extra:
        return name
    extra.sort()
    return name + "{" + ",".join(f"{k}={v}" for k, v in extra) + "}"


def run_folder(directory: str | os.PathLike[str], run_name: str) -> Path:
    """The run's folder under the otel-train directory, shared by every local backend.

    A run name that is a plain file name is the folder's name as is. Any other name (a path
    separator, a control character, a leading dot or space, longer than 200 bytes, empty) is made
    one readable path component and suffixed with ``~`` and a short hash of the real name, so two
    different names never share a folder (``team/a``, ``team_a``, ``.team_a`` and ``" team_a "``
    are four folders).

    Example:
        >>> run_folder("runs", "exp-1").as_posix()
        'runs/exp-1'
        >>> run_folder("runs", "../a/b").as_posix()
        'runs/_a_b~8e7e11e418'
    """
    return Path(directory) / folder_name(run_name)


_UNSAFE_IN_FOLDER = re.compile(r"[/\\\x00-\x1f\x7f]")
_MAX_FOLDER_BYTES = 200


def folder_name(run_name: str) -> str:
    """The one path component `run_folder` uses for `run_name` (injective: see `run_folder`)."""
    if (run_name and run_name == run_name.strip() and not run_name.startswith(".")
            and len(run_name.encode("utf-8", "surrogatepass")) <= _MAX_FOLDER_BYTES
            and not _UNSAFE_IN_FOLDER.search(run_name)):
        return run_name
    cleaned = _UNSAFE_IN_FOLDER.sub("_", run_name).strip().lstrip(".").strip()
    cleaned = cleaned.encode("utf-8", "surrogatepass")[:_MAX_FOLDER_BYTES - 16].decode("utf-8", "ignore")
    digest = hashlib.sha256(run_name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{cleaned or 'run'}~{digest}"


def config_hash(config: Mapping[str, Any] | None) -> str:
    """A short stable hash of a hyperparameter mapping, recorded on the Resource to match runs."""
    if not config:
        return ""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _extra(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    if not attributes:
        return {}
    return {k: v for k, v in attributes.items() if k not in _SERIES_EXCLUDED}


class MetricsConverter:
    """Turns `MetricsData` into rows, keeping running totals of DELTA sums.

    One converter per stream of collections (the reader has one; the sink one per run), since the
    totals are state.
    """

    def __init__(self) -> None:
        self._totals: dict[tuple[str, int, str], float] = {}
        self._runs: dict[tuple[tuple[str, Any], ...], RunInfo] = {}

    def run_for(self, resource_attributes: Mapping[str, Any]) -> RunInfo:
        key = tuple(sorted(resource_attributes.items(), key=lambda kv: kv[0]))
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = RunInfo.from_resource(resource_attributes)
        return run

    def accumulate(self, run: RunInfo, tag: str, value: float, delta: bool) -> float:
        """Running total of a sum series (DELTA points add up; CUMULATIVE points replace)."""
        key = (run.run_id, run.rank, tag)
        total = self._totals.get(key, 0.0) + value if delta else value
        self._totals[key] = total
        return total

    def rows(
        self, data: MetricsData, default_step: int | None = None
    ) -> tuple[list[MetricRow], list[HistogramRow]]:
        """Rows of every point in `data`; points without `train.step` get `default_step` (or 0)."""
        from opentelemetry.sdk.metrics.export import AggregationTemporality, Gauge, Histogram, Sum

        metric_rows: list[MetricRow] = []
        hist_rows: list[HistogramRow] = []
        fallback = 0 if default_step is None else default_step
        for rm in data.resource_metrics:
            run = self.run_for(rm.resource.attributes)
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    d = metric.data
                    name = metric.name
                    if isinstance(d, Gauge):
                        for p in d.data_points:
                            attrs = p.attributes or {}
                            metric_rows.append(
                                MetricRow(run, _step_of(attrs, fallback), name, series_tag(name, attrs),
                                          float(p.value), "gauge", p.time_unix_nano, _extra(attrs))
                            )
                    elif isinstance(d, Sum):
                        kind = "counter" if d.is_monotonic else "sum"
                        delta = d.aggregation_temporality == AggregationTemporality.DELTA
                        for p in sorted(d.data_points, key=lambda q: _step_of(q.attributes or {}, fallback)):
                            attrs = p.attributes or {}
                            # A counter's series ignores the step attribute: its total runs across steps.
                            tag = series_tag(name, attrs)
                            total = self.accumulate(run, tag, float(p.value), delta)
                            metric_rows.append(
                                MetricRow(run, _step_of(attrs, fallback), name, tag, total, kind,
                                          p.time_unix_nano, _extra(attrs), float(p.value) if delta else None)
                            )
                    elif isinstance(d, Histogram):
                        for hp in d.data_points:
                            attrs = hp.attributes or {}
                            step = _step_of(attrs, fallback)
                            extra = _extra(attrs)
                            tag = series_tag(name, attrs)
                            hist_rows.append(
                                HistogramRow(run, step, name, tag, hp.count, float(hp.sum), float(hp.min),
                                             float(hp.max), tuple(hp.explicit_bounds), tuple(hp.bucket_counts),
                                             hp.time_unix_nano, extra)
                            )
                            for stat, value in (("count", hp.count), ("sum", hp.sum), ("min", hp.min), ("max", hp.max)):
                                stat_name = f"{name}/{stat}"
                                metric_rows.append(
                                    MetricRow(run, step, stat_name, series_tag(stat_name, attrs), float(value),
                                              "histogram", hp.time_unix_nano, extra)
                                )
                    # Exponential histograms have no faithful scalar form in every backend; skipped.
        return metric_rows, hist_rows


def _step_of(attributes: Mapping[str, Any], fallback: int) -> int:
    step = attributes.get(STEP_ATTRIBUTE)
    if step is None:
        return fallback
    try:
        return int(step)
    except (TypeError, ValueError):
        return fallback


def span_rows(spans: Iterable[ReadableSpan], runs: MetricsConverter | None = None) -> list[SpanRow]:
    """Rows of SDK spans; `thread.id`/`thread.name`/`train.step` come from their attributes."""
    from opentelemetry.trace import StatusCode

    converter = runs or MetricsConverter()
    out: list[SpanRow] = []
    for span in spans:
        ctx = span.context
        if ctx is None or span.start_time is None:
            continue
        attrs = dict(span.attributes or {})
        parent = span.parent.span_id if span.parent is not None else None
        step = attrs.get(STEP_ATTRIBUTE)
        resource = span.resource.attributes if span.resource is not None else {}
        out.append(
            SpanRow(
                run=converter.run_for(resource),
                name=span.name,
                trace_id=ctx.trace_id,
                span_id=ctx.span_id,
                parent_span_id=parent,
                start_unix_nano=span.start_time,
                end_unix_nano=span.end_time or span.start_time,
                thread_id=_as_int(attrs.get(THREAD_ID)),
                thread_name=str(attrs.get(THREAD_NAME, "")),
                step=None if step is None else _as_int(step),
                attributes=attrs,
                error=span.status.status_code == StatusCode.ERROR,
                status_message=span.status.description or "",
                events=tuple((e.name, e.timestamp, dict(e.attributes or {})) for e in span.events),
                kind=span.kind.value,
                links=tuple((link.context.trace_id, link.context.span_id, dict(link.attributes or {}))
                            for link in span.links),
            )
        )
    return out
