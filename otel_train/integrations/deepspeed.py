"""DeepSpeed: a monitor with DeepSpeed's monitor interface, writing its events to otel-train.

DeepSpeed's engine sends its monitor events (``Train/Samples/train_loss``, ``Train/Samples/lr``, the
``wall_clock_breakdown`` timings …) to ``engine.monitor.write_events([(tag, value, step), ...])`` with its
own step (``global_samples``). Its JSON config has no slot for a third-party monitor, so `attach` puts
this monitor in front of the engine's (TensorBoard/W&B/CSV from the config keep working)::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    OtelTrainMonitor.attach(engine)

This module does not import DeepSpeed: the monitor only needs the interface, so it also serves code that
calls ``write_events`` itself.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

import otel_train as ot
from otel_train.integrations._hooks import log_step
from otel_train.integrations._session import OwnedSession

__all__ = ["OtelTrainMonitor"]

_logger = logging.getLogger(__name__)


def _placement() -> dict[str, Any]:
    """DeepSpeed's own rank when its process group is up; else the launcher's variables decide."""
    dist = sys.modules.get("deepspeed.comm")  # only when the user's DeepSpeed is loaded: never import it
    if dist is not None and dist.is_initialized():
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    return {}


class OtelTrainMonitor:
    """DeepSpeed's monitor interface (`enabled`, `write_events`) over otel-train.

    Each ``(tag, value, step)`` is a gauge named `tag` at `step`; tensors are converted off the training
    thread. `init` runs at the first event when the user has not called it.

    Args:
        inner: A monitor to forward every event to as well (what `attach` passes: the engine's own).

    Example:
        >>> import otel_train as ot
        >>> _ = ot.init(exporters=[], disabled=True)
        >>> OtelTrainMonitor().write_events([("Train/Samples/train_loss", 0.5, 32)])
        >>> ot.shutdown()
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.enabled = True
        self._session = OwnedSession()

    @classmethod
    def attach(cls, engine: Any) -> OtelTrainMonitor:
        """Make `engine` (a `DeepSpeedEngine`) write its monitor events here, and still to its own monitors."""
        monitor = cls(inner=getattr(engine, "monitor", None))
        engine.monitor = monitor
        return monitor

    def write_events(self, event_list: Iterable[tuple[str, Any, int]]) -> None:
        """Write DeepSpeed's events: each a ``(tag, value, step)`` tuple."""
        event_list = list(event_list)
        try:
            self._session.ensure(**_placement())
            by_step: dict[int, dict[str, Any]] = {}
            for tag, value, step in event_list:
                by_step.setdefault(int(step), {})[tag] = value
            for step, values in by_step.items():
                log_step(values, step)  # a step DeepSpeed writes is a step boundary: collection follows it
        except ot.ConfigError:
            raise  # bad settings fail at the first event, before any training step is lost silently
        except Exception:
            _logger.warning("otel-train: could not write DeepSpeed monitor events", exc_info=True)
        inner = self.inner
        if inner is not None and getattr(inner, "enabled", False):
            inner.write_events(event_list)

    def close(self) -> None:
        """Shut otel-train down if this monitor started it (also happens at interpreter exit)."""
        self._session.close()

    def __getattr__(self, name: str) -> Any:
        # DeepSpeed may read other attributes of its monitor (e.g. `tb_monitor`): the inner one answers.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
