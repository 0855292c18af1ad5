"""How the children of a session's process reach its run: spawned ones (DataLoader workers, `multiprocessing`)
through `OTEL_TRAIN_WORKER_ADDRESS`, forked ones through a connection of their own to the exporter process
(`otel_train.ship.workers`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from otel_train._internal.at_fork import after_fork_in_child
from otel_train.capture.step import share_latest_step
from otel_train.config import settings as cfg

__all__ = ["ChildHandOff", "hand_off_disabled"]


class ChildHandOff:
    """The hand-off of one session to its children, from `init()` to `shutdown()`."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        # Spawned children (DataLoader workers, multiprocessing) find the run here: the one variable
        # otel-train sets, because a spawned child has nothing else of ours. Removed at shutdown.
        os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS] = address or "none"
        # Imported now: a forked child must not import.
        from otel_train.ship.workers import StepCell, WorkerClient, step_cell_path

        self._client_class = WorkerClient
        # Children that log without `step=` read the step the trainer is in from this cell.
        self._cell: StepCell | None = None
        if address is not None:
            try:
                self._cell = StepCell(step_cell_path(address))
            except (OSError, ValueError) as err:  # children then get the exporter process's latest step
                logging.getLogger("otel_train").warning("otel-train: no step cell for child processes (%s): "
                                                        "their values without a step get the run's latest", err)
            else:
                share_latest_step(self._cell.view)
                after_fork_in_child(self._forget_cell_in_child)

    def _forget_cell_in_child(self) -> None:
        """A forked child's steps are its own: it never writes the trainer's cell (still mapped, shared)."""
        if self._cell is not None:
            share_latest_step(None)
            self._cell = None

    def forked_child_client(self) -> Any:
        """The forked child's own client (`otel_train.ship.workers.WorkerClient`), connecting on first use."""
        return self._client_class(self.address)

    def release(self) -> None:
        """At shutdown: children spawned from now on are not of this run (unless a later session set its own)."""
        if os.environ.get(cfg.OTEL_TRAIN_WORKER_ADDRESS) == (self.address or "none"):
            del os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS]
        if self._cell is not None:
            share_latest_step(None)
            self._cell.close()
            self._cell = None


def hand_off_disabled() -> None:
    """Under `OTEL_TRAIN_DISABLED`: the spawned children are no-ops too, silently."""
    os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS] = "disabled"
