"""The shutdown summary line: its format, and a real process's stderr with and without OTEL_TRAIN_QUIET."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_train.summary import summary_line

_SCRIPT = textwrap.dedent(
    """
    import sys
    import otel_train as ot

    ot.init(exporters=["jsonl"], dir=sys.argv[1], run_name="summ")
    for i in ot.steps(range(5)):
        ot.log({"train/loss": 1.0 / (i + 1)})
    # no shutdown(): the atexit hook runs it
    """
)


def test_summary_line_names_counts_backends_and_failures() -> None:
    line = summary_line(1_234_567, 4012, ["tensorboard", "wandb"], 7, {"tensorboard": 0, "wandb": 1}, "runs/a")
    assert line == ("otel-train: 1,234,567 points in 4,012 windows to tensorboard, wandb; 7 dropped; "
                    "wandb: 1 failure; run folder runs/a")


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env={**clean, **env},
                          capture_output=True, text=True, timeout=120, check=True)


def test_summary_at_shutdown_on_stderr(tmp_path: Path) -> None:
    proc = _run(tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("otel-train: ")]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert " windows to jsonl; 0 dropped; run folder " in line
    points = int(line.split(" points in ")[0].removeprefix("otel-train: ").replace(",", ""))
    assert points == 5 * 4  # per step: train/loss, train.step.duration_s, train.time_total_s, train.iterations
    assert line.endswith(str(tmp_path / "runs" / "summ"))


@pytest.mark.parametrize("env", [{"OTEL_TRAIN_QUIET": "1"}, {"RANK": "1", "WORLD_SIZE": "2", "OTEL_TRAIN_RUN_ID": "r"}])
def test_no_summary_when_quiet_or_not_rank_zero(tmp_path: Path, env: dict[str, str]) -> None:
    proc = _run(tmp_path, **env)
    assert "otel-train: " not in proc.stderr, proc.stderr
