"""Helpers of the fault-injection suite: what a tiny training loop logs, and reading it back.

Every fault test asserts exact (series, step, value) sets, so the loop logs values that are a
function of the step, and the readers return sets of points.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

#: The series the tiny loop logs (the auto-recorded `train.*` series are left out of the sets).
SERIES = ("loss", "acc")


def value(tag: str, step: int) -> float:
    """What the tiny loop logs for `tag` at `step` (exactly representable in float32)."""
    return 1.0 / (step + 1) if tag == "loss" else step * 0.5


def f32(x: float) -> float:
    """`x` as TensorBoard stores it (float32)."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def expected(steps: range | list[int], as_f32: bool = False) -> set[tuple[str, int, float]]:
    """The exact points of `SERIES` at `steps`."""
    conv = f32 if as_f32 else float
    return {(tag, s, conv(value(tag, s))) for s in steps for tag in SERIES}


def jsonl_points(directory: Path, run_name: str, rank: int = 0) -> list[tuple[str, int, float]]:
    """Every (tag, step, value) of `SERIES` in a JSONL file, in file order, resumes applied."""
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl, resolve_resumes

    path = jsonl_path(directory, run_name, rank)
    if not path.exists():
        return []
    return [(r["tag"], r["step"], r["value"]) for r in resolve_resumes(read_jsonl(path))
            if r["type"] == "metric" and r["tag"] in SERIES]


def jsonl_spans(directory: Path, run_name: str, rank: int = 0) -> list[dict[str, object]]:
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    path = jsonl_path(directory, run_name, rank)
    return [r for r in read_jsonl(path) if r["type"] == "span"] if path.exists() else []


def tb_points(run_dir: Path) -> list[tuple[str, int, float]]:
    """Every (tag, step, value) of `SERIES` in the run's event files, in file order (`readback.tensorboard`: a
    step written twice shows twice; a declared resume's purge applied)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))  # the drivers run without conftest's path
    import readback

    return [(p.name, p.step, p.value) for p in readback.tensorboard(run_dir) if p.name in SERIES]


def wait_unlocked(rank_dir: Path, within_s: float = 60.0) -> None:
    """Until no process holds the rank's spool (a killed job's exporter process, or W&B's service it started, may
    hold it a moment after the kill): replay skips, and `init()` renames, a run another process still writes."""
    from otel_train.ship.spool import try_lock

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        fd = try_lock(rank_dir)
        if fd is not None:
            os.close(fd)
            return
        time.sleep(0.05)
    raise AssertionError(f"{rank_dir} still locked after {within_s} s")
