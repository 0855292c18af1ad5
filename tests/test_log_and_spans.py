"""`ot.log`, `ot.span`, `@ot.traced` through a real session into an in-memory backend."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from pathlib import Path

import numpy as np
import pytest

import otel_train as ot
from otel_train.testing import InMemoryRowExporter


@pytest.fixture
def mem(run_dir: Path) -> InMemoryRowExporter:
    exporter = InMemoryRowExporter()
    ot.init(exporters=[exporter], dir=run_dir, run_id="run-1", run_name="unit")
    return exporter


def test_log_before_init_is_a_clear_error() -> None:
    with pytest.raises(ot.OtelTrainError, match=r"called before otel_train.init\(\); call init\(\) first"):
        ot.log({"loss": 1.0})


def test_span_before_init_is_a_no_op() -> None:
    with ot.span("forward") as sp:
        sp.set_attribute("k", 1)


def test_values_at_steps(mem: InMemoryRowExporter) -> None:
    for i in ot.steps(range(3)):
        ot.log({"train/loss": 1.0 / (i + 1), "train/lr": 0.1})
    ot.log({"eval/acc": 0.9}, step=10)
    ot.flush()
    assert mem.values("train/loss") == [(0, 1.0), (1, 0.5), (2, 1 / 3)]
    assert mem.values("train/lr") == [(0, 0.1), (1, 0.1), (2, 0.1)]
    assert mem.values("eval/acc") == [(10, 0.9)]
    row = next(r for r in mem.metrics if r.tag == "train/loss")
    assert (row.run.run_id, row.run.run_name, row.run.rank, row.kind) == ("run-1", "unit", 0, "gauge")


def test_log_outside_a_step_uses_latest_step_or_zero(mem: InMemoryRowExporter) -> None:
    ot.log({"a": 1.0})
    with ot.step(4):
        pass
    ot.log({"b": 2.0})
    ot.flush()
    assert mem.values("a") == [(0, 1.0)]
    assert mem.values("b") == [(4, 2.0)]


def test_numbers_of_every_kind(mem: InMemoryRowExporter) -> None:
    import torch

    with ot.step(0):
        ot.log({
            "py_int": 3, "py_bool": True, "np_float": np.float32(0.25), "np_int": np.int64(7),
            "np_0d": np.array(1.5), "torch": torch.tensor(2.5), "torch_1": torch.tensor([4.0]),
            "nan": float("nan"), "inf": float("inf"), "ninf": -math.inf,
        })
    ot.flush()
    got = {r.tag: r.value for r in mem.metrics if r.step == 0}
    assert got["py_int"] == 3.0 and got["py_bool"] == 1.0
    assert got["np_float"] == 0.25 and got["np_int"] == 7.0 and got["np_0d"] == 1.5
    assert got["torch"] == 2.5 and got["torch_1"] == 4.0
    assert math.isnan(got["nan"]) and got["inf"] == math.inf and got["ninf"] == -math.inf


def test_tensor_keeps_the_value_it_had_at_log(mem: InMemoryRowExporter) -> None:
    import torch

    t = torch.tensor(1.0)
    with ot.step(0):
        ot.log({"t": t})
        t.add_(1.0)  # mutated in place after logging: the logged 1.0 is what is exported
    ot.flush()
    assert [(r.step, r.value) for r in mem.metrics if r.tag == "t"] == [(0, 1.0)]


def test_non_numbers_are_skipped_with_one_warning_per_key(
    mem: InMemoryRowExporter, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        for i in ot.steps(range(3)):
            ot.log({"text": "hello", "many": [1, 2, 3], "d": {"x": 1}, "ok": float(i), "any name!": 1.0, "": 2.0,
                    3: 4.0})  # type: ignore[dict-item]
        ot.flush()
    assert mem.values("ok") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    # any non-empty string is a key; read as a list, so a point written twice shows
    assert [(r.step, r.value) for r in mem.metrics if r.tag == "any name!"] == [(0, 1.0), (1, 1.0), (2, 1.0)]
    assert not {"text", "many", "d", "", 3} & {r.tag for r in mem.metrics}
    messages = [r.getMessage() for r in caplog.records]
    for key, why in (("'text'", "not a number"), ("'many'", "not a scalar"), ("'d'", "not a number")):
        assert sum(key in m and why in m for m in messages) == 1
    for key in ("''", "3"):
        assert sum(f"key {key} is not a non-empty string" in m for m in messages) == 1
    # counted by cause, every value of the three calls
    assert dict(ot.current_session().refusals) == {"not_a_number": 6, "not_a_scalar": 3, "bad_key": 6}  # type: ignore[union-attr]


def test_log_does_not_keep_the_callers_dict(mem: InMemoryRowExporter) -> None:
    values = {"x": 1.0}
    with ot.step(0):
        ot.log(values)
    values["x"] = 99.0
    ot.flush()
    assert mem.values("x") == [(0, 1.0)]


def test_span_does_not_keep_the_callers_attributes(mem: InMemoryRowExporter) -> None:
    """The attributes a span was opened with, not what the caller's dict holds when the span is exported."""
    import numpy as np
    import torch

    scale, ids, sizes, extra = torch.tensor(1.5), np.array([1.0, 2.0]), [3, 4], [7]
    attributes = {"batch": 1, "scale": scale, "ids": ids, "sizes": sizes}
    with ot.step(0), ot.span("load", attributes) as span:
        span.set_attribute("extra", extra)
    attributes["batch"] = 2
    scale.add_(100)  # in place, after the span ended
    ids += 100
    sizes.append(5)
    extra.append(8)
    ot.flush()
    assert [s.name for s in mem.spans] == ["load"]
    got = mem.spans[0].attributes
    assert (got["batch"], float(got["scale"]), list(got["ids"]), list(got["sizes"]), list(got["extra"])) == (
        1, 1.5, [1.0, 2.0], [3, 4], [7])


