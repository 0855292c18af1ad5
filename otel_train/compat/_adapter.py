"""`MetricsServiceAdapter`: the buffered metrics adapter of `tracking_utils`-style code, over otel-train.

Values are buffered per step until `flush()` and then handed to `otel_train.log` at their step, so
every configured backend gets them. Like the rest of otel-train after `init`, it never raises into
the training loop: a misuse is logged once and the values are dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import otel_train as ot
from otel_train.errors import OtelTrainError

__all__ = ["TIMELINE_KEY", "MetricsServiceAdapter"]

_logger = logging.getLogger("otel_train.compat")

#: The metric name under which raw Chrome trace events (``ph`` ``B``/``E``/``X``) are logged.
TIMELINE_KEY = "timeline"


class MetricsServiceAdapter:
    """Buffer metrics per step, report them at `flush()`; `direct_log` reports at once.

    Needs a running session (`otel_train.init()` or `tracking_utils.init_tracking(args)`).

    Example:
        >>> import otel_train as ot
        >>> _ = ot.init(exporters=[], disabled=True)
        >>> adapter = MetricsServiceAdapter()
        >>> adapter.log({"step": 3, "train/loss": 0.5})
        >>> adapter.pending_steps()
        [3]
        >>> adapter.flush(); adapter.pending_steps()
        []
        >>> ot.shutdown()
    """

    def __init__(self) -> None:
        self._values: dict[int, dict[str, Any]] = {}
        self._events: dict[int, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # -- the adapter's API ----------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step_key: str = "step") -> None:
        """Buffer `metrics` at the step in ``metrics[step_key]`` (that key is not a metric)."""
        try:
            step = int(metrics[step_key])
        except (KeyError, TypeError, ValueError):
            self._warn_once(f"no-step:{step_key}", "MetricsServiceAdapter.log: the metrics have no integer %r "
                            "(the step_key); these values were dropped (warned once)", step_key)
            return
        values = {k: v for k, v in metrics.items() if k != step_key}
        events = _pop_events(values)
        with self._lock:
            self._values.setdefault(step, {}).update(values)
            if events:
                self._events.setdefault(step, []).extend(events)

    def flush(self) -> None:
        """Report every buffered step, in step order."""
        self.flush_through(None)

    def direct_log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Report `metrics` at `step` now, without buffering."""
        values = dict(metrics)
        events = _pop_events(values)
        if events:
            with self._lock:
                self._events.setdefault(int(step), []).extend(events)
        self._report(int(step), values)

    # -- for `tracking_utils` --------------------------------------------------------------------
    def pending_steps(self) -> list[int]:
        """The steps with buffered values, in order."""
        with self._lock:
            return sorted(self._values)

    def flush_through(self, step: int | None) -> list[dict[str, Any]]:
        """Report buffered steps up to `step` (all with ``None``); return their raw timeline events."""
        with self._lock:
            due = sorted(s for s in self._values if step is None or s <= step)
            batches = [(s, self._values.pop(s)) for s in due]
            done = sorted(s for s in self._events if step is None or s <= step)
            events = [e for s in done for e in self._events.pop(s)]
        for s, values in batches:
            self._report(s, values)
        return events

    def _report(self, step: int, values: Mapping[str, Any]) -> None:
        if not values:
            return
        try:
            ot.log(values, step=step)
        except OtelTrainError:
            self._warn_once("no-init", "MetricsServiceAdapter: no otel-train session (call otel_train.init() or "
                            "tracking_utils.init_tracking(args) first); values dropped (warned once)")

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _logger.warning(message, *args)


def _pop_events(values: dict[str, Any]) -> list[dict[str, Any]]:
    if TIMELINE_KEY not in values:
        return []
    from otel_train.compat._timeline import raw_events

    return raw_events(values.pop(TIMELINE_KEY))
