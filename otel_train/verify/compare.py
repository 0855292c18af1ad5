"""One series compared as lists of (step, value): what was logged against what a backend holds.

Each logged value is matched with one held value at its step that equals it as the backend can keep it
(`same_value`: TensorBoard and ClearML keep float32); NaN equals NaN, infinities by sign. What is left at a
step pairs up as wrong values; then a logged value left over is missing, and a held one left over is a
duplicate (a step that was logged) or an unexpected step (one that was never logged in that series).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence

__all__ = ["SeriesResult", "compare", "same_value"]

_F32 = struct.Struct("<f")


def _as_float32(v: float) -> float:
    try:
        return float(_F32.unpack(_F32.pack(v))[0])
    except OverflowError:
        return math.copysign(math.inf, v)


def same_value(logged: float, held: float, float32: bool = False) -> bool:
    """Whether `held` is `logged` as a backend keeps it (float32 backends: rounded to float32 first)."""
    if math.isnan(logged) or math.isnan(held):
        return math.isnan(logged) and math.isnan(held)
    if float32:
        logged = _as_float32(logged)
    if math.isinf(logged) or math.isinf(held):
        return logged == held
    return logged == held or math.isclose(logged, held, rel_tol=1e-6 if float32 else 1e-12, abs_tol=0.0)


@dataclasses.dataclass
class SeriesResult:
    """One series of one backend: counts, and the steps of each kind of problem (in step order)."""

    series: str
    rank: int
    expected: int = 0
    present: int = 0
    missing: list[int] = dataclasses.field(default_factory=list)
    duplicated: list[int] = dataclasses.field(default_factory=list)
    #: (step, logged, held)
    wrong_value: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    #: Steps held that were never logged in this series.
    unexpected_step: list[int] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.wrong_value or self.unexpected_step)


def compare(series: str, rank: int, logged: Sequence[tuple[int, float]], held: Sequence[tuple[int, float]],
            float32: bool = False) -> SeriesResult:
    """Compare one series' logged (step, value) list with the list a backend holds."""
    result = SeriesResult(series, rank, len(logged), len(held))
    by_step: dict[int, tuple[list[float], list[float]]] = {}
    for step, value in logged:
        by_step.setdefault(step, ([], []))[0].append(value)
    for step, value in held:
        by_step.setdefault(step, ([], []))[1].append(value)
    for step in sorted(by_step):
        want, got = by_step[step]
        left: list[float] = []
        for value in want:
            i = next((j for j, h in enumerate(got) if same_value(value, h, float32)), None)
            if i is None:
                left.append(value)
            else:
                got.pop(i)
        pairs = min(len(left), len(got))
        result.wrong_value.extend((step, left[k], got[k]) for k in range(pairs))
        result.missing.extend([step] * (len(left) - pairs))
        extra = len(got) - pairs
        if extra:
            (result.duplicated if want else result.unexpected_step).extend([step] * extra)
    return result
