"""Span rows and phase timings made by the exporter process (`otel_train.ship.span_work`) are the ones the collector
made in the training process: same rows, same phase points, windows split the same way."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_train.backend import Window
from otel_train.capture.instrument import SpanRecord
from otel_train.collect.window_builder import WindowBuilder
from otel_train.ship.framing import decode_window, encode_window, has_span_records, pack_span_records
from otel_train.ship.span_work import SpanCompleter
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("r", "r", rank=0)


def _step(step: int, seq: int) -> tuple[list[tuple[Any, ...]], list[tuple[int, Any]]]:
    """One step's buffered records (a logged dict, the step end) and its spans: two top-level, one nested, one of
    a prefetch thread (not in the step), with a 128-bit trace id and attributes."""
    start = 10_000 + step * 1_000
    trace = (step + 1) << 100 | 7
    spans = [SpanRecord("data", trace, 10 * step + 1, None, start + 10, start + 300, 5, "Main", step, None, None),
             SpanRecord("forward", trace, 10 * step + 2, None, start + 300, start + 800, 5, "Main", step,
                        {"k": 1, "names": ("a", "b")}, None),
             SpanRecord("matmul", trace, 10 * step + 3, 10 * step + 2, start + 400, start + 700, 5, "Main", step,
                        None, "ValueError: x"),
             SpanRecord("prefetch", trace, 10 * step + 4, None, start, start + 900, 6, "Loader", step, None, None,
                        in_step=False)]
    records = [(seq, step, {"train/loss": 1.0 / (step + 1), "lr": 0.1}, start + 850),
               (seq + 1, step, (start, start + 900, step + 1, None), 0)]
    return records, list(enumerate(spans, seq))


def _raw_otel_span(step: int) -> Any:
    """A finished raw OTel span stamped with `step` (what `ThreadSpanProcessor` buffers)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    start = 10_000 + step * 1_000
    span = provider.get_tracer("t").start_span("raw", attributes={"train.step": step, "thread.id": 5},
                                               start_time=start + 820)
    span.end(end_time=start + 840)
    (finished,) = memory.get_finished_spans()
    return finished


def _builder() -> WindowBuilder:
    builder = WindowBuilder()
    builder._wall_offset_ns = 0  # step ends in the spans' clock, the same for both builders
    return builder


def _rows(window: Window) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The window's metric points and its spans, each as the tuple of its fields (rows compare by identity)."""
    metrics = sorted((r.tag, r.step, r.value, r.time_unix_nano) for r in window.metrics)
    spans = sorted((tuple(getattr(s, f.name) for f in dataclasses.fields(s)) for s in window.spans),
                   key=lambda s: (s[3], s[1]))  # span id, name
    return metrics, spans


@pytest.mark.parametrize("grouped", [False, True], ids=["points", "grouped_points"])
def test_rows_made_in_the_exporter_process_equal_those_made_by_the_collector(grouped: bool) -> None:
    """Three windows (the second holds step 1's spans, the third its step end: phases wait across windows),
    with a raw OTel span; built in the training process vs completed by a `SpanCompleter` (the `ot.log` points
    also as groups, as the collector hands them to the exporter process): the same rows."""
    lost: list[tuple[str, int]] = []
    here, there, completer = _builder(), _builder(), SpanCompleter(lambda cause, n: lost.append((cause, n)))
    r0, s0 = _step(0, 0)
    r1, s1 = _step(1, 100)
    s0 = [*s0, (50, _raw_otel_span(0))]
    windows = [(r0, s0), (r1[:1], s1), (r1[1:], [])]
    made_here, made_there = [], []
    for records, spans in windows:
        local = here.build(RUN, None, list(records), list(spans), 1)
        made_here.append(encode_and_decode(local))
        deferred = there.build(RUN, None, list(records), list(spans), 1, defer_spans=True, grouped=grouped)
        assert deferred.span_records is not None and deferred.phases
        assert (deferred.groups is not None) == grouped
        payload, _ = encode_window(RUN, deferred.points, deferred.metrics, deferred.histograms, deferred.spans,
                                   deferred.logs, deferred.groups or ())
        packed = pack_span_records(payload, deferred.span_records, deferred.phase_spans, deferred.phases)
        assert has_span_records(packed)
        whole, window = completer.complete(packed)
        assert window is not None and not has_span_records(whole)
        assert _rows(decode_window(whole)) == _rows(window)  # what is spooled is what the backends get
        made_there.append(window)
    for a, b in zip(made_here, made_there, strict=True):
        assert _rows(a) == _rows(b)
    phases = [(m[0], m[1]) for w in made_there for m in _rows(w)[0] if m[0].startswith("phase/")]
    assert phases == [("phase/data_s", 0), ("phase/forward_s", 0), ("phase/other_s", 0), ("phase/raw_s", 0),
                      ("phase/data_s", 1), ("phase/forward_s", 1), ("phase/other_s", 1)]
    assert completer.points_added == len(phases)
    spans = [s for w in made_there for s in w.spans]
    assert sorted(s.name for s in spans) == sorted(["data", "forward", "matmul", "prefetch", "raw"] * 2)[:-1]
    forward = next(s for s in spans if s.name == "forward" and s.step == 1)
    assert forward.trace_id == (2 << 100 | 7) and forward.attributes["names"] == ("a", "b")


