"""Turning logged values into floats, on the export thread.

Tensors are kept by reference on the training thread; here they are converted, with every
tensor of one window on the same device copied to the host in one batch (one sync per window
instead of one per value).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = ["to_float", "to_floats", "valid_name"]

def valid_name(key: Any) -> bool:
    """Whether `key` can be a metric key: any non-empty string (each backend maps it as it must,
    see `otel_train.names`)."""
    return isinstance(key, str) and key != ""


def to_float(value: Any) -> float | None:
    """The float of a logged value, or None when it cannot be a number."""
    t = type(value)
    if t is float:
        return value  # type: ignore[no-any-return]
    if t is int or t is bool:
        return _int_float(value)
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an integral type beyond the float range
            return _int_float(int(value))  # type: ignore[call-overload]  # Real has no __int__ in typeshed; integral types do
    if isinstance(value, (str, bytes, dict)):
        return None
    item = getattr(value, "item", None)
    if callable(item) and _numel(value) in (1, -1):  # -1: an object with .item() but no size
        try:
            v = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return float(v) if isinstance(v, numbers.Real) else None
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return to_float(value[0])
    return None


def _int_float(value: int) -> float:
    """`float(value)`; an int beyond the float range is +-inf (as float32 overflow is stored), not an error."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _numel(value: Any) -> int:
    numel = getattr(value, "numel", None)
    if callable(numel):
        try:
            return int(numel())
        except (TypeError, ValueError, RuntimeError):
            return -1
    size = getattr(value, "size", None)
    return size if isinstance(size, int) else -1


def to_floats(values: Sequence[Any]) -> list[float | None]:
    """Convert a window's values; torch tensors are stacked per device and copied once."""
    out: list[float | None] = [None] * len(values)
    tensors: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        t = type(v)
        if t is float:
            out[i] = v
        elif t is int:
            out[i] = _int_float(v)
        elif t.__module__ == "torch" and t.__name__ in ("Tensor", "Parameter") and _numel(v) == 1:
            tensors.setdefault(v.device, []).append(i)
        else:
            out[i] = to_float(v)
    if tensors:
        import torch

        for idxs in tensors.values():
            try:
                stacked = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in idxs])
                host = stacked.cpu().tolist()  # the one device->host copy for this device
            except (RuntimeError, TypeError, ValueError):
                host = [to_float(values[i]) for i in idxs]
            for i, v in zip(idxs, host):
                out[i] = v
    return out

