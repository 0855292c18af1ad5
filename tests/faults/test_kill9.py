"""`kill -9` of the training process at steps from the first to a backlog, then `otel-train replay`: every step
that reached the exporter process lands exactly once, in JSONL and in TensorBoard (read back with its own reader).

What reached the exporter process is known from its spool: the windows it spooled (the spool's last
seq) and each backend's durable cursor. Every flushed step had reached it; a step logged after the last
flush may have too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from faultkit import expected

# Real processes, each under a 300 s limit of its own: twice the suite's default per test.
pytestmark = pytest.mark.timeout(600)
DRIVER = Path(__file__).with_name("kill9_driver.py")
# The steps after which each rep (a real exporter process each) is killed. The loop flushes every 5th step, and
# it runs on while the kill is sent, so where the kill lands in a window is up to timing; the steps spread the
# kills over the first step, either side of a flush (4, 5, 6) and a longer backlog.
KILL_STEPS = (0, 4, 5, 6, 17, 29, 43, 60)


def drive(out: Path, kill_steps: tuple[int, ...], *mode: str) -> list[dict[str, Any]]:
    steps = ",".join(map(str, kill_steps)) + ","  # a list, even of one
    proc = subprocess.run([sys.executable, str(DRIVER), str(out), steps, "0", *mode], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: list[dict[str, Any]] = json.loads(proc.stdout)
    assert [r["kill_after_step"] for r in results] == list(kill_steps)
    return results


def test_kill_9_at_any_step_then_replay_lands_each_step_once(tmp_path: Path) -> None:
    for r in drive(tmp_path, KILL_STEPS):
        assert r["killed_by"] == 9 and r["drained_s"] is not None, r  # the exporter process exited by itself
        spooled = r["spooled_seq"]
        # Everything the exporter process spooled is durable in both backends...
        assert r["cursors"] == {"jsonl": spooled, "tensorboard": spooled}, r
        # ... so replay finds nothing to deliver, twice.
        assert r["replays"] == [[0, f"rank0: {spooled} window(s), every one delivered to every backend\n"]] * 2, r
        steps = sorted({p[1] for p in r["jsonl"]})
        last = steps[-1]
        assert steps == list(range(last + 1)), r["rep"]  # no hole
        assert r["last_flushed"] <= last <= r["last_reported"] + 1, r  # every flushed step; nothing invented
        assert len(r["jsonl"]) == len(set(map(tuple, r["jsonl"]))) == len(r["tb"]), r["rep"]  # exactly once
        assert {tuple(p) for p in r["jsonl"]} == expected(range(last + 1)), r["rep"]
        assert {tuple(p) for p in r["tb"]} == expected(range(last + 1), as_f32=True), r["rep"]


def test_kill_9_of_the_whole_job_then_replay_lands_every_spooled_step(tmp_path: Path) -> None:
    """The exporter process killed too, at once: replay delivers what it had spooled but not delivered, and
    resumes each backend after the last window its writes handed to the OS (`Spool.advance`). A window whose
    write had started or finished but was not recorded yet is cut back out of the files first (the intent
    record, `otel_train.ship.append_intent`), so every point is there once."""
    for r in drive(tmp_path, (0, 5, 6, 28, 55), "both"):
        assert r["killed_by"] == 9, r
        last = r["spooled_step"]  # the spool's last intact record: what reached the exporter process
        assert r["last_flushed"] <= last <= r["last_reported"] + 1, r
        assert r["replays"][1] == [0, f"rank0: {r['spooled_seq']} window(s), every one delivered to every backend\n"], r
        assert {tuple(p) for p in r["jsonl"]} == expected(range(last + 1)), r["rep"]
        assert {tuple(p) for p in r["tb"]} == expected(range(last + 1), as_f32=True), r["rep"]
        assert len(r["jsonl"]) == len(set(map(tuple, r["jsonl"]))), r["rep"]  # each point once, in the file
        assert len(r["tb"]) == len(set(map(tuple, r["tb"]))), r["rep"]
