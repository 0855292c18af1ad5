"""`kill -9` of the exporter process at random moments: restarted once, then the training process exports
from the same spool itself; every point and every span lands exactly once in JSONL, TensorBoard and the
Chrome trace (each backend resumes after the last window its writes handed to the OS, `Spool.advance`).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from faultkit import SERIES, expected, jsonl_points, tb_points, value

import otel_train as ot
from otel_train.trace_merge import load_trace

STEPS = 60


def _kill_child(proc: object) -> None:
    old = proc.pid  # type: ignore[attr-defined]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while proc.pid == old and proc.fallback is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_exporter_process_killed_twice_writes_every_point_and_span_once(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    kills = sorted(rng.sample(range(5, STEPS - 5), 2))
    run = f"child-kill-{seed}"
    session = ot.init(exporters=["jsonl", "tensorboard", "chrome_trace"], dir=tmp_path, run_name=run)
    proc = session.export_process
    assert proc is not None
    for step in range(STEPS):
        with ot.step(step), ot.span("work"):
            ot.log({tag: value(tag, step) for tag in SERIES})
        time.sleep(rng.uniform(0.0, 0.03))  # windows go out every 0.1 s: kill before, during and after writes
        if step in kills:
            time.sleep(rng.uniform(0.0, 0.15))
            _kill_child(proc)
    assert ot.flush(timeout_s=60)
    ot.shutdown()
    assert proc.restarts == 1 and proc.fallback is not None

    points = jsonl_points(tmp_path, run)
    assert Counter(points).most_common(1)[0][1] == 1, [p for p, n in Counter(points).items() if n > 1][:5]
    assert set(points) == expected(range(STEPS))
    tb = tb_points(tmp_path / run)
    assert len(tb) == len(set(tb)) and set(tb) == expected(range(STEPS), as_f32=True)
    traces = sorted((tmp_path / run / "trace").glob("rank0*.trace.json"))
    spans = [e["args"]["train.step"] for t in traces for e in load_trace(t) if e.get("name") == "work"]
    assert sorted(spans) == list(range(STEPS))
