"""Points are ordered by their own times, per sender: a late cumulative point is not a
restart, and two processes on one series are told apart (and reported) instead of read as restarts."""

from __future__ import annotations

from typing import Any

from otel_train.sink.decode.requests import DecodeCache, decode_metrics, parse_metrics
from otel_train.sink.runs.router import Router
from otel_train.testing import InMemoryRowExporter, OtlpPoint, metrics_request

_START = 1_000


def _run(bodies: list[bytes]) -> tuple[InMemoryRowExporter, Router]:
    mem = InMemoryRowExporter()
    router = Router(lambda: [mem])
    cache = DecodeCache()
    for body in bodies:
        router.ingest(decode_metrics(parse_metrics(body), cache))
    router.close(10)
    return mem, router


def _series(mem: InMemoryRowExporter, name: str) -> list[tuple[int, float]]:
    return [(r.step, r.value) for r in mem.metrics if r.name == name]


def _resource(instance: str = "p1", **extra: Any) -> dict[str, Any]:
    return {"train.run.id": "r", "service.instance.id": instance, **extra}


def _counter(value: float, t: int, instance: str = "p1", start: int = _START, step: int = 0) -> bytes:
    return metrics_request(_resource(instance), [OtlpPoint("tokens", value, step=step, kind="sum", cumulative=True,
                                                           time_unix_nano=t, start_time_unix_nano=start)])


def test_a_late_cumulative_point_is_not_a_restart() -> None:
    mem, router = _run([_counter(5, 1), _counter(12, 3), _counter(8, 2)])  # 8@t2 arrives last
    assert _series(mem, "tokens") == [(0, 5.0), (0, 12.0)]
    assert router.collisions() == {}


def test_a_point_of_an_earlier_process_start_is_late_and_a_later_start_is_a_restart() -> None:
    mem, _ = _run([_counter(5, 10), _counter(3, 20, start=_START + 5), _counter(7, 12)])
    assert _series(mem, "tokens") == [(0, 5.0), (0, 8.0)]  # restart adds 3; 7 of the old start is late


def test_a_late_cumulative_histogram_point_is_not_a_restart() -> None:
    def hist(count: int, total: float, t: int) -> bytes:
        return metrics_request(_resource(), [OtlpPoint("grad", kind="histogram", step=0, cumulative=True,
                                                       time_unix_nano=t, start_time_unix_nano=_START,
                                                       histogram=(count, total, (1.0,), (count, 0)))])

    mem, _ = _run([hist(5, 5.0, 1), hist(9, 9.0, 3), hist(7, 7.0, 2)])
    assert _series(mem, "grad/count") == [(0, 5.0), (0, 4.0)]  # 9 in all, not 9 + 7
    assert _series(mem, "grad/sum") == [(0, 5.0), (0, 4.0)]


def test_a_late_cumulative_up_down_value_does_not_overwrite_a_newer_one() -> None:
    def updown(value: float, t: int) -> bytes:
        return metrics_request(_resource(), [OtlpPoint("queue", value, step=0, kind="sum", cumulative=True,
                                                        monotonic=False, time_unix_nano=t,
                                                        start_time_unix_nano=_START)])

    mem, _ = _run([updown(5, 2), updown(3, 1)])
    assert _series(mem, "queue") == [(0, 5.0)]


def test_two_senders_on_one_series_add_up_and_are_reported() -> None:
    """Two processes with one run id and no rank, both CUMULATIVE: each sender's increases count once
    (before: every switch between them read as a restart), and /health names the collision."""
    bodies = []
    for i in range(1, 6):  # each process counts 1 per collection, interleaved
        bodies.append(_counter(float(i), i, "proc-a"))
        bodies.append(_counter(float(i), i, "proc-b"))
    mem, router = _run(bodies)
    tokens = _series(mem, "tokens")
    assert tokens[-1] == (0, 10.0) and len(tokens) == 10
    assert router.collisions() == {"r": 8}  # b's first point may be a restart; from a's second on, a collision
    assert router.summary()["runs"][0]["collided_series"] == ["tokens"]


def test_a_process_that_takes_over_a_series_is_a_restart_not_a_collision() -> None:
    """A cumulative process sends, exits; a new one (another `service.instance.id`, counting from 0 again) goes
    on: its values add to the total, and nothing is reported as two senders at once (before: every point of the
    new process was counted as a collision, and the sink warned of two senders)."""
    bodies = [_counter(float(i), i, "proc-a") for i in range(1, 4)]
    bodies += [_counter(float(i), 10 + i, "proc-b", start=_START + 10) for i in range(1, 4)]
    mem, router = _run(bodies)
    assert _series(mem, "tokens") == [(0, 1.0), (0, 2.0), (0, 3.0), (0, 4.0), (0, 5.0), (0, 6.0)]
    assert router.collisions() == {}
    assert router.summary()["runs"][0]["collided_series"] == []


def test_a_nan_increment_is_counted_and_skipped_not_summed() -> None:
    def delta(value: float, step: int) -> bytes:
        return metrics_request(_resource(), [OtlpPoint("tokens", value, step=step, kind="sum", time_unix_nano=step)])

    mem, router = _run([delta(1.0, 0), delta(float("nan"), 1), delta(2.0, 2)])
    assert _series(mem, "tokens") == [(0, 1.0), (2, 3.0)]
    assert router.summary()["runs"][0]["nan_points"] == 1


