"""`ot.resume(N)` after `ot.init()`: every backend, in the exporter process and in-process, supersedes the
earlier steps >= N once, in order after what was logged before; read back with TensorBoard's reader
(purge honoured) and `resolve_resumes`."""

from __future__ import annotations

from pathlib import Path

import pytest
from faultkit import SERIES, expected, f32, jsonl_points, tb_points, value

import otel_train as ot
from otel_train.ship.export_process import replay

RUN = "job-runtime-resume"


def _log(steps: range, offset: float) -> None:
    for s in ot.steps(steps, start=steps.start):
        ot.log({tag: value(tag, s) + offset for tag in SERIES})


@pytest.mark.parametrize("export_process", ["on", "off"])
def test_resume_after_init_supersedes_later_steps_in_every_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export_process: str
) -> None:
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", export_process)
    # Under `drop`, a step below the latest would be dropped: the resume must restart each series' order.
    ot.init(exporters=["tensorboard", "jsonl"], dir=tmp_path, run_id=RUN, run_name=RUN, step_order="drop")
    _log(range(10), 0.0)
    ot.resume(5)  # e.g. a framework loaded a checkpoint at 5 after init()
    _log(range(5, 8), 100.0)
    ot.shutdown()

    want = expected(range(5)) | {(tag, s, value(tag, s) + 100.0) for s in range(5, 8) for tag in SERIES}
    tb = tb_points(tmp_path / RUN)
    assert len(tb) == len({(t, s) for t, s, _ in tb})  # one value per step of each series
    assert set(tb) == {(t, s, f32(v)) for t, s, v in want}
    points = jsonl_points(tmp_path, RUN)
    assert sorted(points) == sorted(want)
    # The resume was acknowledged with the windows: a replay applies nothing again.
    assert all(not p.behind() for p in replay(tmp_path / RUN).values())
    assert jsonl_points(tmp_path, RUN) == points


def test_resume_validates_its_step_and_needs_init(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ot.OtelTrainError, match=r"otel_train.resume\(\) was called before otel_train.init\(\)"):
        ot.resume(3)
    with pytest.raises(ot.ConfigError, match=r"otel_train.resume\(\): 2.5 is not a step"):
        ot.resume(2.5)  # a bad value fails fast before init()
    ot.init(exporters=[], dir=tmp_path)
    with caplog.at_level("WARNING", logger="otel_train"):
        for bad in (-1, "3", 2.5, True, None):
            ot.resume(bad)  # type: ignore[arg-type]  # after init(): never raised into the loop
    warned = [r.getMessage() for r in caplog.records if "otel_train.resume" in r.getMessage()]
    assert len(warned) == 1 and "-1 is not a step" in warned[0] and "warned once" in warned[0]
    ot.resume(4.0)  # type: ignore[arg-type]  # an integral float is a step
    ot.shutdown()
    ot.resume(3)  # after shutdown: nothing to tell, nothing raised


def test_resume_lets_steps_restart_below_the_latest_under_raise(tmp_path: Path) -> None:
    ot.init(exporters=[], dir=tmp_path, step_order="raise")
    with ot.step(9):
        pass
    ot.resume(5)
    with ot.step(5):  # a declared restart is not a step going backwards
        pass
    with pytest.raises(ot.StepOrderError), ot.step(4):
        pass


def test_a_rank_whose_metrics_no_backend_writes_leaves_no_restart_marker(tmp_path: Path) -> None:
    """Under `OTEL_TRAIN_RANKS=0` every rank declares the resume (Lightning calls it on each); rank 1's must
    not land in rank 0's TensorBoard folder, where its marker would supersede rank 0's new steps."""
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.exporters.base import Window
    from otel_train.exporters.jsonl import JsonlExporter
    from otel_train.exporters.tensorboard import TensorBoardExporter
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    rank0, rank1 = (RunInfo(RUN, RUN, rank=r, world_size=2) for r in (0, 1))
    options = ExporterOptions(directory=tmp_path)
    with TensorBoardExporter(options) as tb0, TensorBoardExporter(options) as tb1, JsonlExporter(options) as jl1:
        tb0.export_window(Window([MetricRow(rank0, s, "loss", "loss", value("loss", s), "gauge", 0) for s in range(8)]))
        tb0.resume(rank0, 5)
        assert tb1.resume(rank1, 5) and jl1.resume(rank1, 5)
        tb0.export_window(Window([MetricRow(rank0, s, "loss", "loss", 9.0, "gauge", 0) for s in (5, 6)]))
    assert len(list((tmp_path / RUN).glob("events.*"))) == 1
    assert not list(tmp_path.rglob("rank1.jsonl"))
    assert set(tb_points(tmp_path / RUN)) == {("loss", s, f32(value("loss", s))) for s in range(5)} | {
        ("loss", 5, 9.0), ("loss", 6, 9.0)}
