"""Bounded memory, fast: small buffers overflow, the oldest records and spans are dropped and counted, and what
is kept stays within the bound; nothing outlives its session (sessions, threads, processes, signal handlers,
warning keys). The 1M-step and 50-cycle soak figures are `bench/soak.py`."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import tracemalloc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import otel_train as ot
from otel_train.capture.instrument import LogBuffer, SpanBuffer
from otel_train.testing import InMemoryRowExporter


def test_buffers_drop_oldest_and_count(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_BUFFER_SIZE", "50")
    mem = InMemoryRowExporter()
    session = ot.init(exporters=[mem], dir=run_dir, export_every=10**6, export_interval_s=3600)
    assert session.log_buffer._items.maxlen == 50 and session.span_buffer._items.maxlen == 50
    for i in range(200):  # no collection in between: 200 log records + 200 spans into buffers of 50
        ot.log({"x": float(i)}, step=i)
        with ot.span("s", {"i": i}):
            pass
    assert len(session.log_buffer) == 50 and len(session.span_buffer) == 50
    ot.flush()
    assert mem.values("x") == [(i, float(i)) for i in range(150, 200)]  # the newest 50 survive
    assert [s.attributes["i"] for s in mem.spans if s.name == "s"] == list(range(150, 200))
    assert session.log_buffer.dropped == 150 and session.span_buffer.dropped == 150
    last = max(mem.by_step("otel_train.dropped_records"))
    assert mem.by_step("otel_train.dropped_records")[last] == 150.0
    assert mem.by_step("otel_train.dropped_spans")[last] == 150.0


def test_drop_counts_accumulate_across_windows() -> None:
    buf = SpanBuffer(4)
    for i in range(10):
        buf.append(i)
    assert [s for _, s in buf.drain()] == [6, 7, 8, 9] and buf.dropped == 6
    for i in range(3):
        buf.append(i)
    assert len(buf.drain()) == 3 and buf.dropped == 6
    for i in range(9):
        buf.append(i)
    buf.drain()
    assert buf.dropped == 11


def test_memory_held_by_a_full_buffer_is_bounded() -> None:
    """Appending 20x the bound holds no more than the bound's worth of records."""
    buf = LogBuffer(1_000)
    values = {f"train/m{k:02d}": float(k) for k in range(20)}
    tracemalloc.start()
    try:
        for i in range(1_000):  # fill once: what the bound allows
            buf.append(i, dict(values))
        full, _ = tracemalloc.get_traced_memory()
        for i in range(20_000):
            buf.append(i, dict(values))
        now, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert now - full < 0.1 * full, f"{now - full} bytes more after 20,000 appends into a full buffer of {full}"
    assert len(buf) == 1_000
    assert len(buf.drain()) == 1_000 and buf.dropped == 20_000


def test_steady_windows_drop_nothing(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound that fits the window loses nothing: drops only happen on overflow."""
    monkeypatch.setenv("OTEL_TRAIN_BUFFER_SIZE", "64")
    mem = InMemoryRowExporter()
    session = ot.init(exporters=[mem], dir=run_dir, export_every=10, export_interval_s=3600)
    for i in ot.steps(range(100)):
        for name in ("data", "forward"):
            with ot.span(name):
                pass
        ot.log({"loss": float(i)})
        if i % 10 == 9:
            ot.flush()
    assert mem.values("loss") == [(i, float(i)) for i in range(100)]
    assert len([s for s in mem.spans if s.name == "forward"]) == 100
    assert session.log_buffer.dropped == 0 and session.span_buffer.dropped == 0
    assert not mem.values("otel_train.dropped_records")


# -- nothing outlives its session (`bench/soak.py` prints the same figures over 50 cycles) -----------------
def _live_children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


_EARLIER = set[threading.Thread]()  # threads an earlier test left (a hung backend's worker is given up on, by design)


def _our_threads() -> list[str]:
    """otel-train threads started since the test began (`_EARLIER` is filled by the autouse fixture)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("otel-train") and t not in _EARLIER]


