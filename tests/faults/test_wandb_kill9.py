"""`kill -9` of a whole job using W&B (training process, exporter process and W&B's service process, as a
scheduler's cancel kills a process group), then `otel-train replay`: every step is in the W&B run files
exactly once, read back from the `.wandb` files.

W&B's service process writes the run file on its own schedule, so the exporter's cursor for W&B may only
claim the steps the file holds (the issue: the marker said 151 while the file held 0-138, and replay skipped
139-151 for good).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from backendkit import isolated_wandb_env, read_run, wandb_files
from faultkit import expected, jsonl_points, value, wait_unlocked

from otel_train.ship.export_process import replay
from otel_train.ship.spool import Spool, spool_dir

RUN = "job-wandb-kill9"
STEPS = 400  # spooled before the kill; a few 32 KiB blocks of W&B's run file

_JOB = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import faultkit
import otel_train as ot
session = ot.init(exporters=["wandb", "jsonl"], dir=sys.argv[1], run_id={RUN!r}, run_name={RUN!r},
                  export_interval_s=0.05)
for s in ot.steps(range({STEPS})):
    ot.log({{tag: faultkit.value(tag, s) for tag in faultkit.SERIES}})
    ot.log({{"pad/" + str(i): float(i) for i in range(20)}})
    time.sleep(0.002)
while session.export_progress().spooled_step < {STEPS - 1}:
    time.sleep(0.01)
print(session.export_process.pid, flush=True)
time.sleep(600)
"""


def _wandb_points(directory: Path) -> list[tuple[str, int, float]]:
    points = []
    for path in wandb_files(directory, RUN, RUN):
        for step, row in read_run(path)["history"].items():
            points += [(tag, step, row[tag]) for tag in ("loss", "acc") if tag in row]
    return points


@pytest.mark.parametrize("after_s", [0.3, 1.5])
def test_kill_9_of_the_whole_job_then_replay_writes_every_step_to_wandb_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after_s: float) -> None:
    isolated_wandb_env(monkeypatch, tmp_path / "wandb-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.Popen([sys.executable, "-c", _JOB, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        assert proc.stdout is not None
        exporter = int(proc.stdout.readline())
        try:
            proc.wait(timeout=after_s)  # the exporter process keeps delivering meanwhile
        except subprocess.TimeoutExpired:
            pass
        # The whole job, as a scheduler's cancel: the exporter process runs in a session of its own, and W&B's
        # service process in the exporter process's. Both groups are stopped first, so neither sees the other die
        # (a training process that outlived its exporter process by a moment restarted it, outside both groups).
        os.killpg(proc.pid, signal.SIGSTOP)
        os.killpg(exporter, signal.SIGSTOP)
        os.killpg(exporter, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    wait_unlocked(spool_dir(tmp_path, RUN, 0))  # a killed process's children (W&B's service) may hold it a while
    spool = Spool(spool_dir(tmp_path, RUN, 0))
    assert spool.last_step == STEPS - 1
    held = {s for _, s, _ in _wandb_points(tmp_path)}
    claimed = spool.cursor("wandb")
    # What the cursor claims is in W&B's file: every window up to it has all its steps there.
    claimed_steps = {s for seq, s, _ in spool.read(0) if seq <= claimed}
    assert claimed_steps <= held | {-1}, (claimed, max(held, default=-1))

    for _ in range(2):
        assert all(not p.behind() for p in replay(tmp_path / RUN).values())
        points = _wandb_points(tmp_path)
        assert set(points) == expected(range(STEPS)), sorted(expected(range(STEPS)) - set(points))[:5]
        assert max(Counter(points).values()) == 1  # each step exactly once, over both run files
        assert set(jsonl_points(tmp_path, RUN)) == expected(range(STEPS))
    assert value("loss", 0) == 1.0
