"""`ot.span` and raw OTel spans share one context: parent links both ways, in span rows and in the
OTel spans a plain `SpanExporter` (and OTLP's encoder) receives."""

from __future__ import annotations

import contextvars
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_train as ot
from otel_train.testing import InMemoryRowExporter


@pytest.fixture
def sinks(run_dir: Path) -> tuple[InMemoryRowExporter, InMemorySpanExporter]:
    rows, otel = InMemoryRowExporter(), InMemorySpanExporter()
    ot.init(exporters=[rows, otel], dir=run_dir, run_id="ctx-run", run_name="ctx")
    return rows, otel


def _by_name(spans: list) -> dict:
    out = {s.name: s for s in spans}
    assert len(out) == len(spans), "span names must be unique in these tests"
    return out


def test_raw_span_inside_ot_span_is_its_child(sinks: tuple[InMemoryRowExporter, InMemorySpanExporter]) -> None:
    rows, otel = sinks
    tracer = ot.get_tracer()
    with ot.step(3), ot.span("outer"), tracer.start_as_current_span("raw-inner"):
        pass
    ot.flush()
    r = _by_name(rows.spans)
    assert r["raw-inner"].parent_span_id == r["outer"].span_id
    assert r["raw-inner"].trace_id == r["outer"].trace_id
    assert r["outer"].parent_span_id is None and r["raw-inner"].step == r["outer"].step == 3
    o = _by_name(otel.get_finished_spans())
    assert o["raw-inner"].parent is not None
    assert o["raw-inner"].parent.span_id == o["outer"].context.span_id
    assert o["raw-inner"].context.trace_id == o["outer"].context.trace_id
    assert o["outer"].parent is None


def test_ot_span_inside_raw_span_is_its_child(sinks: tuple[InMemoryRowExporter, InMemorySpanExporter]) -> None:
    rows, otel = sinks
    tracer = ot.get_tracer()
    with tracer.start_as_current_span("raw-outer"), ot.span("mid"):
        with ot.span("ours-leaf"):
            pass
        with tracer.start_as_current_span("raw-leaf"):
            pass
    ot.flush()
    r = _by_name(rows.spans)
    assert r["mid"].parent_span_id == r["raw-outer"].span_id
    assert r["ours-leaf"].parent_span_id == r["mid"].span_id
    assert r["raw-leaf"].parent_span_id == r["mid"].span_id
    assert len({s.trace_id for s in rows.spans}) == 1
    o = _by_name(otel.get_finished_spans())
    assert o["mid"].parent.span_id == o["raw-outer"].context.span_id
    assert o["ours-leaf"].parent.span_id == o["mid"].context.span_id
    assert o["raw-leaf"].parent.span_id == o["mid"].context.span_id
    assert {s.context.trace_id for s in o.values()} == {o["raw-outer"].context.trace_id}


def test_parent_links_survive_otlp_encoding(sinks: tuple[InMemoryRowExporter, InMemorySpanExporter]) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    _, otel = sinks
    tracer = ot.get_tracer()
    with tracer.start_as_current_span("raw-outer"), ot.span("mid"), tracer.start_as_current_span("raw-leaf"):
        pass
    ot.flush()
    request = encode_spans(otel.get_finished_spans())
    spans = {s.name: s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert spans["mid"].parent_span_id == spans["raw-outer"].span_id
    assert spans["raw-leaf"].parent_span_id == spans["mid"].span_id
    assert spans["raw-outer"].parent_span_id == b""
    assert spans["mid"].trace_id == spans["raw-outer"].trace_id == spans["raw-leaf"].trace_id


def test_current_span_inside_ot_span_and_context_restored(
        sinks: tuple[InMemoryRowExporter, InMemorySpanExporter]) -> None:
    rows, _ = sinks
    assert not trace.get_current_span().get_span_context().is_valid
    with ot.span("outer") as scope:
        current = trace.get_current_span()
        ctx = current.get_span_context()
        assert ctx.is_valid and ctx.span_id == scope.span_id and ctx.trace_id == scope.trace_id
        current.set_attribute("via.otel.api", 7)  # lands on our span
        with pytest.raises(ValueError), ot.span("fails"):
            raise ValueError("boom")
        assert trace.get_current_span() is current  # the failed span's context was detached
    assert not trace.get_current_span().get_span_context().is_valid
    ot.flush()
    r = _by_name(rows.spans)
    assert r["outer"].attributes["via.otel.api"] == 7
    assert r["fails"].error and r["fails"].parent_span_id == r["outer"].span_id


def test_traced_generator_does_not_leak_context(sinks: tuple[InMemoryRowExporter, InMemorySpanExporter]) -> None:
    rows, _ = sinks

    @ot.traced("gen")
    def numbers():
        yield 1
        yield 2

    with ot.span("caller"):
        it = numbers()
        first = next(it)
        outside = trace.get_current_span().get_span_context()  # between yields: still the caller's
        assert list(it) == [2] and first == 1
    ot.flush()
    r = _by_name(rows.spans)
    assert outside.span_id == r["caller"].span_id
    assert r["gen"].parent_span_id == r["caller"].span_id


def test_spans_are_separate_traces_without_a_parent(sinks: tuple[InMemoryRowExporter, InMemorySpanExporter]) -> None:
    rows, _ = sinks
    for name in ("a", "b"):
        with ot.span(name):
            pass
    ot.flush()
    r = _by_name(rows.spans)
    assert r["a"].trace_id != r["b"].trace_id and r["a"].span_id != r["b"].span_id
    assert r["a"].parent_span_id is None and r["b"].parent_span_id is None


def test_a_span_left_in_another_context_ends_without_raising(
        sinks: tuple[InMemoryRowExporter, InMemorySpanExporter], caplog: pytest.LogCaptureFixture) -> None:
    """A span entered in one context and exited in another (a coroutine resumed in another task): its context
    cannot be reset there; OTel's detach says so, the span is still written and nothing reaches the caller."""
    rows, _ = sinks
    scope = ot.span("moved")
    scope.__enter__()
    contextvars.copy_context().run(scope.__exit__, None, None, None)
    ot.flush()
    assert [s.name for s in rows.spans] == ["moved"]
    assert "Failed to detach context" in caplog.text


def test_the_span_context_is_the_one_the_otel_api_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry import context as otel_context

    from otel_train._internal import sdk

    var = sdk.context_var()
    assert var is not None and var.get() is otel_context.get_current()
    token = var.set(otel_context.set_value("k", 1))
    assert otel_context.get_value("k") == 1
    var.reset(token)

    class OtherRuntime(otel_context._RuntimeContext):  # what OTEL_PYTHON_CONTEXT may choose instead
        def attach(self, context: Any) -> Any: ...
        def get_current(self) -> Any: ...
        def detach(self, token: Any) -> None: ...

    monkeypatch.setattr(otel_context, "_RUNTIME_CONTEXT", OtherRuntime())
    assert sdk.context_var() is None  # ot.span then goes through the API's functions


def test_a_thread_renamed_after_its_first_span_names_the_later_ones(
        sinks: tuple[InMemoryRowExporter, InMemorySpanExporter]) -> None:
    rows, _ = sinks

    def work() -> None:
        with ot.span("first"):
            pass
        threading.current_thread().name = "renamed"
        with ot.span("second"):
            pass

    worker = threading.Thread(target=work, name="loader")
    worker.start()
    worker.join()
    ot.flush()
    r = _by_name(rows.spans)
    assert (r["first"].thread_name, r["second"].thread_name) == ("loader", "renamed")
    assert r["first"].thread_id == r["second"].thread_id == worker.native_id
