"""`kill -9` of the exporter process at the worst moment: right after a backend appended a window to its files and
before delivery recorded it as written (`Spool.advance`). The restarted exporter process cuts the files back to
where they were before that write (the intent record, `otel_train.ship.append_intent`) and delivers the window
again: JSONL and TensorBoard hold every step exactly once (read back as lists, in file order).

The kill is injected with the test-only `OTEL_TRAIN_TEST_KILL_AFTER_WRITE` (`otel_train._internal.faults`): the
exporter process kills itself after the write of the first window reaching `KILL_AT`, once (a marker file).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
import readback
from faultkit import SERIES, f32, value

import otel_train as ot
from otel_train._internal.faults import KILL_AFTER_WRITE
from otel_train.exporters.jsonl import jsonl_path, read_jsonl

STEPS = 40
KILL_AT = 20


def _jsonl_points(directory: Path, run: str) -> list[tuple[str, int, float]]:
    return [(r["tag"], r["step"], r["value"]) for r in read_jsonl(jsonl_path(directory, run, 0))
            if r["type"] == "metric" and r["tag"] in SERIES]


def _tb_points(folder: Path) -> list[tuple[str, int, float]]:
    """Every (tag, step, value) of `SERIES` in the order the event files hold them: a step written twice shows twice."""
    return [(p.name, p.step, p.value) for p in readback.tensorboard(folder) if p.name in SERIES]


@pytest.mark.parametrize("backend", ["jsonl", "tensorboard"])
def test_exporter_process_killed_between_a_write_and_its_record_writes_each_step_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    marker = tmp_path / "killed"
    # Read by the exporter process when it starts (this process imported the hook before: it stays unarmed).
    monkeypatch.setenv(KILL_AFTER_WRITE, f"{backend}@{KILL_AT}@{marker}")
    run = f"kill-gap-{backend}"
    session = ot.init(exporters=[backend], dir=tmp_path / "runs", run_name=run, export_interval_s=0.05)
    proc = session.export_process
    assert proc is not None
    killed = proc.pid
    for step in ot.steps(range(STEPS)):
        ot.log({tag: value(tag, step) for tag in SERIES})
        time.sleep(0.01)  # several windows: some written and recorded before the one the kill follows
        if step == KILL_AT + 5:  # let the kill happen and the exporter process restart before the loop goes on
            deadline = time.monotonic() + 30
            while proc.pid == killed and time.monotonic() < deadline:
                time.sleep(0.01)
    assert ot.flush(timeout_s=60)
    ot.shutdown()
    assert marker.exists() and proc.restarts == 1  # killed once, after the write of step KILL_AT's window

    if backend == "jsonl":
        got = _jsonl_points(tmp_path / "runs", run)
        want = [(tag, s, value(tag, s)) for s in range(STEPS) for tag in SERIES]
    else:
        got = _tb_points(tmp_path / "runs" / run)
        want = [(tag, s, f32(value(tag, s))) for s in range(STEPS) for tag in SERIES]
    assert [p for p, n in Counter(got).items() if n > 1] == []  # the killed window is not in the files twice
    assert sorted(got, key=lambda p: (p[1], p[0])) == sorted(want, key=lambda p: (p[1], p[0]))


@pytest.mark.parametrize("gzipped", [False, True], ids=["json", "gzip"])
def test_chrome_trace_killed_between_a_write_and_its_record_has_each_span_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gzipped: bool) -> None:
    """The Chrome trace: the restarted exporter process writes a new file (`rank0.1.trace.json`); the window the
    kill left unrecorded is cut back out of the first one, so across both files each step's span is there once."""
    from otel_train.trace_merge import load_trace

    marker = tmp_path / "killed"
    monkeypatch.setenv(KILL_AFTER_WRITE, f"chrome_trace@{KILL_AT}@{marker}")
    if gzipped:
        monkeypatch.setenv("OTEL_TRAIN_TRACE_GZIP", "1")
    run = "kill-gap-trace"
    session = ot.init(exporters=["chrome_trace"], dir=tmp_path / "runs", run_name=run, export_interval_s=0.05)
    proc = session.export_process
    assert proc is not None
    killed = proc.pid
    for step in ot.steps(range(STEPS)):
        with ot.span("work"):
            time.sleep(0.01)
        if step == KILL_AT + 5:
            deadline = time.monotonic() + 30
            while proc.pid == killed and time.monotonic() < deadline:
                time.sleep(0.01)
    assert ot.flush(timeout_s=60)
    ot.shutdown()
    assert marker.exists() and proc.restarts == 1

    files = sorted((tmp_path / "runs" / run / "trace").glob("rank0*"))
    assert len(files) == 2  # the killed process's file and the restarted one's
    steps = [e["args"]["train.step"] for f in files for e in load_trace(f) if e.get("ph") == "X" and e["name"] == "work"]
    assert sorted(steps) == list(range(STEPS))  # each span once: none missing, none twice
