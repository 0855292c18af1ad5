"""A sink killed and restarted: exactly once for TensorBoard and W&B under the reorder hold.

The hold keeps the spool's cursor below the lowest held step of a whole run, so while the ranks of a run are
several steps apart a killed sink's spool hands over again rows of the faster rank that were already written;
the restarted hold skips them (`otel_train.sink.runs.released`). And a restarted sink delivers what its runs' spools
hold without waiting for the runs to send again (`otel_train.sink.runs.spool_replay`). First the record on its own,
then real `otel-train sink` processes killed with SIGKILL, read back from TensorBoard's event files in file order
and JSONL (lists: a step written twice shows twice)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import readback
from rotel_proc import SinkProcess, wait_until

from otel_train.backend import Window
from otel_train.sink.runs.feed import spool_folder
from otel_train.sink.runs.released import ReleasedSteps
from otel_train.sink.runs.reorder import ReorderHold
from otel_train.testing import InMemoryRowExporter, OtlpPoint, metrics_request
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo

R0, R1 = RunInfo("r", "r", rank=0, world_size=2), RunInfo("r", "r", rank=1, world_size=2)
GAP = 10  # rank 1 runs this many steps behind rank 0


def _state_only(folder: Path) -> bool:
    """Whether a run's spool folder keeps only the run's series state (once every backend holds everything)."""
    names = {p.name for p in folder.iterdir()}
    return "ledger.snapshot" in names and names <= {"ledger.snapshot", "ledger.journal"}


class _SkipsOlder(InMemoryRowExporter):
    stores_older_steps = False


def _rows(run: RunInfo, steps: Iterable[int], tag: str = "loss") -> list[MetricRow]:
    return [MetricRow(run, s, tag, tag, float(s), "gauge", 0) for s in steps]


def _got(inner: InMemoryRowExporter) -> list[tuple[int, str, int]]:
    return [(r.run.rank, r.tag, r.step) for r in inner.metrics]


# -- the record, on a fake clock -----------------------------------------------------------------------------
def _hold(path: Path, now: list[float]) -> tuple[ReorderHold, _SkipsOlder]:
    inner = _SkipsOlder()
    hold = ReorderHold(inner, 5.0, clock=lambda: now[0])
    hold.remember_released(path)
    return hold, inner


def test_a_restarted_hold_skips_what_its_backend_already_held(tmp_path: Path) -> None:
    now = [0.0]
    first, before = _hold(tmp_path / "released", now)
    first.export_window(Window(_rows(R0, range(10, 15))))
    now[0] = 3.0
    first.export_window(Window(_rows(R1, range(5)) + _rows(R0, [8], tag="acc")))
    now[0] = 5.0
    assert first.force_flush()  # rank 0's loss 10-14 and acc 8 are written; rank 1 is still held
    assert _got(before) == [(0, "acc", 8)] + [(0, "loss", s) for s in range(10, 15)]  # in step order
    # killed here: the spool's cursor is below rank 1's step 0, so it hands every window over again
    now[0] = 0.0
    second, after = _hold(tmp_path / "released", now)
    assert second.export_window(Window(_rows(R0, range(10, 15))))
    # acc 9 is above what acc held (8), though below rank 0's loss (14): written
    second.export_window(Window(_rows(R1, range(5)) + _rows(R0, [8, 9], tag="acc") + _rows(R0, [15])))
    now[0] = 10.0
    assert second.force_flush()
    assert _got(after) == [(1, "loss", s) for s in range(5)] + [(0, "acc", 9), (0, "loss", 15)]
    assert second.redelivered == 6 and after.step_order.counts() == {"backwards": 0, "dropped": 0}


def test_a_step_is_recorded_only_once_the_backend_holds_it(tmp_path: Path) -> None:
    path = tmp_path / "released"
    steps = ReleasedSteps(path)
    steps.note(_rows(R0, range(5)))
    assert not path.exists()  # noted at the write, recorded after the backend's flush
    steps.save(durable=2)  # a backend whose store lags (W&B): only what it holds is claimed
    kept, skipped = ReleasedSteps(path).drop_redelivered(_rows(R0, range(5)))
    assert [r.step for r in kept] == [3, 4] and skipped == 3
    steps.save(durable=None)
    kept, skipped = ReleasedSteps(path).drop_redelivered(_rows(R0, range(6)))
    assert [r.step for r in kept] == [5] and skipped == 5


def test_a_torn_record_costs_a_repeat_never_a_loss_and_a_restart_forgets(tmp_path: Path) -> None:
    path = tmp_path / "released"
    steps = ReleasedSteps(path)
    steps.note(_rows(R0, [3]) + _rows(R1, [7]))
    steps.save(None)
    steps.note(_rows(R0, [4]))
    steps.save(None)
    path.write_bytes(path.read_bytes()[:-5])  # the last record torn by a kill
    reread = ReleasedSteps(path)
    assert [r.step for r in reread.drop_redelivered(_rows(R0, range(6)))[0]] == [4, 5]
    reread.forget("r", 1)  # rank 1 restarted (a declared resume): its steps start over
    assert ReleasedSteps(path).drop_redelivered(_rows(R1, [0, 7]))[1] == 0


def test_the_record_stays_small_however_long_the_run(tmp_path: Path) -> None:
    path = tmp_path / "released"
    steps = ReleasedSteps(path)
    for step in range(30_000):  # ~1.6 MB of records if only appended
        steps.note(_rows(R0, [step], tag="loss") + _rows(R0, [step], tag="lr"))
        steps.save(None)
    assert path.stat().st_size <= 1 << 20  # rewritten whole (two series) once it passes 1 MiB
    assert ReleasedSteps(path).drop_redelivered(_rows(R0, [29_999, 30_000]))[1] == 1


def _append(path: Path, steps: ReleasedSteps, rows: list[MetricRow]) -> None:
    """What the hold and its backend do for one write: check, report the append (the intent), append."""
    steps.check_before_write(rows)
    steps.intend([(str(path), path.stat().st_size if path.exists() else 0)])
    with open(path, "a") as f:
        f.writelines(f"{r.run.rank} {r.tag} {r.step}\n" for r in rows)
    steps.note(rows)


def test_writes_not_recorded_before_a_kill_are_cut_back_and_recorded_ones_are_not(tmp_path: Path) -> None:
    path, out = tmp_path / "released", tmp_path / "events"
    steps = ReleasedSteps(path)
    _append(out, steps, _rows(R0, range(3)))
    steps.save(None)  # recorded: generation 1 complete
    _append(out, steps, _rows(R0, range(3, 5)))
    _append(out, steps, _rows(R1, range(2)))  # two writes, one generation: the sizes before the first
    # killed here, before the save: a restart cuts both writes back out; the spool hands their rows over again
    unrecorded = out.stat().st_size - 3 * len("0 loss 0\n")
    again = ReleasedSteps(path)
    assert again.cut_unrecorded_appends() == unrecorded
    assert out.read_text().splitlines() == [f"0 loss {s}" for s in range(3)]
    kept, skipped = again.drop_redelivered(_rows(R0, range(5)) + _rows(R1, range(2)))
    assert [(r.run.rank, r.step) for r in kept] == [(0, 3), (0, 4), (1, 0), (1, 1)] and skipped == 3
    assert ReleasedSteps(path).cut_unrecorded_appends() == 0  # applied once

    _append(out, again, kept)  # the restarted sink writes them, records them, and is killed later
    again.save(None)
    assert ReleasedSteps(path).cut_unrecorded_appends() == 0  # recorded: nothing is cut
    assert len(out.read_text().splitlines()) == 7


def test_a_write_holding_a_row_the_record_already_has_is_never_cut_back(tmp_path: Path) -> None:
    """A second value of a recorded (series, step) is written after it (sent far apart): cut back, the restarted
    hold would skip it as a redelivery, a loss; so that write keeps the older rule (it may repeat, never lost)."""
    path, out = tmp_path / "released", tmp_path / "events"
    steps = ReleasedSteps(path)
    _append(out, steps, _rows(R0, range(3)))
    steps.save(None)
    _append(out, steps, _rows(R0, [2, 3]))  # step 2 of `loss` again
    assert ReleasedSteps(path).cut_unrecorded_appends() == 0
    assert len(out.read_text().splitlines()) == 5
    steps.save(None)
    _append(out, steps, _rows(R0, [4]))  # the next generation is cut back as usual
    assert ReleasedSteps(path).cut_unrecorded_appends() == len("0 loss 4\n")


def test_a_torn_intent_or_completion_never_loses_a_row(tmp_path: Path) -> None:
    path, out = tmp_path / "released", tmp_path / "events"
    steps = ReleasedSteps(path)
    _append(out, steps, _rows(R0, range(3)))
    intent = tmp_path / "appending.released"
    whole = intent.read_bytes()
    intent.write_bytes(whole[:-2])  # torn: nothing is cut, as before intents (the rows may repeat)
    assert ReleasedSteps(path).cut_unrecorded_appends() == 0 and len(out.read_text().splitlines()) == 3
    intent.write_bytes(whole)
    steps.save(None)
    _append(out, steps, _rows(R0, [3]))
    steps.save(None)
    path.write_bytes(path.read_bytes()[:-4])  # the line recording step 3 torn: its mark and completion are gone
    again = ReleasedSteps(path)
    assert again.cut_unrecorded_appends() == len("0 loss 3\n")  # so step 3 goes too, and is written again
    kept, _ = again.drop_redelivered(_rows(R0, range(4)))
    assert [r.step for r in kept] == [3]


# -- real sink processes -------------------------------------------------------------------------------------
def _body(run_id: str, rank: int, steps: Iterable[int]) -> bytes:
    return metrics_request({"train.run.id": run_id, "train.rank": rank, "train.world_size": 2},
                           [OtlpPoint("train/loss", rank * 1000 + s, step=s, time_unix_nano=s + 1) for s in steps])


def _stream(sink: SinkProcess, run_id: str, ticks: range) -> int:
    """Rank 0 sends step t and rank 1 step t - GAP each tick (one request each); returns points sent."""
    sent = 0
    for t in ticks:
        sink.post_metrics(_body(run_id, 0, [t]))
        sent += 1
        if t >= GAP:
            sink.post_metrics(_body(run_id, 1, [t - GAP]))
            sent += 1
        time.sleep(0.03)
    return sent


def _tb_points(folder: Path) -> list[tuple[int, float]]:
    """(step, value) of `train/loss` in the order the event files hold them: a step written twice shows twice."""
    return [(p.step, p.value) for p in readback.tensorboard(folder) if p.name == "train/loss"]


def _jsonl_points(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [(r["step"], r["value"]) for r in lines if r.get("type") == "metric" and r["tag"] == "train/loss"]


def _expected(rank: int, last: int) -> list[tuple[int, float]]:
    return [(s, float(rank * 1000 + s)) for s in range(last + 1)]


def _unacknowledged_rows(spool: Path, backend: str) -> int:
    """Rows of the spooled windows past `backend`'s cursor (what a restart hands it again)."""
    from otel_train.ship.framing import decode_window
    from otel_train.ship.spool import Spool

    s = Spool(spool)
    return sum(len(decode_window(p).metrics) for _, _, p in s.read(s.cursor(backend)))


