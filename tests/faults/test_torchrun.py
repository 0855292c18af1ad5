"""SIGTERM to a real `torchrun` job (two CPU workers): torchrun's agent catches it and sends SIGTERM to its
workers; otel-train in each worker hands off every step logged before the signal, marks the run preempted and
lets the worker die by the signal in time, so the agent never has to SIGKILL a worker.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from faultkit import SERIES, value

DRIVER = Path(__file__).with_name("torchrun_driver.py")
WORLD = 2


def logged_steps(out: Path, rank: int) -> list[int]:
    path = out / f"progress.{rank}"
    return [int(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_sigterm_to_torchrun_lands_every_logged_step_of_every_worker(tmp_path: Path) -> None:
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                             f"--nproc_per_node={WORLD}", str(DRIVER), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while min(len(logged_steps(tmp_path, r)) for r in range(WORLD)) < 5:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the workers did not reach step 5"
        time.sleep(0.05)
    at_signal = [logged_steps(tmp_path, r)[-1] for r in range(WORLD)]  # logged before any worker got the signal
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0  # torchrun reports the signal it was stopped by
    assert "SIGKILL" not in stderr, stderr[-3000:]  # every worker ended on the SIGTERM the agent forwarded

    for rank in range(WORLD):
        after = logged_steps(tmp_path, rank)[-1]  # the last step the loop noted: it runs no step after the signal
        records = list(read_jsonl(jsonl_path(tmp_path, "tr", rank)))
        points = [(r["tag"], r["step"], r["value"]) for r in records if r["type"] == "metric" and r["tag"] in SERIES]
        assert len(points) == len(set(points))  # each point once
        last = max(step for _, step, _ in points)
        assert at_signal[rank] <= after <= last <= after + 1  # (+1: a step logged, not yet noted, at the signal)
        assert set(points) == {(tag, s, value(tag, s) + rank) for s in range(last + 1) for tag in SERIES}
        assert [r["signal"] for r in records if r["type"] == "preempted"] == ["SIGTERM"]
