"""Hugging Face Accelerate: a `GeneralTracker`, so `accelerator.log(...)` reaches otel-train unchanged.

Usage::

    from otel_train.integrations.accelerate import OtelTrainTracker

    accelerator = Accelerator(log_with=OtelTrainTracker())
    accelerator.init_trackers("my-project", config={"lr": 1e-3})  # config -> the run config

What appears where:

- ``accelerator.log({"loss": loss}, step=i)``: every number or tensor becomes a gauge of the same name at
  step ``i`` (without ``step``: the current `otel_train` step). Tensors are passed through as they are and
  turned into numbers on otel-train's export thread, not on the training thread.
- ``init_trackers(..., config=...)`` (`store_init_configuration`): the run config.
- ``accelerator.end_training()`` (`finish`): shuts otel-train down if this tracker started it.

`main_process_only` (default True, as for Accelerate's own trackers) runs the tracker on the main process
only; with ``OtelTrainTracker(main_process_only=False)`` every process records and `OTEL_TRAIN_RANKS` decides
which ranks export metrics. The tracker calls `otel_train.init()` (env configuration) when the user has not,
with Accelerate's process index, local process index and number of processes as rank, local rank and
world size.

This module imports ``accelerate``; ``import otel_train`` does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import otel_train as ot
from otel_train.integrations._hooks import numeric
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
        run_name: The otel-train run name; default `OTEL_TRAIN_RUN_NAME`, else the run id. (Accelerate
            does not pass ``init_trackers``' project name to trackers built by the user.)
        main_process_only: Record on the main process only (Accelerate's default); False: every
            process records and `OTEL_TRAIN_RANKS` decides who exports.

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

    @property
    def tracker(self) -> Any:
        """The otel-train session (what `otel_train.init()` returned), or None before `start`."""
        return ot._session

    def _ensure(self, config: Mapping[str, Any] | None = None) -> None:
        state = PartialState()
        self._owned.ensure(rank=state.process_index, local_rank=state.local_process_index,
                           world_size=state.num_processes, config=config, run_name=self.run_name)

    @on_main_process
    def start(self) -> None:
        """Called by ``init_trackers``: start otel-train if the user has not."""
        self._ensure()

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``init_trackers(config=...)``: the run config (before training, so every backend gets it)."""
        self._ensure(values)
        self._owned.add_config(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``accelerator.log``: numbers and tensors as gauges at `step` (strings are skipped)."""
        self._ensure()
        data = numeric(values)
        if data:
            ot.log(data, step=step)

    @on_main_process
    def finish(self) -> None:
        """``accelerator.end_training()``: shut otel-train down if this tracker started it."""
        self._owned.close()
