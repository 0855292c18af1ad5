"""JsonlExporter: every row as a JSON line per rank, NaN/inf round-trip, append, plain OTel paths."""

from __future__ import annotations

import json
import math
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.exporters.jsonl import JsonlExporter, jsonl_path, read_jsonl
from otel_train.vocab.rows import HistogramRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo


def run_info(rank: int = 0) -> RunInfo:
    return RunInfo("rid-9", "jl", rank=rank, world_size=2)


def metric(tag: str, step: int, value: float, rank: int = 0, **attrs: object) -> MetricRow:
    return MetricRow(run_info(rank), step, tag.split("{")[0], tag, value, "gauge", 1000 + step, attrs)


def test_rows_of_every_type(tmp_path: Path) -> None:
    hist = HistogramRow(run_info(), 2, "grad", "grad", 3, 6.0, 1.0, 3.0, (1.5, 2.5), (1, 1, 1), 5000)
    sp = SpanRow(run_info(), "forward", 0xABC, 0x12, 0x11, 100, 250, 7, "MainThread", 2,
                 {"train.step": 2, "shape": (4, 8)}, True, "boom")
    with JsonlExporter(ExporterOptions(directory=tmp_path)) as exp:
        assert exp.export_window(Window(
            metrics=[metric("train/loss", 1, 0.5), metric("eval/acc{split=val}", 2, 0.75, split="val")],
            histograms=[hist], spans=[sp]))
    path = jsonl_path(tmp_path, "jl", 0)
    assert exp.paths == [path]
    recs = list(read_jsonl(path))
    assert recs[0] == {"type": "metric", "run_id": "rid-9", "run_name": "jl", "rank": 0, "step": 1,
                       "name": "train/loss", "tag": "train/loss", "value": 0.5, "kind": "gauge",
                       "time_unix_nano": 1001, "attributes": {}}
    assert (recs[1]["tag"], recs[1]["name"], recs[1]["attributes"]) == ("eval/acc{split=val}", "eval/acc",
                                                                         {"split": "val"})
    assert recs[2] == {"type": "histogram", "run_id": "rid-9", "run_name": "jl", "rank": 0, "step": 2,
                       "name": "grad", "tag": "grad", "count": 3, "sum": 6.0, "min": 1.0, "max": 3.0,
                       "explicit_bounds": [1.5, 2.5], "bucket_counts": [1, 1, 1], "time_unix_nano": 5000,
                       "attributes": {}}
    assert recs[3] == {"type": "span", "run_id": "rid-9", "run_name": "jl", "rank": 0, "step": 2,
                       "name": "forward", "trace_id": f"{0xABC:032x}", "span_id": f"{0x12:016x}",
                       "parent_span_id": f"{0x11:016x}", "start_unix_nano": 100, "end_unix_nano": 250,
                       "thread_id": 7, "thread_name": "MainThread", "error": True, "status_message": "boom",
                       "attributes": {"train.step": 2, "shape": [4, 8]}}


def test_non_finite_values_round_trip(tmp_path: Path) -> None:
    with JsonlExporter(ExporterOptions(directory=tmp_path)) as exp:
        exp.export_window(Window(metrics=[metric("a", 0, math.nan), metric("b", 0, math.inf),
                                          metric("c", 0, -math.inf)]))
    text = jsonl_path(tmp_path, "jl", 0).read_text()
    assert '"value":NaN' in text and '"value":Infinity' in text and '"value":-Infinity' in text
    values = {r["tag"]: r["value"] for r in read_jsonl(jsonl_path(tmp_path, "jl", 0))}
    assert math.isnan(values["a"]) and values["b"] == math.inf and values["c"] == -math.inf


def test_per_rank_files_append_across_instances(tmp_path: Path) -> None:
    for start in (0, 2):  # a second instance (resumed run) appends to the same record
        with JsonlExporter(ExporterOptions(directory=tmp_path)) as exp:
            for step in (start, start + 1):
                exp.export_window(Window(metrics=[metric("loss", step, step / 10, rank=0),
                                                  metric("loss", step, step / 10 + 1, rank=1)]))
    for rank in (0, 1):
        recs = list(read_jsonl(jsonl_path(tmp_path, "jl", rank)))
        assert [(r["rank"], r["step"], r["value"]) for r in recs] == [
            (rank, s, s / 10 + rank) for s in range(4)]


