"""`init()` returns before the OTel SDK, the reader and the exporter process are built (they start on a thread of
their own): nothing logged meanwhile is lost, and bad configuration still fails `init()` itself.

The background start is held back here (a gate before it builds anything), so every call below runs while it is
under way, on every run, not only when the machine happens to be slow. Points are read back from JSONL as
lists: a point lost or written twice fails.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics, trace

import otel_train as ot
from otel_train.errors import ConfigError
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.session import runtime

STEPS = 25


@pytest.fixture
def held_start(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The session's background start waits until the test sets the returned event."""
    gate = threading.Event()
    build = runtime.Session._build_rest

    def gated(self: runtime.Session, *args: Any) -> None:
        assert gate.wait(60)
        build(self, *args)

    monkeypatch.setattr(runtime.Session, "_build_rest", gated)
    yield gate
    gate.set()


def _records(run_dir: Path, run: str) -> list[dict[str, Any]]:
    return list(read_jsonl(jsonl_path(run_dir, run, 0)))


@pytest.mark.parametrize("placement", ["on", "off"])
def test_everything_logged_while_the_start_is_under_way_lands(run_dir: Path, held_start: threading.Event,
                                                              monkeypatch: pytest.MonkeyPatch, placement: str) -> None:
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", placement)
    meter = metrics.get_meter("early")  # before init: the API's proxy, which follows the session
    gauge = meter.create_gauge("early/gauge")
    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="early", export_every=1)
    assert session._reader is None  # still starting: all that follows waits in buffers or for the SDK
    counter = meter.create_counter("early/count")
    tracer = trace.get_tracer("early")
    release = threading.Timer(0.05, held_start.set)  # the first raw OTel call waits for the start, then goes on
    release.start()
    for step in ot.steps(range(STEPS)):
        with ot.span("work"):
            ot.log({"train/loss": step / 4, "train/lr": float(step)})
        gauge.set(step * 2.0)
        counter.add(1)
        with tracer.start_as_current_span("raw"):
            pass
    release.join()
    ot.shutdown()

    records = _records(run_dir, "early")
    metric = [(r["tag"], r["step"], r["value"]) for r in records if r["type"] == "metric"]
    for tag, value in (("train/loss", lambda s: s / 4), ("train/lr", float), ("early/gauge", lambda s: s * 2.0),
                       ("early/count", lambda s: float(s + 1))):  # the counter as its running total
        assert sorted(p for p in metric if p[0] == tag) == [(tag, s, value(s)) for s in range(STEPS)]
    spans = [(r["name"], r["step"]) for r in records if r["type"] == "span"]
    for name in ("work", "raw"):
        assert sorted(s for s in spans if s[0] == name) == [(name, s) for s in range(STEPS)]


def test_bad_configuration_fails_init_before_anything_starts(run_dir: Path, held_start: threading.Event) -> None:
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="no_such_backend"):
        ot.init(exporters=["jsonl", "no_such_backend"], dir=run_dir)
    with pytest.raises(ConfigError, match="OTEL_TRAIN_EXPORT_EVERY|export_every"):
        ot.init(exporters=["jsonl"], dir=run_dir, export_every=0)
    assert {t.name for t in threading.enumerate()} <= threads  # no start thread, no collector, no child's reader
    assert ot.current_session() is None


def test_a_start_that_fails_is_logged_and_never_raises_into_the_loop(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def failing(self: runtime.Session, *args: Any) -> None:
        raise OSError("no more processes")

    monkeypatch.setattr(runtime.Session, "_build_rest", failing)
    with caplog.at_level(logging.ERROR, logger="otel_train"):
        session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="failed")
        for step in ot.steps(range(3)):
            with ot.span("work"):
                ot.log({"train/loss": 1.0})
        metrics.get_meter("failed").create_counter("n").add(1)  # waits for nothing: the start is over
        assert not ot.flush(timeout_s=1)
        ot.shutdown()
    assert session.closed
    assert "starting the reader and the exporter process failed" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_child_forked_while_starting_logs_through_the_exporter_process(run_dir: Path,
                                                                       held_start: threading.Event) -> None:
    ot.init(exporters=["jsonl"], dir=run_dir, run_name="fork")
    with ot.step(0):
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say: its values go to the run over its own connection
            try:
                ot.log({"child/x": 7.0})
                ot.flush()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        ot.log({"train/loss": 1.0})
    held_start.set()
    ot.shutdown()
    assert os.waitstatus_to_exitcode(status) == 0
    metric = [(r["name"], r["step"], r["value"]) for r in _records(run_dir, "fork") if r["type"] == "metric"]
    assert sorted(p for p in metric if p[0] in ("child/x", "train/loss")) == [("child/x", 0, 7.0),
                                                                               ("train/loss", 0, 1.0)]


def test_steps_that_ended_while_starting_make_the_windows_they_would_have(run_dir: Path,
                                                                          held_start: threading.Event) -> None:
    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="windows", export_every=2,
                      export_interval_s=3600)
    for step in ot.steps(range(6)):
        with ot.span("work"):
            ot.log({"train/loss": float(step)})
    held_start.set()
    assert session.wait_started()
    assert ot.flush(timeout_s=30)
    assert session.reader.windows == 3  # one per 2 steps, as if the reader had been up from the first
    ot.shutdown()
    records = _records(run_dir, "windows")
    assert sorted((r["step"], r["value"]) for r in records if r.get("tag") == "train/loss") == [
        (s, float(s)) for s in range(6)]
    assert sorted(r["step"] for r in records if r["type"] == "span" and r["name"] == "work") == list(range(6))


def test_steps_ended_by_the_framework_while_starting_count_toward_export_every(
        run_dir: Path, held_start: threading.Event) -> None:
    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="logged", export_every=3, export_interval_s=3600)
    for step in range(3):  # a framework's logged steps (`ot.step_ended`), no `ot.step`
        ot.log({"train/x": float(step)}, step=step)
        ot.step_ended(step)
    held_start.set()
    assert session.wait_started()
    reader = session.reader
    deadline = time.monotonic() + 30
    while reader.windows < 1 and time.monotonic() < deadline:  # the third ended step made a collection due
        time.sleep(0.02)
    assert reader.windows == 1
    ot.shutdown()
    assert sorted(r["step"] for r in _records(run_dir, "logged") if r.get("tag") == "train/x") == [0, 1, 2]


def test_a_shutdown_while_starting_waits_for_the_start_and_loses_nothing(run_dir: Path,
                                                                       held_start: threading.Event) -> None:
    ot.init(exporters=["jsonl"], dir=run_dir, run_name="early-end")
    for step in ot.steps(range(4)):
        ot.log({"train/loss": float(step)})
    release = threading.Timer(0.2, held_start.set)  # the start is still held back as shutdown begins
    release.start()
    ot.shutdown()
    release.join()
    assert sorted((r["step"], r["value"]) for r in _records(run_dir, "early-end") if r.get("tag") == "train/loss") == [
        (s, float(s)) for s in range(4)]
