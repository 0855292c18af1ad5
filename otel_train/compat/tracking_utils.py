"""One-import migration for code written against a `tracking_utils`-style module.

Change the import, keep the calls::

    from otel_train.compat import tracking_utils     # was: from <framework> import tracking_utils
    tracking_utils.init_tracking(args)
    tracking_utils.log(args, {"step": s, "train/loss": x}, "step")
    tracking_utils.flush_metrics(args, s)

`init_tracking` maps the attributes of `args` onto otel-train's settings (an explicit
`OTEL_TRAIN_*` / `WANDB_*` variable wins; unknown attributes are ignored; a missing attribute is
"off"):

====================================  ======================================================
``use_tensorboard``                   exporter ``tensorboard``
``use_wandb``                         exporter ``wandb``
``use_clearml``                       exporter ``clearml``
``use_metrics_service``               exporter ``otlp`` (to the collector / ``otel-train sink``)
``wandb_project``, ``tb_project_name``  ``OTEL_TRAIN_PROJECT`` (W&B's first)
``tb_experiment_name``                ``OTEL_TRAIN_RUN_NAME``
``wandb_team``, ``wandb_group``       W&B entity and group (``WANDB_ENTITY`` / ``WANDB_RUN_GROUP`` win)
``timeline_dump_dir``                 ``timeline_step_<N>.json`` per flushed step
====================================  ======================================================

Everything logged between two `flush_metrics` calls belongs to the step flushed second. The calls
drive `otel_train.step`: `flush_metrics(args, N)` ends step N (the built-in step series are recorded,
export starts) and opens step N + 1, so spans recorded before that step's first `log` carry it; a
`log` at another step ends the open one and opens that step. (Before the first step's first `log`,
spans carry no step; they still go into its timeline file, which is filled by time.)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import otel_train as ot
from otel_train.compat._adapter import MetricsServiceAdapter
from otel_train.config.settings import OTEL_TRAIN_EXPORTERS, OTEL_TRAIN_PROJECT, OTEL_TRAIN_RUN_NAME

__all__ = ["flush_metrics", "init_tracking", "log"]

_logger = logging.getLogger("otel_train.compat")

#: ``args`` flag -> exporter name.
BACKEND_FLAGS = (("use_tensorboard", "tensorboard"), ("use_wandb", "wandb"), ("use_clearml", "clearml"),
                 ("use_metrics_service", "otlp"))


class _Tracking:
    """What `init_tracking` started: the adapter, the open step, the timeline dump."""

    def __init__(self, timeline: Any) -> None:
        self.adapter = MetricsServiceAdapter()
        self.timeline = timeline
        self.open_step: ot.step | None = None
        self.lock = threading.Lock()

    def enter(self, step: int) -> None:
        with self.lock:
            if self.open_step is not None and self.open_step.index == step:
                return
            self._close()
            self.open_step = ot.step(step)
            self.open_step.__enter__()

    def close(self, step: int) -> None:
        """End step `step` and open `step + 1`, so that the next step's spans before its first `log` carry it."""
        with self.lock:
            if self.open_step is not None and self.open_step.index <= step:
                self._close()
                self.open_step = ot.step(step + 1)
                self.open_step.__enter__()

    def _close(self) -> None:
        if self.open_step is None:
            return
        scope, self.open_step = self.open_step, None
        try:
            scope.__exit__(None, None, None)
        except ValueError:  # entered in another thread's context: its step end still ran
            pass


_state: _Tracking | None = None
_warned: set[str] = set()


def _attr(args: Any, name: str) -> Any:
    return getattr(args, name, None)


def settings_from_args(args: Any, env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`init()` keywords for `args`, and the W&B entity/group (explicit variables in `env` win).

    Example:
        >>> from types import SimpleNamespace
        >>> settings_from_args(SimpleNamespace(use_wandb=True, wandb_project="p", cuda=True), env={})
        ({'exporters': ['wandb'], 'project': 'p'}, {})
    """
    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {}
    names = [name for flag, name in BACKEND_FLAGS if _attr(args, flag)]
    if env.get(OTEL_TRAIN_EXPORTERS) is not None:
        names = [p.strip().lower() for p in env[OTEL_TRAIN_EXPORTERS].split(",") if p.strip()]
    kwargs["exporters"] = names
    project = (_attr(args, "wandb_project") if _attr(args, "use_wandb") else None) or _attr(args, "tb_project_name")
    if project and env.get(OTEL_TRAIN_PROJECT) is None:
        kwargs["project"] = str(project)
    if _attr(args, "tb_experiment_name") and env.get(OTEL_TRAIN_RUN_NAME) is None:
        kwargs["run_name"] = str(_attr(args, "tb_experiment_name"))
    wandb: dict[str, Any] = {}
    if "wandb" in names:
        for attr, key, var in (("wandb_team", "entity", "WANDB_ENTITY"), ("wandb_group", "group", "WANDB_RUN_GROUP")):
            if _attr(args, attr) and not env.get(var):
                wandb[key] = str(_attr(args, attr))
    return kwargs, wandb


def init_tracking(args: Any) -> None:
    """Start otel-train from `args` (see the module docstring for the mapping).

    Raises:
        ConfigError: a setting is invalid (one line naming it), as `otel_train.init` does.
    """
    global _state
    _finish()
    kwargs, wandb = settings_from_args(args)
    names: list[Any] = list(kwargs.pop("exporters"))
    if wandb:  # a W&B entity/group: build that exporter here with the session's options
        from otel_train.config.exporter_options import ExporterOptions
        from otel_train.config.settings import load_settings
        from otel_train.exporters.wandb import WandbExporter

        s = load_settings(exporters=[n for n in names if isinstance(n, str)], **kwargs)
        options = ExporterOptions.from_settings(s)
        names = [WandbExporter(options, **wandb) if n == "wandb" else n for n in names]
    timeline = None
    dump_dir = _attr(args, "timeline_dump_dir")
    if dump_dir:
        from otel_train.compat._timeline import TimelineDump

        timeline = TimelineDump(str(dump_dir))
        names.append(timeline)
    ot.init(exporters=names, **kwargs)
    _state = _Tracking(timeline)


def _finish() -> None:
    """End the step `flush_metrics` opened and forget the state (tests; a new `init_tracking` does it too)."""
    global _state
    if _state is not None:
        with _state.lock:
            _state._close()
        _state = None


def _tracking(call: str) -> _Tracking | None:
    if _state is None and call not in _warned:
        _warned.add(call)
        _logger.warning("tracking_utils.%s before init_tracking(args); ignored (warned once)", call)
    return _state


def log(args: Any, metrics: Mapping[str, Any], step_key: str) -> None:
    """Buffer `metrics` at step ``metrics[step_key]``; a ``timeline`` value holds raw Chrome trace events."""
    state = _tracking("log")
    if state is None:
        return
    try:
        step = int(metrics[step_key])
    except (KeyError, TypeError, ValueError):
        step = None
    if step is not None:
        state.enter(step)
    state.adapter.log(metrics, step_key)


def flush_metrics(args: Any, step: int) -> None:
    """End of step `step`: report everything buffered up to it; with a timeline directory, write its file."""
    state = _tracking("flush_metrics")
    if state is None:
        return
    step = int(step)
    events = state.adapter.flush_through(step)
    state.close(step)
    if state.timeline is not None:
        until_ns = time.time_ns()
        ot.flush()  # the step's spans reach the dump before its file is written
        state.timeline.write_step(step, until_ns, events)
