"""The sink's temporality and step rules (`otel_train.sink.runs.temporality`), read back from TensorBoard."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sinkkit import scalars

from otel_train.config.exporter_options import ExporterOptions
from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics
from otel_train.sink.runs.router import Router
from otel_train.sink.runs.temporality import SeriesLedger, exponential_buckets
from otel_train.sink.service import exporter_factory
from otel_train.testing import InMemoryRowExporter, OtlpPoint, metrics_request

_BOUNDS = (1.0, 5.0)


def _resource(rank: int = 0, world: int = 2, run: str = "r") -> dict[str, Any]:
    return {"train.run.id": run, "train.rank": rank, "train.world_size": world}


def _tensorboard(directory: Path, bodies: Iterable[bytes]) -> Router:
    router = Router(exporter_factory(("tensorboard",), ExporterOptions(directory=directory, ranks="all")))
    cache = DecodeCache()
    for body in bodies:
        router.ingest(decode_metrics(parse_metrics(body), cache))
    router.close(30)
    return router


def _memory(bodies: Iterable[bytes]) -> InMemoryRowExporter:
    mem = InMemoryRowExporter()
    router = Router(lambda: [mem])
    cache = DecodeCache()
    for body in bodies:
        router.ingest(decode_metrics(parse_metrics(body), cache))
    router.close(30)
    return mem


def _snapshot(rank: int, history: list[tuple[int, float, list[float]]], start: int, t: int) -> bytes:
    """What a CUMULATIVE reader sends after the steps in `history`: every step's series again."""
    points = []
    for step, (amount, loss, observed) in enumerate(history):
        points.append(OtlpPoint("train/tokens", amount, step=step, kind="sum", cumulative=True,
                                time_unix_nano=t, start_time_unix_nano=start))
        points.append(OtlpPoint("train/loss", loss, step=step, time_unix_nano=t))
        counts = [sum(v <= _BOUNDS[0] for v in observed), sum(_BOUNDS[0] < v <= _BOUNDS[1] for v in observed),
                  sum(v > _BOUNDS[1] for v in observed)]
        points.append(OtlpPoint("train/grad", kind="histogram", step=step, cumulative=True, time_unix_nano=t,
                                start_time_unix_nano=start,
                                histogram=(len(observed), float(sum(observed)), _BOUNDS, counts)))
    return metrics_request(_resource(rank), points)


_step = st.tuples(st.integers(0, 50), st.integers(-3, 3).map(float),
                  st.lists(st.sampled_from([0.5, 2.0, 9.0]), max_size=3))


@settings(max_examples=25, deadline=None)
@given(histories=st.lists(st.lists(_step, min_size=1, max_size=6), min_size=2, max_size=2),
       data=st.data())
def test_any_interleaving_of_cumulative_re_exports_equals_one_export_of_the_final_state(
        histories: list[list[tuple[int, float, list[float]]]], data: st.DataObject) -> None:
    streams: list[list[bytes]] = []
    for rank, history in enumerate(histories):
        stream = []
        for n in range(1, len(history) + 1):  # a collection after some steps, sent once or twice (a retry)
            if n == len(history) or data.draw(st.booleans()):
                body = _snapshot(rank, history[:n], start=7, t=100 + n)
                stream.extend([body] * data.draw(st.integers(1, 2)))
        streams.append(stream)
    order = data.draw(st.permutations([0] * len(streams[0]) + [1] * len(streams[1])))
    cursors = [iter(s) for s in streams]
    interleaved = [next(cursors[rank]) for rank in order]  # each rank's requests stay in their order
    finals = [_snapshot(rank, h, start=7, t=999) for rank, h in enumerate(histories)]
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        _tensorboard(Path(a), interleaved)
        _tensorboard(Path(b), finals)
        for rank, history in enumerate(histories):
            got, want = scalars(Path(a) / "r" / f"rank{rank}"), scalars(Path(b) / "r" / f"rank{rank}")
            assert got == want
            totals = [float(sum(h[0] for h in history[:i + 1])) for i in range(len(history))]
            assert [v for _, v in got["train/tokens"]] == totals
            assert got["train/loss"] == [(s, h[1]) for s, h in enumerate(history)]
            assert got["train/grad/count"] == [(s, float(len(h[2]))) for s, h in enumerate(history)]


