"""A trainer killed with SIGKILL before its exporter process said ``ready`` loses nothing it logged.

`init()` does not wait for the exporter process: the windows logged before it is up go into its socket at once
(numbered on from the spool, which the trainer reads itself), and the exporter process spools and delivers them
after the trainer is gone. The test-only `OTEL_TRAIN_TEST_SLOW_READY` (`otel_train._internal.faults`) keeps the
exporter process from saying ``ready`` until the trainer is dead: the moment a loaded machine makes likely.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import readback
from faultkit import wait_unlocked

from otel_train._internal.faults import SLOW_READY
from otel_train.cli import main as cli_main
from otel_train.ship.spool import Spool, last_seq, spool_dir

STEPS = 12
RUN = "before-ready"

TRAIN = textwrap.dedent("""
    import sys, time
    import otel_train as ot
    session = ot.init(exporters="jsonl,tensorboard", dir=sys.argv[1], run_id=sys.argv[2], run_name=sys.argv[2])
    print("exporter", session.export_process.pid, flush=True)
    for step in range(int(sys.argv[3])):
        with ot.step(step):
            ot.log({"loss": step / 4})
    ot.flush(timeout_s=0.1)  # hands every window to the exporter process; it cannot answer before `ready`
    print("logged", flush=True)
    time.sleep(600)  # killed here
""")


def _points(run_dir: Path) -> dict[str, list[tuple[str, int | None, float]]]:
    return {
        "jsonl": [(p.name, p.step, p.value) for p in readback.jsonl(run_dir / "rank0.jsonl") if p.name == "loss"],
        "tensorboard": [(p.name, p.step, p.value) for p in readback.tensorboard(run_dir) if p.name == "loss"],
    }


@pytest.mark.timeout(300)
def test_windows_logged_before_ready_survive_a_kill_9_of_the_trainer(tmp_path: Path) -> None:
    marker = tmp_path / "go"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, SLOW_READY: str(marker)}
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(tmp_path), RUN, str(STEPS)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None
    rank_dir = spool_dir(tmp_path, RUN, 0)
    try:
        kind, pid = proc.stdout.readline().split()
        assert kind == "exporter"
        assert proc.stdout.readline().strip() == "logged"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
        assert last_seq(rank_dir) == 0  # the exporter process has not read a window yet: it was not ready
        os.kill(int(pid), 0)  # ... and it is alive
    finally:
        proc.kill()
        marker.touch()  # now it says `ready` (to nobody), reads what the trainer sent, spools and delivers it
    wait_unlocked(rank_dir, 120)

    expected = [("loss", step, step / 4) for step in range(STEPS)]
    assert _points(tmp_path / RUN) == {"jsonl": expected, "tensorboard": expected}  # each step once, in order
    spool = Spool(rank_dir)
    assert spool.last_seq > 0 and spool.cursors == {"jsonl": spool.last_seq, "tensorboard": spool.last_seq}
    del spool
    assert cli_main(["replay", str(tmp_path / RUN)]) == 0  # nothing left to deliver: nothing added twice
    assert _points(tmp_path / RUN) == {"jsonl": expected, "tensorboard": expected}
