"""How the children of a session's process reach its run: spawned ones (DataLoader workers, `multiprocessing`)
through `OTEL_TRAIN_WORKER_ADDRESS`, forked ones through a connection of their own to the exporter process
(`otel_train.ship.workers`)."""

from __future__ import annotations

import os
from typing import Any

from otel_train import config as cfg

__all__ = ["ChildHandOff", "hand_off_disabled"]


class ChildHandOff:
    """The hand-off of one session to its children, from `init()` to `shutdown()`."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        # Spawned children (DataLoader workers, multiprocessing) find the run here: the one variable
        # otel-train sets, because a spawned child has nothing else of ours. Removed at shutdown.
        os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS] = address or "none"
        from otel_train.ship.workers import WorkerClient  # imported now: a forked child must not import

        self._client_class = WorkerClient

    def forked_child_client(self) -> Any:
        """The forked child's own client (`otel_train.ship.workers.WorkerClient`), connecting on first use."""
        return self._client_class(self.address)

    def release(self) -> None:
        """At shutdown: children spawned from now on are not of this run (unless a later session set its own)."""
        if os.environ.get(cfg.OTEL_TRAIN_WORKER_ADDRESS) == (self.address or "none"):
            del os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS]


def hand_off_disabled() -> None:
    """Under `OTEL_TRAIN_DISABLED`: the spawned children are no-ops too, silently."""
    os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS] = "disabled"
