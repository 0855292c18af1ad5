"""The shutdown summary line: its format, and a real process's stderr with and without OTEL_TRAIN_QUIET."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_train.session.summary import summary_line

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


def test_summary_line_counts_every_loss_by_cause() -> None:
    line = summary_line(100, 3, ["jsonl", "wandb"], 5, {},
                        dropped_by={"values over the log buffer": 4, "spans over the span buffer": 0,
                                    "windows over an export queue": 1},
                        rows_lost={"jsonl": {}, "wandb": {"bad_value": 2, "refused": 1, "gave_up": 0}},
                        steps_order_dropped={"wandb": 3})
    assert line == ("otel-train: 100 points in 3 windows to jsonl, wandb; 5 dropped (4 values over the log buffer, "
                    "1 windows over an export queue); wandb: 3 rows not written (2 bad value, 1 refused by the "
                    "backend); wandb: 0 rows with a step going backwards, 3 not written")


_REFUSING = textwrap.dedent(
    """
    import sys
    import otel_train as ot
    from otel_train.testing import InMemoryRowExporter

    class Refusing(InMemoryRowExporter):
        name = "picky"

        def write_metrics(self, rows, histograms):
            if any(r.tag == "odd" for r in rows):
                raise ValueError("picky refuses `odd`")
            super().write_metrics(rows, histograms)

    picky = Refusing()
    ot.init(exporters=[picky], dir=sys.argv[1], run_name="summ")
    for i in ot.steps(range(4)):
        ot.log({"train/loss": 1.0 / (i + 1), "odd": float(i)})
        ot.flush()
    ot.shutdown()
    print("landed", sorted(r.step for r in picky.metrics if r.tag == "train/loss"))
    """
)


def test_summary_counts_the_rows_a_backend_refused(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_REFUSING)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=clean, capture_output=True,
                          text=True, timeout=120, check=True)
    assert "landed [0, 1, 2, 3]" in proc.stdout  # the rest of every window
    line = next(x for x in proc.stderr.splitlines() if x.startswith("otel-train: "))
    assert "; 0 dropped; picky: 4 failures; picky: 4 rows not written (4 refused by the backend); " in line, line
    # 4 failed writes, one per window (its rows tried alone to find the refused one are not failures of their own)
    warned = [x for x in proc.stderr.splitlines() if "`odd`" in x and "skipped a row" in x]
    assert len(warned) == 1, proc.stderr  # once for the series, not per row


_DOWN = textwrap.dedent(
    """
    import sys
    import otel_train as ot
    from otel_train.testing import InMemoryRowExporter

    class Down(InMemoryRowExporter):
        name = "down"

        def write_metrics(self, rows, histograms):
            raise ConnectionError("the server is down")

    ot.init(exporters=[Down()], dir=sys.argv[1], run_name="down", shutdown_timeout_s=2.0)
    for i in ot.steps(range(3)):
        ot.log({"train/loss": 1.0 / (i + 1)})
    ot.shutdown()
    """
)


def test_rows_an_in_process_backend_still_fails_at_shutdown_are_counted(tmp_path: Path) -> None:
    """In the training process (no spool behind the backend) a backend still failing at shutdown loses what it
    holds: it was said ("closed with N window(s) it could not write") but the summary read "0 dropped"."""
    script = tmp_path / "train.py"
    script.write_text(_DOWN)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=clean, capture_output=True,
                          text=True, timeout=120, check=True)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("otel-train: ") and " points in " in x)
    assert "down: " in line and "rows not written (" in line and "still failing at shutdown)" in line, line
