"""ChromeTraceExporter: events, pids/tids, error marks, counters, per-rank files, crash-loadability."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import readback
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.exporters.chrome_trace import ERROR_CNAME, ChromeTraceExporter, trace_path
from otel_train.trace_merge import load_trace
from otel_train.vocab.rows import MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

T0 = 1_700_000_000_000_000_000  # ns


def run_info(rank: int = 0) -> RunInfo:
    return RunInfo("rid-1", "demo", rank=rank, world_size=2, host="node7", pid=4242 + rank)


def span(name: str, step: int | None, start_us: int, dur_us: int, *, rank: int = 0, tid: int = 11,
         thread: str = "MainThread", error: bool = False, message: str = "", **attrs: object) -> SpanRow:
    a: dict[str, object] = dict(attrs)
    if step is not None:
        a["train.step"] = step
    a["thread.id"] = tid
    a["thread.name"] = thread
    return SpanRow(run_info(rank), name, 1, start_us, None, T0 + start_us * 1000, T0 + (start_us + dur_us) * 1000,
                   tid, thread, step, a, error, message)


def metric(tag: str, step: int, value: float, t_us: int, rank: int = 0, kind: str = "gauge") -> MetricRow:
    return MetricRow(run_info(rank), step, tag, tag, value, kind, T0 + t_us * 1000)


def opts(tmp_path: Path, counters: bool = True) -> ExporterOptions:
    return ExporterOptions(directory=tmp_path, trace_counters=counters)


def by_ph(events: list[dict], ph: str) -> list[dict]:
    return [e for e in events if e["ph"] == ph]


def test_spans_become_complete_events_with_step_tid_and_error(tmp_path: Path) -> None:
    exp = ChromeTraceExporter(opts(tmp_path))
    assert exp.export_window(Window(spans=[
        span("forward", 0, 10, 5, lr=0.1),
        span("load", 0, 12, 3, tid=22, thread="loader"),
        span("backward", 1, 20, 7, error=True, message="CUDA OOM"),
    ]))
    exp.shutdown()
    path = trace_path(tmp_path, "demo", 0)
    assert exp.paths == [path]
    events = json.loads(path.read_text())  # valid JSON after a clean shutdown
    spans = {e["name"]: e for e in by_ph(events, "X")}
    assert spans["forward"] == {"name": "forward", "cat": "span", "ph": "X", "ts": T0 / 1000 + 10, "dur": 5.0,
                                "pid": 0, "tid": 11, "args": {"train.step": 0, "lr": 0.1}}
    assert spans["load"]["tid"] == 22 and spans["load"]["args"] == {"train.step": 0}
    assert spans["backward"]["args"] == {"train.step": 1, "error": "CUDA OOM"}
    assert spans["backward"]["cname"] == ERROR_CNAME and "cname" not in spans["forward"]
    meta = {(e["name"], e.get("tid")): e["args"] for e in by_ph(events, "M")}
    assert meta[("process_name", None)] == {"name": "rank 0 (node7 pid 4242)"}
    assert meta[("process_sort_index", None)] == {"sort_index": 0}
    assert meta[("thread_name", 11)] == {"name": "MainThread"}
    assert meta[("thread_name", 22)] == {"name": "loader"}
    # One thread_name per (pid, tid), even across windows.
    assert sum(1 for e in by_ph(events, "M") if e["name"] == "thread_name") == 2


def test_thread_names_once_across_windows_and_fallback_tid(tmp_path: Path) -> None:
    no_thread = SpanRow(run_info(), "bare", 1, 9, None, T0, T0 + 1000, 0, "", 3, {"train.step": 3})
    named = SpanRow(run_info(), "named", 1, 10, None, T0, T0 + 1000, 0, "worker", None, {})
    with ChromeTraceExporter(opts(tmp_path)) as exp:
        for i in range(3):
            exp.export_window(Window(spans=[span("step", i, 100 * i, 50)]))
        exp.export_window(Window(spans=[no_thread, named, no_thread]))
    events = json.loads(trace_path(tmp_path, "demo", 0).read_text())
    names = [e for e in by_ph(events, "M") if e["name"] == "thread_name"]
    assert sorted(e["args"]["name"] for e in names) == ["MainThread", "thread 1", "worker"]
    xs = {e["name"]: e for e in by_ph(events, "X")}
    assert xs["bare"]["tid"] == 1 and xs["bare"]["args"] == {"train.step": 3}
    assert xs["named"]["tid"] > 1 and xs["named"]["tid"] < 100_001 and "train.step" not in xs["named"]["args"]
    assert [e["args"]["train.step"] for e in by_ph(events, "X") if e["name"] == "step"] == [0, 1, 2]


def test_counter_events_for_scalars(tmp_path: Path) -> None:
    with ChromeTraceExporter(opts(tmp_path)) as exp:
        exp.export_window(Window(metrics=[
            metric("train/loss", 0, 2.5, 10), metric("train/loss", 1, 1.25, 20),
            metric("train/loss", 2, math.nan, 30), metric("train/loss", 3, math.inf, 40),
            metric("train/loss", 4, -math.inf, 50),
            metric("grad/count", 1, 3.0, 20, kind="histogram"),
        ]))
    events = json.loads(trace_path(tmp_path, "demo", 0).read_text(), parse_constant=_not_strict_json)
    counters = by_ph(events, "C")
    assert [(c["name"], c["ts"], c["pid"], c["args"]) for c in counters] == [
        ("train/loss", T0 / 1000 + 10, 0, {"value": 2.5}),
        ("train/loss", T0 / 1000 + 20, 0, {"value": 1.25}),
        ("train/loss", T0 / 1000 + 30, 0, {"value": "NaN"}),  # strict JSON has no NaN: the strings Perfetto reads
        ("train/loss", T0 / 1000 + 40, 0, {"value": "Infinity"}),
        ("train/loss", T0 / 1000 + 50, 0, {"value": "-Infinity"}),
    ]
    back = readback.chrome_counters(trace_path(tmp_path, "demo", 0))
    assert [p.value for p in back[:2]] == [2.5, 1.25] and math.isnan(back[2].value)
    assert [p.value for p in back[3:]] == [math.inf, -math.inf]


def _not_strict_json(constant: str) -> None:
    raise AssertionError(f"{constant} in the trace: chrome://tracing and Perfetto reject it")


def test_counters_off(tmp_path: Path) -> None:
    exp = ChromeTraceExporter(opts(tmp_path, counters=False))
    assert exp.handles_metrics is False and exp.handles_spans is True
    exp.export_window(Window(metrics=[metric("train/loss", 0, 1.0, 1)], spans=[span("s", 0, 1, 1)]))
    exp.shutdown()
    events = json.loads(trace_path(tmp_path, "demo", 0).read_text())
    assert by_ph(events, "C") == [] and len(by_ph(events, "X")) == 1


def test_one_file_per_rank_from_one_instance(tmp_path: Path) -> None:
    with ChromeTraceExporter(opts(tmp_path)) as exp:
        exp.export_window(Window(spans=[span("a", 0, 1, 1, rank=0), span("b", 0, 2, 1, rank=1)]))
        exp.export_window(Window(spans=[span("c", 1, 3, 1, rank=1)]))
    r0 = json.loads(trace_path(tmp_path, "demo", 0).read_text())
    r1 = json.loads(trace_path(tmp_path, "demo", 1).read_text())
    assert [(e["name"], e["pid"]) for e in by_ph(r0, "X")] == [("a", 0)]
    assert [(e["name"], e["pid"]) for e in by_ph(r1, "X")] == [("b", 1), ("c", 1)]
    assert {e["args"]["name"] for e in r1 if e["name"] == "process_name"} == {"rank 1 (node7 pid 4243)"}


def test_resumed_run_keeps_the_earlier_trace(tmp_path: Path) -> None:
    for name in ("first", "second"):
        with ChromeTraceExporter(opts(tmp_path)) as exp:
            exp.export_window(Window(spans=[span(name, 0, 1, 1)]))
    first = json.loads(trace_path(tmp_path, "demo", 0).read_text())
    second = json.loads(trace_path(tmp_path, "demo", 0).with_name("rank0.1.trace.json").read_text())
    assert [e["name"] for e in by_ph(first, "X")] == ["first"]
    assert [e["name"] for e in by_ph(second, "X")] == ["second"]


def test_non_finite_and_odd_attributes_stay_strict_json(tmp_path: Path) -> None:
    with ChromeTraceExporter(opts(tmp_path)) as exp:
        exp.export_window(Window(spans=[span("s", 0, 1, 1, loss=math.inf, shape=(2, 3), bad=math.nan)]))
    text = trace_path(tmp_path, "demo", 0).read_text()
    args = by_ph(json.loads(text, parse_constant=pytest.fail), "X")[0]["args"]
    assert args == {"train.step": 0, "loss": "inf", "shape": [2, 3], "bad": "nan"}


def test_plain_otel_sdk_path(tmp_path: Path) -> None:
    resource = Resource({"service.name": "t", "train.run.id": "sdk-run", "train.run.name": "sdk", "train.rank": 1})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(ChromeTraceExporter(opts(tmp_path))))
    tracer = provider.get_tracer("test")
    outer = {"train.step": 5, "thread.id": 77, "thread.name": "main"}
    with (tracer.start_as_current_span("step", attributes=outer),
          tracer.start_as_current_span("forward", attributes={"train.step": 5, "thread.id": 77}) as s):
        s.set_status(Status(StatusCode.ERROR, "nan loss"))
        s.record_exception(FloatingPointError("nan loss"))
    provider.shutdown()
    events = json.loads(trace_path(tmp_path, "sdk", 1).read_text())
    xs = {e["name"]: e for e in by_ph(events, "X")}
    assert set(xs) == {"step", "forward"}
    assert all(e["pid"] == 1 and e["tid"] == 77 and e["args"]["train.step"] == 5 for e in xs.values())
    assert xs["forward"]["args"]["error"] == "nan loss" and xs["forward"]["cname"] == ERROR_CNAME
    # The child lies inside its parent on the timeline.
    assert xs["step"]["ts"] <= xs["forward"]["ts"]
    assert xs["forward"]["ts"] + xs["forward"]["dur"] <= xs["step"]["ts"] + xs["step"]["dur"]
    # The recorded exception: an instant event on the span's thread, inside the span.
    (mark,) = [e for e in by_ph(events, "i") if e.get("cat") == "span_event"]
    assert (mark["name"], mark["pid"], mark["tid"], mark["s"]) == ("exception", 1, 77, "t")
    assert mark["args"]["exception.type"] == "FloatingPointError" and mark["args"]["exception.message"] == "nan loss"
    assert xs["forward"]["ts"] <= mark["ts"] <= xs["forward"]["ts"] + xs["forward"]["dur"]


_CRASH = textwrap.dedent("""
    import os, sys, time
    from otel_train.exporters.base import Window
    from otel_train.exporters.chrome_trace import ChromeTraceExporter
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.rows import MetricRow, SpanRow
    from otel_train.vocab.run_identity import RunInfo
    run = RunInfo("rid", "crash", rank=3)
    exp = ChromeTraceExporter(ExporterOptions(directory=sys.argv[1], trace_gzip=sys.argv[3:] == ["gzip"]))
    for step in range(4):
        t = 1_000_000_000 * (step + 1)
        exp.export_window(Window(
            metrics=[MetricRow(run, step, "train/loss", "train/loss", 1.0 / (step + 1), "gauge", t)],
            spans=[SpanRow(run, "step", 1, step + 1, None, t, t + 500_000, 9, "MainThread", step,
                           {"train.step": step})]))
    if sys.argv[2] == "flush":
        exp.force_flush()
    print("ready", flush=True)
    time.sleep(60)
