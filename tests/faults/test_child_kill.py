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


def _child_logs(steps: int, started: object, go_on: object) -> None:
    """A spawned child of the run (a DataLoader worker's situation): logs `child/x` at steps 0..steps-1 through its
    connection to the exporter process, the second half after the parent killed that process."""
    import otel_train as child_ot

    for step in range(steps):
        if step == steps // 2:
            started.set()  # type: ignore[attr-defined]
            go_on.wait(60)  # type: ignore[attr-defined]
        child_ot.log({"child/x": float(step)}, step=step)
        time.sleep(0.01)


def test_a_child_goes_on_sending_after_the_exporter_process_is_restarted(tmp_path: Path) -> None:
    """Before: the child's first send to the killed exporter process failed and the child dropped the rest of its
    telemetry for good (one warning; nothing counted). The trainer restarts the exporter process on the same
    listening socket: the child connects again and every value it logs after the restart lands."""
    import multiprocessing

    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    run = "child-goes-on"
    session = ot.init(exporters=["jsonl"], dir=tmp_path, run_name=run)
    proc = session.export_process
    assert proc is not None
    ctx = multiprocessing.get_context("spawn")
    started, go_on = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_child_logs, args=(40, started, go_on))
    with ot.step(0):
        child.start()
        assert started.wait(60)
        time.sleep(0.5)  # the child's first half sent (it sends every 0.2 s)
        _kill_child(proc)
        go_on.set()
        child.join(60)
    assert child.exitcode == 0
    assert ot.flush(timeout_s=60)
    ot.shutdown()
    assert proc.restarts == 1
    steps = [r["step"] for r in read_jsonl(jsonl_path(tmp_path, run, 0))
             if r["type"] == "metric" and r["name"] == "child/x"]  # tagged {worker=pid}
    assert len(steps) == len(set(steps)), steps  # none twice
    assert set(range(20, 40)) <= set(steps), sorted(steps)  # everything logged after the restart
