"""`ot.log(..., attributes=)`: values with extra attributes become gauge points carrying them, one series per
attribute set, exactly as a gauge set with those attributes; bad attributes are counted and left out, never
raised. Read back from the JSONL file and the in-memory backend as lists, in the order written."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.testing import InMemoryRowExporter

RUN = "attrs"


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(jsonl_path(run_dir, RUN, 0)) if r["type"] == "metric"]


def _points(records: list[dict[str, Any]], tag: str) -> list[tuple[int, str, dict[str, Any]]]:
    """(step, repr(value), attributes) of every record of `tag`, in file order (repr: NaN equals itself)."""
    return [(r["step"], repr(float(r["value"])), r["attributes"]) for r in records if r["tag"] == tag]


@pytest.fixture
def mem(run_dir: Path) -> InMemoryRowExporter:
    exporter = InMemoryRowExporter()
    ot.init(exporters=["jsonl", exporter], dir=run_dir, run_name=RUN)
    return exporter


def test_attributes_make_one_series_per_set_and_keep_nan(run_dir: Path, mem: InMemoryRowExporter) -> None:
    import torch

    for i in ot.steps(range(3)):
        ot.log({"trial/loss": [1.0, math.nan, math.inf][i]}, attributes={"trial_id": "a"})
        ot.log({"trial/loss": torch.tensor(float(i)), "trial/iter": i}, attributes={"trial_id": "b", "n": 2})
        ot.log({"trial/loss": 5.0})  # no attributes: its own series, as before
    ot.log({"trial/loss": -math.inf}, step=1, attributes={"trial_id": "a"})  # an explicit step, back in time
    ot.flush()
    records = _metrics(run_dir)
    a, b = {"trial_id": "a"}, {"n": 2, "trial_id": "b"}
    assert _points(records, "trial/loss{trial_id=a}") == [(0, "1.0", a), (1, "nan", a), (2, "inf", a),
                                                         (1, "-inf", a)]
    assert _points(records, "trial/loss{n=2,trial_id=b}") == [(0, "0.0", b), (1, "1.0", b), (2, "2.0", b)]
    assert _points(records, "trial/iter{n=2,trial_id=b}") == [(0, "0.0", b), (1, "1.0", b), (2, "2.0", b)]
    assert _points(records, "trial/loss") == [(0, "5.0", {}), (1, "5.0", {}), (2, "5.0", {})]
    assert [(s, repr(v)) for s, v in mem.values("trial/loss{trial_id=a}")] == [(0, "1.0"), (1, "nan"), (2, "inf"),
                                                                              (1, "-inf")]
    assert mem.values("trial/iter{n=2,trial_id=b}") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert {(r.name, r.kind) for r in mem.metrics if r.attributes} == {("trial/loss", "gauge"),
                                                                        ("trial/iter", "gauge")}


def test_the_same_rows_as_a_gauge_set_with_those_attributes(run_dir: Path, mem: InMemoryRowExporter) -> None:
    gauge = ot.get_meter("test").create_gauge("via/gauge")
    with ot.step(7):
        gauge.set(0.5, {"trial_id": "a"})
        ot.log({"via/log": 0.5}, attributes={"trial_id": "a"})
    ot.flush()
    by_name = {r["name"]: r for r in _metrics(run_dir) if r["name"].startswith("via/")}
    assert sorted(by_name) == ["via/gauge", "via/log"]
    logged, set_ = ({k: v for k, v in by_name[n].items() if k not in ("name", "tag", "time_unix_nano")}
                    for n in ("via/log", "via/gauge"))
    assert logged == set_ and logged["step"] == 7 and logged["attributes"] == {"trial_id": "a"}
    assert (by_name["via/log"]["tag"], by_name["via/gauge"]["tag"]) == ("via/log{trial_id=a}", "via/gauge{trial_id=a}")


def test_bad_attributes_are_counted_and_left_out_not_raised(run_dir: Path, mem: InMemoryRowExporter,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    session: Any = ot.current_session()
    with caplog.at_level(logging.WARNING, logger="otel_train"), ot.step(3):
        ot.log({"x": math.nan}, attributes={"ok": "v", "": 1, "bad": {"a": 1}, "train.step": 9, "mix": [1.0, "a"]})
        ot.log({"y": 1.0}, attributes=["not", "a", "mapping"])  # type: ignore[arg-type]
        ot.log({"z": 2.0}, attributes={"sizes": [1, 2], "flag": True})
    ot.flush()
    assert session.refused_attributes == 5
    warned = [r.getMessage() for r in caplog.records if "otel_train.log:" in r.getMessage()]
    assert len(warned) == 1 and "attribute key '' is not a non-empty string" in warned[0]
    records = _metrics(run_dir)
    assert _points(records, "x{ok=v}") == [(3, "nan", {"ok": "v"})]
    assert _points(records, "y") == [(3, "1.0", {})]  # no attribute could be read: logged without
    # the comma of a sequence value is escaped in the series name (`series_tag`)
    assert _points(records, "z{flag=True,sizes=(1\\, 2)}") == [(3, "2.0", {"flag": True, "sizes": [1, 2]})]


def test_an_explicit_step_back_in_another_series_does_not_raise(run_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `OTEL_TRAIN_STEP_ORDER=raise` the call checks the one loop's steps; values with attributes are other
    series (a trial at step 1 after another at step 3), whose order the backends check per series."""
    monkeypatch.setenv("OTEL_TRAIN_STEP_ORDER", "raise")
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, run_name=RUN)
    ot.log({"loss": 1.0}, step=3, attributes={"trial_id": "a"})
    ot.log({"loss": 2.0}, step=1, attributes={"trial_id": "b"})
    with pytest.raises(ot.StepOrderError):
        ot.log({"loss": 2.0}, step=5)
        ot.log({"loss": 2.0}, step=4)
    ot.flush()
    assert mem.values("loss{trial_id=a}") == [(3, 1.0)]
    assert mem.values("loss{trial_id=b}") == [(1, 2.0)]


def test_a_child_process_value_keeps_its_attributes_beside_the_worker() -> None:
    from otel_train.ship.workers import WorkerListener
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo("r", "r")
    listener: Any = SimpleNamespace(_run=run, _last_step=lambda: 4, _metrics=True)
    window = WorkerListener._window(listener, 2, 99, [("loss", 1, 0.5, 10, {"trial_id": "a"}), ("loss", -1, 1.5, 11)],
                                    [])
    assert [(r.tag, r.step, r.value, dict(r.attributes)) for r in window.metrics] == [
        ("loss{trial_id=a,worker=2}", 1, 0.5, {"trial_id": "a", "worker": 2}),
        ("loss{worker=2}", 4, 1.5, {"worker": 2})]