def test_cumulative_counter_per_step_becomes_running_totals_written_once() -> None:
    """The issue's measurement: +100 per step with `train.step`, re-sent at every collection."""
    history = [(100, 0.0, [])] * 5
    bodies = [_snapshot(0, history[:n], start=1, t=n) for n in (1, 1, 2, 3, 3, 3, 5)]
    mem = _memory(bodies)
    rows = [(r.step, r.value) for r in mem.metrics if r.tag == "train/tokens"]
    assert rows == [(s, 100.0 * (s + 1)) for s in range(5)]
    assert [r.step for r in mem.metrics if r.tag == "train/loss"] == [0, 1, 2, 3, 4]


def test_restarted_process_continues_the_totals() -> None:
    """A new start time (the process restarted from a checkpoint) is a reset: all of its value is new."""
    def counter(value: int, start: int, t: int, step: int | None = None) -> bytes:
        return metrics_request(_resource(world=1), [OtlpPoint("tokens", value, step=step, kind="sum",
                                                              cumulative=True, start_time_unix_nano=start,
                                                              time_unix_nano=t)])

    bodies = [counter(10, 1, 2), counter(30, 1, 3), counter(30, 1, 4),  # a repeat: not written
              counter(5, 50, 51), counter(25, 50, 52)]  # restart: 5 more, then 20 more
    mem = _memory(bodies)
    # step-less and no steps in the run: a per-series sequence number
    assert mem.values("tokens") == [(0, 10.0), (1, 30.0), (2, 35.0), (3, 55.0)]
    # the same with a lower value but the same start time (a collector that lost the start time)
    mem = _memory([counter(10, 0, 2), counter(30, 0, 3), counter(4, 0, 9)])
    assert [r.value for r in mem.metrics] == [10.0, 30.0, 34.0]


def test_stepless_points_take_the_runs_current_step_and_keep_their_time() -> None:
    loss = [OtlpPoint("train/loss", 0.5, step=7, time_unix_nano=70), OtlpPoint("other/loss", 0.1, step=3)]
    bodies = [
        metrics_request(_resource(rank=1), loss),  # rank 1 reports step 7: the run's current step
        metrics_request(_resource(rank=0), [OtlpPoint("mem", 3.0, time_unix_nano=123_000)]),
        metrics_request(_resource(rank=0), [OtlpPoint("mem", 3.0, time_unix_nano=124_000)]),  # re-sent: once
        metrics_request(_resource(rank=0), [OtlpPoint("mem", 4.0, time_unix_nano=125_000)]),
    ]
    mem = _memory(bodies)
    rows = [(r.step, r.value, r.time_unix_nano) for r in mem.metrics if r.tag == "mem"]
    assert rows == [(7, 3.0, 123_000), (7, 4.0, 125_000)]


def test_up_down_counters_gauges_and_delta_sums() -> None:
    def body(value: float, t: int, **kw: Any) -> bytes:
        return metrics_request(_resource(world=1), [OtlpPoint("queue", value, kind="sum", time_unix_nano=t,
                                                              start_time_unix_nano=1, **kw)])

    updown = _memory([body(5, 2, cumulative=True, monotonic=False, step=1),
                      body(5, 3, cumulative=True, monotonic=False, step=1),
                      body(-2, 4, cumulative=True, monotonic=False, step=2)])
    assert [(r.step, r.value) for r in updown.metrics] == [(1, 5.0), (2, 3.0)]  # a running total, once
    delta = _memory([body(5, 2, step=1), body(5, 3, step=2), body(-2, 4, step=3, monotonic=False)])
    assert [(r.step, r.value) for r in delta.metrics] == [(1, 5.0), (2, 10.0), (3, 8.0)]  # DELTA: running total


