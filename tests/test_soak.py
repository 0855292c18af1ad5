"""Bounded memory, fast: small buffers overflow, the oldest records and spans are dropped and counted,
and what is kept stays within the bound (the 1M-step RSS soak is `bench/soak.py`)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

import otel_train as ot
from otel_train.instrument import LogBuffer, SpanBuffer
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
    assert mem.values("x") == {i: float(i) for i in range(150, 200)}  # the newest 50 survive
    assert [s.attributes["i"] for s in mem.spans if s.name == "s"] == list(range(150, 200))
    assert session.log_buffer.dropped == 150 and session.span_buffer.dropped == 150
    last = max(mem.values("otel_train.dropped_records"))
    assert mem.values("otel_train.dropped_records")[last] == 150.0
    assert mem.values("otel_train.dropped_spans")[last] == 150.0


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
    assert mem.values("loss") == {i: float(i) for i in range(100)}
    assert len([s for s in mem.spans if s.name == "forward"]) == 100
    assert session.log_buffer.dropped == 0 and session.span_buffer.dropped == 0
    assert not mem.values("otel_train.dropped_records")
