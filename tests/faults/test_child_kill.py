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



#: A spawned child of the run (a DataLoader worker's situation), as its own program: `ot.log` at steps 0..39 through
#: its connection to the exporter process; after step 19 it says so (a file) and waits for the parent's go-ahead.
CHILD = """
import sys, time
from pathlib import Path
import otel_train as ot

half, go_on = Path(sys.argv[1]), Path(sys.argv[2])
for step in range(40):
    if step == 20:
        half.write_text("")
        while not go_on.exists():
            time.sleep(0.01)
    ot.log({"child/x": float(step)}, step=step)
    time.sleep(0.01)
"""


def test_a_child_goes_on_sending_after_the_exporter_process_is_restarted(tmp_path: Path) -> None:
    """Before: the child's first send to the killed exporter process failed and the child dropped the rest of its
    telemetry for good (one warning; nothing counted). The trainer restarts the exporter process on the same
    listening socket: the child connects again and every value it logs after the restart lands."""
    import subprocess
    import sys

    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    run = "child-goes-on"
    session = ot.init(exporters=["jsonl"], dir=tmp_path, run_name=run)
    proc = session.export_process
    assert proc is not None
    half, go_on = tmp_path / "half", tmp_path / "go-on"
    with ot.step(0):  # the child inherits the run's worker address from this process's environment
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(half), str(go_on)])
        deadline = time.monotonic() + 60
        while not half.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert half.exists(), child.poll()
        time.sleep(0.5)  # the child's first half sent (it sends every 0.2 s)
        _kill_child(proc)
        go_on.write_text("")
        assert child.wait(60) == 0
    assert ot.flush(timeout_s=60)
    ot.shutdown()
    assert proc.restarts == 1
    steps = [r["step"] for r in read_jsonl(jsonl_path(tmp_path, run, 0))
             if r["type"] == "metric" and r["name"] == "child/x"]  # tagged {worker=pid}
    assert len(steps) == len(set(steps)), steps  # none twice
    assert set(range(20, 40)) <= set(steps), sorted(steps)  # everything logged after the restart
