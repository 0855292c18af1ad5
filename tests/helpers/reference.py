"""The reference model of the differential test: what a generated logging program logged, point by point.

A program is plain JSON (so it crosses into the subprocess that runs it, `tests/differential/program.py`):

    {"blocks": [{"kind": "step" | "steps" | "log_step", "start": int, "form": <step form>,
                 "omit_start": bool,                       # "steps" only: `ot.steps(it)` without start=
                 "iters": [{"logs": [[key, value spec], ...], "span": name | None, "flush": bool}, ...]}]}

A value spec is ``{"form": <value form>, "v": number}``, or for a 0-d tensor
``{"form": "tensor", "dtype": "float32" | "float64" | "int64", "v": number, "mutate": number | None}``
(`mutate` is filled in place right after the `ot.log` call). `expected_points` says, per rank, which
``(name, step, value)`` points every backend must hold: the value as the call saw it, once, at its step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from otel_train.verify.readers import Point, SpanPoint


def logged_value(spec: dict[str, Any]) -> float:
    """The number the `ot.log` call saw, as a float (a float32 source keeps its float32 rounding)."""
    form, v = spec["form"], spec["v"]
    if form in ("np_float32",) or (form == "tensor" and spec["dtype"] == "float32"):
        return float(np.float32(v))
    if form in ("bool", "np_bool"):
        return float(bool(v))
    if form in ("int", "np_int64") or (form == "tensor" and spec["dtype"] == "int64"):
        return float(int(v))
    return float(v)


def iter_steps(program: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """Each iteration of the program with the step it runs at (what `ot.step`/`ot.steps`/`step=` mean)."""
    out: list[tuple[int, dict[str, Any]]] = []
    latest: int | None = None
    for block in program["blocks"]:
        start = block["start"]
        if block.get("omit_start"):  # `ot.steps(it)` continues after the latest step, like `ot.step()`
            start = 0 if latest is None else latest + 1
        for k, it in enumerate(block["iters"]):
            out.append((start + k, it))
            if block["kind"] != "log_step":  # `ot.log(step=)` enters no step: `ot.step()` does not follow it
                latest = start + k
    return out


def expected_points(program: dict[str, Any]) -> list[Point]:
    return [Point(key, step, logged_value(spec)) for step, it in iter_steps(program) for key, spec in it["logs"]]


def expected_spans(program: dict[str, Any]) -> list[SpanPoint]:
    return [SpanPoint(it["span"], step) for step, it in iter_steps(program) if it.get("span")]


def same_value(a: float, b: float, rel: float = 1e-9) -> bool:
    """Equal as a backend can keep it: NaN equals NaN, infinities by sign, finite values within `rel`."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0) or a == b
