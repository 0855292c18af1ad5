"""`otel-train replay` can only add: it never cuts or rewrites what a backend's files hold.

A trainer whose DataLoader workers log is killed with SIGKILL; its exporter process drains what reached it and
exits. Replay (twice) must leave every point the files held in place, once, and the Chrome trace valid JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import readback
from faultkit import wait_unlocked

from otel_train.cli import main as cli_main

DRIVER = Path(__file__).parent / "worker_kill9_driver.py"
KILL_AFTER = 40


def _held(run_dir: Path) -> dict[str, list[tuple[str, int | None, float]]]:
    """What the files hold: JSONL and TensorBoard points, the trace's worker and loss counters, in file order."""
    return {
        "jsonl": [(p.name, p.step, p.value) for p in readback.jsonl(run_dir / "rank0.jsonl")],
        "tensorboard": [(p.name, p.step, p.value) for p in readback.tensorboard(run_dir)],
        "trace": [(p.name, p.step, p.value) for p in readback.chrome_counters(run_dir / "trace" / "rank0.trace.json")],
    }


def _replay(run_dir: Path) -> int:
    return cli_main(["replay", str(run_dir)])


@pytest.mark.timeout(300)
def test_replay_after_kill9_with_workers_logging_keeps_every_point(tmp_path: Path) -> None:
    run = "workers-kill9"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "OTEL_TRAIN_VERIFY": "record"}
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path), run], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        kind, num = line.split()
        if kind == "step" and int(num) >= KILL_AFTER:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(30)
    run_dir = tmp_path / run
    wait_unlocked(run_dir / "spool" / "rank0", 120)

    before = _held(run_dir)
    workers_before = {b: [p for p in pts if p[0].startswith("data/item")] for b, pts in before.items()}
    assert all(workers_before.values()), {b: len(p) for b, p in workers_before.items()}  # workers' points landed
    json.loads((run_dir / "trace" / "rank0.trace.json").read_text())  # the drained trace is valid JSON

    for _ in range(2):
        _replay(run_dir)
        after = _held(run_dir)
        for backend, points in before.items():
            kept = Counter(after[backend])
            missing = [p for p in points if kept[p] < Counter(points)[p]]
            assert not missing, (backend, len(missing), missing[:5])  # nothing the files held is gone
            assert len(after[backend]) == len(points), (backend, len(after[backend]), len(points))  # nothing added twice
        json.loads((run_dir / "trace" / "rank0.trace.json").read_text())  # still valid JSON
    assert cli_main(["verify", str(run_dir)]) == 0  # every backend holds what the run logged, once
