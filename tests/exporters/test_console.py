"""ConsoleExporter: one compact table per window, last value per tag."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters import console
from otel_train.exporters.base import Window
from otel_train.exporters.console import ConsoleExporter
from otel_train.vocab.rows import MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("rid", "con", rank=1)


def metric(tag: str, step: int, value: float, kind: str = "gauge", t: int = 0) -> MetricRow:
    return MetricRow(RUN, step, tag, tag, value, kind, t or step)


def test_window_table() -> None:
    out = io.StringIO()
    exp = ConsoleExporter(ExporterOptions(), stream=out)
    assert exp.handles_metrics and not exp.handles_spans
    exp.export_window(Window(metrics=[
        metric("train/loss", 12, 0.9), metric("train/lr", 10, 1e-3), metric("train/loss", 10, 1.5),
        metric("train/loss", 11, 1.2), metric("eval/acc", 11, math.nan),
        metric("grad/count", 11, 4.0, kind="histogram"),
    ], spans=[SpanRow(RUN, "s", 1, 1, None, 0, 1, 1, "", 1, {})]))
    assert out.getvalue() == (
        "[otel-train] con rank 1  steps 10-12\n"
        "  eval/acc    nan\n"
        "  train/loss  0.9\n"
        "  train/lr    0.001\n"
    )
    exp.export_window(Window(metrics=[metric("train/loss", 13, 0.123456789)]))
    assert out.getvalue().splitlines()[-2:] == ["[otel-train] con rank 1  step 13", "  train/loss  0.123457"]
    exp.shutdown()


def test_many_tags_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "MAX_TAGS", 3)
    out = io.StringIO()
    with ConsoleExporter(ExporterOptions(), stream=out) as exp:
        exp.export_window(Window(metrics=[metric(f"t{i}", 0, float(i)) for i in range(5)]))
    assert out.getvalue().splitlines() == [
        "[otel-train] con rank 1  step 0", "  t0  0", "  t1  1", "  t2  2", "  ... 2 more tag(s)"]


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    with ConsoleExporter(ExporterOptions()) as exp:
        exp.export_window(Window(metrics=[metric("train/loss", 5, 0.5)]))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "[otel-train] con rank 1  step 5\n  train/loss  0.5\n"


def test_a_real_job_prints_its_table_on_the_trainers_stderr(tmp_path: Path) -> None:
    """Named with the default placement (the other backends in the exporter process), the table still reaches the
    terminal the user watches: the training process's standard error, not the exporter process's log file."""
    script = ("import otel_train as ot\n"
              "ot.init(run_name='con')\n"
              "for s in ot.steps(range(3)):\n"
              "    ot.log({'train/loss': s + 0.5})\n"
              "ot.shutdown()\n")
    env = {**os.environ, "OTEL_TRAIN_DIR": str(tmp_path), "OTEL_TRAIN_EXPORTERS": "console,jsonl",
           "OTEL_TRAIN_QUIET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "train/loss" in line or line.startswith("[otel-train]")]
    assert any(line.startswith("[otel-train] con rank 0") for line in lines), done.stderr
    assert [line.split()[-1] for line in lines if "train/loss" in line][-1] == "2.5", done.stderr
