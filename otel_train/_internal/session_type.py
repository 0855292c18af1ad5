"""The public type of what `otel_train.init()` returns: `otel_train.Session` (a protocol, no implementation).

The running session and the disabled one (`OTEL_TRAIN_DISABLED`) both satisfy it (mypy checks that in
`init`). Only what a user calls is in it, so the runtime classes can change behind it.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["RunIdentity", "Session"]


@runtime_checkable
class RunIdentity(Protocol):
    """Which run and rank a session records (the OTel Resource attributes of the same names)."""

    @property
    def run_id(self) -> str:
        """`train.run.id`: the same on every rank of one job."""

    @property
    def run_name(self) -> str:
        """`train.run.name`: the run's folder and display name."""

    @property
    def rank(self) -> int:
        """`train.rank`."""

    @property
    def local_rank(self) -> int:
        """`train.local_rank`."""

    @property
    def world_size(self) -> int:
        """`train.world_size`."""


@runtime_checkable
class Session(Protocol):
    """What `otel_train.init()` returns. The module-level functions (`otel_train.log`, `flush`, `shutdown`, ...)
    act on it, so most code never needs it.

    Example:
        >>> import otel_train as ot
        >>> session: ot.Session = ot.init(exporters=[], disabled=True)
        >>> session.enabled, session.run
        (False, None)
        >>> session.shutdown()
    """

    @property
    def enabled(self) -> bool:
        """False under `OTEL_TRAIN_DISABLED` / `OTEL_SDK_DISABLED`: every call is a no-op."""

    @property
    def closed(self) -> bool:
        """True after `shutdown()`."""

    @property
    def run(self) -> RunIdentity | None:
        """The run and rank this process records, or None when disabled."""

    def log(self, mapping: Mapping[str, Any], step: int | None = None,
            attributes: Mapping[str, Any] | None = None) -> None:
        """`otel_train.log`: record each value of `mapping` as a gauge named by its key, at `step`, with the
        extra `attributes` (each a distinct series)."""

    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> AbstractContextManager[Any]:
        """`otel_train.span`: a context manager timing a block as a span."""

    def add_config(self, config: Mapping[str, Any]) -> None:
        """Merge hyperparameters into the run's config (backends that have not opened their run yet see them)."""

    def resume(self, step: int) -> None:
        """`otel_train.resume`: the run restarts at `step`."""

    def flush(self, timeout_s: float | None = None) -> bool:
        """`otel_train.flush`: collect now and wait until every backend has written it."""

    def shutdown(self) -> None:
        """`otel_train.shutdown`: flush and close every backend. Idempotent."""

    def export_progress(self, timeout_s: float = 5.0) -> Any:
        """How far the exporter process is (windows spooled; per backend the last durable window and step),
        or None when every backend runs in this process (or the session is disabled)."""
