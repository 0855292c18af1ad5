"""Accelerate in real processes: every rank records when asked (2 processes under `accelerate launch`), two jobs on
one host with the same rendezvous port are two runs, and logged steps are durable without `ot.step` (kill -9)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the Accelerate integration test needs `pip install 'otel-train[accelerate]'`")

from otel_train.exporters.jsonl import jsonl_path, read_jsonl

_JOB = textwrap.dedent("""
    import os

    from accelerate import Accelerator

    import otel_train as ot
    from otel_train.integrations.accelerate import OtelTrainTracker

    tracker = OtelTrainTracker(main_process_only=False)
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("proj")  # Accelerate runs this (and accelerator.log) on the main process only
    rank = accelerator.process_index
    for i in range(3):
        accelerator.log({"train/x": -1.0}, step=i)  # main process only: Accelerate's rule
        tracker.log({"train/x": float(10 * rank + i)}, step=i + 100)  # every process: the README's recipe
    run = ot.current_session().run
    # One file per rank: the ranks share the launcher's stdout, where two prints can interleave mid-line.
    with open(os.path.join(os.environ["PLACEMENT_DIR"], f"rank{rank}.txt"), "w") as f:
        f.write(f"{rank} {run.run_id} {run.rank}")
    accelerator.end_training()
    tracker.finish()  # end_training finishes trackers on the main process only
""")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k not in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    env.update({"OTEL_TRAIN_DIR": str(tmp_path / "runs"), "OTEL_TRAIN_EXPORTERS": "jsonl", **extra})
    return env


def _points(directory: Path, run: str, rank: int) -> list[tuple[int, float]]:
    return [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(directory, run, rank))
            if r["type"] == "metric" and r["tag"] == "train/x"]


def _launch(script: Path, env: dict[str, str], placements: Path) -> dict[int, str]:
    """Run `script` as a 2-process `accelerate launch` job on port 29533; rank -> run id it wrote to `placements`."""
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert launcher is not None
    placements.mkdir()
    done = subprocess.run(
        [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", "29533", str(script)],
        check=False, env={**env, "PLACEMENT_DIR": str(placements)}, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {}
    for placement in placements.iterdir():
        rank, run_id, session_rank = placement.read_text().split()
        assert rank == session_rank  # Accelerate's process index is the session's rank
        runs[int(rank)] = run_id
    return runs


def test_every_process_records_and_two_jobs_on_one_port_are_two_runs(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    env = _env(tmp_path, OTEL_TRAIN_RANKS="all")
    first = _launch(script, env, tmp_path / "first")
    second = _launch(script, env, tmp_path / "second")
    assert sorted(first) == sorted(second) == [0, 1]
    assert first[0] == first[1]  # the ranks of one job share one run
    assert second[0] == second[1]
    assert first[0] != second[0]  # the same port (29533) twice: still two runs
    runs = tmp_path / "runs"
    for run in (first[0], second[0]):
        assert sorted(_points(runs, run, 0)) == [(0, -1.0), (1, -1.0), (2, -1.0), (100, 0.0), (101, 1.0), (102, 2.0)]
        assert sorted(_points(runs, run, 1)) == [(100, 10.0), (101, 11.0), (102, 12.0)]  # rank 1 recorded: its own file


_KILLED = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    from accelerate import Accelerator

    from otel_train.integrations.accelerate import OtelTrainTracker

    accelerator = Accelerator(cpu=True, log_with=OtelTrainTracker(run_name="killed"))
    accelerator.init_trackers("proj")
    for i in range(5):
        accelerator.log({"train/x": float(i)}, step=i)
    # OTEL_TRAIN_EXPORT_INTERVAL_S is an hour: the points can only arrive because the logged steps are step
    # boundaries. Once all five are on disk, die without any shutdown.
    out = Path(os.environ["OTEL_TRAIN_DIR"]) / "killed" / "rank0.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if out.exists() and out.read_text().count('"train/x"') >= 5:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
    sys.exit(3)  # never collected: the logged steps did not drive collection
""")


def test_logged_steps_are_collected_and_survive_kill_9(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    done = subprocess.run([sys.executable, str(script)], env=_env(tmp_path, OTEL_TRAIN_EXPORT_INTERVAL_S="3600"),
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert _points(tmp_path / "runs", "killed", 0) == [(i, float(i)) for i in range(5)]
