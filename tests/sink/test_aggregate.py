"""`Aggregator` with an injected clock: completion by ranks, by timeout, at drain; late rows."""

from __future__ import annotations

from otel_train.sink.runs.aggregate import Aggregator
from otel_train.vocab.rows import MetricRow, series_tag
from otel_train.vocab.run_identity import RunInfo


def _row(rank: int, step: int, value: float, world: int = 2, split: str | None = None) -> MetricRow:
    attrs = {"split": split} if split else {}
    tag = series_tag("loss", attrs)
    return MetricRow(RunInfo("r", "r", rank=rank, world_size=world), step, "loss", tag, value, "gauge", step, attrs)


def test_complete_timeout_drain_and_late() -> None:
    now = [0.0]
    agg = Aggregator(("mean", "max"), timeout_s=5.0, clock=lambda: now[0])
    assert agg.add([_row(0, 0, 1.0), _row(0, 1, 10.0)]) == []
    out = agg.add([_row(1, 0, 3.0)])  # step 0 complete; step 1 still waits for rank 1
    assert [(r.step, r.tag, r.value, r.run.rank) for r in out] == [(0, "loss/mean", 2.0, 0), (0, "loss/max", 3.0, 0)]
    assert agg.add([_row(1, 0, 99.0)]) == [] and agg.late_rows == 1  # already aggregated
    now[0] = 4.9
    assert agg.expire() == []
    now[0] = 5.0
    assert [(r.step, r.value) for r in agg.expire()] == [(1, 10.0), (1, 10.0)]  # over the ranks that reported
    agg.add([_row(0, 2, 4.0, split="val")])
    drained = agg.drain()
    assert [(r.step, r.tag) for r in drained] == [(2, "loss/mean{split=val}"), (2, "loss/max{split=val}")]
    assert agg.pending_steps == 0


def test_single_rank_runs_get_no_aggregates() -> None:
    agg = Aggregator(("mean",), timeout_s=1.0)
    assert agg.add([_row(0, 0, 1.0, world=1)]) == [] and agg.drain() == []