def test_exponential_histograms_summaries_and_histograms_without_min_max() -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="train.run.id").value.string_value = "r"
    sm = rm.scope_metrics.add()
    exp = sm.metrics.add(name="latency").exponential_histogram
    exp.aggregation_temporality = 2
    p = exp.data_points.add(count=6, sum=20.0, min=0.0, max=7.5, scale=0, zero_count=1, start_time_unix_nano=1,
                            time_unix_nano=5)
    p.positive.offset = 1
    p.positive.bucket_counts.extend([2, 3])  # (2, 4]: 2, (4, 8]: 3
    p.attributes.add(key="train.step").value.int_value = 3
    summary = sm.metrics.add(name="rtt").summary.data_points.add(count=4, sum=10.0, time_unix_nano=5)
    summary.attributes.add(key="train.step").value.int_value = 3
    summary.quantile_values.add(quantile=0.5, value=2.0)
    summary.quantile_values.add(quantile=0.99, value=4.0)
    hist = sm.metrics.add(name="size").histogram
    hist.aggregation_temporality = 1
    hist.data_points.add(count=2, sum=3.0, explicit_bounds=[1.0], bucket_counts=[1, 1], time_unix_nano=5)
    sm.metrics.add(name="nothing")  # a metric without data: counted as unsupported
    decoded = decode_metrics(parse_metrics(req.SerializeToString()), DecodeCache())
    assert decoded.unsupported == {"empty": 1}
    decoded.finish(SeriesLedger())
    values = {(r.tag, r.step): r.value for r in decoded.metrics}
    assert values == {
        ("latency/count", 3): 6.0, ("latency/sum", 3): 20.0, ("latency/min", 3): 0.0, ("latency/max", 3): 7.5,
        ("rtt/count", 3): 4.0, ("rtt/sum", 3): 10.0, ("rtt/p50", 3): 2.0, ("rtt/p99", 3): 4.0,
        ("size/count", 3): 2.0, ("size/sum", 3): 3.0,  # step-less: the current step; no min/max rows
    }
    (latency, size) = decoded.histograms
    assert (latency.explicit_bounds, latency.bucket_counts) == ((0.0, 4.0, 8.0), (1, 2, 3, 0))
    assert size.bucket_counts == (1, 1)


def test_exponential_buckets_negative_and_fine_scales() -> None:
    bounds, counts = exponential_buckets(1, 0, (0, [1]), (0, [2, 1]))
    assert counts == (1, 2, 0, 1, 0)
    assert bounds[0] == -(2 ** 0.5) and bounds[1] == -1.0 and bounds[2] == 0.0 and bounds[3] == 2 ** 0.5
    assert exponential_buckets(0, 0, (0, []), (0, [])) == ((), (0,))


