"""The `otel-train` command as a newcomer runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_train.cli", *args], cwd=cwd, capture_output=True, text=True, check=False)


def test_demo_writes_curves_and_trace_and_says_where(tmp_path: Path) -> None:
    result = _cli("demo", "--steps", "30", "--dir", "runs", "--run-name", "first", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tensorboard --logdir runs" in result.stdout
    assert "runs/first/trace/rank0.trace.json" in result.stdout and "ui.perfetto.dev" in result.stdout
    acc = EventAccumulator(str(tmp_path / "runs" / "first"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(30))
    assert loss[-1].value < loss[0].value  # it learns
    assert {"train/lr", "train/grad_norm", "train/throughput"} <= set(acc.Tags()["scalars"])
    events = json.loads((tmp_path / "runs" / "first" / "trace" / "rank0.trace.json").read_text())
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} == {"data", "forward", "backward", "optimizer"}
    assert len(spans) == 4 * 30


def test_trace_merge_command(tmp_path: Path) -> None:
    for rank in (0, 1):
        ev = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
              {"name": "step", "ph": "X", "ts": 10 + rank, "dur": 5, "pid": rank, "tid": 1, "args": {}}]
        (tmp_path / f"rank{rank}.trace.json").write_text(json.dumps(ev))
    result = _cli("trace", "merge", "all.json", "rank0.trace.json", "rank1.trace.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    merged = json.loads((tmp_path / "all.json").read_text())
    assert sorted(e["pid"] for e in merged if e["ph"] == "X") == [0, 1]
    assert "merged 4 events" in result.stdout


def test_bad_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "OTEL_TRAIN_EXPORTERS": "tensorbord"}
    result = subprocess.run([sys.executable, "-m", "otel_train.cli", "demo", "--steps", "1"], cwd=tmp_path,
                            capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("otel-train: error: OTEL_TRAIN_EXPORTERS: unknown exporter 'tensorbord'")
    assert len(result.stderr.strip().splitlines()) == 1


def test_replay_set_with_a_name_no_backend_reads_is_one_line(tmp_path: Path) -> None:
    result = _cli("replay", str(tmp_path), "--set", "WANDB_MOD=offline", cwd=tmp_path)
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("otel-train replay: --set 'WANDB_MOD=offline': expected NAME=VALUE with NAME one of ")
    assert "WANDB_MODE" in line and "MLFLOW_TRACKING_URI" in line and "TRACKIO_DIR" in line