def test_cut_off_last_line_is_skipped(tmp_path: Path) -> None:
    exp = JsonlExporter(ExporterOptions(directory=tmp_path))
    exp.export_window(Window(metrics=[metric("loss", 0, 1.0)]))
    exp.force_flush()
    path = jsonl_path(tmp_path, "jl", 0)
    with open(path, "a") as f:
        f.write('{"type":"metric","st')  # what a kill in the middle of a write leaves
    assert [r["step"] for r in read_jsonl(path)] == [0]
    exp.shutdown()


def test_a_writer_after_a_torn_line_starts_a_new_line(tmp_path: Path) -> None:
    # A killed exporter process leaves half a line; its restart writes that window again after it.
    with JsonlExporter(ExporterOptions(directory=tmp_path)) as exp:
        exp.export_window(Window(metrics=[metric("loss", 0, 1.0)]))
    path = jsonl_path(tmp_path, "jl", 0)
    with open(path, "a") as f:
        f.write('{"type":"metric","st')
    with JsonlExporter(ExporterOptions(directory=tmp_path)) as exp:
        exp.export_window(Window(metrics=[metric("loss", 1, 0.5), metric("loss", 2, 0.25)]))
    assert [(r["step"], r["value"]) for r in read_jsonl(path)] == [(0, 1.0), (1, 0.5), (2, 0.25)]


def test_plain_otel_sdk_paths(tmp_path: Path) -> None:
    resource = Resource({"train.run.id": "sdk", "train.run.name": "sdk-run", "train.rank": 0})
    exp = JsonlExporter(ExporterOptions(directory=tmp_path))
    reader = PeriodicExportingMetricReader(exp, export_interval_millis=3_600_000)
    meters = MeterProvider(resource=resource, metric_readers=[reader])
    tracers = TracerProvider(resource=resource)
    tracers.add_span_processor(SimpleSpanProcessor(exp))
    meter = meters.get_meter("t")
    loss = meter.create_gauge("train/loss")
    seen = meter.create_counter("train/samples")
    for step in range(2):
        loss.set(1.0 / (step + 1), {"train.step": step})
        seen.add(32)
        meters.force_flush()  # one collection per step
    with tracers.get_tracer("t").start_as_current_span("step", attributes={"train.step": 1}) as s:
        s.set_status(Status(StatusCode.ERROR, "bad"))
    recs = list(read_jsonl(jsonl_path(tmp_path, "sdk-run", 0)))
    tracers.shutdown()
    meters.shutdown()
    spans = [r for r in recs if r["type"] == "span"]
    assert [(r["name"], r["step"], r["error"], r["status_message"]) for r in spans] == [("step", 1, True, "bad")]
    metrics = [(r["tag"], r["step"], r["value"], r["kind"]) for r in recs if r["type"] == "metric"]
    # The second collection repeats step 0's gauge point (the SDK's gauges are cumulative here).
    assert [m for m in metrics if m[0] == "train/loss"][-2:] == [("train/loss", 0, 1.0, "gauge"),
                                                                ("train/loss", 1, 0.5, "gauge")]
    assert [m for m in metrics if m[0] == "train/samples"] == [("train/samples", 0, 32.0, "counter"),
                                                               ("train/samples", 0, 64.0, "counter")]
    assert all(r["run_id"] == "sdk" for r in recs)


def test_lines_are_plain_json_objects(tmp_path: Path) -> None:
    with JsonlExporter(ExporterOptions(directory=tmp_path)) as exp:
        exp.export_window(Window(metrics=[metric("x", 0, 1.0, obj=complex(1, 2))]))
    line = jsonl_path(tmp_path, "jl", 0).read_text().splitlines()[0]
    assert json.loads(line)["attributes"]["obj"] == "(1+2j)"  # odd attribute types: str()
