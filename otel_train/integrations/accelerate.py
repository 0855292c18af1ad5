"""Hugging Face Accelerate: a `GeneralTracker`, so `accelerator.log(...)` reaches otel-train unchanged.

Usage::

    from otel_train.integrations.accelerate import OtelTrainTracker

    accelerator = Accelerator(log_with=OtelTrainTracker())
    accelerator.init_trackers("my-project", config={"lr": 1e-3})  # config -> the run config

What appears where:

- ``accelerator.log({"loss": loss}, step=i)``: every number or tensor becomes a gauge of the same name at
  step ``i`` (without ``step``: the current `otel_train` step), NaN and +-inf as they are; a dict value (which
  Accelerate's TensorBoard tracker writes with ``add_scalars``) becomes one gauge per entry, ``loss/<entry>``.
  Strings and other values are left out, counted (`left_out`) and warned about once per key. Tensors are
  turned into numbers on otel-train's export thread. Each logged step is a step boundary
  (`otel_train.step_ended`): collection follows Accelerate's steps.
- ``init_trackers(project_name, config=...)``: the project (`OTEL_TRAIN_PROJECT` wins when set) and the run
  config.
- ``accelerator.end_training()`` (`finish`): shuts otel-train down if this tracker started it.

Accelerate runs ``accelerator.log`` on the main process only, whatever the tracker says. With
``OtelTrainTracker(main_process_only=False)`` the tracker starts on every process (so every rank has a
session); log from every process with ``accelerator.get_tracker("otel_train").log(values, step=i)`` (or
`otel_train.log`), and `OTEL_TRAIN_RANKS` decides which ranks export metrics. The tracker calls
`otel_train.init()` (env configuration) when the user has not, with Accelerate's process index, local process
index and number of processes as rank, local rank and world size.

This module imports ``accelerate``; ``import otel_train`` does not.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import otel_train as ot
from otel_train.integrations._hooks import LeftOut, flatten, log_step
from otel_train.integrations._session import OwnedSession

try:
    from accelerate.state import PartialState
    from accelerate.tracking import GeneralTracker
    from accelerate.tracking import on_main_process as _on_main_process
except ImportError as err:
    raise ModuleNotFoundError(
        "otel_train.integrations.accelerate needs accelerate: pip install 'otel-train[accelerate]'",
        name="accelerate",
    ) from err

__all__ = ["OtelTrainTracker"]

_F = TypeVar("_F")
#: Accelerate's gate: runs the method on the main process only when `main_process_only` is set.
on_main_process = cast("Callable[[_F], _F]", _on_main_process)


class OtelTrainTracker(GeneralTracker):  # type: ignore[misc]
    """An Accelerate tracker writing through otel-train (pass an instance to ``log_with``).

    Args:
        run_name: The otel-train run name; default `OTEL_TRAIN_RUN_NAME`, else the run id.
        main_process_only: Start and record on the main process only (Accelerate's default); False: the
            tracker runs on every process (log there through ``accelerator.get_tracker("otel_train")``:
            ``accelerator.log`` itself runs on the main process only) and `OTEL_TRAIN_RANKS` decides who
            exports.

    Example:
        >>> accelerator = Accelerator(log_with=OtelTrainTracker())  # doctest: +SKIP
        >>> accelerator.init_trackers("demo", config={"lr": 0.1})  # doctest: +SKIP
        >>> accelerator.log({"train/loss": loss}, step=0)  # doctest: +SKIP
    """

    name = "otel_train"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, *, main_process_only: bool = True) -> None:
        super().__init__()
        self.run_name = run_name
        self.main_process_only = main_process_only
        self._owned = OwnedSession()
        self._left_out = LeftOut("Accelerate")
        self._project: str | None = None

    @property
    def left_out(self) -> int:
        """How many logged values were not numbers (strings, lists ...) and were left out."""
        return self._left_out.count

    @property
    def tracker(self) -> Any:
        """The otel-train session (what `otel_train.init()` returned), or None before `start`."""
        return ot.current_session()

    def _ensure(self, config: Mapping[str, Any] | None = None) -> None:
        state = PartialState()
        project = None if os.environ.get("OTEL_TRAIN_PROJECT") else self._project
        self._owned.ensure(rank=state.process_index, local_rank=state.local_process_index,
                           world_size=state.num_processes, config=config, run_name=self.run_name, project=project)

    @on_main_process
    def start(self) -> None:
        """Called by ``init_trackers``: start otel-train if the user has not, in ``init_trackers``' project."""
        self._project = _init_trackers_project()
        self._ensure()

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``init_trackers(config=...)``: the run config (before training, so every backend gets it)."""
        self._ensure(values)
        self._owned.add_config(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``accelerator.log``: numbers and tensors as gauges at `step` (dicts flattened to ``key/entry``;
        anything else counted and warned about once per key); the step is a step boundary."""
        self._ensure()
        log_step(self._left_out.keep(flatten(values)), step)

    @on_main_process
    def finish(self) -> None:
        """``accelerator.end_training()``: shut otel-train down if this tracker started it."""
        self._owned.close()


def _init_trackers_project() -> str | None:
    """The ``project_name`` given to ``Accelerator.init_trackers``, which calls `start` (Accelerate hands
    it only to the trackers it builds itself): read from that caller's frame, None when not found."""
    frame = sys._getframe(1)
    for _ in range(8):  # start <- on_main_process wrappers <- init_trackers
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code.co_name == "init_trackers":
            name = frame.f_locals.get("project_name")
            return str(name) if name else None
    return None
