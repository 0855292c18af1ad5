"""What the runtime (or the sink) tells every backend besides the rows: `ExporterOptions`, and their
description on disk for `otel-train replay` (`options_to_json` / `options_from_json`).

The description is plain JSON: reading it back builds values, never runs code, so a run folder on a shared
file system cannot make `replay` execute anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Container, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_train.config.settings import Route, Settings

__all__ = ["ExporterOptions", "options_from_json", "options_to_json"]


@dataclasses.dataclass(frozen=True)
class ExporterOptions:
    """What the runtime (or the sink) tells every backend besides the rows."""

    directory: Path = Path("otel-train-runs")
    project: str = "otel-train"
    hparams: Mapping[str, Any] | None = None
    ranks: str = "0"
    trace_counters: bool = True
    #: Per-backend routing by exporter name (`OTEL_TRAIN_<BACKEND>_*`, `init(routes=)`); see `otel_train.config.routing`.
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
        from otel_train.config.settings import load_settings

        return cls.from_settings(load_settings())

    @classmethod
    def from_settings(cls, s: Settings, *, directory: Path | None = None, ranks: str | None = None,
                      with_hparams: bool = True) -> ExporterOptions:
        """Options from loaded settings. The sink passes ``ranks="all"`` and no hyperparameters
        (each run brings its own); the runtime passes the directory it checked."""
        return cls(directory or s.dir, s.project, s.config if with_hparams else None, ranks or s.ranks,
                   s.trace_counters, routes=s.routes, trace_steps=s.trace_steps, trace_gzip=s.trace_gzip,
                   step_order=s.step_order, resume_step=s.resume_step if with_hparams else None)  # the sink: per run


_ROUTE_FIELDS = ("include", "exclude", "every", "ranks", "logs", "include_setting", "exclude_setting")


def options_to_json(options: ExporterOptions) -> dict[str, Any]:
    """`options` as JSON values. Hyperparameters that are not JSON values are written as their `str`
    (what the backends show of them anyway); a step selection that is neither a `StepSelection` nor a
    finite collection of steps is written as None (all steps)."""
    from otel_train.config.settings import StepSelection

    steps: Any = None
    if isinstance(options.trace_steps, StepSelection):
        steps = {"ranges": options.trace_steps.ranges, "periodic": options.trace_steps.periodic}
    elif isinstance(options.trace_steps, (set, frozenset, list, tuple, range)):
        steps = {"steps": sorted(int(s) for s in options.trace_steps)}
    routes = None if options.routes is None else {
        name: {f: getattr(route, f) for f in _ROUTE_FIELDS} for name, route in options.routes.items()}
    out = {
        "directory": str(options.directory), "project": options.project,
        "hparams": None if options.hparams is None else dict(options.hparams), "ranks": options.ranks,
        "trace_counters": options.trace_counters, "routes": routes, "trace_steps": steps,
        "trace_gzip": options.trace_gzip, "step_order": options.step_order, "resume_step": options.resume_step,
    }
    converted: dict[str, Any] = json.loads(json.dumps(out, default=str))  # whatever is not JSON becomes its str
    return converted


def _route(route: Any, fields: Mapping[str, Any]) -> Route:
    kwargs = {f: (tuple(v) if isinstance(v, list) else v) for f, v in fields.items() if f in _ROUTE_FIELDS}
    built: Route = route(**kwargs)
    return built


def options_from_json(data: Mapping[str, Any]) -> ExporterOptions:
    """`ExporterOptions` from `options_to_json`'s output.

    Raises:
        ValueError: `data` is not such a description (a field of the wrong type).
    """
    from otel_train.config.settings import Route, StepSelection

    try:
        steps: Container[int] | None = None
        raw_steps = data.get("trace_steps")
        if isinstance(raw_steps, dict) and "steps" in raw_steps:
            steps = frozenset(int(s) for s in raw_steps["steps"])
        elif isinstance(raw_steps, dict):
            steps = StepSelection(tuple((int(a), int(b)) for a, b in raw_steps["ranges"]),
                                  tuple((int(a), int(b)) for a, b in raw_steps["periodic"]))
        raw_routes = data.get("routes")
        routes = None if raw_routes is None else {
            str(name): _route(Route, fields) for name, fields in dict(raw_routes).items()}
        hparams = data.get("hparams")
        resume = data.get("resume_step")
        return ExporterOptions(
            directory=Path(str(data["directory"])), project=str(data["project"]),
            hparams=None if hparams is None else dict(hparams), ranks=str(data["ranks"]),
            trace_counters=bool(data["trace_counters"]), routes=routes, trace_steps=steps,
            trace_gzip=bool(data["trace_gzip"]), step_order=str(data["step_order"]),
            resume_step=None if resume is None else int(resume))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"not an exporter description of this otel-train ({err!r})") from None