def test_auto_step_metrics(mem: InMemoryRowExporter) -> None:
    for i in range(3):
        with ot.step(i, samples=64):
            pass
    ot.flush()
    assert mem.values("train.iterations") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert [step for step, _ in mem.values("train.step.duration_s")] == [0, 1, 2]
    assert [step for step, _ in mem.values("train.throughput")] == [0, 1, 2]
    totals = mem.values("train.time_total_s")
    assert [step for step, _ in totals] == [0, 1, 2]
    assert totals[0][1] <= totals[1][1] <= totals[2][1]


def test_span_rows_carry_step_thread_and_parent(mem: InMemoryRowExporter) -> None:
    with ot.step(5), ot.span("outer", {"phase": "fwd"}), ot.span("inner"):
        pass
    ot.flush()
    by_name = {s.name: s for s in mem.spans}
    outer, inner = by_name["outer"], by_name["inner"]
    assert outer.step == 5 and inner.step == 5
    assert inner.parent_span_id == outer.span_id and inner.trace_id == outer.trace_id
    assert outer.parent_span_id is None
    assert outer.thread_id == threading.get_native_id()
    assert outer.thread_name == threading.current_thread().name
    assert outer.attributes["phase"] == "fwd" and outer.attributes["train.step"] == 5
    assert outer.start_unix_nano <= inner.start_unix_nano <= inner.end_unix_nano <= outer.end_unix_nano


def test_span_error_is_marked_and_exception_propagates(mem: InMemoryRowExporter) -> None:
    with pytest.raises(ValueError, match="bad batch"), ot.step(1), ot.span("forward"):
        raise ValueError("bad batch")
    ot.flush()
    (span,) = mem.spans
    assert span.error and span.status_message == "ValueError: bad batch"


def test_spans_from_worker_threads_keep_their_thread(mem: InMemoryRowExporter) -> None:
    def work() -> None:
        with ot.span("load"):
            pass

    t = threading.Thread(target=work, name="loader-0")
    with ot.step(2):
        t.start()
        t.join()
    ot.flush()
    (span,) = mem.spans
    assert span.thread_name == "loader-0" and span.thread_id == t.native_id and span.step == 2


