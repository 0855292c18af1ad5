"""load_trace (also of cut-off files) and merge_traces of per-rank Chrome traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.exporters.chrome_trace import ChromeTraceExporter, trace_path
from otel_train.trace_merge import load_trace, merge_traces
from otel_train.vocab.rows import MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

T0 = 1_700_000_000_000_000_000


def rank_run(rank: int) -> RunInfo:
    return RunInfo("rid", "merge", rank=rank, world_size=2, host=f"node{rank}", pid=100 + rank)


def write_rank(tmp_path: Path, rank: int, starts_us: list[int], close: bool = True) -> tuple[Path, ChromeTraceExporter]:
    run = rank_run(rank)
    exp = ChromeTraceExporter(ExporterOptions(directory=tmp_path))
    for step, start in enumerate(starts_us):
        t = T0 + start * 1000
        exp.export_window(Window(
            metrics=[MetricRow(run, step, "train/loss", "train/loss", float(rank * 10 + step), "gauge", t)],
            spans=[SpanRow(run, f"r{rank}s{step}", 1, step + 1, None, t, t + 1000, 5, "MainThread", step,
                           {"train.step": step})],
        ))
    if close:
        exp.shutdown()
    else:
        exp.force_flush()  # as a killed process leaves it: flushed, never closed
    return trace_path(tmp_path, "merge", rank), exp


def test_merge_two_ranks(tmp_path: Path) -> None:
    r0, _ = write_rank(tmp_path, 0, [10, 30, 50])
    r1, open_exp = write_rank(tmp_path, 1, [20, 40], close=False)  # one rank crashed
    assert not r1.read_text().rstrip().endswith("]")
    out = tmp_path / "out" / "merged.trace.json"
    n = merge_traces(out, [r0, r1])
    open_exp.shutdown()
    events = json.loads(out.read_text())
    assert n == len(events)
    xs = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in xs] == ["r0s0", "r1s0", "r0s1", "r1s1", "r0s2"]  # sorted by ts
    assert {e["name"][:2]: e["pid"] for e in xs} == {"r0": 0, "r1": 1}
    assert [e["args"]["train.step"] for e in xs] == [0, 0, 1, 1, 2]
    meta = [e for e in events if e["ph"] == "M"]
    assert events[: len(meta)] == meta  # metadata first
    keys = [(e["name"], e["pid"], e.get("tid")) for e in meta]
    assert len(keys) == len(set(keys))
    assert {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"} == {
        (0, "rank 0 (node0 pid 100)"), (1, "rank 1 (node1 pid 101)")}
    assert {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"} == {(0, 5), (1, 5)}
    counters = [(e["pid"], e["args"]["value"]) for e in events if e["ph"] == "C"]
    assert counters == [(0, 0.0), (1, 10.0), (0, 1.0), (1, 11.0), (0, 2.0)]
    # Merging the same file twice keeps one copy of its metadata.
    n2 = merge_traces(out, [r0, r0])
    assert n2 == len(load_trace(out)) and sum(e.get("name") == "process_name" for e in load_trace(out)) == 1


def test_load_trace_formats(tmp_path: Path) -> None:
    ev = {"name": "a", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 1}
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"traceEvents": [ev], "displayTimeUnit": "ms"}))
    assert load_trace(obj) == [ev]
    cut = tmp_path / "cut.json"
    cut.write_text('[\n' + json.dumps(ev) + ',\n{"name":"b","ph":"X","ts":3,"du')  # killed mid-event
    assert load_trace(cut) == [ev]
    empty = tmp_path / "empty.json"
    empty.write_text("[\n")
    assert load_trace(empty) == []
    bad = tmp_path / "bad.json"
    bad.write_text('{"no": "events"}')
    with pytest.raises(ValueError, match="not a Chrome trace"):
        load_trace(bad)
    junk = tmp_path / "junk.json"
    junk.write_text("hello")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        load_trace(junk)


def test_torch_profiler_trace_merges_onto_our_timeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real torch profiler on CPU with the bridge: its `record_function`s sit inside our spans, same thread."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    import otel_train as ot
    from otel_train.cli import main

    monkeypatch.setenv("OTEL_TRAIN_PROFILER_BRIDGE", "1")
    ot.init(exporters=["chrome_trace"], dir=tmp_path, run_name="prof")
    w = torch.randn(64, 64, requires_grad=True)
    with ot.step(0), ot.span("outside_profiler"):
        pass
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in ot.steps(range(3), start=1):
            with ot.span("forward"):
                loss = (torch.randn(32, 64) @ w).pow(2).mean()
            with ot.span("backward"):
                loss.backward()
    ot.shutdown()
    prof_path = tmp_path / "torch_trace.json"
    # torch's Python writer: kineto's C++ writer in torch 2.13 once dropped the file's first bytes in CI
    prof.export_chrome_trace(str(prof_path), use_python_export=True)
    torch_names = [e.get("name") for e in json.loads(prof_path.read_text())["traceEvents"]
                   if e.get("cat") == "user_annotation"]
    assert torch_names.count("forward") == 3 and torch_names.count("backward") == 3
    assert "outside_profiler" not in torch_names  # no profiler then: nothing opened

    ours = trace_path(tmp_path, "prof", 0)
    out = tmp_path / "merged.json.gz"
    assert main(["trace", "merge", str(out), str(ours), "--profiler", str(prof_path)]) == 0
    events = load_trace(out)
    tid = threading.get_native_id()
    our_spans = [e for e in events if e.get("cat") == "span" and e["name"] in ("forward", "backward")]
    torch_spans = [e for e in events if e.get("cat") == "user_annotation"]
    assert len(our_spans) == len(torch_spans) == 6
    for mine, theirs in zip(sorted(our_spans, key=lambda e: e["ts"]), sorted(torch_spans, key=lambda e: e["ts"])):
        assert (theirs["name"], theirs["pid"], theirs["tid"]) == (mine["name"], 0, tid)  # rank 0, same thread
        # Same clock: the record function opens after our span starts and closes before it ends
        # (1 ms of slack for the two clocks' reading order).
        assert mine["ts"] - 1000 <= theirs["ts"] and theirs["ts"] + theirs["dur"] <= mine["ts"] + mine["dur"] + 1000
    assert any(e.get("cat") == "cpu_op" and e["pid"] == 0 for e in events)  # torch's ops on the rank's track
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name" and e["pid"] == 0}
    assert len(names) == 1 and names.pop().startswith("rank 0")  # ours wins over torch's "python"


def test_profiler_trace_of_rank_one_gets_its_pid_clock_and_device_tracks(tmp_path: Path) -> None:
    """A Kineto-shaped file (times relative to `baseTimeNanoseconds`, host pid, one GPU) of rank 1."""
    from otel_train.trace_merge import load_profiler_trace

    base_ns = 1_700_000_000_000_000_000
    kineto = {
        "baseTimeNanoseconds": base_ns, "distributedInfo": {"rank": 1, "world_size": 2},
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 4242, "tid": 0, "args": {"name": "python"}},
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            {"ph": "X", "cat": "user_annotation", "name": "forward", "pid": 4242, "tid": 77, "ts": 10.0, "dur": 5.0},
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 12.5, "dur": 1.0},
        ],
    }
    path = tmp_path / "rank1_torch.json"
    path.write_text(json.dumps(kineto))
    events = {(e["ph"], e["name"], e.get("args", {}).get("name")): e for e in load_profiler_trace(path)}
    forward = events[("X", "forward", None)]
    gemm = events[("X", "gemm", None)]
    assert (forward["pid"], forward["tid"], forward["ts"]) == (1, 77, base_ns / 1000 + 10.0)
    assert (gemm["pid"], gemm["ts"]) == (2000, base_ns / 1000 + 12.5)  # 1000 * (rank + 1) + device 0
    assert ("M", "process_name", "rank 1 GPU 0") in events and ("M", "process_name", "rank 1") in events
    assert "tid" not in events[("M", "process_name", "rank 1")]  # keyed like ours, so ours win in a merge