def test_tensorboard_overflow_bucket_ends_at_the_max_or_is_left_out(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def hist(name: str, counts: list[int]) -> OtlpPoint:
        return OtlpPoint(name, kind="histogram", step=1, histogram=(sum(counts), 12.0, _BOUNDS, counts))

    _tensorboard(tmp_path, [metrics_request(_resource(world=1), [hist("full", [1, 1, 1]), hist("empty", [1, 2, 0])])])
    acc = EventAccumulator(str(tmp_path / "r"), size_guidance={"histograms": 0})
    acc.Reload()
    full, empty = acc.Histograms("full")[0].histogram_value, acc.Histograms("empty")[0].histogram_value
    assert list(full.bucket_limit) == [1.0, 5.0, 9.0] and list(full.bucket) == [1.0, 1.0, 1.0]  # no max sent
    assert list(empty.bucket_limit) == [1.0, 5.0] and list(empty.bucket) == [1.0, 2.0]


def _gauge_rows(steps: range, ranks: tuple[int, ...] = (0, 1), tags: int = 1) -> list[Any]:
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    return [MetricRow(RunInfo("r", "r", rank=rank), step, f"g{t}", f"g{t}", float(step), "gauge", 0)
            for step in steps for rank in ranks for t in range(tags)]


def test_gauges_are_remembered_per_series_for_a_window_of_steps_never_cleared_wholesale() -> None:
    ledger = SeriesLedger(window_steps=20)
    written: list[Any] = []
    for top in range(0, 1000, 50):  # a cumulative sender: every export re-sends every past step
        ledger.saw_step(top + 49)  # as `Decoded.finish` does
        ledger.gauges(_gauge_rows(range(top + 50), tags=3), written.append)
        ledger.commit()
    # each (rank, series, step) written once; steps that fell out of the window are not written again
    keys = [(r.run.rank, r.tag, r.step) for r in written]
    assert len(keys) == len(set(keys)) == 2 * 3 * 1000
    assert ledger.window_skipped > 0
    held = sum(len(steps) for by_tag in ledger._gauges.values() for steps in by_tag.values())
    assert 0 < held <= 2 * 3 * (20 + 50)  # bounded by series x window (+ a request): pruned, never cleared


def test_retried_delta_points_and_spans_are_applied_once() -> None:
    body = metrics_request(_resource(world=1), [OtlpPoint("tokens", 5, kind="sum", step=s, time_unix_nano=10 + s,
                                                          start_time_unix_nano=s) for s in range(3)])
    delta = _memory([body, body, body])  # a request sent three times (its acknowledgement lost)
    assert [(r.step, r.value) for r in delta.metrics] == [(0, 5.0), (1, 10.0), (2, 15.0)]
    ledger = SeriesLedger()
    ids = lambda spans: [(s.trace_id, s.span_id) for s in spans]
    assert ids(ledger.new_spans([_span(1, 7), _span(1, 8)])) == [(1, 7), (1, 8)]
    assert ids(ledger.new_spans([_span(1, 8), _span(2, 8)])) == [(2, 8)]
    assert ledger.retries_skipped == 1


def _span(trace_id: int, span_id: int) -> Any:
    from otel_train.vocab.rows import SpanRow
    from otel_train.vocab.run_identity import RunInfo

    return SpanRow(RunInfo("r", "r"), "s", trace_id, span_id, None, 0, 1, 0, "", 1, {})


def test_the_ledger_state_round_trips_through_msgpack_and_a_rollback_undoes_a_request() -> None:
    import ormsgpack

    def again(value: Any) -> Any:  # what the run's state files give back
        return ormsgpack.unpackb(ormsgpack.packb(value))

    bodies = _sdk_program("cumulative")
    first = SeriesLedger(persistent=True)
    journal: list[Any] = []
    for body in bodies[:3]:
        decoded = decode_metrics(parse_metrics(body), DecodeCache())
        first.begin()
        decoded.finish(first)
        journal.append(again(first.changes()))
        first.commit()
    snapshot = again(first.dump())
    # a refused request changes nothing
    refused = decode_metrics(parse_metrics(bodies[3]), DecodeCache())
    first.begin()
    refused.finish(first)
    first.rollback()
    assert again(first.dump()) == snapshot
    # restored from the snapshot, or from the journal alone: the rest of the program as if never interrupted
    expected = SeriesLedger()
    for body in bodies[:3]:
        decode_metrics(parse_metrics(body), DecodeCache()).finish(expected)
    want = []
    for body in bodies[3:]:
        d = decode_metrics(parse_metrics(body), DecodeCache())
        d.finish(expected)
        want += [(r.tag, r.step, r.value) for r in d.metrics]
    for state, records in ((snapshot, []), (None, journal)):
        restored = SeriesLedger(persistent=True)
        restored.load(state, records)
        restored.loaded()
        got = []
        for body in bodies[3:]:
            d = decode_metrics(parse_metrics(body), DecodeCache())
            d.finish(restored)
            got += [(r.tag, r.step, r.value) for r in d.metrics]
        assert got == want and want


def _sdk_program(temporality: str) -> list[bytes]:
    """One program run with the OTel Python SDK, exported in `temporality` after every step as OTLP bytes:
    a counter, an up-down counter and a histogram, with and without `train.step`."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider, UpDownCounter
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    t = AggregationTemporality.CUMULATIVE if temporality == "cumulative" else AggregationTemporality.DELTA
    reader = InMemoryMetricReader(preferred_temporality={Counter: t, UpDownCounter: t, Histogram: t})
    provider = MeterProvider(metric_readers=[reader], resource=Resource({"train.run.id": "parity"}))
    meter = provider.get_meter("parity")
    tokens, queue, grad = meter.create_counter("tokens"), meter.create_up_down_counter("queue"), \
        meter.create_histogram("grad")
    inflight = meter.create_up_down_counter("inflight")
    latency = meter.create_histogram("latency")
    bodies = []
    for step in range(6):
        tokens.add(10 + step, {"train.step": step})
        queue.add(3 if step % 2 == 0 else -2, {"train.step": step})
        for v in (step * 0.5, step * 1.5 + 1):
            grad.record(v, {"train.step": step})
        inflight.add(1 if step < 4 else -1)  # step-less: the usual OTel way
        latency.record(10.0 - step)  # step-less: min/max must agree in both temporalities
        data = reader.get_metrics_data()
        if data is not None:
            bodies.append(encode_metrics(data).SerializeToString())
    provider.shutdown()
    return bodies


def test_one_program_gives_the_same_rows_in_either_temporality() -> None:
    """Temporality parity: up-down counters are running totals in both, histogram
    /min and /max run since the series' start in both; every other row equal too."""
    rows = {}
    for temporality in ("cumulative", "delta"):
        mem = _memory(_sdk_program(temporality))
        rows[temporality] = sorted((r.name, r.step, round(r.value, 9)) for r in mem.metrics)
        rows[temporality + "/hist"] = sorted((h.name, h.step, h.count, tuple(h.bucket_counts))
                                             for h in mem.histograms)
    assert rows["cumulative"] == rows["delta"]
    assert rows["cumulative/hist"] == rows["delta/hist"]
    queue = [(step, v) for name, step, v in rows["delta"] if name == "queue"]
    assert queue == [(0, 3.0), (1, 1.0), (2, 4.0), (3, 2.0), (4, 5.0), (5, 3.0)]
    latency_min = [v for name, _, v in rows["delta"] if name == "latency/min"]
    assert latency_min == [10.0, 9.0, 8.0, 7.0, 6.0, 5.0]  # since the start, not per window


def test_retried_log_records_are_taken_once_and_their_keys_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.sink.runs import temporality
    from otel_train.vocab.rows import LogRow
    from otel_train.vocab.run_identity import RunInfo

    def record(t: int, rank: int = 0) -> LogRow:
        return LogRow(RunInfo("r", "r", rank=rank), 1, t, 13, "WARN", "slow", "job", {"a": 1})

    ledger = SeriesLedger()
    assert [r.time_unix_nano for r in ledger.new_logs([record(1), record(2)])] == [1, 2]
    assert [(r.time_unix_nano, r.rank) for r in ledger.new_logs([record(2), record(2, rank=1), record(3)])] == [
        (2, 1), (3, 0)]  # the same record of another rank is its own
    assert ledger.retries_skipped == 1
    monkeypatch.setattr(temporality, "_MAX_LOGS", 100)
    for t in range(10, 1010):
        ledger.new_logs([record(t)])
    assert len(ledger._logs) <= 125 and [r.time_unix_nano for r in ledger.new_logs([record(1009)])] == []


def _gauge(rank: int, tag: str, step: int, value: float) -> Any:
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    return MetricRow(RunInfo("r", "r", rank=rank), step, tag, tag, value, "gauge", 0)


def test_gauge_changes_round_trip_bit_for_bit_and_a_rollback_undoes_new_and_changed_values() -> None:
    import math
    import struct

    import ormsgpack

    def again(value: Any) -> Any:
        return ormsgpack.unpackb(ormsgpack.packb(value))

    def same(a: Any, b: Any) -> bool:  # bit for bit (a NaN equals no NaN)
        return bool(ormsgpack.packb(a) == ormsgpack.packb(b))

    nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0123))[0]  # a NaN with a payload
    ledger = SeriesLedger(persistent=True)
    journal = []
    for rows in ([_gauge(0, "a", 1, 1.0), _gauge(0, "a", 2, 2.0), _gauge(1, "a", 1, nan)],
                 [_gauge(0, "a", 2, 2.5), _gauge(0, "b", 7, -0.0), _gauge(1, "a", 1, nan), _gauge(0, "a", 3, 3.0)]):
        ledger.begin()
        ledger.gauges(rows, lambda row: None)
        journal.append(again(ledger.changes()))
        ledger.commit()
    before = again(ledger.dump())
    # one request: a value changed, a new step written twice, a new series; all of it refused
    ledger.begin()
    written: list[Any] = []
    ledger.gauges([_gauge(0, "a", 1, 9.0), _gauge(0, "c", 4, 1.0), _gauge(0, "c", 4, 5.0), _gauge(0, "a", 9, 0.0)],
                  written.append)
    assert len(written) == 4
    ledger.rollback()
    assert same(ledger.dump(), before)
    # restored from the journal, or from the snapshot: the same values, bit for bit (NaN payload, -0.0)
    for state, records in ((None, journal), (before, [])):
        restored = SeriesLedger(persistent=True)
        restored.load(state, records)
        restored.loaded()
        assert same(restored.dump()[1]["g"], before[1]["g"])  # (restoring also fills in series' top steps)
        got: list[Any] = []
        restored.gauges([_gauge(0, "a", 1, 1.0), _gauge(0, "a", 2, 2.5), _gauge(1, "a", 1, nan),
                         _gauge(0, "b", 7, -0.0), _gauge(0, "a", 3, 3.0), _gauge(0, "a", 2, 2.0),
                         _gauge(0, "b", 7, 0.0)], got.append)
        assert [(r.tag, r.step, r.value) for r in got] == [("a", 2, 2.0)]  # 0.0 == -0.0: the same value
        assert struct.pack("<d", restored._gauges[1]["a"][1]) == struct.pack("<d", nan) and math.isnan(nan)
        assert math.copysign(1.0, restored._gauges[0]["b"][7]) == -1.0
