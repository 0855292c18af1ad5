"""Per-step phase timings: the pure computation, windows split mid-step, and a real TensorBoard run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from backendkit import by_step, tb_scalars

import otel_train as ot
from otel_train.collect.phases import DURATION_KEY, PhaseTimer, Span, phase_values
from otel_train.vocab.semconv import display_name


def test_nested_spans_count_once_and_other_is_the_uncovered_rest() -> None:
    spans = [
        Span("data", 1, None, 0, 200, 7, 3),
        Span("train", 2, None, 300, 900, 7, 3),
        Span("backward", 3, 2, 500, 800, 7, 3),  # nested in `train`: counted in it
        Span("prefetch", 4, None, 0, 1000, 8, 3, in_step=False),  # a prefetch thread: not in the step
    ]
    values = phase_values(spans, 0, 1000)
    assert values == {"phase/data_s": 200e-9, "phase/train_s": 600e-9, "phase/other_s": 200e-9}


def test_spans_are_clipped_to_the_step_and_names_made_valid() -> None:
    values = phase_values([Span("load batch", 1, None, -500, 400, 1, 0)], 0, 1000)
    assert values == {"phase/load_batch_s": 400e-9, "phase/other_s": 600e-9}


def test_spans_before_the_steps_end_wait_for_it_across_windows() -> None:
    timer = PhaseTimer()
    t = 10_000
    # A collection in the middle of step 5: its spans arrive, its duration does not yet.
    first = timer.points([Span("forward", 1, None, t - 800, t - 500, 1, 5)], [])
    assert first == []
    second = timer.points([Span("backward", 2, None, t - 500, t - 100, 1, 5)], [(DURATION_KEY, 5, 1000e-9, t)])
    got = {k: v for k, s, v, _ in second if s == 5}
    assert got == {"phase/forward_s": pytest.approx(300e-9), "phase/backward_s": pytest.approx(400e-9),
                   "phase/other_s": pytest.approx(300e-9)}
    # A span stamped with step 5 after it ended (between steps, no step context) is not kept.
    assert timer.points([Span("late", 3, None, t + 10, t + 20, 1, 5, in_step=False)], []) == []
    assert timer._pending == {}


def test_steps_numbered_again_from_zero_still_get_phases() -> None:
    timer = PhaseTimer()
    for epoch in range(2):
        for step in range(3):
            t = (epoch * 3 + step + 1) * 10_000
            got = timer.points([Span("forward", step + 1, None, t - 5000, t - 1000, 1, step)],
                               [(DURATION_KEY, step, 8000e-9, t)])
            assert [(k, s) for k, s, _, _ in got] == [("phase/forward_s", step), ("phase/other_s", step)]


def test_steps_that_never_end_are_forgotten() -> None:
    timer = PhaseTimer()
    timer.points([Span("orphan", 1, None, 0, 10, 1, 7)], [])  # explicit step, no `ot.step`
    for _ in range(1001):
        timer.points([], [])
    assert timer._pending == {} and timer._pending_count == 0


def _demo_like(steps: int) -> None:
    for i in ot.steps(range(steps)):
        with ot.span("data"):
            time.sleep(0.001)
        with ot.span("forward"), ot.span("matmul"):  # nested: inside forward_s, not its own phase
            time.sleep(0.002)
        with ot.span("backward"):
            time.sleep(0.002)
        time.sleep(0.001)  # not in any span: other_s
        with ot.span("optimizer"):
            ot.log({"train/loss": 1.0 / (i + 1)})


def test_phases_add_up_to_the_step_duration_in_tensorboard(tmp_path: Path) -> None:
    ot.init(exporters=["tensorboard"], dir=tmp_path, run_name="phases")
    _demo_like(12)
    ot.shutdown()
    series = tb_scalars(tmp_path / "phases")
    phases = sorted(t for t in series if t.startswith("phase/"))
    assert phases == ["phase/backward_s", "phase/data_s", "phase/forward_s", "phase/optimizer_s", "phase/other_s"]
    durations = series[display_name(DURATION_KEY)]
    assert [step for step, _ in durations] == list(range(12))
    at = {t: by_step(series[t]) for t in phases}
    assert all(sorted(steps) == list(range(12)) for steps in at.values())
    for step, duration in durations:
        total = sum(at[t][step] for t in phases)
        assert total == pytest.approx(duration, rel=0.05), step
        assert at["phase/forward_s"][step] >= 0.002  # the nested matmul is inside forward
        assert at["phase/other_s"][step] >= 0.001  # the un-spanned sleep


def test_phases_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_PHASES", "0")
    ot.init(exporters=["tensorboard"], dir=tmp_path, run_name="nophases")
    _demo_like(3)
    ot.shutdown()
    series = tb_scalars(tmp_path / "nophases")
    assert display_name(DURATION_KEY) in series
    assert not [t for t in series if t.startswith("phase/")]


def test_the_clock_offset_ignores_reads_split_by_a_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step ends are converted from `perf_counter_ns` to the spans' wall clock by an offset read once; a thread
    preempted between the two reads (5 ms here) must not shift every step end, or spans near a step's end fall
    outside it and lose their phase."""
    from otel_train.collect import window_builder

    true_offset = 1_000
    # Three tries of (perf before, wall, perf after): the first preempted between its reads.
    perf = iter([100, 5_000_110, 5_000_200, 5_000_210, 5_000_300, 5_000_340])
    walls = iter([5_000_100 + true_offset, 5_000_205 + true_offset, 5_000_320 + true_offset])

    class Clock:
        @staticmethod
        def perf_counter_ns() -> int:
            return next(perf)

        @staticmethod
        def time_ns() -> int:
            return next(walls)

    monkeypatch.setattr(window_builder, "time", Clock)
    assert window_builder.wall_offset_ns(tries=3) == true_offset
