"""Raw OTel instruments without `train.step` land at the step they were recorded in, not the step current when
the window is collected: counters (with their running total), histograms and gauges, read back from JSONL and
TensorBoard's own reader as lists, so a point written twice or at a wrong step fails.

The loop runs steps as fast as it can (no sleeps) and collection is driven explicitly: `export_every` and the
interval are set so that nothing but the `flush()` calls collects, so every window spans many steps.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.testing import InMemoryRowExporter

STEPS = 30
FLUSH_AT = (9, 20)  # a collection inside these steps, after their records


def _jsonl(directory: Path, run: str, names: set[str]) -> list[tuple[str, int, float]]:
    return [(r["tag"], r["step"], r["value"]) for r in read_jsonl(jsonl_path(directory, run, 0))
            if r["type"] == "metric" and r["name"] in names]


def _tb(run_dir: Path) -> tuple[list[tuple[str, int, float]], list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = [(tag, e.step, e.value) for tag in ("steps_done", "lr") for e in acc.Scalars(tag)]
    hists = [(e.step, e.histogram_value.num, e.histogram_value.sum) for e in acc.Histograms("batch_size")]
    return scalars, hists


def test_counter_histogram_gauge_land_at_the_step_they_were_recorded_in(run_dir: Path) -> None:
    ot.init(exporters=["jsonl", "tensorboard"], dir=run_dir, run_id="raw", run_name="raw",
            export_every=10_000, export_interval_s=3600)
    meter = ot.get_meter("trainer")
    done = meter.create_counter("steps_done")
    batch = meter.create_histogram("batch_size")
    lr = meter.create_gauge("lr")
    for k in ot.steps(range(STEPS)):
        done.add(k + 1)
        batch.record(2 * k)
        batch.record(2 * k + 1)
        lr.set(k / 64)
        if k in FLUSH_AT:
            assert ot.flush(timeout_s=30)
    ot.shutdown()

    totals = [sum(j + 1 for j in range(k + 1)) for k in range(STEPS)]  # the counter's running total
    want_counter = [("steps_done", k, float(totals[k])) for k in range(STEPS)]
    want_lr = [("lr", k, k / 64) for k in range(STEPS)]
    got = _jsonl(run_dir, "raw", {"steps_done", "lr", "batch_size/count", "batch_size/sum"})
    assert sorted(p for p in got if p[0] == "steps_done") == want_counter
    assert sorted(p for p in got if p[0] == "lr") == want_lr
    assert sorted(p for p in got if p[0] == "batch_size/count") == [("batch_size/count", k, 2.0) for k in range(STEPS)]
    assert sorted(p for p in got if p[0] == "batch_size/sum") == [("batch_size/sum", k, 4.0 * k + 1) for k in
                                                                   range(STEPS)]
    scalars, hists = _tb(run_dir / "raw")
    assert sorted(scalars) == sorted(want_counter + want_lr)  # k / 64 and the totals are exact in float32
    assert sorted(hists) == [(k, 2.0, 4.0 * k + 1) for k in range(STEPS)]


def test_points_recorded_on_another_thread_take_the_latest_step(run_dir: Path) -> None:
    """A thread of the user's has no step context: its points take the latest step entered (`current_step()`),
    still the step they were recorded in, not the one current at collection."""
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, export_every=10_000, export_interval_s=3600)
    samples = ot.get_meter("loader").create_counter("samples")
    for k in ot.steps(range(5)):
        worker = threading.Thread(target=samples.add, args=(10,))
        worker.start()
        worker.join()
    assert ot.flush(timeout_s=30)
    assert [(r.tag, r.step, r.value) for r in mem.metrics if r.name == "samples"] == [
        ("samples", k, 10.0 * (k + 1)) for k in range(5)]


def test_an_explicit_step_attribute_is_kept(run_dir: Path) -> None:
    mem = InMemoryRowExporter()
    ot.init(exporters=[mem], dir=run_dir, export_every=10_000, export_interval_s=3600)
    g = ot.get_meter().create_gauge("eval/acc")
    with ot.step(7):
        g.set(0.5, {"train.step": 3})
        g.set(0.75, {"split": "val"})
    assert ot.flush(timeout_s=30)
    got: list[tuple[Any, ...]] = [(r.tag, r.step, r.value) for r in mem.metrics if r.name == "eval/acc"]
    assert sorted(got) == [("eval/acc", 3, 0.5), ("eval/acc{split=val}", 7, 0.75)]


def test_a_starved_collector_never_overflows_the_sdks_limit() -> None:
    """Past half the cardinality limit in uncollected steps, points take the window's step instead of creating
    more per-step attribute sets (the SDK would fold them into an `otel.metric.overflow` series)."""
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_train.collect.reader import StepAlignedMetricReader

    mem = InMemoryRowExporter()
    reader = StepAlignedMetricReader([mem], export_every=1, export_interval_s=3600)
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter("t").create_counter("c")
    for k in range(1005):  # nothing collects meanwhile: no session, no interval
        with ot.step(k):
            counter.add(1)
    assert reader.force_flush()
    got = [(r.tag, r.step, r.value) for r in mem.metrics if r.name == "c"]
    assert got == [("c", k, float(k + 1)) for k in range(1000)] + [("c", 1004, 1005.0)]
    provider.shutdown()
