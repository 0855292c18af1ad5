"""`logging` records and uncaught exceptions as OTel log records, through a real session into an in-memory backend:
at their step, rank and span, with their traceback; otel-train's own diagnostics left out; a flood rate-limited
and counted; nothing left installed after `shutdown()`."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.capture.log_records import RateLimit, severity_number
from otel_train.testing import InMemoryRowExporter

log = logging.getLogger("tests.train")


@pytest.fixture
def start(run_dir: Path) -> Iterator[InMemoryRowExporter]:
    """A session with an in-memory backend, started in the test body (pytest swaps thread hooks per phase)."""
    exporter = InMemoryRowExporter()
    ot.init(exporters=[exporter], dir=run_dir, run_id="run-1", run_name="unit")
    yield exporter


def _messages(mem: InMemoryRowExporter) -> list[tuple[int | None, str, str]]:
    return [(r.step, r.severity_text, r.body) for r in mem.logs]


def test_warnings_land_at_their_steps_with_rank_and_run(run_dir: Path) -> None:
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, run_id="run-1", run_name="unit")
    for i in ot.steps(range(4)):
        if i in (1, 3):
            log.warning("loss spiked at %d", i)
        log.info("not captured: below the default level WARNING")
    ot.flush()
    assert _messages(mem) == [(1, "WARNING", "loss spiked at 1"), (3, "WARNING", "loss spiked at 3")]
    row = mem.logs[0]
    assert (row.run.run_id, row.rank, row.logger, row.severity_number) == ("run-1", 0, "tests.train", 13)
    assert row.attributes["code.function.name"] == "test_warnings_land_at_their_steps_with_rank_and_run"
    assert row.attributes["thread.id"] == threading.get_native_id()


def test_level_from_the_environment(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_LOG_LEVEL", "INFO")
    log.setLevel(logging.INFO)  # a logger's own level still applies
    try:
        mem = InMemoryRowExporter()
        ot.init(exporters=[mem], dir=run_dir)
        with ot.step(2):
            log.info("epoch done")
            log.debug("below INFO")
        ot.flush()
    finally:
        log.setLevel(logging.NOTSET)
    assert _messages(mem) == [(2, "INFO", "epoch done")]


def test_a_records_own_step_wins(start: InMemoryRowExporter) -> None:
    with ot.step(5):
        log.warning("about an earlier step", extra={"train.step": 2})
    ot.flush()
    (row,) = start.logs
    assert row.step == 2 and "train.step" not in row.attributes


def test_a_record_carries_the_active_span(start: InMemoryRowExporter) -> None:
    with ot.step(5), ot.span("forward") as span:
        log.error("nan in the logits")
    ot.flush()
    (row,) = start.logs
    context = span.get_span_context()
    assert (row.step, row.trace_id, row.span_id) == (5, context.trace_id, context.span_id)
    assert start.spans[0].span_id == row.span_id


def test_a_logged_exception_carries_its_traceback(start: InMemoryRowExporter) -> None:
    with ot.step(1):
        try:
            raise ValueError("bad batch")
        except ValueError:
            log.exception("loading failed")
    ot.flush()
    (row,) = start.logs
    assert (row.step, row.severity_text, row.body) == (1, "ERROR", "loading failed")
    assert row.attributes["exception.type"] == "ValueError"
    assert row.attributes["exception.message"] == "bad batch"
    assert 'raise ValueError("bad batch")' in row.attributes["exception.stacktrace"]


def test_own_diagnostics_are_left_out_but_events_kept(start: InMemoryRowExporter) -> None:
    with ot.step(7):
        logging.getLogger("otel_train.ship").warning("a backend failed")  # would feed itself: left out
        logging.getLogger("otel_train.hang").warning("rank 0 stuck", extra={"event.name": "train.hang",
                                                                             "hang.frame": "step"})
    ot.flush()
    (row,) = start.logs
    assert (row.step, row.logger, row.body) == (7, "otel_train.hang", "rank 0 stuck")
    assert (row.attributes["event.name"], row.attributes["hang.frame"]) == ("train.hang", "step")


def test_a_framework_logger_that_does_not_propagate_is_captured_once(run_dir: Path) -> None:
    framework = logging.getLogger("tests.framework")
    framework.propagate = False
    try:
        mem = InMemoryRowExporter()
        ot.init(exporters=[mem], dir=run_dir)
        with ot.step(0):
            framework.warning("from the framework")
            framework.propagate = True  # now it reaches the root logger's handler too: still one record
            framework.warning("propagating now")
        ot.flush()
        assert _messages(mem) == [(0, "WARNING", "from the framework"), (0, "WARNING", "propagating now")]
    finally:
        framework.propagate = True


def test_an_uncaught_exception_in_a_thread_is_a_record_and_the_earlier_hook_runs(
        start: InMemoryRowExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    hook = threading.excepthook
    monkeypatch.setattr(ot._session.log_capture.hooks, "_previous_threading",
                        lambda args: seen.append(args.exc_type.__name__))

    def fail() -> None:
        raise RuntimeError("worker thread died")

    with ot.step(3):
        thread = threading.Thread(target=fail, name="prefetch")
        thread.start()
        thread.join()
    ot.flush()
    assert seen == ["RuntimeError"] and threading.excepthook is hook
    (row,) = start.logs
    assert (row.step, row.severity_text, row.logger) == (3, "ERROR", "otel_train.uncaught")
    assert row.attributes["thread.name"] == "prefetch"
    assert "worker thread died" in row.body and "in fail" in row.attributes["exception.stacktrace"]


def test_the_main_threads_uncaught_exception_is_a_fatal_record(start: InMemoryRowExporter,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    printed: list[type[BaseException]] = []
    monkeypatch.setattr(ot._session.log_capture.hooks, "_previous_sys", lambda t, e, tb: printed.append(t))
    try:
        with ot.step(9):
            raise KeyError("missing")
    except KeyError:
        sys.excepthook(*sys.exc_info())  # what the interpreter calls for an exception nobody caught
    ot.flush()
    assert printed == [KeyError]
    (row,) = start.logs
    assert (row.step, row.severity_text, row.severity_number) == (9, "FATAL", 21)
    assert row.attributes["exception.type"] == "KeyError"


def test_a_flood_is_rate_limited_and_counted(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_LOG_RATE", "50")
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir)
    session = ot._session
    with ot.step(0):
        for i in range(5000):
            log.warning("flood %d", i)
        logging.getLogger("otel_train.hang").warning("stuck", extra={"event.name": "train.hang"})  # never limited
    ot.shutdown()
    kept = [r for r in mem.logs if r.logger == "tests.train"]
    assert 50 <= len(kept) < 5000 and any(r.logger == "otel_train.hang" for r in mem.logs)
    assert session.refusals.get("log_rate_limited", 0) == 5000 - len(kept)


def test_shutdown_removes_the_hooks(run_dir: Path) -> None:
    hooks = (sys.excepthook, threading.excepthook, logging.Logger.callHandlers)
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir)
    assert logging.Logger.callHandlers is not hooks[2]
    ot.shutdown()
    assert (sys.excepthook, threading.excepthook, logging.Logger.callHandlers) == hooks
    log.warning("after shutdown")  # goes nowhere of ours, raises nothing
    assert mem.logs == []


def test_basic_config_after_init_still_configures_logging(run_dir: Path) -> None:
    """Capturing adds no handler: `logging.basicConfig()` after `init()` still finds the root logger without one."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    try:
        ot.init(exporters=[InMemoryRowExporter()], dir=run_dir)
        logging.basicConfig()
        assert len(root.handlers) == 1 and isinstance(root.handlers[0], logging.StreamHandler)
    finally:
        root.handlers = saved


