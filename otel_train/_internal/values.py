"""Turning logged values into floats, on the export thread, and saying why one is refused.

Tensors are kept by reference on the training thread; here they are converted, with every
tensor of one window on the same device copied to the host in one batch (one sync per window
instead of one per value).

A number is any `numbers.Real` (int, bool, float, `Fraction`, NumPy scalars), a `decimal.Decimal`
(not registered as `Real`, yet a real number) and a one-element tensor, array or list; everything else is
refused: `refusal` says why, as one of `REFUSAL_CAUSES` (the shutdown summary's words).
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["REFUSAL_CAUSES", "REFUSED_PREFIX", "RefusalCounts", "refusal", "to_float", "to_floats", "valid_name"]

#: Why a value never reached any window, by cause (`Session.refusals`), as the shutdown summary words it: the
#: first word is the unit counted.
REFUSAL_CAUSES = {
    "not_a_number": "values not a number",
    "not_a_scalar": "values not a scalar (more or fewer than one element)",
    "bad_key": "values with a key that is not a non-empty string",
    "not_a_mapping": "calls of `ot.log` without a mapping",
    "bad_step": "values at a step that is no step",
    "step_out_of_range": "values at a step outside 0..2**63-1",
    "bad_attribute": "attributes left out (their values were logged without them)",
    "bad_step_entered": "calls of `ot.step`/`ot.steps`/`ot.resume` with a step that is no step (ignored)",
    "log_rate_limited": "log records over the rate limit (`OTEL_TRAIN_LOG_RATE`)",
}
#: A child process reports its refusals with the other losses it tells the exporter process (cause -> count):
#: ``REFUSED_PREFIX + cause`` marks one of `REFUSAL_CAUSES` among them.
REFUSED_PREFIX = "refused:"


class RefusalCounts(dict[str, int]):
    """Refusals by cause (`REFUSAL_CAUSES`): a plain dict to read, `add` to count from any thread (the training
    thread refuses steps and attributes at the call, the collector values and keys as it converts them).

    Example:
        >>> counts = RefusalCounts()
        >>> counts.add("not_a_number", 2); counts.add("bad_key"); counts.add("bad_key", 0)
        >>> counts
        {'not_a_number': 2, 'bad_key': 1}
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, cause: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self[cause] = self.get(cause, 0) + n

    def snapshot(self) -> dict[str, int]:
        """A copy, consistent while others count."""
        with self._lock:
            return dict(self)


def valid_name(key: Any) -> bool:
    """Whether `key` can be a metric key: any non-empty string (each backend maps it as it must,
    see `otel_train.vocab.names`)."""
    return isinstance(key, str) and key != ""


def valid_text(text: str) -> str:
    """`text` where it is valid Unicode, which every backend stores (as UTF-8); else with each lone surrogate written
    as the byte it stands for, escaped: a file name decoded with `os.fsdecode` (``'img_\\udcff.png'``) becomes
    ``'img_\\\\xff.png'``. Before, such a key stopped the run's delivery at the first backend that encoded it.

    Example:
        >>> valid_text("img_\\udcff.png"), valid_text("épochs/loss")
        ('img_\\\\xff.png', 'épochs/loss')
    """
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate that stands for no byte
            return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    if type(value).__module__ == "decimal":  # `Decimal` is a real number though not registered as `Real`
        try:
            return float(value)
        except (TypeError, ValueError):  # a signaling NaN
            return None
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


def refusal(value: Any) -> str:
    """Why `value`, which `to_float` refused, is no value: ``not_a_scalar`` for a tensor, array or sequence that
    does not hold exactly one element, else ``not_a_number``.

    Example:
        >>> refusal([1.0, 2.0]), refusal("0.5"), refusal(None), refusal(1j)
        ('not_a_scalar', 'not_a_number', 'not_a_number', 'not_a_number')
    """
    if isinstance(value, (str, bytes, bytearray, dict)):
        return "not_a_number"
    if isinstance(value, (list, tuple)):
        return "not_a_scalar" if len(value) != 1 else refusal(value[0])
    if callable(getattr(value, "item", None)) and _numel(value) not in (1, -1):
        return "not_a_scalar"
    return "not_a_number"


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