def encode_and_decode(parts: Any) -> Window:
    payload, _ = encode_window(parts.run, parts.points, parts.metrics, parts.histograms, parts.spans, parts.logs)
    return decode_window(payload)


def test_a_window_with_unreadable_span_records_is_said_counted_and_kept_apart(caplog: Any, tmp_path: Path) -> None:
    """Records cut short (a corrupt frame): said, and the payload goes on as it came instead of ending the exporter
    process; delivery then says it is unreadable and counts it (the shutdown summary's dropped)."""
    from otel_train.ship.delivery import WINDOWS_UNREADABLE, Delivery
    from otel_train.ship.spool import Spool

    payload, _ = encode_window(RUN, [("loss", 1, 0.5, 0)])
    packed = pack_span_records(payload, [SpanRecord("a", 1, 2, None, 0, 1, 5, "M", 1, None, None)], [], True)
    kept, window = SpanCompleter(lambda cause, n: None).complete(packed[:-3])
    assert window is None and kept == packed[:-3]
    assert any("span records could not be read" in r.getMessage() for r in caplog.records)
    delivery = Delivery({}, Spool(tmp_path / "spool"))
    delivery.spans = SpanCompleter(delivery.count_lost)
    delivery.submit(1, 1, packed[:-3])
    assert delivery.progress().children_lost == {WINDOWS_UNREADABLE: 1}


def test_span_rows_that_cannot_be_made_are_counted_and_the_window_goes_on(caplog: Any) -> None:
    """A record whose fields break the row maker (attributes that are no mapping): the window's points are
    delivered without its span rows and phases, and the records are counted as lost."""
    from otel_train.ship.span_work import SPANS_NOT_MADE

    payload, _ = encode_window(RUN, [("loss", 1, 0.5, 0)])
    bad = SpanRecord("a", 1, 2, None, 0, 1, 5, "M", 1, 42, None)  # type: ignore[arg-type]
    lost: list[tuple[str, int]] = []
    kept, window = SpanCompleter(lambda cause, n: lost.append((cause, n))).complete(
        pack_span_records(payload, [bad, bad], [], True))
    assert window is None and kept == payload
    assert [(p.tag, p.step, p.value) for p in decode_window(kept).metrics] == [("loss", 1, 0.5)]
    assert lost == [(SPANS_NOT_MADE, 2)]
    assert any("could not be made" in r.getMessage() for r in caplog.records)


def test_the_summary_counts_the_phase_points_the_exporter_process_made(tmp_path: Path) -> None:
    """The shutdown summary's point count is what the backends got: every metric row of the JSONL file but
    otel-train's own health rows (which it never counted)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys, otel_train as ot
        ot.init(dir=sys.argv[1], run_name="s", exporters="jsonl")
        for i in ot.steps(range(30)):
            with ot.span("data"):
                pass
            with ot.span("forward"):
                ot.log({"train/loss": 1.0 / (i + 1)})
        ot.shutdown()
    """))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=120, check=True)
    (line,) = [x for x in proc.stderr.splitlines() if " points in " in x]
    counted = int(line.split("otel-train: ")[1].split(" points")[0].replace(",", ""))
    rows = [json.loads(x) for x in (tmp_path / "runs" / "s" / "rank0.jsonl").read_text().splitlines()]
    metrics = [r for r in rows if r["type"] == "metric" and not r["name"].startswith("otel_train.")]
    assert sum(r["name"].startswith("phase/") for r in metrics) == 3 * 30  # data, forward, other
    assert counted == len(metrics)


def test_a_window_sent_again_after_a_restart_is_made_and_counted_once(tmp_path: Path) -> None:
    """A restarted exporter process is sent the windows its predecessor may have spooled: delivery takes a seq
    once, so its phase points are made (and counted in the summary) once."""
    from otel_train.ship.delivery import Delivery
    from otel_train.ship.spool import Spool

    builder = _builder()
    records, spans = _step(0, 0)
    parts = builder.build(RUN, None, records, spans, 0, defer_spans=True)
    payload, max_step = encode_window(RUN, parts.points, parts.metrics, parts.histograms, parts.spans, parts.logs)
    packed = pack_span_records(payload, parts.span_records or [], parts.phase_spans, parts.phases)
    delivery = Delivery({}, Spool(tmp_path / "spool"))
    delivery.spans = SpanCompleter(delivery.count_lost)
    for _ in range(2):
        delivery.submit(1, max_step, packed)
    assert delivery.progress().points_added == 3  # data, forward, other
    ((seq, _, spooled),) = list(delivery.spool.read(0))  # type: ignore[union-attr]
    assert seq == 1 and not has_span_records(spooled)
    assert sorted(m.tag for m in decode_window(spooled).metrics if m.tag.startswith("phase/")) == [
        "phase/data_s", "phase/forward_s", "phase/other_s"]
