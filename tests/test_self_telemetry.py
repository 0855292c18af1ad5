"""Self-telemetry: otel-train's own health as `otel_train/*` series, read back from real TensorBoard files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters import base
from otel_train.exporters.tensorboard import TensorBoardExporter
from otel_train.session.summary import write_session_summary
from otel_train.ship.delivery import Delivery, Progress
from otel_train.ship.framing import encode_window
from otel_train.ship.self_metrics import SelfMetrics
from otel_train.testing import InMemoryRowExporter
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("health", "health")


def _scalars(run_folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_backend_failing_twice_shows_in_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base.RowExporter, "backoff_s", (0.0,))  # retry at once: the test is about counting, not waiting
    tb = TensorBoardExporter(ExporterOptions(directory=tmp_path))
    flaky = InMemoryRowExporter(fail_times=2)
    flaky.isolate_rows = False  # both failures are writes of a window (no row tried alone in between)
    delivery = Delivery({"tensorboard": tb, "flaky": flaky}, None)
    delivery.annotate = SelfMetrics(delivery.backend_stats)
    for step in range(5):
        payload, max_step = encode_window(RUN, [("train/loss", step, 1.0 / (step + 1), time.time_ns())])
        delivery.submit(step + 1, max_step, payload)
        delivery.flush(time.monotonic() + 10)  # each window's health sees the previous window written
    assert delivery.close(time.monotonic() + 10)

    scalars = _scalars(tmp_path / "health")
    errors = scalars["otel_train/backend_errors{exporter=flaky}"]
    assert [s for s, _ in errors] == [0, 1, 2, 3, 4]
    assert errors[0][1] == 0 and errors[-1][1] == 2  # counted in the run, visible beside the loss
    assert {v for _, v in scalars["otel_train/backend_errors{exporter=tensorboard}"]} == {0}
    assert [v for _, v in scalars["otel_train/points"]] == [1, 2, 3, 4, 5]  # points received so far
    assert [v for _, v in scalars["otel_train/windows"]] == [1, 2, 3, 4, 5]
    latency = scalars["otel_train/export_latency_s{exporter=tensorboard}"]
    assert [s for s, _ in latency] == [1, 2, 3, 4] and all(v >= 0 for _, v in latency)  # from the 2nd window on
    assert {v for _, v in scalars["otel_train/backlog_windows{exporter=tensorboard}"]} == {1}  # just the new one
    written = [v for _, v in scalars["otel_train/rows_written{exporter=tensorboard}"]]
    assert written[0] == 0 and written == sorted(set(written))  # loss + health rows, growing
    assert delivery.progress().failures == {"tensorboard": 0, "flaky": 2}
    assert [r.value for r in flaky.metrics if r.tag == "train/loss"] == [1.0, 0.5, 1 / 3, 0.25, 0.2]


@pytest.mark.parametrize("on", [True, False])
def test_exporter_process_reports_its_health(run_dir: Path, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not on:
        monkeypatch.setenv("OTEL_TRAIN_SELF_METRICS", "0")
    ot.init(exporters="tensorboard,jsonl", dir=run_dir, run_name="self", export_interval_s=60)
    for step in ot.steps(range(4)):
        ot.log({"train/loss": float(step)})
        ot.flush()  # one window per step
    ot.shutdown()
    scalars = _scalars(run_dir / "self")
    ours = {tag for tag in scalars if tag.startswith("otel_train/")}
    if not on:
        assert ours == set()
        return
    assert {"otel_train/points", "otel_train/windows", "otel_train/backlog_windows{exporter=jsonl}",
            "otel_train/backend_errors{exporter=tensorboard}", "otel_train/dropped_windows{exporter=jsonl}"} <= ours
    windows = scalars["otel_train/windows"]
    assert {s for s, _ in windows} == {0, 1, 2, 3}  # at each window's step
    assert [v for _, v in windows] == list(range(1, len(windows) + 1))
    assert {v for _, v in scalars["otel_train/backend_errors{exporter=jsonl}"]} == {0}


def test_summary_names_the_exporter_process_failures(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    session = ot.init(exporters="tensorboard,jsonl", dir=run_dir, run_name="sum")
    ot.log({"train/loss": 1.0}, step=0)
    ot.shutdown()
    session.export_process.last_progress = Progress(failures={"tensorboard": 0, "jsonl": 3}, dropped={"jsonl": 1})
    write_session_summary(session)  # what shutdown writes, with a child whose `jsonl` failed 3 times
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "jsonl: 3 failures" in line and "tensorboard:" not in line and "; 1 dropped (1 windows the exporter process could not take or its backends dropped);" in line
