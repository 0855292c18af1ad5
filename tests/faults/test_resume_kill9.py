"""`kill -9` of a whole job (training process and exporter process), then a new attempt resumes at N below
the last step the killed one spooled: after it ends (and after `otel-train replay`), TensorBoard and JSONL
show one value per step of each series, the new attempt's at steps >= N, and nothing of the killed attempt
at or after N.

The killed attempt's spool keeps windows its backends had not acknowledged; the new attempt's exporter
process reads them back. The resume is spooled after them, and their rows at steps >= N are cut, so they
can no longer land after the restart marker (the zig-zag a resume exists to prevent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from faultkit import SERIES, f32, jsonl_points, tb_points, value, wait_unlocked

import otel_train as ot
from otel_train.ship.export_process import replay
from otel_train.ship.spool import Spool, spool_dir

RUN = "job-kill9-resume"
KILLED_STEPS = 30  # the first attempt logs 0..29, all spooled, then the job is killed
RESUME_AT = 10
NEW_STEPS = range(RESUME_AT, 20)

_FIRST_ATTEMPT = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import faultkit
import otel_train as ot
session = ot.init(exporters=["jsonl", "tensorboard"], dir=sys.argv[1], run_id={RUN!r}, run_name={RUN!r},
                  export_interval_s=0.05)
for s in ot.steps(range({KILLED_STEPS})):
    ot.log({{tag: faultkit.value(tag, s) for tag in faultkit.SERIES}})
# Every window has reached the exporter process (spooled) once it answers; no flush: nothing waits for backends.
while session.export_progress().spooled_step < {KILLED_STEPS - 1}:
    time.sleep(0.01)
print(session.export_process.pid, flush=True)
time.sleep(600)
"""


def _killed_attempt(directory: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _FIRST_ATTEMPT, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        exporter = int(proc.stdout.readline())
        os.kill(exporter, signal.SIGKILL)  # the whole job at once
        proc.kill()
    finally:
        proc.wait(timeout=60)
    spool = spool_dir(directory, RUN, 0)
    wait_unlocked(spool)  # the killed exporter process releases the run a moment after the kill
    assert Spool(spool).last_step == KILLED_STEPS - 1
    # Fault injection: the exporter process died before it acknowledged anything, so every window is
    # still undelivered for the next attempt (backends acknowledge at most once a second while data flows).
    (spool / "cursors.json").unlink(missing_ok=True)


@pytest.mark.parametrize("declared", ["init", "runtime"])
def test_resume_after_kill_9_shows_one_value_per_step(tmp_path: Path, declared: str) -> None:
    _killed_attempt(tmp_path)
    ot.init(exporters=["jsonl", "tensorboard"], dir=tmp_path, run_id=RUN, run_name=RUN,
            resume_step=RESUME_AT if declared == "init" else None)
    if declared == "runtime":  # a framework integration that loads its checkpoint after init()
        ot.resume(RESUME_AT)
    for s in ot.steps(NEW_STEPS, start=RESUME_AT):
        ot.log({tag: value(tag, s) + 100.0 for tag in SERIES})
    ot.shutdown()

    want = {(tag, s, value(tag, s)) for s in range(RESUME_AT) for tag in SERIES}
    want |= {(tag, s, value(tag, s) + 100.0) for s in NEW_STEPS for tag in SERIES}
    for _ in range(2):  # replay finds nothing left: the resume was acknowledged with the windows
        assert all(not p.behind() for p in replay(tmp_path / RUN).values())
        tb = tb_points(tmp_path / RUN)
        assert set(tb) == {(t, s, f32(v)) for t, s, v in want}
        points = jsonl_points(tmp_path, RUN)
        assert set(points) == want
        # A window written but not acknowledged before the kill is written again (same values).
        assert max(Counter(points).values()) <= 2 and max(Counter(tb).values()) <= 2
