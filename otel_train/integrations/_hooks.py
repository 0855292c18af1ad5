"""What the callback-style integrations share: spans that begin in one hook and end in another,
and the numeric part of a framework's log dictionary.

Frameworks announce "batch begins" and "batch ends" as two calls, so a span cannot be a ``with``
block. `HookSpans` keeps the open spans by key and ends them in reverse order when a run fails.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from typing import Any

import otel_train as ot

__all__ = ["HookSpans", "HookStep", "LeftOut", "flatten", "log_step", "numeric"]

_logger = logging.getLogger("otel_train.integrations")


def _is_number(value: Any) -> bool:
    """What `otel_train.log` can turn into a gauge: numbers (bools as 0/1), tensors, NumPy scalars/arrays."""
    return isinstance(value, numbers.Real) or (hasattr(value, "dtype") and callable(getattr(value, "item", None)))


def flatten(values: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level, keys joined with `sep` (``{"a": {"b": 1}}`` -> ``{"a/b": 1}``).

    Example:
        >>> flatten({"loss": {"train": 1.0, "val": 2.0}, "lr": 0.1})
        {'loss/train': 1.0, 'loss/val': 2.0, 'lr': 0.1}
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, name + sep))
        else:
            out[name] = value
    return out


class LeftOut:
    """The values an integration cannot record (strings, None, lists ...): counted, and warned once per key.

    Example:
        >>> left = LeftOut("Accelerate")
        >>> left.keep({"loss": 0.5, "note": "warmup"})
        {'loss': 0.5}
        >>> left.count
        1
    """

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self.count = 0  # values left out so far
        self._warned: set[str] = set()

    def keep(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of `values` that can be gauges; the others are counted and warned about once per key."""
        out: dict[str, Any] = {}
        for key, value in values.items():
            if _is_number(value):
                out[key] = value
                continue
            self.count += 1
            if key not in self._warned:
                self._warned.add(key)
                _logger.warning("otel-train: %s logged %r as a %s, which is not a number; left out (warned once "
                                "per key; %d value(s) left out so far)", self.framework, key,
                                type(value).__name__, self.count)
        return out


def log_step(values: Mapping[str, Any], step: int | None) -> None:
    """`otel_train.log` at the framework's `step`, then that step ends (`otel_train.step_ended`): a logged step
    is a step boundary, so collection follows the framework's steps (live and durable like `otel_train.step`)."""
    if values:
        ot.log(values, step=step)
    ot.step_ended((ot.current_step() or 0) if step is None else step)


def numeric(values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `values` that can be a gauge: numbers and tensors (converted off-thread).

    Strings, ``None`` and containers (a framework's log dict may hold them) are left out, so
    `otel_train.log` never sees them. Nothing is converted here: tensors stay tensors.

    Example:
        >>> numeric({"loss": 0.5, "epoch": 1, "note": "warmup", "skip": None})
        {'loss': 0.5, 'epoch': 1}
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, numbers.Real) or (hasattr(value, "numel") and hasattr(value, "dtype")):
            out[str(key)] = value
    return out


class HookStep:
    """`otel_train.step(i)` entered in one hook and exited in another (train batch begin/end)."""

    def __init__(self) -> None:
        self._open: ot.step | None = None

    def begin(self, index: int) -> None:
        self.end()  # a step whose end hook never came (an exception the framework swallowed)
        self._open = ot.step(int(index))
        self._open.__enter__()

    def end(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)


class HookSpans:
    """Spans opened by one framework hook and closed by another, keyed by what they time.

    A span whose step equals the current `otel_train` step is an `otel_train.span` (the cheap
    path, used for train steps). Others (validation, epochs, checkpoint saves between steps)
    are raw OTel spans that carry the framework's step in `train.step` explicitly.
    """

    def __init__(self) -> None:
        self._open: dict[str, tuple[Any, Any]] = {}

    def begin(self, key: str, name: str, step: int | None, attributes: Mapping[str, Any] | None = None) -> None:
        """Open span `name` under `key` (ending a span still open under the same key first)."""
        self.end(key)
        attrs = dict(attributes or {})
        if step is None or step == ot.current_step():
            scope = ot.span(name, attrs)
            scope.__enter__()
            self._open[key] = (scope, None)
            return
        from opentelemetry import context, trace

        attrs[ot.STEP_ATTRIBUTE] = int(step)
        span = ot.get_tracer("otel_train.integrations").start_span(name, attributes=attrs)
        token = context.attach(trace.set_span_in_context(span))
        self._open[key] = (span, token)

    def is_open(self, key: str) -> bool:
        return key in self._open

    def end(self, key: str, error: BaseException | None = None) -> None:
        """Close the span open under `key`, if any; with `error`, mark it failed."""
        entry = self._open.pop(key, None)
        if entry is None:
            return
        span, token = entry
        if token is None:  # an otel_train.span scope
            if error is None:
                span.__exit__(None, None, None)
            else:
                span.__exit__(type(error), error, None)
            return
        from opentelemetry import context
        from opentelemetry.trace import Status, StatusCode

        context.detach(token)  # OTel logs (never raises) a detach out of order; the span still ends
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

    def end_all(self, error: BaseException | None = None) -> None:
        """Close every open span, innermost first (a run ended by an exception)."""
        for key in reversed(list(self._open)):
            self.end(key, error)
