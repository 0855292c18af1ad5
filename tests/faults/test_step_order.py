"""Steps going backwards under each `OTEL_TRAIN_STEP_ORDER` policy: the same rule in every backend."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
from faultkit import jsonl_points, tb_points

import otel_train as ot
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.step_order import StepOrder

RUN = RunInfo("r", "r")


def rows(*steps: int, tag: str = "loss") -> list[MetricRow]:
    return [MetricRow(RUN, s, tag, tag, float(s), "gauge", 0) for s in steps]


def log_backwards(directory: Path, policy: str) -> Any:
    """Through the exporter process, unless the test keeps backends in-process (to read their counters)."""
    session = ot.init(exporters=["jsonl", "tensorboard"], dir=directory, run_id="so", run_name="so",
                      step_order=policy)
    for s in (0, 1, 2, 3):
        ot.log({"loss": float(s)}, step=s)
    ot.flush()
    ot.log({"loss": 20.0}, step=2)  # backwards: a late value for step 2
    ot.log({"loss": 4.0}, step=4)
    ot.shutdown()
    return session


def test_warn_writes_backwards_rows_as_given_and_counts(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", "off")  # counters are read from the exporters here
    with caplog.at_level(logging.WARNING, logger="otel_train.vocab.step_order"):
        session = log_backwards(tmp_path, "warn")
    assert jsonl_points(tmp_path, "so") == [("loss", s, float(s)) for s in range(4)] + [
        ("loss", 2, 20.0), ("loss", 4, 4.0)]
    counts = {e.name: e.step_order.counts() for e in session.exporters}
    assert counts == {"jsonl": {"backwards": 1, "dropped": 0}, "tensorboard": {"backwards": 1, "dropped": 1}}
    assert any("went back to step 2 after step 3" in r.getMessage() for r in caplog.records)
    # TensorBoard skips it (its data server would take it for a restart and hide step 3): the series as first logged.
    assert tb_points(tmp_path / "so") == [("loss", s, float(s)) for s in range(5)]
    assert any("tensorboard: series 'loss'" in r.getMessage() and "not written here" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("where", ["on", "off"])
def test_drop_keeps_backwards_rows_out_of_every_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        where: str) -> None:
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", where)  # the same rule in the exporter process and in-process
    session = log_backwards(tmp_path, "drop")
    want = [("loss", s, float(s)) for s in range(5)]
    assert jsonl_points(tmp_path, "so") == want
    assert sorted(tb_points(tmp_path / "so")) == want
    if where == "off":
        assert session.step_order_counts() == {name: {"backwards": 1, "dropped": 1} for name in ("jsonl", "tensorboard")}


def test_raise_refuses_backwards_step_and_log_on_the_training_thread(tmp_path: Path) -> None:
    ot.init(exporters=["jsonl"], dir=tmp_path, run_id="so", run_name="so", step_order="raise")
    with ot.step(5):
        ot.log({"loss": 5.0})
    with pytest.raises(ot.StepOrderError, match=r"otel_train.step\(3\) after step 5"), ot.step(3):
        ot.log({"loss": 3.0})
    with pytest.raises(ot.StepOrderError, match=r"otel_train.log\(step=4\) after step 5"):
        ot.log({"loss": 4.0}, step=4)
    ot.log({"loss": 6.0}, step=6)
    with pytest.raises(ot.StepOrderError, match=r"step=5\) after step 6"):
        ot.log({"loss": 5.5}, step=5)
    # Raw OTel points carry their own step: under `raise` the export path drops them (nothing to raise into).
    gauge = ot.get_meter().create_gauge("loss")
    gauge.set(1.0, {"train.step": 2})
    ot.shutdown()
    assert jsonl_points(tmp_path, "so") == [("loss", 5, 5.0), ("loss", 6, 6.0)]


def test_policy_state_is_per_series_and_equal_steps_pass() -> None:
    order = StepOrder("drop")
    kept = order.filter(rows(1, 1, 2) + rows(0, tag="acc") + rows(0))
    assert [(r.tag, r.step) for r in kept] == [("loss", 1), ("loss", 1), ("loss", 2), ("acc", 0)]
    assert order.counts() == {"backwards": 1, "dropped": 1}
    assert order.filter(rows(3)) is not None and order.filter(kept) is not kept  # stateful across windows


def test_bad_policy_fails_at_init_naming_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_STEP_ORDER", "ignore")
    with pytest.raises(ot.ConfigError, match="OTEL_TRAIN_STEP_ORDER: 'ignore' is not allowed; use one of warn, "
                                             "drop, raise"):
        ot.init(exporters=[], dir=tmp_path)


class _FakeRun:
    def __init__(self, root: Path) -> None:
        self.settings = types.SimpleNamespace(wandb_dir=str(root))
        self.starting_step = 0
        self.logged: list[tuple[int, dict[str, Any]]] = []

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        pass


def test_wandb_under_warn_drops_what_it_cannot_store_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    run = _FakeRun(tmp_path)

    class Settings:
        model_fields: ClassVar[dict[str, None]] = {"resume_from": None}

        def __init__(self, **kwargs: Any) -> None:
            pass

    fake = types.SimpleNamespace(init=lambda settings=None, **kw: run, Settings=Settings)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from otel_train.exporters.wandb import WandbExporter

    exporter = WandbExporter(ExporterOptions(directory=tmp_path))
    exporter.hold_s = 0.0  # each window written at once: rows later than W&B's hold
    with caplog.at_level(logging.WARNING):
        exporter.export_window(Window(rows(0, 1, 2)))
        exporter.export_window(Window(rows(1) + rows(1, tag="acc") + rows(3)))
    exporter.shutdown()
    assert run.logged == [(0, {"loss": 0.0}), (1, {"loss": 1.0}), (2, {"loss": 2.0}), (3, {"loss": 3.0})]
    # `loss` at 1 went backwards in its series: skipped by the step order, as in TensorBoard.
    assert exporter.step_order.counts() == {"backwards": 1, "dropped": 1}
    # `acc` at 1 did not, but the run's step axis is at 2: W&B cannot store it either.
    assert exporter.steps_dropped == 1
    assert any("lands in the other backends only" in r.getMessage()
               for r in caplog.records)


def test_the_sink_applies_the_same_policy_per_run() -> None:
    from otel_train.sink.decode.requests import Decoded
    from otel_train.sink.runs.router import Router
    from otel_train.testing import InMemoryRowExporter

    built: list[InMemoryRowExporter] = []

    def make() -> list[Any]:
        built.append(InMemoryRowExporter(ExporterOptions(step_order="drop")))
        return list(built[-1:])

    router = Router(make)
    router.ingest(Decoded.of_rows(rows(0, 1, 2)))
    router.ingest(Decoded.of_rows(rows(1) + rows(3)))
    router.close(timeout_s=30.0)
    (exporter,) = built
    assert [(r.step, r.value) for r in exporter.metrics] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert exporter.step_order.counts() == {"backwards": 1, "dropped": 1}
