"""The hang watchdog's rule and records, driven by fake looks and clocks (no sleeping for the decisions)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from otel_train.capture.instrument import SpanBuffer, SpanScope
from otel_train.capture.step import step
from otel_train.hangs.hang_rule import HangRule, Work
from otel_train.hangs.stacks import ThreadStack, short_path, thread_stacks
from otel_train.hangs.watchdog import HangWatchdog, Look, TrainingThreadView


class FakeView:
    """Looks handed to the watchdog one by one."""

    def __init__(self) -> None:
        self.next: Look = Look(None, [], [], [])
        self.thread_id = threading.current_thread().native_id  # the training thread

    def look(self) -> Look:
        return self.next


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_stacks(position: tuple[int, int] = (1, 2), moves: bool = False) -> Any:
    calls = [0]

    def stacks(skip: int | None) -> list[ThreadStack]:
        calls[0] += 1
        pos = (position[0], position[1] + calls[0]) if moves else position
        return [ThreadStack("MainThread", 11, True, ["train.py:41 in load_batch", "train.py:80 in main"],
                            "train.py:41 in load_batch", pos),
                ThreadStack("loader", 12, False, ["queue.py:180 in get"], None, (3, 4))]
    return stacks


def make(tmp_path: Path, floor_s: float = 60.0, factor: float = 10.0, moves: bool = False) -> tuple[HangWatchdog, FakeView, Clock]:
    view, clock = FakeView(), Clock()
    dog = HangWatchdog(floor_s, factor, tmp_path / "hang" / "rank1.json",
                       {"rank": 1, "world_size": 4, "run_id": "r", "host": "h", "pid": 7},
                       view=view, stacks=fake_stacks(moves=moves), wall=clock)  # type: ignore[arg-type]
    return dog, view, clock


def read(tmp_path: Path) -> dict[str, Any]:
    content: dict[str, Any] = json.loads((tmp_path / "hang" / "rank1.json").read_text())
    return content


def finish_steps(dog: HangWatchdog, view: FakeView, durations: list[float]) -> None:
    """Steps of `durations` seen to finish, each with a `data` span of half its time."""
    for k, d in enumerate(durations):
        view.next = Look(k, [], [Work("step", d, 1000 + k), Work("span data", d / 2, 2000 + k)], [])
        dog.check()


def test_a_kind_never_seen_to_finish_waits_factor_times_the_floor() -> None:
    rule = HangRule(floor_s=60.0, factor=10.0)
    assert rule.limit_s("step") == 600.0
    for d in (1.0, 2.0, 30.0):
        rule.add("step", d)
    assert rule.usual_s("step") == 2.0
    assert rule.limit_s("step") == 60.0  # max(10 × 2 s, 60 s)
    for d in (9.0, 9.0, 9.0):
        rule.add("step", d)
    assert rule.limit_s("step") == 90.0  # median 9 s


def test_work_is_stuck_only_when_the_step_and_its_innermost_span_both_passed_their_limits() -> None:
    rule = HangRule(floor_s=1.0, factor=10.0)
    for _ in range(5):
        rule.add("step", 0.2)
        rule.add("span backward", 0.1)
        rule.add("span validation", 2.0)
    assert rule.stuck([Work("step", 2.5, 1), Work("span backward", 2.4, 2)])
    assert not rule.stuck([Work("step", 2.5, 1), Work("span validation", 2.4, 2)])  # a slow validation: usual
    assert rule.stuck([Work("step", 25.0, 1), Work("span validation", 24.0, 2)])
    assert not rule.stuck([])


def test_a_stuck_step_is_recorded_in_the_file_and_the_log_then_again_as_the_wait_doubles_then_resumed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dog, view, _ = make(tmp_path)
    finish_steps(dog, view, [0.5] * 10)
    assert read(tmp_path)["state"] == "running"
    spans = ["train", "data"]
    with caplog.at_level(logging.WARNING, logger="otel_train.hang"):
        view.next = Look(50, [Work("step", 59.0, 7), Work("span data", 58.0, 8)], [], spans)
        dog.check()
        assert read(tmp_path)["state"] == "running" and not caplog.records  # 59 s < 60 s
        view.next = Look(50, [Work("step", 61.0, 7), Work("span data", 60.5, 8)], [], spans)
        dog.check()
        content = read(tmp_path)
        assert content["state"] == "stuck" and content["step"] == 50 and content["rank"] == 1
        latest = content["latest"]
        assert (latest["step"], latest["phase"], latest["spans"], latest["waited_s"], latest["limit_s"]) == (
            50, "data", ["train", "data"], 61.0, 60.0)
        assert latest["main_frame"] == "train.py:41 in load_batch" and latest["native"] is True
        assert [t["name"] for t in latest["threads"]] == ["MainThread", "loader"]
        assert latest["threads"][0]["frames"] == ["train.py:41 in load_batch", "train.py:80 in main"]
        for waited in (100.0, 121.0):  # the next record is due at twice the first wait (122 s)
            view.next = Look(50, [Work("step", waited, 7), Work("span data", waited, 8)], [], spans)
            dog.check()
        assert len(read(tmp_path)["history"]) == 1
        view.next = Look(50, [Work("step", 123.0, 7), Work("span data", 123.0, 8)], [], spans)
        dog.check()
        assert [r["waited_s"] for r in read(tmp_path)["history"]] == [61.0, 123.0]
        view.next = Look(51, [], [Work("step", 130.25, 7), Work("span data", 130.0, 8)], [])
        dog.check()
    content = read(tmp_path)
    assert content["state"] == "resumed"
    assert [(r["state"], r["waited_s"]) for r in content["history"]] == [
        ("stuck", 61.0), ("stuck", 123.0), ("resumed", 130.25)]
    assert [r.levelname for r in caplog.records] == ["WARNING"] * 3
    first, _, resumed = caplog.records
    assert first.__dict__["event.name"] == "train.hang" and first.__dict__["train.step"] == 50
    assert first.__dict__["train.hang.frame"] == "train.py:41 in load_batch"
    assert "in native code" in first.getMessage() and "step 50 has run 61.0 s" in first.getMessage()
    assert "Thread 'loader'" in first.__dict__["train.hang.threads"]
    assert resumed.__dict__["train.hang.state"] == "resumed"
    assert resumed.getMessage() == "otel-train rank 1: step 50 resumed after 130.25 s (in `data`)"


def test_a_main_thread_whose_frame_moves_is_not_in_native_code(tmp_path: Path) -> None:
    dog, view, _ = make(tmp_path, floor_s=1.0, moves=True)
    finish_steps(dog, view, [0.01] * 5)
    view.next = Look(5, [Work("step", 2.0, 7)], [], [])
    dog.check()
    assert read(tmp_path)["latest"]["native"] is False
    assert read(tmp_path)["latest"]["phase"] == "step"


def test_no_hang_in_a_run_whose_steps_vary(tmp_path: Path) -> None:
    """A slow first step (compiling), then a 12× slower validation span inside every 20th step: no record."""
    dog, view, _ = make(tmp_path, floor_s=2.0, factor=10.0)
    ident = iter(range(10_000))
    view.next = Look(0, [Work("step", 19.0, next(ident))], [], [])  # first step: no past, limit 10 × 2 s
    dog.check()
    for k in range(1, 80):
        if k % 20 == 0:  # the step runs past the steps' limit, its validation span within the validations'
            s, v = next(ident), next(ident)
            view.next = Look(k, [Work("step", 13.0, s), Work("span validation", 12.5, v)], [], ["validation"])
            dog.check()
            view.next = Look(k, [], [Work("step", 13.0, s), Work("span validation", 12.5, v)], [])
        else:
            view.next = Look(k, [], [Work("step", 1.0, next(ident))], [])
        dog.check()
    assert read(tmp_path)["state"] == "running" and read(tmp_path)["history"] == []


def test_stop_marks_the_file_ended_and_a_failing_look_is_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dog, view, _ = make(tmp_path)

    def broken() -> Look:
        raise RuntimeError("boom")
    view.look = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="otel_train.hangs.watchdog"):
        dog.check()
        dog.check()
    assert [r.getMessage() for r in caplog.records] == [
        "otel-train: the hang watchdog failed (logged once; it goes on)"]
    dog.stop()
    dog.stop()
    assert read(tmp_path)["state"] == "ended"


def test_the_view_sees_the_open_step_and_spans_and_learns_the_step_duration() -> None:
    view = TrainingThreadView(threading.current_thread().native_id)
    buffer = SpanBuffer(100)
    with step(3), SpanScope(buffer, "train"), SpanScope(buffer, "data"):
        seen = view.look()
    assert seen.step == 3 and seen.spans == ["train", "data"]
    assert [w.key for w in seen.works] == ["step", "span data"]
    after = view.look()
    assert after.works == [] and [w.key for w in after.finished] == ["step"] and after.finished[0].elapsed_s >= 0
    assert view.look().finished == []  # counted once


def test_outside_a_step_the_innermost_open_span_is_the_work_and_ended_spans_are_left_out() -> None:
    view = TrainingThreadView(threading.current_thread().native_id)
    buffer = SpanBuffer(100)
    with SpanScope(buffer, "fit"):
        with SpanScope(buffer, "checkpoint"), SpanScope(buffer, "save"):
            pass
        with SpanScope(buffer, "validation"):
            seen = view.look()
        between = view.look()
    assert seen.step is None and seen.spans == ["fit", "validation"]
    assert [w.key for w in seen.works] == ["span validation"]
    assert between.spans == ["fit"] and [w.key for w in between.works] == ["span fit"]


def test_span_durations_come_from_the_collected_spans_of_the_training_thread(tmp_path: Path) -> None:
    dog, _, _ = make(tmp_path, floor_s=1.0, factor=10.0)
    buffer = SpanBuffer(100)
    with SpanScope(buffer, "backward"):
        pass
    mine = buffer.drain()
    other = SpanScope(buffer, "backward")
    other.thread_id, other.start_ns, other.end_ns = -1, 0, 10**12  # another thread's: left out
    dog.take_spans([*mine, (99, other)])
    assert dog.rule.usual_s("span backward") is None
    dog.check()
    usual = dog.rule.usual_s("span backward")
    assert usual is not None and usual < 1.0


def test_a_look_learns_from_the_latest_spans_of_the_collections_since_the_last_one(tmp_path: Path) -> None:
    """The collector hands each collection's spans; the look takes the training thread's latest 512 of them,
    oldest first, across collections (the earlier ones, and what came before the last look, are not learned)."""
    dog, _, _ = make(tmp_path, floor_s=1.0, factor=10.0)
    me = threading.current_thread().native_id

    def collection(name: str, n: int, first: int) -> list[tuple[int, SpanScope]]:
        out = []
        for i in range(n):
            scope = SpanScope(SpanBuffer(1), name)
            scope.thread_id, scope.start_ns, scope.end_ns = me, 0, (first + i) * 1000
            out.append((first + i, scope))
        return out

    dog.take_spans(collection("old", 300, 0))
    dog.check()  # learned, then gone
    dog.take_spans(collection("a", 400, 1000))
    dog.take_spans(collection("b", 400, 2000))
    learned = dog._finished_spans()
    assert len(learned) == 512
    assert learned == [("span a", i * 1000 / 1e9) for i in range(1288, 1400)] + [
        ("span b", i * 1000 / 1e9) for i in range(2000, 2400)]
    assert dog._finished_spans() == []


def test_every_thread_stack_is_innermost_first_with_the_user_frame() -> None:
    ready, done = threading.Event(), threading.Event()

    def parked() -> None:
        ready.set()
        done.wait(10)
    t = threading.Thread(target=parked, name="parked")
    t.start()
    ready.wait(10)
    try:
        stacks = {s.name: s for s in thread_stacks()}
    finally:
        done.set()
        t.join()
    assert stacks["MainThread"].main and stacks["MainThread"].frames[0].endswith("in thread_stacks")
    assert "in test_every_thread_stack_is_innermost_first_with_the_user_frame" in (
        stacks["MainThread"].user_frame or "")
    assert any(f.endswith("in parked") for f in stacks["parked"].frames)
    assert short_path("/x/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py") == (
        "torch/distributed/distributed_c10d.py")


def test_a_rank_that_ends_while_stuck_says_so_and_the_roll_call_names_where(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Stopped (shutdown on a signal) while its step is still stuck: an `ended` record with the place and the
    whole wait, the file `ended` (not live), and the roll call says where it was."""
    from otel_train.hangs.hang_file import read_hang_files
    from otel_train.hangs.roll_call import take_roll_call

    dog, view, clock = make(tmp_path)
    finish_steps(dog, view, [0.5] * 10)
    with caplog.at_level(logging.WARNING, logger="otel_train.hang"):
        view.next = Look(50, [Work("step", 61.0, 7), Work("span data", 60.5, 8)], [], ["train", "data"])
        dog.check()
        clock.now += 30.0
        dog.stop()  # the step never ended
        dog.stop()
    content = read(tmp_path)
    assert content["state"] == "ended"
    assert [(r["state"], r["waited_s"]) for r in content["history"]] == [("stuck", 61.0), ("ended", 91.0)]
    ended = content["latest"]
    assert (ended["step"], ended["phase"], ended["main_frame"], ended["native"]) == (
        50, "data", "train.py:41 in load_batch", True)
    assert [r.__dict__["train.hang.state"] for r in caplog.records] == ["stuck", "ended"]
    assert caplog.records[1].getMessage().startswith(
        "otel-train rank 1: ended while step 50 was stuck for 91.0 s in `data` at train.py:41 in load_batch")
    call = take_roll_call(read_hang_files(tmp_path), now=clock.now + 600)
    assert not call.stuck and call.ended == [1]
    assert call.verdict() == ("no rank is stuck (0 running, 1 ended, 3 without a hang file); the job ended while "
                              "rank [1] had waited 91 s in `data` at `train.py:41 in load_batch`")


def test_a_rank_that_resumed_before_it_ended_has_no_ended_record(tmp_path: Path) -> None:
    dog, view, _ = make(tmp_path)
    finish_steps(dog, view, [0.5] * 10)
    view.next = Look(50, [Work("step", 61.0, 7)], [], [])
    dog.check()
    view.next = Look(51, [], [Work("step", 62.0, 7)], [])
    dog.stop()  # its last look sees the step finished: `resumed`, then the file `ended`
    content = read(tmp_path)
    assert content["state"] == "ended" and [r["state"] for r in content["history"]] == ["stuck", "resumed"]