""")


def _run_crash_and_kill(tmp_path: Path, *argv: str) -> None:
    """Run `_CRASH` until it has written its windows, then SIGKILL it."""
    proc = subprocess.Popen([sys.executable, "-c", _CRASH, str(tmp_path), *argv], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("flush", ["flush", "no-flush"])  # each window reaches the OS even unflushed
def test_crashed_process_leaves_a_loadable_trace(tmp_path: Path, flush: str) -> None:
    _run_crash_and_kill(tmp_path, flush)
    text = trace_path(tmp_path, "crash", 3).read_text()
    assert text.startswith("[\n") and text.endswith(",\n")  # no closing bracket: killed
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    # What chrome://tracing does with an unterminated array: drop the last comma, add `]`.
    viewer = json.loads(text.rstrip().rstrip(",") + "]")
    events = load_trace(tmp_path / "crash" / "trace" / "rank3.trace.json")
    assert events == viewer
    assert [e["args"]["train.step"] for e in by_ph(events, "X")] == [0, 1, 2, 3]
    assert {e["pid"] for e in events} == {3}
    assert [c["args"]["value"] for c in by_ph(events, "C")] == [1.0, 0.5, 1 / 3, 0.25]


def test_failing_write_is_isolated_and_retried(tmp_path: Path) -> None:
    blocker = tmp_path / "demo"
    blocker.write_text("a file where the run folder should be")
    exp = ChromeTraceExporter(opts(tmp_path))
    assert exp.export_window(Window(spans=[span("s", 0, 1, 1)])) is False
    assert exp.failures == 1  # the window (its one row tried alone, twice, is no failure of its own)
    blocker.unlink()
    assert exp.force_flush() is True  # the pending window is written on the forced retry
    exp.shutdown()
    events = json.loads(trace_path(tmp_path, "demo", 0).read_text())
    assert [e["name"] for e in by_ph(events, "X")] == ["s"]


# -- long runs: step windows and gzip ----------------------------------------------------------------
def test_trace_steps_keep_only_the_requested_steps(tmp_path: Path) -> None:
    from otel_train.config.settings import parse_step_selection

    sel = parse_step_selection("OTEL_TRAIN_TRACE_STEPS", "2-3,every:10:2")
    exp = ChromeTraceExporter(ExporterOptions(directory=tmp_path, trace_steps=sel))
    for step in range(13):
        exp.export_window(Window(metrics=[metric("train/loss", step, float(step), 100 * step + 50)],
                                 spans=[span("forward", step, 100 * step, 10)]))
    exp.export_window(Window(spans=[span("setup", None, 5000, 10)]))  # outside any step: left out too
    exp.shutdown()
    events = json.loads(trace_path(tmp_path, "demo", 0).read_text())
    assert sorted(e["args"]["train.step"] for e in by_ph(events, "X")) == [0, 1, 2, 3, 10, 11]
    assert sorted(e["ts"] for e in by_ph(events, "C")) == [(T0 + (100 * s + 50) * 1000) / 1000 for s in (0, 1, 2, 3, 10, 11)]


@pytest.mark.parametrize("raw", ["5-2", "x", "every:0", "every:5:6", "-3", "1-"])
def test_bad_trace_steps_name_the_variable(raw: str) -> None:
    from otel_train.config.settings import load_settings
    from otel_train.errors import ConfigError

    with pytest.raises(ConfigError, match=r"OTEL_TRAIN_TRACE_STEPS: .* is not a step selection; use `A-B`"):
        load_settings({"OTEL_TRAIN_TRACE_STEPS": raw})


def test_gzip_trace_loads_with_json_and_gzip(tmp_path: Path) -> None:
    import gzip

    exp = ChromeTraceExporter(ExporterOptions(directory=tmp_path, trace_gzip=True))
    exp.export_window(Window(spans=[span("forward", s, 100 * s, 10) for s in range(50)]))
    exp.shutdown()
    path = trace_path(tmp_path, "demo", 0, gzipped=True)
    assert path.name == "rank0.trace.json.gz" and exp.paths == [path]
    with gzip.open(path, "rt", encoding="utf-8") as f:
        events = json.load(f)
    assert [e["args"]["train.step"] for e in by_ph(events, "X")] == list(range(50))
    assert load_trace(path) == events


def test_gzip_trace_of_a_killed_process_still_loads(tmp_path: Path) -> None:
    import zlib

    _run_crash_and_kill(tmp_path, "no-flush", "gzip")
    path = trace_path(tmp_path, "crash", 3, gzipped=True)
    inflater = zlib.decompressobj(wbits=31)
    text = inflater.decompress(path.read_bytes()).decode()
    assert not inflater.eof and text.endswith(",\n")  # no gzip trailer, but every window decompresses
    events = load_trace(path)
    assert [e["args"]["train.step"] for e in by_ph(events, "X")] == [0, 1, 2, 3]
    assert [c["args"]["value"] for c in by_ph(events, "C")] == [1.0, 0.5, 1 / 3, 0.25]


def test_demo_with_trace_window_and_gzip_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import otel_train as ot
    from otel_train.demo import train

    monkeypatch.setenv("OTEL_TRAIN_TRACE_STEPS", "3-4")
    monkeypatch.setenv("OTEL_TRAIN_TRACE_GZIP", "1")
    ot.init(exporters=["chrome_trace"], dir=tmp_path, run_name="win")
    train(steps=10, progress=None)
    ot.shutdown()
    events = load_trace(trace_path(tmp_path, "win", 0, gzipped=True))
    spans = by_ph(events, "X")
    assert {e["args"]["train.step"] for e in spans} == {3, 4}
    assert sorted(e["name"] for e in spans if e["args"]["train.step"] == 3) == ["backward", "data", "forward",
                                                                               "optimizer"]