def _delta(step: int, value: float = 1.0, rank: int = 0) -> bytes:
    return metrics_request(_resource(**{"train.rank": rank}), [OtlpPoint("tokens", value, step=step, kind="sum",
                                                                         time_unix_nano=step + 1)])


def test_a_late_delta_step_is_written_at_its_own_step_and_the_series_ends_at_the_true_total() -> None:
    # Parallel collector consumers reorder requests: step 10's increase arrives after step 11's, and
    # steps 20 and 21 after 22. Each point is written at its own step with the total as of that step, and the
    # series' highest step, written short, is written again with the whole total.
    order = [*range(10), 11, 10, 12, 13, 14, 15, 16, 17, 18, 19, 22, 20, 21, 23]
    mem, router = _run([_delta(s) for s in order])
    assert _series(mem, "tokens") == [(s, s + 1.0) for s in range(10)] + [
        (11, 11.0), (10, 11.0), (11, 12.0),  # step 11 was written before step 10's increase came: again, whole
        *[(s, s + 1.0) for s in range(12, 20)],
        (22, 21.0), (20, 21.0), (22, 22.0), (21, 22.0), (22, 23.0),  # 22 whole again after each late step
        (23, 24.0)]
    # Counted per run (shown in /health `late_delta_points`): 3 late points; the rows they left short.
    assert router.late_deltas() == {"r": {"points": 3, "stale_totals": 3}}


def test_late_delta_steps_of_two_ranks_are_kept_apart() -> None:
    mem, router = _run([_delta(0, rank=0), _delta(1, rank=1), _delta(0, rank=1), _delta(1, rank=0)])
    got = [(r.run.rank, r.step, r.value) for r in mem.metrics if r.name == "tokens"]
    assert got == [(0, 0, 1.0), (1, 1, 1.0), (1, 0, 1.0), (1, 1, 2.0), (0, 1, 2.0)]
    assert router.late_deltas() == {"r": {"points": 1, "stale_totals": 1}}


def _gauge(name: str, value: float, t: int, step: int | None) -> bytes:
    return metrics_request(_resource(), [OtlpPoint(name, value, step=step, time_unix_nano=t)])


def test_a_late_gauge_point_does_not_overwrite_a_newer_value_of_its_step() -> None:
    """A gauge set again at one step by three exports (t1, t2, t4); the t3 export arrives last (a collector's
    retry): the step keeps t4's value, and the late point is counted."""
    bodies = [_gauge("lr", 0.1, 1, 0), _gauge("lr", 0.2, 2, 0), _gauge("lr", 0.4, 4, 0), _gauge("lr", 0.3, 3, 0)]
    mem, router = _run(bodies)
    assert _series(mem, "lr") == [(0, 0.1), (0, 0.2), (0, 0.4)]
    assert router.summary()["runs"][0]["late_points"] == 1


def test_a_late_gauge_point_at_a_step_without_a_value_is_written() -> None:
    """Reordered requests of a gauge logged once per step: the late one is the only value of its step."""
    mem, router = _run([_gauge("loss", 1.0, 1, 1), _gauge("loss", 3.0, 3, 3), _gauge("loss", 2.0, 2, 2)])
    assert _series(mem, "loss") == [(1, 1.0), (3, 3.0), (2, 2.0)]
    assert router.summary()["runs"][0]["late_points"] == 0


def test_a_late_stepless_gauge_point_is_not_written_as_the_current_value() -> None:
    """A gauge without `train.step` takes the run's current step: a late (older) value would show at the newest
    step as if it were current."""
    def export(k: int, mem_value: float) -> bytes:
        return metrics_request(_resource(), [OtlpPoint("loss", float(k), step=k, time_unix_nano=k),
                                             OtlpPoint("gpu_mem", mem_value, time_unix_nano=k)])

    mem, router = _run([export(0, 100.0), export(1, 101.0), export(3, 103.0), export(2, 102.0)])
    assert _series(mem, "gpu_mem") == [(0, 100.0), (1, 101.0), (3, 103.0)]
    assert router.summary()["runs"][0]["late_points"] == 1


def test_the_newest_gauge_time_is_kept_with_the_runs_state_and_undone_with_a_refused_request() -> None:
    """What a restarted sink knows: a late point after the restart is still late (the journal's gauge rows carry
    their times; a snapshot its `m` table). A request that could not be made durable (rolled back) leaves the
    newest time as it was."""
    from otel_train.sink.runs.temporality import SeriesLedger
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo("r", "r")

    def lr(value: float, t: int) -> list[MetricRow]:
        return [MetricRow(run, 0, "lr", "lr", value, "gauge", t)]

    ledger = SeriesLedger(persistent=True)
    ledger.begin()
    ledger.gauges(lr(0.4, 40), lambda r: None)
    journal = [ledger.changes()]
    ledger.commit()
    for restored in (SeriesLedger(persistent=True), SeriesLedger(persistent=True)):
        if not journal[1:]:  # from the journal
            restored.load(None, journal)
            journal.append([])
        else:  # from a snapshot
            restored.load(ledger.dump(), [])
        written: list[MetricRow] = []
        restored.gauges(lr(0.3, 30), written.append)  # older than the value held: late
        assert (written, restored.late_points) == ([], 1)

    ledger.begin()
    ledger.gauges(lr(0.9, 90), lambda r: None)
    ledger.rollback()  # refused: as if it never came
    written = []
    ledger.gauges(lr(0.5, 50), written.append)  # newer than 40: taken
    assert [r.value for r in written] == [0.5]