def test_traced_plain_async_and_generators(mem: InMemoryRowExporter) -> None:
    @ot.traced
    def plain(x: int) -> int:
        return x + 1

    @ot.traced("named")
    async def coro() -> str:
        await asyncio.sleep(0)
        return "done"

    @ot.traced()
    def gen(n: int):  # type: ignore[no-untyped-def]
        yield from range(n)

    @ot.traced()
    async def agen(n: int):  # type: ignore[no-untyped-def]
        for i in range(n):
            yield i

    async def consume() -> list[int]:
        return [i async for i in agen(2)]

    with ot.step(0):
        assert plain(1) == 2
        assert asyncio.run(coro()) == "done"
        assert list(gen(3)) == [0, 1, 2]
        assert asyncio.run(consume()) == [0, 1]
    ot.flush()
    names = sorted(s.name for s in mem.spans)
    assert names == sorted([
        "test_traced_plain_async_and_generators.<locals>.plain", "named",
        "test_traced_plain_async_and_generators.<locals>.gen", "test_traced_plain_async_and_generators.<locals>.agen",
    ])
    assert all(s.step == 0 for s in mem.spans)


def test_traced_error_propagates(mem: InMemoryRowExporter) -> None:
    @ot.traced
    def fails() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        fails()
    ot.flush()
    assert mem.spans[0].error and "KeyError" in mem.spans[0].status_message


def test_raw_otel_instruments_and_spans(mem: InMemoryRowExporter) -> None:
    meter = ot.get_meter()
    tokens = meter.create_counter("train/tokens")
    latency = meter.create_histogram("io/latency_ms")
    acc = meter.create_gauge("eval/acc")
    tracer = ot.get_tracer()
    for i in ot.steps(range(3)):
        tokens.add(100, {"train.step": i})
        latency.record(5.0 * (i + 1), {"train.step": i})
        acc.set(0.5 + i / 10, {"train.step": i, "split": "val"})
        with tracer.start_as_current_span("raw"):
            pass
        ot.flush()
    # Counters are running totals; histograms become count/sum/min/max rows plus full histograms.
    assert mem.values("train/tokens") == [(0, 100.0), (1, 200.0), (2, 300.0)]
    assert mem.values("io/latency_ms/sum") == [(0, 5.0), (1, 10.0), (2, 15.0)]
    assert mem.values("io/latency_ms/count") == [(0, 1.0), (1, 1.0), (2, 1.0)]
    assert [h.step for h in mem.histograms] == [0, 1, 2]
    assert mem.values("eval/acc{split=val}") == [(0, 0.5), (1, 0.6), (2, 0.7)]
    raw = [s for s in mem.spans if s.name == "raw"]
    assert [s.step for s in raw] == [0, 1, 2]
    assert all(s.thread_id == threading.get_native_id() for s in raw)


def test_raw_point_without_step_gets_the_step_that_ended_the_window(mem: InMemoryRowExporter) -> None:
    gauge = ot.get_meter().create_gauge("gpu/mem")
    for i in ot.steps(range(2)):
        gauge.set(float(i))
        ot.flush()
    assert mem.values("gpu/mem") == [(0, 0.0), (1, 1.0)]


def test_log_after_shutdown_is_dropped_quietly(mem: InMemoryRowExporter, caplog: pytest.LogCaptureFixture) -> None:
    ot.shutdown()
    with caplog.at_level(logging.WARNING):
        ot.log({"x": 1.0})
        ot.log({"x": 2.0})
        with ot.span("late"):
            pass
    assert sum("after shutdown" in r.getMessage() for r in caplog.records) == 1
    assert mem.closed


