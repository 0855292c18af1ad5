"""The `attributes=` of `otel_train.log`, checked at the call the way OpenTelemetry checks attributes.

OTel's rule (`opentelemetry.attributes`): a key is a non-empty string; a value is a ``str``, ``bool``, ``int`` or
``float``, or a sequence of one of those types (``None`` allowed in it), kept as a tuple. An attribute that breaks
it is left out and the measurement is still recorded; so are ``train.step`` and ``train.rank`` here, which
otel-train sets itself (the step comes from `step=` or the step context, the rank from the run). What was left out
is returned, for the caller to count and warn about: nothing here raises.

`held_attributes`: a span's attributes as they are at the call (its rows are made after it ends, off the training
thread), so that a list, tensor or array the caller changes in place later does not reach the backends changed.

Example:
    >>> clean_attributes({"trial_id": "a1", "sizes": [1, 2], "": 3, "bad": {"x": 1}})
    ({'trial_id': 'a1', 'sizes': (1, 2)}, ['', 'bad'])
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from otel_train._internal.ratelimit import LogOnce
from otel_train.capture.step import RANK_ATTRIBUTE, STEP_ATTRIBUTE

__all__ = ["clean_attributes", "held_attributes", "held_value", "refused_reason"]

_warn_once = LogOnce(logging.getLogger("otel_train"))
_SCALARS = (str, bool, int, float)
_SET_BY_US = frozenset({STEP_ATTRIBUTE, RANK_ATTRIBUTE})
_REFUSED = object()


def _clean_value(value: Any) -> Any:
    """The value as OTel keeps it, or `_REFUSED`."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        kind: type | None = None
        for item in value:
            if item is None:
                continue
            if not isinstance(item, _SCALARS):
                return _REFUSED
            # bool is an int subclass: OTel tells them apart, so does this
            item_kind = bool if isinstance(item, bool) else int if isinstance(item, int) else type(item)
            if kind is None:
                kind = item_kind
            elif item_kind is not kind and not issubclass(item_kind, kind):
                return _REFUSED
        return tuple(value)
    return _REFUSED


def clean_attributes(attributes: Any) -> tuple[dict[str, Any], list[Any]]:
    """(the attributes OTel keeps, the keys it leaves out); a non-mapping leaves out everything (``[attributes]``)."""
    if not isinstance(attributes, Mapping):
        return {}, [attributes]
    clean: dict[str, Any] = {}
    refused: list[Any] = []
    for key, value in attributes.items():
        if type(key) is not str or not key or key in _SET_BY_US:
            refused.append(key)
            continue
        kept = _clean_value(value)
        if kept is _REFUSED:
            refused.append(key)
        else:
            clean[key] = kept
    return clean, refused


def refused_reason(attributes: Any, key: Any) -> str:
    """Why `key` of `attributes` was left out, in one line for the warning."""
    if not isinstance(attributes, Mapping):
        return f"`attributes` must be a mapping of str -> value, got {type(attributes).__name__}"
    if key in _SET_BY_US:
        return f"attribute {key!r} is set by otel-train (pass the step as `step=`)"
    if type(key) is not str or not key:
        return f"attribute key {key!r} is not a non-empty string"
    value = attributes.get(key)
    return (f"attribute {key!r} has a {type(value).__name__} value; allowed: str, bool, int, float or a sequence "
            f"of one of those types")


_IMMUTABLE = frozenset((str, int, float, bool, type(None)))


def held_value(value: Any) -> Any:
    """A span attribute's value as it is now (the span's rows are made after it ends): a value that can change in
    place is copied: a sequence as a tuple, a mapping as a dict, a tensor cloned on its device (no sync), a NumPy
    array copied. Anything else is kept (written as its text later)."""
    if type(value) in _IMMUTABLE:
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(value)
    if isinstance(value, Mapping):
        return dict(value)
    torch = sys.modules.get("torch")
    try:
        if torch is not None and isinstance(value, torch.Tensor):
            return value.detach().clone()
        if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
            return value.copy()
        return value
    except Exception:  # never into the training loop: an exotic tensor (meta, a subclass) is kept as given
        return value


def held_attributes(attributes: Any) -> dict[str, Any]:
    """`attributes` as they are at the call (`held_value` for each). Not a mapping: pairs are taken as `dict` takes
    them (``[("k", 1)]``), anything else gives none, warned once; never an error into the training loop."""
    if not isinstance(attributes, Mapping):
        try:
            attributes = dict(attributes)
        except Exception:
            _warn_once.warning("not-a-mapping", "otel_train.span: `attributes` must be a mapping of str -> value, "
                               "got %s; the span is kept without them (warned once)", type(attributes).__name__)
            return {}
    return {key: held_value(value) for key, value in attributes.items()}