@pytest.fixture(autouse=True)
def _note_earlier_threads() -> None:
    _EARLIER.clear()
    _EARLIER.update(threading.enumerate())


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll `condition` until it holds (a bounded wait on the real condition, never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("exporters", [["jsonl"], "memory"], ids=["exporter-process", "in-process"])
def test_sessions_and_readers_are_freed_after_shutdown(run_dir: Path, exporters: Any) -> None:
    """After N init/shutdown cycles no session, reader or exporter-process handle is alive (gc + weakref), the
    fork hooks held do not grow, and no thread or exporter process of ours is left."""
    from otel_train._internal import at_fork

    cycles = 3 if exporters == ["jsonl"] else 10
    children_before = _live_children()
    ot.init(exporters=[InMemoryRowExporter()], dir=run_dir, run_name="warm-up")  # lazy imports, first hooks
    ot.shutdown()
    hooks_before = at_fork.registered()
    refs: list[weakref.ref[Any]] = []
    for c in range(cycles):
        exp = exporters if exporters != "memory" else [InMemoryRowExporter()]
        session = ot.init(exporters=exp, dir=run_dir, run_name=f"cycle-{c}")
        refs += [weakref.ref(session), weakref.ref(session.reader)]
        if session.export_process is not None:
            refs.append(weakref.ref(session.export_process))
        for _ in ot.steps(range(3)):
            ot.log({"loss": 1.0})
        ot.shutdown()
        del session
    ot._session = None  # the face keeps the last closed session for a second `ot.shutdown()`
    assert _wait_for(lambda: not _our_threads()), _our_threads()

    def all_freed() -> bool:  # a thread that has just ended may still hold its object for a moment
        gc.collect()
        return all(r() is None for r in refs)

    assert _wait_for(all_freed, timeout_s=10.0), [r() for r in refs if r() is not None]
    assert at_fork.registered() <= hooks_before
    assert _wait_for(lambda: _live_children() <= children_before), "an exporter process outlived its session"


def test_signal_handlers_are_given_back_at_shutdown(run_dir: Path) -> None:
    """Each `init()` installs otel-train's handlers over the user's; each `shutdown()` gives the user's back."""
    def users_handler(signum: int, frame: object) -> None:
        pass

    signums = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]
    original = signal.signal(signal.SIGUSR1, users_handler)
    try:
        before = [signal.getsignal(s) for s in signums]
        for c in range(2):
            ot.init(exporters=[InMemoryRowExporter()], dir=run_dir, run_name=f"signals-{c}")
            during = [signal.getsignal(s) for s in signums]
            assert all(h is not b for h, b in zip(during, before, strict=True)), "init() installs its handlers"
            ot.shutdown()
            assert [signal.getsignal(s) for s in signums] == before
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_a_handler_installed_over_ours_is_left_in_place(run_dir: Path) -> None:
    """A framework's handler set after `init()` (it may chain to ours) is not replaced at shutdown, and it still
    ends in ours: a chained call flushes, never recursing."""
    from otel_train.session import exit_hooks

    chained: list[int] = []
    original = signal.getsignal(signal.SIGUSR1)
    ot.init(exporters=[InMemoryRowExporter()], dir=run_dir, run_name="framework")
    ours = signal.getsignal(signal.SIGUSR1)

    def framework_handler(signum: int, frame: Any) -> None:
        chained.append(signum)
        if callable(ours):
            ours(signum, frame)

    signal.signal(signal.SIGUSR1, framework_handler)
    try:
        ot.shutdown()
        assert signal.getsignal(signal.SIGUSR1) is framework_handler
        ot.init(exporters=[InMemoryRowExporter()], dir=run_dir, run_name="framework-2")
        assert signal.getsignal(signal.SIGUSR1) is framework_handler  # not wrapped again: it may chain to ours
        signal.raise_signal(signal.SIGUSR1)  # the framework's handler, then ours (flush only)
        assert chained == [signal.SIGUSR1]
        ot.shutdown()
    finally:
        signal.signal(signal.SIGUSR1, original)
        exit_hooks._previous_handlers.pop(signal.SIGUSR1, None)  # what ours would have given back


class _Injected(TypeError):
    pass


def _raise(*args: object, **kwargs: object) -> None:
    raise _Injected("injected: the OTel SDK refused an argument")


