"""When a step or span has run far past its usual duration: the watchdog's rule, pure (no clock, no thread).

Each kind of work is compared with its own past: steps with steps (key ``"step"``), and a span with the spans of
its name (key ``"span <name>"``), so a validation or checkpoint span is judged against earlier validations or
checkpoints, never against training steps. A kind's limit is ``max(factor × median of its past durations, floor)``;
a kind never seen to finish (the first step, which may compile; the first validation) gets ``factor × floor``.

Work is stuck when the open step has passed its limit *and* the innermost span opened inside it (if any) has
passed its own; outside any step, when the innermost open span has. So a step that runs a 10× slower validation
span is not stuck while that validation is within the validations' limit.

Example:
    >>> rule = HangRule(floor_s=60.0, factor=10.0)
    >>> rule.limit_s("step")  # nothing seen yet: factor × floor
    600.0
    >>> for d in (0.5, 0.4, 9.0):
    ...     rule.add("step", d)
    >>> rule.limit_s("step")  # max(10 × median 0.5 s, 60 s)
    60.0
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

__all__ = ["HangRule", "Work"]

_HISTORY = 101  # durations kept per kind (the median of the latest)
_MAX_KINDS = 256  # kinds (span names) remembered; further names share the no-history limit


class Work(NamedTuple):
    """One open unit of work as the watchdog sees it: its kind, how long it has run, and its identity."""

    key: str  # "step" or "span <name>"
    elapsed_s: float
    ident: int  # id() of the step or span object: the same work across two looks


class HangRule:
    """Past durations per kind of work and the limit each kind gets (see the module docstring)."""

    def __init__(self, floor_s: float, factor: float) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self._past: dict[str, deque[float]] = {}

    def add(self, key: str, duration_s: float) -> None:
        """A unit of kind `key` finished in `duration_s`."""
        past = self._past.get(key)
        if past is None:
            if len(self._past) >= _MAX_KINDS:
                return
            past = self._past[key] = deque(maxlen=_HISTORY)
        past.append(duration_s)

    def usual_s(self, key: str) -> float | None:
        """The median duration of kind `key`, or None when none was seen to finish."""
        past = self._past.get(key)
        return statistics.median(past) if past else None

    def limit_s(self, key: str) -> float:
        """How long a unit of kind `key` may run before it counts as stuck."""
        usual = self.usual_s(key)
        if usual is None:
            return self.factor * self.floor_s
        return max(self.factor * usual, self.floor_s)

    def stuck(self, works: list[Work]) -> bool:
        """Whether every one of `works` (the open step, then its innermost span; at least one) has passed its
        limit."""
        return bool(works) and all(w.elapsed_s > self.limit_s(w.key) for w in works)
