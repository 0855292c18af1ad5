"""One step coercion for every entry point: NumPy integers, integral floats and integer tensors are steps;
2.5, NaN and strings are refused at the call (raised before `init()`, warned once and counted after it)
and never reach a window. Read back from JSONL and TensorBoard as lists, so a duplicate shows."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

import otel_train as ot
from otel_train.capture.step import coerce_step
from otel_train.exporters.jsonl import read_jsonl
from otel_train.vocab.run_paths import run_folder


def _metric_rows(folder: Path, name: str) -> list[tuple[int, float]]:
    rows = [r for r in read_jsonl(folder / "rank0.jsonl") if r.get("type") == "metric" and r["name"] == name]
    assert all(type(r["step"]) is int for r in rows), rows  # never "3" or "tensor(3)"
    return [(r["step"], r["value"]) for r in rows]


def _tb(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


@pytest.mark.parametrize("value, expected", [
    (3, 3), (0, 0), (np.int64(3), 3), (np.int32(7), 7), (np.uint8(9), 9), (61.0, 61), (np.float32(4.0), 4),
    (np.array(5), 5),
])
def test_steps_that_are_taken(value: object, expected: int) -> None:
    got = coerce_step(value, "here")
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value", [-1, -2.0, np.int64(-3), 2.5, 4.9, math.nan, math.inf, -math.inf, "3", b"3", None,
                                   True, False, [1],
                                   np.float64(0.5), np.array([1, 2])])
def test_steps_that_are_refused_name_the_value(value: object) -> None:
    with pytest.raises(ValueError, match=r"^here: .* is not a step; expected an integer"):
        coerce_step(value, "here")


def test_torch_steps() -> None:
    torch = pytest.importorskip("torch", reason="torch is a test dependency; only its absence skips this")
    assert coerce_step(torch.tensor(3), "here") == 3
    assert coerce_step(torch.tensor(3.0), "here") == 3
    with pytest.raises(ValueError):
        coerce_step(torch.tensor(2.5), "here")


def test_before_init_a_bad_step_fails_fast() -> None:
    with pytest.raises(ValueError, match=r"otel_train.step\(\): 2.5 is not a step"):
        ot.step(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"otel_train.steps\(start=\): 'a' is not a step"):
        list(ot.steps(range(2), start="a"))  # type: ignore[arg-type]


def test_every_entry_point_coerces_the_same_way(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch", reason="torch is a test dependency; only its absence skips this")
    ot.init(exporters="jsonl,tensorboard", dir=tmp_path, run_id="coerce", export_every=1)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        with ot.step(np.int64(3)):  # type: ignore[arg-type]
            ot.log({"a": 1.0})
        with ot.step(4.0):  # type: ignore[arg-type]
            ot.log({"a": 2.0})
        with ot.step(torch.tensor(5)):  # type: ignore[arg-type]
            ot.log({"a": 3.0})
        ot.log({"b": 10.0}, step=61.0)  # type: ignore[arg-type]
        ot.log({"b": 11.0}, step=np.int64(62))  # type: ignore[arg-type]
        ot.log({"b": 12.0}, step=torch.tensor(63))  # type: ignore[arg-type]
        for bad in (2.5, "64", math.nan, True):
            ot.log({"b": 99.0, "c": 99.0}, step=bad)  # type: ignore[arg-type]  # refused: never written
        with ot.step(4.9):  # type: ignore[arg-type]  # refused: the block is the next step (6)
            ot.log({"a": 4.0})
        for _ in ot.steps(range(2), start=np.int64(70)):  # type: ignore[arg-type]
            ot.log({"a": 5.0})
        refused = ot._session.refused_step_values
        assert ot.flush()
    ot.shutdown()
    folder = run_folder(tmp_path, "coerce")
    assert _metric_rows(folder, "a") == [(3, 1.0), (4, 2.0), (5, 3.0), (6, 4.0), (70, 5.0), (71, 5.0)]
    assert _metric_rows(folder, "b") == [(61, 10.0), (62, 11.0), (63, 12.0)]
    assert _metric_rows(folder, "c") == []
    assert _tb(folder, "b") == [(61, 10.0), (62, 11.0), (63, 12.0)]
    assert refused == 8  # two values of each of the four refused `ot.log` calls
    warned = [r.getMessage() for r in caplog.records if "is not a step" in r.getMessage()]
    assert len(warned) == 1 and "otel_train.log(step=): 2.5 is not a step" in warned[0]


def test_steps_without_start_continue_after_the_latest(tmp_path: Path) -> None:
    ot.init(exporters="jsonl", dir=tmp_path, run_id="epochs", export_every=1)
    for epoch in range(3):
        for batch in ot.steps(range(4)):
            ot.log({"loss": float(epoch * 10 + batch)})
    ot.shutdown()
    rows = _metric_rows(run_folder(tmp_path, "epochs"), "loss")
    assert rows == [(e * 4 + b, float(e * 10 + b)) for e in range(3) for b in range(4)]


def test_a_declared_restart_is_where_numberless_steps_start(tmp_path: Path) -> None:
    ot.init(exporters="jsonl", dir=tmp_path, run_id="restart", export_every=1, resume_step=5)
    with ot.step():
        ot.log({"x": 1.0})
    ot.resume(3)
    for _ in ot.steps(range(2)):
        ot.log({"x": 2.0})
    ot.shutdown()
    rows = [r for r in read_jsonl(run_folder(tmp_path, "restart") / "rank0.jsonl")
            if r.get("type") == "metric" and r["name"] == "x"]
    assert [(r["step"], r["value"]) for r in rows] == [(5, 1.0), (3, 2.0), (4, 2.0)]


def test_a_child_process_coerces_its_steps(tmp_path: Path) -> None:
    import subprocess
    import sys

    ot.init(exporters="jsonl", dir=tmp_path, run_id="child", export_every=1)
    code = ("import numpy, otel_train\n"
            "otel_train.log({'w': 1.0}, step=numpy.int64(7))\n"
            "otel_train.log({'w': 2.0}, step=8.0)\n"
            "otel_train.log({'w': 9.0}, step=2.5)\n"  # refused in the child too, never raised
            "otel_train.flush()\n")
    # a child started by the training process finds the run through the environment init() set
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "2.5 is not a step" in out.stderr
    ot.shutdown()
    assert sorted(_metric_rows(run_folder(tmp_path, "child"), "w")) == [(7, 1.0), (8, 2.0)]


def test_jsonl_steps_are_numbers_not_strings(tmp_path: Path) -> None:
    ot.init(exporters="jsonl", dir=tmp_path, run_id="types", export_every=1)
    ot.log({"x": 1.0}, step=np.int64(3))  # type: ignore[arg-type]
    ot.shutdown()
    lines = (run_folder(tmp_path, "types") / "rank0.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"metric"' in line and '"x"' in line]
    assert steps == [3]


@pytest.mark.parametrize("value", [-1, np.int64(-3), -2.0, 2**63, 2**64, np.uint64(2**63), 2.0**63, 1e300])
def test_a_step_outside_64_bits_or_below_zero_is_out_of_range(value: object) -> None:
    from otel_train.capture.step import StepOutOfRange

    with pytest.raises(StepOutOfRange, match=r"^here: .* is not a step; expected an integer from 0 to 2\*\*63-1$"):
        coerce_step(value, "here")


def test_the_largest_step_is_taken() -> None:
    assert coerce_step(2**63 - 1, "here") == 2**63 - 1
    assert coerce_step(np.int64(2**63 - 1), "here") == 2**63 - 1


def test_steps_out_of_range_are_counted_and_never_cost_a_window(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An int step below 0 or beyond 64 bits (which no backend stores, and which used to lose its whole window when
    the window was packed) is refused at the call and counted; the values beside it in the window land."""
    ot.init(exporters="jsonl,tensorboard", dir=tmp_path, run_id="range", export_every=10**6)
    with caplog.at_level(logging.WARNING, logger="otel_train"):
        with ot.step(1):
            ot.log({"a": 1.0})
        ot.log({"b": 9.0, "c": 9.0}, step=2**63)  # an int: the call's fast path checks the range too
        ot.log({"b": 9.0}, step=-1)
        ot.log({"b": 9.0}, step=np.int64(-5))  # type: ignore[arg-type]
        with ot.step(-3):  # type: ignore[arg-type]  # refused: the block is the next step (2)
            ot.log({"a": 2.0})
        ot.log({"a": 3.0}, step=2**63 - 1)
        refusals = dict(ot._session.refusals)
    ot.shutdown()
    folder = run_folder(tmp_path, "range")
    assert _metric_rows(folder, "a") == [(1, 1.0), (2, 2.0), (2**63 - 1, 3.0)]
    assert _metric_rows(folder, "b") == [] and _metric_rows(folder, "c") == []
    assert _tb(folder, "a") == [(1, 1.0), (2, 2.0), (2**63 - 1, 3.0)]
    assert refusals == {"step_out_of_range": 4, "bad_step_entered": 1}
    warned = [r.getMessage() for r in caplog.records if "is not a step" in r.getMessage()]
    assert len(warned) == 1 and "9223372036854775808 is not a step; expected an integer from 0 to 2**63-1" in warned[0]


