"""Start otel-train for an integration when the user has not, and shut down only what it started.

Every framework integration holds one `OwnedSession`: ``ensure()`` at the framework's "run begins"
event, ``close()`` at "run ends". A session the user started with `otel_train.init()` is used as it
is and never shut down by the integration.

A framework that restores a checkpoint declares the resume (`resume_at`): through `init(resume_step=)` when
the integration starts the session then, else through `otel_train.resume` on the running session.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import otel_train as ot

_logger = logging.getLogger(__name__)


def session_running() -> bool:
    """Whether `otel_train.init()` has started a session that is not shut down yet."""
    return ot.current_session() is not None


class OwnedSession:
    """An `init()` made on the user's behalf, remembered so that only it is shut down."""

    def __init__(self) -> None:
        self.started = False

    def ensure(
        self,
        *,
        rank: int | None = None,
        local_rank: int | None = None,
        world_size: int | None = None,
        config: Mapping[str, Any] | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        resume_step: int | None = None,
        project: str | None = None,
    ) -> bool:
        """Call `otel_train.init()` (env configuration, plus the framework's own rank) unless a session runs.

        Returns:
            Whether this call started the session.

        Raises:
            ConfigError: the env configuration is invalid (before any training step runs).
        """
        if session_running():
            if rank is not None or local_rank is not None or world_size is not None:
                ot.set_placement(rank=rank, local_rank=local_rank, world_size=world_size)
            return False
        ot.init(rank=rank, local_rank=local_rank, world_size=world_size, config=config, run_name=run_name,
                run_id=run_id, resume_step=resume_step, project=project)
        self.started = True
        return True

    def resume_at(self, step: int, **ensure: Any) -> None:
        """The framework restored a checkpoint: the run restarts at `step`. Starts the session with
        ``resume_step=step`` (`ensure` holds the rest of `ensure`'s keywords) unless one runs; a running one
        is told with `otel_train.resume`. Never raises into the framework past `init`'s own errors."""
        if self.ensure(resume_step=step, **ensure):
            return
        try:
            ot.resume(step)
        except ot.OtelTrainError as err:  # a step the framework reported oddly must not stop training
            _logger.warning("otel-train: the resume at step %r was not declared: %s", step, err)

    def close(self) -> None:
        """Shut down the session if this object started it; otherwise flush what was logged so far."""
        if self.started:
            self.started = False
            ot.shutdown()
        elif session_running():
            ot.flush()

    def add_config(self, config: Mapping[str, Any]) -> None:
        """Add hyperparameters the framework reports after the session started (no-op without one)."""
        session = ot.current_session()
        if session is not None:
            session.add_config(config)
