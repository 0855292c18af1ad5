"""The step context: explicit and implicit steps, threads, asyncio, step-end listeners."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

import otel_train as ot
from otel_train.capture.step import StepEnd, add_step_end_listener, remove_step_end_listener


def test_no_step_before_any() -> None:
    assert ot.current_step() is None


def test_step_none_means_previous_plus_one() -> None:
    with ot.step():
        assert ot.current_step() == 0
    with ot.step(10):
        pass
    with ot.step() as s:
        assert s == 11


def test_steps_iterates_with_start() -> None:
    seen = [(item, ot.current_step()) for item in ot.steps("abc", start=5)]
    assert seen == [("a", 5), ("b", 6), ("c", 7)]


def test_outside_a_step_the_latest_step_is_current() -> None:
    with ot.step(3):
        pass
    assert ot.current_step() == 3


def test_nested_steps_restore_outer() -> None:
    with ot.step(1):
        with ot.step(2):
            assert ot.current_step() == 2
        assert ot.current_step() == 1


def test_threads_fall_back_to_latest_step() -> None:
    seen: list[int | None] = []
    with ot.step(7):
        t = threading.Thread(target=lambda: seen.append(ot.current_step()))
        t.start()
        t.join()
    assert seen == [7]


def test_asyncio_tasks_see_their_own_step() -> None:
    async def work(i: int) -> int | None:
        with ot.step(i):
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return ot.current_step()

    async def main() -> list[int | None]:
        return list(await asyncio.gather(work(1), work(2), work(3)))

    assert asyncio.run(main()) == [1, 2, 3]


def test_backwards_step_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_train.capture.step"):
        for i in (5, 3, 2, 6):
            with ot.step(i):
                pass
    warnings = [r for r in caplog.records if "follows step" in r.getMessage()]
    assert len(warnings) == 1
    assert "step 3 follows step 5" in warnings[0].getMessage()


def test_listener_gets_duration_iterations_samples() -> None:
    got: list[StepEnd] = []
    add_step_end_listener(got.append)
    try:
        with ot.step(0, samples=32):
            pass
        with ot.step(1):
            pass
    finally:
        remove_step_end_listener(got.append)
    assert [(e.step, e.iterations, e.samples) for e in got] == [(0, 1, 32), (1, 2, None)]
    assert all(e.duration_s >= 0 and e.time_total_s >= e.duration_s for e in got)


def test_failing_listener_does_not_break_the_loop() -> None:
    def boom(info: StepEnd) -> None:
        raise RuntimeError("listener bug")

    add_step_end_listener(boom)
    try:
        with ot.step(0):
            pass
    finally:
        remove_step_end_listener(boom)
    assert ot.current_step() == 0