def test_level_off_keeps_exception_capture(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_LOG_LEVEL", "off")
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir)
    with ot.step(1):
        log.error("not captured: logging is off")
    ot.flush()
    assert mem.logs == [] and not ot._session.log_capture.handler.active
    assert ot._session.log_capture.hooks.active


def test_a_bad_level_fails_at_init_naming_the_variable(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_LOG_LEVEL", "loud")
    with pytest.raises(ot.ConfigError, match="OTEL_TRAIN_LOG_LEVEL: 'loud' is not allowed"):
        ot.init(exporters=[InMemoryRowExporter()], dir=run_dir)


def test_rate_limit_passes_its_rate_and_counts_the_rest() -> None:
    now = [0.0]
    limit = RateLimit(3, clock=lambda: now[0])
    assert [limit.allow() for _ in range(5)] == [True, True, True, False, False]
    now[0] = 1.0  # a second later: three more
    assert [limit.allow() for _ in range(4)] == [True, True, True, False]
    assert limit.dropped == 3


def test_severity_numbers_follow_the_otel_mapping() -> None:
    assert [severity_number(n) for n in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
                                         logging.CRITICAL)] == [5, 9, 13, 17, 21]


def test_a_raw_otel_logger_gets_the_step_and_span(start: InMemoryRowExporter) -> None:
    from opentelemetry import _logs

    raw = _logs.get_logger("raw.app")
    with ot.step(4), ot.span("eval") as span:
        raw.emit(severity_number=_logs.SeverityNumber.WARN, severity_text="WARN", body="raw warning",
                 attributes={"k": 1})
    raw.emit(_logs.LogRecord(body="explicit step", severity_number=_logs.SeverityNumber.INFO, severity_text="INFO",
                             attributes={"train.step": 9}))
    ot.flush()
    assert [(r.step, r.logger, r.severity_number, r.body) for r in start.logs] == [
        (4, "raw.app", 13, "raw warning"), (9, "raw.app", 9, "explicit step")]
    assert start.logs[0].span_id == span.get_span_context().span_id and start.logs[0].attributes == {"k": 1}
    ot.shutdown()
    raw.emit(body="between sessions: dropped")  # raises nothing
