"""The exporter process's health counters reach the training process: step-order counters per backend and the
spool's failed appends, in `Session.export_progress()`, as self-telemetry series and in the shutdown summary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_disk_full import FULL_DISK

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl


def health_rows(directory: Path, run_name: str) -> dict[str, list[tuple[int, float]]]:
    """The step-order and spool series otel-train wrote to JSONL: tag -> [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in read_jsonl(jsonl_path(directory, run_name, 0)):
        if r["type"] == "metric" and r["name"] in ("otel_train.steps_backwards", "otel_train.steps_order_dropped",
                                                   "otel_train.spool_failed_appends"):
            out.setdefault(r["tag"], []).append((r["step"], r["value"]))
    return out


def test_step_order_counters_reach_the_training_process(tmp_path: Path, backend_home: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A real run whose step goes backwards once, through the exporter process: every backend saw one row go
    backwards; TensorBoard and W&B (which cannot hold it as logged) did not write it."""
    out = tmp_path / "runs"
    session = ot.init(exporters=["jsonl", "tensorboard", "wandb"], dir=out, run_id="hc", run_name="hc",
                      step_order="warn")
    assert session.export_process is not None
    for s in range(4):
        ot.log({"loss": float(s)}, step=s)
    assert ot.flush(timeout_s=60)
    ot.log({"loss": 20.0}, step=2)  # backwards: a late value for step 2
    assert ot.flush(timeout_s=60)
    ot.log({"loss": 4.0}, step=4)  # its window carries the counts as self-telemetry
    assert ot.flush(timeout_s=60)
    progress = session.export_progress()
    assert progress.steps_backwards == {"jsonl": 1, "tensorboard": 1, "wandb": 1}
    assert progress.steps_order_dropped == {"jsonl": 0, "tensorboard": 1, "wandb": 1}
    assert progress.spool_failed_appends == 0
    ot.shutdown()
    # Series only once non-zero: nothing before the late row, then the counts at the next window's step.
    assert health_rows(out, "hc") == {
        "otel_train.steps_backwards{exporter=jsonl}": [(4, 1.0)],
        "otel_train.steps_backwards{exporter=tensorboard}": [(4, 1.0)],
        "otel_train.steps_backwards{exporter=wandb}": [(4, 1.0)],
        "otel_train.steps_order_dropped{exporter=tensorboard}": [(4, 1.0)],
        "otel_train.steps_order_dropped{exporter=wandb}": [(4, 1.0)],
    }
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("otel-train: ") and " points in " in x]
    assert ("; jsonl: 1 row with a step going backwards, 0 not written; tensorboard: 1 row with a step going "
            "backwards, 1 not written; wandb: 1 row with a step going backwards, 1 not written; run folder") in line


def test_step_order_counters_in_process_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process backends report the same counters in the summary (there is no exporter process to ask)."""
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", "off")
    session = ot.init(exporters=["jsonl"], dir=tmp_path, run_id="hi", run_name="hi", step_order="drop")
    for s in (0, 1, 2, 1, 3):
        ot.log({"loss": float(s)}, step=s)
        assert ot.flush(timeout_s=30)
    assert session.export_progress() is None
    assert session.step_order_counts() == {"jsonl": {"backwards": 1, "dropped": 1}}
    ot.shutdown()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("otel-train: ") and " points in " in x]
    assert "; jsonl: 1 row with a step going backwards, 1 not written; run folder" in line


TRAIN = textwrap.dedent("""
    import sys
    import otel_train as ot
    session = ot.init(exporters=["jsonl"], dir=sys.argv[1], run_id="full", run_name="full", export_interval_s=0.02)
    for s in ot.steps(range(20)):
        ot.log({"loss": float(s)})
        ot.flush()  # one window per step: the failed appends are exactly the patched writes
    p = session.export_progress()
    print("PROGRESS", p.spool_failed_appends, p.steps_backwards, p.steps_order_dropped, flush=True)
    ot.shutdown()
""")


def test_spool_failed_appends_reach_the_training_process(tmp_path: Path) -> None:
    """A faked full disk (spool writes 2 and 3 fail, `test_disk_full`'s patch) in the exporter process."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FULL_DISK)
    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_TRAIN_")}
    env.update(PYTHONPATH=str(tmp_path / "site"), FAKE_ENOSPC="2:4")
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(out)], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["PROGRESS 2 {'jsonl': 0} {'jsonl': 0}"]
    series = health_rows(out, "full")
    assert list(series) == ["otel_train.spool_failed_appends"]
    values = [v for _, v in series["otel_train.spool_failed_appends"]]
    assert values[-1] == 2.0 and set(values) <= {1.0, 2.0}  # from the window after the first failure on
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("otel-train: ") and " points in " in x]
    assert "; 2 windows not written ahead to the spool (disk full?); run folder" in line