def test_a_raw_otel_point_at_a_step_out_of_range_is_counted_not_written(tmp_path: Path) -> None:
    """A raw OTel instrument's own `train.step` is not checked at the call: the collector refuses the point."""
    from otel_train.testing import InMemoryRowExporter

    mem = InMemoryRowExporter()
    session = ot.init(exporters=[mem], dir=tmp_path, run_id="raw", export_every=10**6)
    gauge = ot.get_meter("test").create_gauge("raw/g")
    with ot.step(4):
        gauge.set(1.0, {"train.step": 2**63})
        gauge.set(2.0, {"train.step": -2, "k": "v"})
        gauge.set(3.0)
        ot.log({"a": 4.0})
    assert ot.flush()
    assert mem.values("raw/g") == [(4, 3.0)] and mem.values("a") == [(4, 4.0)]
    assert dict(session.refusals) == {"step_out_of_range": 2}


def test_the_sink_refuses_a_negative_step_as_ot_log_does() -> None:
    from otel_train.sink.decode.otlp import BAD_STEP, step_value

    assert [step_value(v) for v in (0, 2**63 - 1, 7.0, "8")] == [0, 2**63 - 1, 7, 8]
    assert [step_value(v) for v in (-1, -5.0, "-2", 2**63)] == [BAD_STEP] * 4
