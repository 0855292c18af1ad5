"""`kill -9` of the training process at random steps, then `otel-train replay`: every step that reached
the exporter process lands exactly once, in JSONL and in TensorBoard (read back with its own reader).

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

from faultkit import expected

DRIVER = Path(__file__).with_name("kill9_driver.py")
REPS = 24


def test_kill_9_at_random_steps_then_replay_lands_each_step_once(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(DRIVER), str(tmp_path), str(REPS), "9"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: list[dict[str, Any]] = json.loads(proc.stdout)
    assert len(results) == REPS
    for r in results:
        assert r["killed_by"] == 9 and r["drained_s"] is not None, r  # the exporter process exited by itself
        spooled = r["spooled_seq"]
        # Everything the exporter process spooled is durable in both backends...
        assert r["cursors"] == {"jsonl": spooled, "tensorboard": spooled}, r
        # ... so replay finds nothing to deliver, twice.
        assert r["replays"] == [[0, f"rank0: {spooled} window(s), every backend up to date\n"]] * 2, r
        steps = sorted({p[1] for p in r["jsonl"]})
        last = steps[-1]
        assert steps == list(range(last + 1)), r["rep"]  # no hole
        assert r["last_flushed"] <= last <= r["last_reported"] + 1, r  # every flushed step; nothing invented
        assert len(r["jsonl"]) == len(set(map(tuple, r["jsonl"]))) == len(r["tb"]), r["rep"]  # exactly once
        assert {tuple(p) for p in r["jsonl"]} == expected(range(last + 1)), r["rep"]
        assert {tuple(p) for p in r["tb"]} == expected(range(last + 1), as_f32=True), r["rep"]