@pytest.mark.parametrize("where", ["reader", "meter_provider", "exporter_process"])
def test_a_failed_start_leaves_nothing_behind(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture, where: str) -> None:
    """The session's start fails after the exporter process started (an SDK that refuses an argument, or before
    the exporter process was sent its configuration). It runs
    off the training thread once `init()` has returned, so nothing raises into the loop: the failure is logged
    once, what the loop logs is counted as not exported, and after `shutdown()` no exporter process, thread,
    handler, environment variable or claim on the run folder is left."""
    import opentelemetry.sdk.metrics

    import otel_train.collect.reader

    children_before = _live_children()
    handler_before = signal.getsignal(signal.SIGTERM)
    mem = InMemoryRowExporter()
    if where == "reader":
        monkeypatch.setattr(otel_train.collect.reader, "StepAlignedMetricReader", _raise)
    elif where == "exporter_process":  # started already (`child_boot`), never told its configuration
        import otel_train.ship.export_process

        monkeypatch.setattr(otel_train.ship.export_process.ExportProcess, "__init__", _raise)
    else:
        monkeypatch.setattr(opentelemetry.sdk.metrics, "MeterProvider", _raise)
    with caplog.at_level(logging.ERROR, logger="otel_train"):
        session = ot.init(exporters=["jsonl", mem], dir=run_dir, run_name="failed", run_id="failed")
        assert session.wait_started() and session.reader is None
        assert _wait_for(lambda: _live_children() <= children_before), "the exporter process outlived the start"
        for step in ot.steps(range(3)):
            with ot.span("work"):
                ot.log({"train/loss": float(step)})
        assert not ot.flush(timeout_s=1)
        ot.shutdown()
    failures = [r for r in caplog.records if "starting the reader and the exporter process failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None and failures[0].exc_info[0] is _Injected
    assert session.unexported == {"records": 6, "spans": 3}  # 3 `ot.log` calls and 3 step ends; 3 spans
    assert mem.metrics == [] and mem.spans == []
    assert _live_children() <= children_before, "the exporter process outlived the failed start"
    assert _wait_for(lambda: not _our_threads()), _our_threads()
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert "OTEL_TRAIN_WORKER_ADDRESS" not in os.environ
    assert mem.closed  # the exporter handed to init() is shut down, as shutdown() would
    monkeypatch.undo()
    session = ot.init(exporters=["jsonl"], dir=run_dir, run_name="failed", run_id="failed")
    assert session.run.run_name == "failed"  # the run folder's claim was released: the same run, not "failed-2"
    ot.shutdown()


def test_warning_keys_are_bounded() -> None:
    """Rate-limited warnings keyed by user data (metric keys, run ids) remember at most `max_keys` keys; a key
    still remembered is not logged again, one forgotten logs again only after `max_keys` other keys."""
    import logging

    from otel_train._internal.ratelimit import MAX_KEYS, LogOnce

    log = LogOnce(logging.getLogger("test"), max_keys=100)
    assert [log.should_log(f"key-{i}") for i in range(10_000)] == [True] * 10_000
    assert len(log) == 100
    assert not log.should_log("key-9999") and not log.should_log("key-9900")
    assert log.should_log("key-0")  # forgotten 9,900 keys ago
    assert len(LogOnce(logging.getLogger("test"))._last) == 0 and MAX_KEYS >= 100


def test_fork_hooks_run_for_live_objects_only() -> None:
    """A forked child runs the hook of an object still alive, and none of one collected (held weakly)."""
    from otel_train._internal import at_fork

    class Holder:
        def __init__(self, name: str, w: int) -> None:
            self.name, self.w = name, w

        def after_fork(self) -> None:
            os.write(self.w, self.name.encode() + b"\n")

    r, w = os.pipe()
    live, gone = Holder("live", w), Holder("gone", w)
    at_fork.after_fork_in_child(live.after_fork)
    at_fork.after_fork_in_child(gone.after_fork)
    gone_ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert gone_ref() is None  # the hook did not keep it alive
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # the hooks ran in the child before this line
    os.waitpid(pid, 0)
    os.close(w)
    with os.fdopen(r) as pipe:
        assert pipe.read().split() == ["live"]
    with pytest.raises(TypeError):
        at_fork.after_fork_in_child(print)  # a plain function would never be collected
