"""The sink's reorder hold: TensorBoard and W&B get a point that a collector delivers late in its
place, not skipped. The release rule on a fake clock; then the real sink with real TensorBoard (with and without
a spool, with no traffic after the reordered requests, an idle close, a point later than the hold), a sink
killed while it holds points, and a real offline W&B run."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from rotel_proc import SinkProcess, wait_until
from sinkkit import make_sink, scalars

from otel_train.backend import Window
from otel_train.config.exporter_options import ExporterOptions
from otel_train.sink.runs import reorder
from otel_train.sink.runs.reorder import ReorderHold, needs_hold
from otel_train.testing import InMemoryRowExporter, OtlpPoint, metrics_request
from otel_train.vocab.rows import HistogramRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

R0, R1 = RunInfo("r", "r", rank=0, world_size=2), RunInfo("r", "r", rank=1, world_size=2)


class _SkipsOlder(InMemoryRowExporter):
    """Keeps what it is given, and, like TensorBoard and W&B, skips a row whose step went back in its series."""

    stores_older_steps = False


def _rows(run: RunInfo, steps: Iterable[int], tag: str = "loss") -> list[MetricRow]:
    return [MetricRow(run, s, tag, tag, float(s), "gauge", 0) for s in steps]


def _hold(reorder_s: float = 5.0) -> tuple[ReorderHold, _SkipsOlder, list[float]]:
    now = [0.0]
    inner = _SkipsOlder()
    return ReorderHold(inner, reorder_s, clock=lambda: now[0]), inner, now


def _got(inner: InMemoryRowExporter) -> list[tuple[int, int, str]]:
    return [(r.run.rank, r.step, r.tag) for r in inner.metrics]


# -- the release rule (fake clock) -------------------------------------------------------------------------
def test_a_held_lower_step_goes_out_before_a_higher_one() -> None:
    hold, inner, now = _hold()
    assert hold.export_window(Window(_rows(R0, [5, 6])))
    now[0] = 1.0
    assert hold.export_window(Window(_rows(R0, [3, 4]) + _rows(R1, [0])))
    assert inner.metrics == [] and hold.held == 5
    assert hold.durable_step() == -1  # the spool's cursor must not pass rank 1's step 0
    now[0] = 5.0  # steps 5-6 are due: out with them goes every held step of rank 0 up to 6, in step order
    assert hold.force_flush()
    assert _got(inner) == [(0, 3, "loss"), (0, 4, "loss"), (0, 5, "loss"), (0, 6, "loss")]
    assert hold.held == 1 and hold.durable_step() == -1  # rank 1 arrived at 1.0: held until 6.0
    now[0] = 6.0
    assert hold.force_flush()
    assert _got(inner)[4:] == [(1, 0, "loss")]
    assert hold.held == 0 and hold.durable_step() is None
    assert inner.step_order.counts() == {"backwards": 0, "dropped": 0}


def test_what_stays_held_is_above_every_step_released() -> None:
    hold, inner, now = _hold()
    hold.export_window(Window(_rows(R0, [1, 2])))
    now[0] = 2.0
    hold.export_window(Window(_rows(R0, [3, 0])))  # one request: a late step 0 and a new step 3
    now[0] = 5.0  # steps 1-2 are due (highest 2): step 0 goes with them, step 3 stays until 7.0
    hold.export_window(Window(_rows(R0, [4])))
    assert inner.metrics == []  # a write holds; what is due goes out at the next flush
    hold.force_flush()
    assert [r.step for r in inner.metrics] == [0, 1, 2]
    assert hold.held == 2 and hold.durable_step() == 2
    now[0] = 10.0
    hold.force_flush()
    assert [r.step for r in inner.metrics] == [0, 1, 2, 3, 4]


def test_a_point_later_than_the_hold_is_skipped_and_counted() -> None:
    hold, inner, now = _hold()
    hold.export_window(Window(_rows(R0, [5, 6])))
    now[0] = 5.0
    hold.force_flush()
    hold.export_window(Window(_rows(R0, [4, 7])))  # step 4 comes after step 6 was written
    now[0] = 10.0
    hold.force_flush()
    assert [r.step for r in inner.metrics] == [5, 6, 7]
    assert inner.step_order.counts() == {"backwards": 1, "dropped": 1}  # /health `steps_order_skipped`


def test_a_second_value_at_a_held_step_after_a_higher_one_is_skipped_as_if_the_first_were_written() -> None:
    hold, inner, now = _hold()
    hold.export_window(Window(_rows(R0, range(10))))  # the first attempt: steps 0-9
    now[0] = 1.0
    again = [MetricRow(R0, s, "loss", "loss", 100.0 + s, "gauge", 0) for s in (5, 6, 7)]
    hold.export_window(Window(again + _rows(R0, [3], tag="acc")))  # a restart from step 5; a new series at 3
    now[0] = 2.0
    hold.export_window(Window(_rows(R0, [9])))  # the same step again, later: not below the series' step 9
    now[0] = 10.0
    hold.force_flush()
    first = [(s, "loss", float(s)) for s in range(10)]
    assert [(r.step, r.tag, r.value) for r in inner.metrics] == first[:4] + [(3, "acc", 3.0)] + first[4:] + [
        (9, "loss", 9.0)]
    assert inner.step_order.counts() == {"backwards": 3, "dropped": 3}  # steps 5, 6, 7 (below 9) of the restart


def test_spans_pass_at_once_and_histograms_are_held_like_points() -> None:
    hold, inner, now = _hold()
    span = SpanRow(R0, "forward", 1, 2, None, 0, 1, 7, "main", 3, {})
    hist = HistogramRow(R0, 2, "grad", "grad", 1, 1.0, 1.0, 1.0, (1.0,), (1, 0), 0)
    late = HistogramRow(R0, 1, "grad", "grad", 1, 1.0, 1.0, 1.0, (1.0,), (1, 0), 0)
    assert hold.export_window(Window(histograms=[hist], spans=[span]))
    assert inner.spans == [span] and inner.histograms == []
    hold.export_window(Window(histograms=[late]))
    now[0] = 5.0
    hold.force_flush()
    assert inner.histograms == [late, hist]


def test_shutdown_and_an_explicit_flush_release_everything() -> None:
    hold, inner, _ = _hold()
    hold.export_window(Window(_rows(R0, [2])))
    hold.force_flush()
    assert inner.metrics == []  # not due, and no flush of everything was asked for
    hold.drain_at_next_flush()
    hold.force_flush()
    assert [r.step for r in inner.metrics] == [2]
    hold.export_window(Window(_rows(R0, [4, 3])))
    hold.shutdown()
    hold.shutdown()  # idempotent
    assert [r.step for r in inner.metrics] == [2, 3, 4] and inner.closed


def test_past_its_row_budget_the_oldest_rows_go_out_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reorder, "MAX_HELD_ROWS", 4)
    hold, inner, now = _hold()
    hold.export_window(Window(_rows(R0, [0, 1])))
    now[0] = 1.0
    hold.export_window(Window(_rows(R0, [2, 3])))
    assert inner.metrics == []
    hold.export_window(Window(_rows(R0, [4])))  # 5 rows held: the oldest request goes out
    assert [r.step for r in inner.metrics] == [0, 1] and hold.held == 3


def test_the_spool_cursor_never_passes_a_held_row(tmp_path: Path) -> None:
    from otel_train.ship.delivery import Delivery
    from otel_train.ship.framing import encode_window
    from otel_train.ship.spool import Spool

    hold, inner, now = _hold()
    delivery = Delivery({"tb": hold}, Spool(tmp_path / "spool"))  # type: ignore[dict-item]
    for seq, steps in ((1, range(5, 10)), (2, range(5))):
        rows = _rows(R0, steps)
        payload, _ = encode_window(RunInfo("", ""), (), rows, (), ())
        delivery.submit(seq, max(steps), payload, Window(rows))
    assert delivery.flush(time.monotonic() + 10)
    # Flushed, but held: a sink killed now hands both requests over again from the spool after a restart.
    assert inner.metrics == [] and delivery.progress().delivered == {"tb": 0}
    now[0] = 5.0
    assert delivery.flush(time.monotonic() + 10)
    assert [r.step for r in inner.metrics] == list(range(10)) and delivery.progress().delivered == {"tb": 2}
    assert delivery.close(time.monotonic() + 10)


def test_durable_step_is_the_lower_of_the_holds_and_the_backends() -> None:
    hold, inner, _ = _hold()
    inner.durable_step = lambda: 1  # type: ignore[method-assign]  # a backend whose store lags (W&B)
    hold.export_window(Window(_rows(R0, [7])))
    assert hold.durable_step() == 1
    inner.durable_step = lambda: None  # type: ignore[method-assign]
    assert hold.durable_step() == 6
    assert hold.kill_safe_writes is False and hold.name == "memory" and hold.step_order is inner.step_order


def test_only_backends_that_skip_older_steps_are_held(tmp_path: Path) -> None:
    from otel_train.exporters.jsonl import JsonlExporter
    from otel_train.exporters.tensorboard import TensorBoardExporter

    options = ExporterOptions(directory=tmp_path)
    assert needs_hold(TensorBoardExporter(options)) and not needs_hold(JsonlExporter(options))
    # Under OTEL_TRAIN_STEP_ORDER=drop every backend skips such a row: every one is held, so all show the same.
    assert needs_hold(JsonlExporter(ExporterOptions(directory=tmp_path, step_order="drop")))


def test_the_hold_is_a_setting() -> None:
    from otel_train.errors import ConfigError
    from otel_train.sink.settings import load_sink_settings

    assert load_sink_settings({}).reorder_s == 5.0
    assert load_sink_settings({"OTEL_TRAIN_SINK_REORDER_S": "0"}).reorder_s == 0.0  # no hold
    assert load_sink_settings({"OTEL_TRAIN_SINK_REORDER_S": "0"}, reorder_s="2.5").reorder_s == 2.5
    with pytest.raises(ConfigError, match=r"^OTEL_TRAIN_SINK_REORDER_S: 'soon' is not a number; expected seconds "
                                          r">= 0 \(0: no hold\)$"):
        load_sink_settings({"OTEL_TRAIN_SINK_REORDER_S": "soon"})
    with pytest.raises(ConfigError, match=r"^--reorder-s: 'inf' is not allowed"):
        load_sink_settings({}, reorder_s="inf")


def test_reorder_s_0_turns_the_hold_off(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, reorder_s=0)
    try:
        _send(sink, _body("a", range(5, 10)), _body("a", range(5)))
        assert sink.flush(10)
        # TensorBoard is handed each request as it comes: the late steps 0-4 are skipped, counted
        assert scalars(tmp_path / "runs" / "a")["train/loss"] == [(s, s / 2) for s in range(5, 10)]
        assert sink.health()["steps_order_skipped"] == {"a": {"tensorboard": 5}}
    finally:
        sink.stop()


# -- the real sink, real TensorBoard ----------------------------------------------------------------------
def _body(run_id: str, steps: Iterable[int], rank: int = 0) -> bytes:
    return metrics_request({"train.run.id": run_id, "train.rank": rank},
                           [OtlpPoint("train/loss", s / 2, step=s, time_unix_nano=s + 1) for s in steps])


def _send(sink: Any, *bodies: bytes) -> None:
    for body in bodies:
        sink.ingest("metrics", body, "application/x-protobuf", None)


@pytest.mark.parametrize("spooled", [True, False], ids=["spool", "no-spool"])
def test_held_points_go_out_in_order_with_no_more_traffic(tmp_path: Path, spooled: bool) -> None:
    # With a spool, delivery's periodic flush releases them; without, the sink's housekeeping asks for one.
    spool = {"spool_dir": tmp_path / "spool"} if spooled else {"spool_run_mb": 0}
    sink = make_sink(tmp_path, reorder_s=0.3, **spool)
    try:
        _send(sink, _body("a", range(5, 10)), _body("a", range(5)))
        # no flush, no more requests: the hold lets go on its own (else TensorBoard stays empty until `stop`)
        assert wait_until(lambda: len(scalars(tmp_path / "runs" / "a").get("train/loss", [])) >= 10)
        assert scalars(tmp_path / "runs" / "a")["train/loss"] == [(s, s / 2) for s in range(10)]
        assert sink.health()["steps_order_skipped"] == {} and sink.health()["reorder_held"] == 0
    finally:
        sink.stop()


def test_a_point_later_than_the_hold_is_still_skipped_and_counted_in_health(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, reorder_s=0.2)
    try:
        _send(sink, _body("a", range(5, 10)))
        # steps 5-9 are written (in TensorBoard's files) before steps 0-4 come
        assert wait_until(lambda: len(scalars(tmp_path / "runs" / "a").get("train/loss", [])) == 5)
        _send(sink, _body("a", range(5)))  # later than the hold: TensorBoard would hide 5-9 behind them
        assert sink.flush(10)
        assert scalars(tmp_path / "runs" / "a")["train/loss"] == [(s, s / 2) for s in range(5, 10)]
        assert sink.health()["steps_order_skipped"] == {"a": {"tensorboard": 5}}
    finally:
        sink.stop()


def test_a_sender_that_starts_over_inside_the_hold_is_skipped_in_tensorboard_not_written_twice(
        tmp_path: Path) -> None:
    # A job restarted from a checkpoint (a new process: another `service.instance.id`) sends steps 5-14 again
    # while its first attempt's steps 0-9 are still held. TensorBoard would show both values at steps 5-9: as
    # without the hold, it keeps the series as first logged and skips the second attempt's steps 5-8 (below the
    # series' step 9; a second value at that step is a step not going back), counted; JSONL writes every point.
    sink = make_sink(tmp_path, ("tensorboard", "jsonl"), reorder_s=3600)

    def attempt(instance: str, steps: Iterable[int], offset: float) -> bytes:
        return metrics_request({"train.run.id": "a", "train.rank": 0, "service.instance.id": instance},
                               [OtlpPoint("train/loss", s / 2 + offset, step=s, time_unix_nano=int(1000 * (1 + offset)) + s)
                                for s in steps])
    try:
        _send(sink, attempt("first", range(10), 0.0), attempt("second", range(5, 15), 100.0))
        assert sink.flush(10)
        skipped = sink.health()["steps_order_skipped"]
    finally:
        sink.stop()
    first, second = [(s, s / 2) for s in range(10)], [(s, s / 2 + 100.0) for s in range(5, 15)]
    assert scalars(tmp_path / "runs" / "a")["train/loss"] == first + second[4:]
    assert skipped == {"a": {"tensorboard": 4}}
    from otel_train.exporters.jsonl import read_jsonl

    (path,) = (tmp_path / "runs" / "a").glob("rank*.jsonl")
    assert [(r["step"], r["value"]) for r in read_jsonl(path) if r.get("tag") == "train/loss"] == first + second


def test_an_idle_run_is_closed_with_its_held_points_written(tmp_path: Path) -> None:
    sink = make_sink(tmp_path, reorder_s=3600, idle_s=0.3)
    try:
        _send(sink, _body("a", range(3, 6)), _body("a", range(3)))
        assert wait_until(lambda: sink.router.runs_closed == 1)
        assert scalars(tmp_path / "runs" / "a")["train/loss"] == [(s, s / 2) for s in range(6)]
        assert sink.health()["reorder_held"] == 0
    finally:
        sink.stop()


def test_a_sink_killed_while_holding_points_writes_them_after_a_restart(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    args = ("--exporters", "tensorboard", "--dir", str(runs))

    first = SinkProcess(tmp_path / "first", *args, "--reorder-s", "3600").wait_ready()
    try:
        first.post_metrics(_body("k", range(5, 10)))
        first.post_metrics(_body("k", range(5)))  # reordered: still in the hold when the sink dies
        # A request is answered once spooled; its rows reach the hold on the run's delivery thread just after.
        assert wait_until(lambda: first.get("/health")["reorder_held"] == 10, 60), first.get("/health")
        assert [r["reorder_held"] for r in first.get("/runs")["runs"]] == [10]
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
    assert scalars(runs / "k") == {}  # nothing was written: it was all held
    second = SinkProcess(tmp_path / "second", *args, "--reorder-s", "1").wait_ready()
    try:
        second.post_metrics(_body("k", [10]))  # the run comes back: its spool hands the held requests over again
    finally:
        assert second.terminate() == 0
    assert scalars(runs / "k")["train/loss"] == [(s, s / 2) for s in range(11)]


# -- the real sink, a real offline W&B run -----------------------------------------------------------------
def _wandb_points(path: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in the order the `.wandb` file holds them (a step written twice shows twice)."""
    from backendkit import wandb_records

    out = []
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            if key in items:
                out.append((items["_step"], items[key]))
    return out


def test_wandb_gets_reordered_requests_in_step_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from backendkit import isolated_wandb_env, wandb_files

    isolated_wandb_env(monkeypatch, tmp_path / "wandb")
    sink = make_sink(tmp_path, ("wandb",), spool_dir=tmp_path / "spool")
    try:
        # a collector's parallel consumers deliver steps 4-7 first, then 0-3, then 8-9
        _send(sink, _body("wb", range(4, 8)), _body("wb", range(4)), _body("wb", range(8, 10)))
    finally:
        sink.stop()
    import wandb

    wandb.teardown()  # W&B's service process writes the last records of the run file
    files = wandb_files(tmp_path / "runs", "wb", "wb")
    assert len(files) == 1
    assert _wandb_points(files[0], "train/loss") == [(s, s / 2) for s in range(10)]
