"""A real `torchrun` job (gloo, CPU): 4 ranks, rank 1 stuck before the gradient `all_reduce` of step 50. Every
rank's hang record exists; the roll call names rank 1 and its frame, and the others' common frame in
`all_reduce`; each rank's file ends with a `resumed` record once rank 1 goes on. A second job, whose steps vary
(a slow first step, a slow validation every 20 steps), records no hang.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch.distributed", reason="needs torch (the [test] extra)")

JOB = Path(__file__).with_name("hang_job.py")


def start_job(tmp_path: Path, mode: str, world: int, env: dict[str, str]) -> subprocess.Popen[str]:
    """Run the job from `tmp_path` as ``train.py`` (so its frames read ``train.py:NN``)."""
    shutil.copy(JOB, tmp_path / "train.py")
    full = {**os.environ, "OTEL_TRAIN_DIR": str(tmp_path / "runs"), "OTEL_TRAIN_EXPORTERS": "jsonl",
            "OTEL_TRAIN_EXPORT_PROCESS": "off", "OTEL_TRAIN_QUIET": "1", "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                             f"--nproc_per_node={world}", "train.py", mode, str(tmp_path)],
                            cwd=tmp_path, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def hang_files(run_dir: Path) -> dict[int, dict[str, Any]]:
    from otel_train.hangs.hang_file import read_hang_files

    return read_hang_files(run_dir)


def roll_call(run_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_train.cli", "hangs", *flags, str(run_dir)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_roll_call_names_the_rank_the_others_wait_for(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "job"
    proc = start_job(tmp_path, "hang", 4, {"OTEL_TRAIN_HANG_AFTER_S": "2", "OTEL_TRAIN_HANG_FACTOR": "5"})
    try:
        deadline = time.monotonic() + 120
        while True:
            files = hang_files(run_dir)
            if len(files) == 4 and all(f["state"] == "stuck" for f in files.values()):
                break
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, f"not every rank recorded a hang: {files}"
            time.sleep(0.2)
        stuck = roll_call(run_dir)
        as_json = json.loads(roll_call(run_dir, "--json").stdout)
    finally:
        (tmp_path / "go").touch()  # rank 1 goes on; the job ends by itself
        output, _ = proc.communicate(timeout=180)
    print(stuck.stdout)  # the roll call as a user sees it (quoted in docs/where-is-my-step-stuck.md)
    assert stuck.returncode == 1, stuck.stdout + stuck.stderr
    verdict = stuck.stdout.splitlines()[0]
    assert verdict.startswith("ranks [0, 2, 3] have waited "), verdict
    assert "in `backward` at `torch/distributed/distributed_c10d.py:" in verdict and " in all_reduce` (from `train.py:" in verdict
    assert "rank [1] has waited " in verdict and " in `data` at `train.py:" in verdict and " in load_batch`" in verdict
    assert verdict.endswith("rank 1 is where to look")
    assert as_json["suspects"] == [1] and [g["ranks"] for g in as_json["groups"]] == [[0, 2, 3], [1]]
    assert {s for g in as_json["groups"] for s in g["steps"]} == {50}

    assert proc.returncode == 0, output[-4000:]
    files = hang_files(run_dir)
    assert sorted(files) == [0, 1, 2, 3] and {f["state"] for f in files.values()} == {"ended"}
    for rank, content in files.items():
        history = content["history"]
        assert history[0]["state"] == "stuck" and history[0]["step"] == 50, (rank, history)
        assert history[-1]["state"] == "resumed" and history[-1]["step"] == 50, (rank, history)
        threads = history[0]["threads"]
        assert next(t for t in threads if t["main"])["frames"][0] == history[0]["main_frame"]
    assert roll_call(run_dir).returncode == 0


def test_steps_that_vary_record_no_hang(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "job"
    proc = start_job(tmp_path, "vary", 2, {"OTEL_TRAIN_HANG_AFTER_S": "1", "OTEL_TRAIN_HANG_FACTOR": "5"})
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    files = hang_files(run_dir)
    assert sorted(files) == [0, 1]
    assert [(f["state"], f["history"]) for f in files.values()] == [("ended", [])] * 2, files
    assert "train.hang" not in output and "has run" not in output