def _kill(sink: SinkProcess) -> None:
    sink.proc.send_signal(signal.SIGKILL)
    sink.proc.wait(10)


def test_ranks_steps_apart_killed_while_holding_every_step_once(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    args = ("--exporters", "tensorboard", "--dir", str(runs), "--reorder-s", "1")
    first = SinkProcess(tmp_path / "first", *args).wait_ready()
    try:
        sent, t = 0, 0
        # until the hold has released rank 0 past rank 1 (TensorBoard has 20 of its steps), then a few more
        while t < 2 * GAP or len(_tb_points(runs / "k" / "rank0")) < 2 * GAP:
            sent += _stream(first, "k", range(t, t + 5))
            t += 5
            assert t < 1000, "the hold released nothing"
        sent += _stream(first, "k", range(t, t + 5))
        t += 5
        assert first.get("/health")["reorder_held"] > 0
    finally:
        _kill(first)
    written = len(_tb_points(runs / "k" / "rank0")) + len(_tb_points(runs / "k" / "rank1"))
    unacked = _unacknowledged_rows(runs / ".sink-spool" / spool_folder("k"), "tensorboard (sink)")
    # rows the spool hands over again although TensorBoard has them: the faster rank's, behind the cursor
    again = unacked - (sent - written)
    assert again > 0, (sent, written, unacked)

    second = SinkProcess(tmp_path / "second", *args).wait_ready()
    try:
        after = _stream(second, "k", range(t, 70 + t))
        for step in range(60 + t, 70 + t):  # rank 1 catches up
            second.post_metrics(_body("k", 1, [step]))
            after += 1
        health = second.settled_health()
    finally:
        assert second.terminate() == 0
    assert _tb_points(runs / "k" / "rank0") == _expected(0, 69 + t)
    assert _tb_points(runs / "k" / "rank1") == _expected(1, 69 + t)
    # /health adds up: what came in, what the spool handed over again and was skipped, no step-order skip
    assert health["points"] == after
    assert health["redelivered_skipped"] == {"k": {"tensorboard": again}}
    assert health["steps_order_skipped"] == {} and health["errors"] == 0
    assert health["spool_replay"] == {"runs_found": 1, "runs_replayed": 1, "runs_left": 0, "done": True}


def test_a_restarted_sink_delivers_its_spools_with_no_more_traffic(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    args = ("--exporters", "tensorboard,jsonl", "--dir", str(runs), "--reorder-s", "1")
    first = SinkProcess(tmp_path / "first", *args).wait_ready()
    try:
        _stream(first, "k", range(40))  # the job ends with the sink down: nobody sends again
        first.post_metrics(_body("done", 0, range(5)))  # a second run, all of it held when the sink dies
        # every request handed to the backends (JSONL records each write right after it: a kill between the two
        # writes that window twice, a limit of its own that this test is not about)
        assert wait_until(lambda: all(r["queued"] == 0 for r in first.get("/runs")["runs"]))
        assert first.get("/health")["reorder_held"] > 0
    finally:
        _kill(first)
    assert _tb_points(runs / "done" / "rank0") == []

    second = SinkProcess(tmp_path / "second", *args).wait_ready()
    try:
        complete = {("k", 0): _expected(0, 39), ("k", 1): _expected(1, 39 - GAP), ("done", 0): _expected(0, 4)}
        # no request reaches the restarted sink: it delivers the spools on its own, and closes both runs
        assert wait_until(lambda: second.get("/health")["runs_closed"] == 2)
        for (run_id, rank), points in complete.items():
            assert _tb_points(runs / run_id / f"rank{rank}") == points
            assert _jsonl_points(runs / run_id / f"rank{rank}.jsonl") == points
        health = second.get("/health")
        assert health["spool_replay"] == {"runs_found": 2, "runs_replayed": 2, "runs_left": 0, "done": True}
        assert health["points"] == 0 and health["runs_open"] == 0 and health["steps_order_skipped"] == {}
        # every backend holds everything: the spool keeps only the run's series state
        assert _state_only(runs / ".sink-spool" / spool_folder("k"))
    finally:
        assert second.terminate() == 0
    assert _tb_points(runs / "k" / "rank0") == _expected(0, 39)


# -- a sink killed between a backend's write and its record -----------------------------------------------------
def _stream_until_killed(sink: SinkProcess, run_id: str) -> list[tuple[int, int]]:
    """As `_stream`, until the sink dies; the (rank, step) of every request sent, the last one perhaps unanswered."""
    sent: list[tuple[int, int]] = []
    for t in range(1000):
        for rank, step in ((0, t), (1, t - GAP)):
            if step >= 0:
                sent.append((rank, step))
                try:
                    sink.post_metrics(_body(run_id, rank, [step]))
                except OSError:  # refused, reset: killed
                    return sent
        time.sleep(0.03)
    raise AssertionError("the sink was never killed")


def _spooled(spool: Path) -> list[tuple[int, int]]:
    """(rank, step) of every point a sink spooled (the requests it took), in spool order."""
    from otel_train.ship.framing import decode_window
    from otel_train.ship.spool import Spool

    return [(r.run.rank, r.step) for _, _, p in Spool(spool).read(0) for r in decode_window(p).metrics]


@pytest.mark.parametrize("backend", ["tensorboard", "jsonl"])
def test_a_sink_killed_between_a_write_and_its_record_writes_each_step_once(tmp_path: Path, backend: str) -> None:
    """The test-only `OTEL_TRAIN_TEST_KILL_AFTER_WRITE` makes the first sink SIGKILL itself right after the backend
    was handed rows at step 30 or later, before they are recorded: TensorBoard (behind the reorder hold, ranks
    `GAP` steps apart: `ReleasedSteps`) and JSONL (`Spool.advance`). The restarted sink cuts what that write appended
    back out (the intent record written before it) and writes it again from the spool: every step once."""
    from otel_train._internal.faults import KILL_AFTER_WRITE

    runs = tmp_path / "runs"
    env = {KILL_AFTER_WRITE: f"{backend}@30@{tmp_path / 'killed'}"}  # once: the restarted sink is not killed
    args = ("--exporters", backend, "--dir", str(runs), "--reorder-s", "1")
    first = SinkProcess(tmp_path / "first", *args, env=env).wait_ready()
    try:
        sent = _stream_until_killed(first, "g")
    finally:
        code = first.proc.wait(30)
    assert code == -signal.SIGKILL and (tmp_path / "killed").exists()
    spooled = _spooled(runs / ".sink-spool" / spool_folder("g"))
    assert spooled == sent[:len(spooled)] and len(spooled) >= len(sent) - 1  # all but an unanswered last one
    nxt = [max(s for r, s in sent if r == rank) + 1 for rank in (0, 1)]
    last = nxt[0] + 20

    second = SinkProcess(tmp_path / "second", *args, env=env).wait_ready()
    try:
        for rank, step in sent[len(spooled):]:  # a collector retries what the killed sink did not take
            second.post_metrics(_body("g", rank, [step]))
        while nxt[1] <= last:  # on as before, then rank 1 catches up
            for rank in (0, 1):
                if nxt[rank] <= last:
                    second.post_metrics(_body("g", rank, [nxt[rank]]))
                    nxt[rank] += 1
        health = second.settled_health()
    finally:
        assert second.terminate() == 0
    for rank in (0, 1):
        got = (_tb_points(runs / "g" / f"rank{rank}") if backend == "tensorboard"
               else _jsonl_points(runs / "g" / f"rank{rank}.jsonl"))
        assert got == _expected(rank, last), rank
    assert health["steps_order_skipped"] == {} and health["errors"] == 0


# -- the same with a real offline W&B run ----------------------------------------------------------------------
def _wandb_points(files: list[Path]) -> list[tuple[int, float]]:
    """(step, value) of `train/loss` in the order W&B's run files hold them (files in the order they were
    created: a restarted sink resumes the run in a new file); a step written twice shows twice."""
    from backendkit import wandb_records

    out = []
    for path in files:
        for rec in wandb_records(path):
            if rec.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                if "train/loss" in items:
                    out.append((int(items["_step"]), float(items["train/loss"])))
    return out


def test_wandb_ranks_steps_apart_killed_while_holding_every_step_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from backendkit import isolated_wandb_env, wandb_files

    isolated_wandb_env(monkeypatch, tmp_path / "wandb")
    runs = tmp_path / "runs"
    args = ("--exporters", "wandb", "--dir", str(runs), "--reorder-s", "1")
    first = SinkProcess(tmp_path / "first", *args).wait_ready()
    try:
        _stream(first, "w", range(40))
        assert wait_until(lambda: first.get("/health")["reorder_held"] < 40)  # W&B has taken some (its runs started)
        _stream(first, "w", range(40, 50))
        assert first.get("/health")["reorder_held"] > 0
    finally:
        _kill(first)
    second = SinkProcess(tmp_path / "second", *args).wait_ready()
    try:
        _stream(second, "w", range(50, 60))
        for step in range(60 - GAP, 60):  # rank 1 catches up
            second.post_metrics(_body("w", 1, [step]))
        health = second.settled_health()
    finally:
        assert second.terminate(60) == 0
    assert _wandb_points(wandb_files(runs, "w", "w")) == _expected(0, 59)
    assert _wandb_points(wandb_files(runs, "w", "w-rank1")) == _expected(1, 59)
    assert health["steps_order_skipped"] == {} and health["errors"] == 0


# -- the replay at start, in process: which spools, how many runs open at once ------------------------------
def test_the_replay_delivers_each_unfinished_spool_once_within_max_open_runs(tmp_path: Path) -> None:
    import threading

    from otel_train.ship.framing import encode_window
    from otel_train.ship.spool import Spool
    from otel_train.sink.runs.router import Router
    from otel_train.sink.runs.spool_replay import SpoolReplay, unfinished_spools

    spool_dir = tmp_path / "spool"
    for run_id in ("a", "b", "c", "done"):
        spool = Spool(spool_dir / spool_folder(run_id))
        for seq in (1, 2):
            rows = _rows(RunInfo(run_id, run_id), [seq])
            spool.append(seq, seq, encode_window(RunInfo("", ""), (), rows, (), ())[0])
        spool.close()
        if run_id == "done":  # every backend acknowledged it: nothing to replay
            spool.acknowledge("memory (sink)", 2)
    (spool_dir / "not-a-run").mkdir()
    assert sorted(run_id for run_id, _ in unfinished_spools(spool_dir)) == ["a", "b", "c"]

    made: list[InMemoryRowExporter] = []
    open_now = [0, 0]  # backends open now, most at once
    lock = threading.Lock()

    class _Counted(InMemoryRowExporter):
        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            with lock:
                open_now[0] -= 1
            super().shutdown(timeout_millis)

    def make() -> list[Any]:
        with lock:
            open_now[0] += 1
            open_now[1] = max(open_now)
        made.append(_Counted())
        return [made[-1]]

    router = Router(make, spool_dir=spool_dir, max_open_runs=1)
    replay = SpoolReplay(router, spool_dir, threading.Event(), workers=2).start()
    try:
        assert replay.wait(60)
        assert replay.stats() == {"runs_found": 3, "runs_replayed": 3, "runs_left": 0, "done": True}
        got = sorted((r.run.run_id, r.step) for e in made for r in e.metrics)
        assert got == [(run_id, s) for run_id in ("a", "b", "c") for s in (1, 2)]
        assert open_now[1] == 1 and router.runs_open == 0  # one run at a time; each closed once delivered
        assert sorted(p.name for p in spool_dir.iterdir()) == sorted([*map(spool_folder, "abc"), spool_folder("done"),
                                                                      "not-a-run"])
        for run_id in "abc":  # delivered: only the run's series state is left
            assert _state_only(spool_dir / spool_folder(run_id))
    finally:
        router.close(10)


def test_health_never_says_the_replay_is_done_before_it_began(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that stops the sink once `/health` says the spools are delivered (a launcher, a test) must not
    be told so in the moment between the receivers answering and the replay's start: it stopped the sink
    with the spool not written."""
    from sinkkit import make_sink

    from otel_train.ship.framing import encode_window
    from otel_train.ship.spool import Spool
    from otel_train.sink.receive import http_server

    runs = tmp_path / "runs"
    spool = Spool(runs / ".sink-spool" / spool_folder("left"))
    spool.append(1, 0, encode_window(RunInfo("", ""), (), _rows(RunInfo("left", "left"), [0]), (), ())[0])
    spool.close()
    first_answer: list[dict[str, Any]] = []
    real_start = http_server.start_http

    def start_and_ask(sink: Any, *args: Any) -> Any:
        started = real_start(sink, *args)
        first_answer.append(sink.health()["spool_replay"])  # what the first GET /health can get
        return started

    monkeypatch.setattr(http_server, "start_http", start_and_ask)
    sink = make_sink(tmp_path, ("jsonl",), spool_dir=runs / ".sink-spool")
    try:
        assert first_answer and first_answer[0]["done"] is False
        assert sink.spool_replay.wait(60)
        assert sink.health()["spool_replay"] == {"runs_found": 1, "runs_replayed": 1, "runs_left": 0, "done": True}
    finally:
        sink.stop()
    from otel_train.exporters.jsonl import read_jsonl

    assert [(r["step"], r["value"]) for r in read_jsonl(runs / "left" / "rank0.jsonl") if r["type"] == "metric"] \
        == [(0, 0.0)]