def test_disabled_session_is_a_no_op(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_DISABLED", "1")
    session = ot.init(dir=run_dir)
    assert session.enabled is False
    for _ in ot.steps(range(3)):
        with ot.span("x") as sp:
            sp.set_attribute("batch", 3)  # the same span API as when enabled
            ot.log({"loss": 1.0})
    assert ot.flush() is True
    ot.shutdown()
    assert not run_dir.exists()


def test_text_that_is_not_valid_unicode_or_no_text_costs_nothing_else(run_dir: Path) -> None:
    """Through the exporter process into JSONL and TensorBoard: a key holding a lone surrogate (a file name decoded
    with `os.fsdecode`) stopped every backend's writes for the rest of the run (the exporter process died twice,
    the fallback too) while the summary said "0 dropped"; an attribute whose `str()` raises lost its whole window;
    `ot.span(attributes=[("k", 1)])` raised into the loop. Now the key is written with the byte escaped, the
    attribute as a placeholder, the pairs as a mapping, and every step of `train/loss` lands."""
    import os

    from backendkit import tb_scalars

    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    class Opaque:
        def __str__(self) -> str:
            raise RuntimeError("no str")

        __repr__ = __str__

    bad = "per_file/" + os.fsdecode(b"img_\xff.png")
    ot.init(exporters=["jsonl", "tensorboard"], dir=run_dir, run_name="odd-text")
    for i in range(5):
        with ot.step(i):
            ot.log({"train/loss": float(i)})
            if i == 2:
                ot.log({bad: 1.0})
                with ot.span(os.fsdecode(b"load_\xfe"), attributes={"file": bad, "obj": Opaque()}):
                    pass
            if i == 3:
                with ot.span("fwd", attributes=[("k", 1)]):  # type: ignore[arg-type]
                    pass
    ot.shutdown()
    rows = list(read_jsonl(jsonl_path(run_dir, "odd-text", 0)))
    assert [(r["step"], r["value"]) for r in rows if r.get("tag") == "train/loss"] == [(i, float(i)) for i in range(5)]
    assert [(r["step"], r["value"]) for r in rows if r.get("tag") == "per_file/img_\\xff.png"] == [(2, 1.0)]
    spans = {r["name"]: r["attributes"] for r in rows if r["type"] == "span"}
    assert spans["load_\\xfe"]["file"] == "per_file/img_\\xff.png"
    assert spans["load_\\xfe"]["obj"] == "<Opaque: str() failed>"
    assert spans["fwd"]["k"] == 1
    scalars = tb_scalars(run_dir / "odd-text")
    assert scalars["train/loss"] == [(i, float(i)) for i in range(5)]
    assert scalars["per_file/img_\\xff.png"] == [(2, 1.0)]


def test_a_disabled_run_refuses_a_step_as_quietly_as_an_enabled_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that runs with otel-train on must not crash when a launcher turns it off: after `init()` a step that is
    no step is ignored (enabled: warned and counted); disabled, `ot.step("3")` raised ValueError."""
    monkeypatch.setenv("OTEL_TRAIN_DISABLED", "1")
    ot.init(exporters=[])
    for bad in ("3", 2.5, -1, True, float("nan")):
        with ot.step(bad):  # type: ignore[arg-type]
            ot.log({"x": 1.0}, step=bad)  # type: ignore[arg-type]
        ot.resume(bad)  # type: ignore[arg-type]
    ot.shutdown()
    # before `init()` (and after shutdown): raised, as ever
    with pytest.raises(ValueError, match="is not a step"), ot.step("3"):  # type: ignore[arg-type]
        pass


def test_what_shutdowns_deadline_leaves_unexported_is_counted_and_said(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A fast loop's last collection that cannot finish by shutdown's deadline: what it drained and the buffers held
    was abandoned without a count ("0 dropped", verify passing on the part that arrived). Now every record is
    either delivered or counted, and the summary says how many were left."""
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="deadline")
    reader = session.reader
    build = reader._builder.build

    def slow_build(*args: object, **kwargs: object) -> object:
        import time

        time.sleep(0.6)  # longer than the deadline below
        return build(*args, **kwargs)

    for i in range(70):
        with ot.step(i):
            ot.log({"train/loss": float(i)})
        if i == 49:
            assert ot.flush()  # steps 0..49 written; every collection of 50..69 outlasts the deadline
            monkeypatch.setattr(reader._builder, "build", slow_build)
    reader.shutdown(200)  # ms
    ot.shutdown()
    session.export_process._proc.wait(60)  # it delivers what it was handed, then exits
    delivered = [r["step"] for r in read_jsonl(jsonl_path(run_dir, "deadline", 0)) if r.get("tag") == "train/loss"]
    left = reader.unexported["records"]  # each step: its `ot.log` record and its step end
    assert len(delivered) + left // 2 == 70 and left > 0, (delivered, left)
    err = capsys.readouterr().err
    assert f"{left} records left unexported at shutdown's deadline" in err, err
