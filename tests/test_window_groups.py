"""The collector hands the exporter process `ot.log` points as groups, one logged dict each (`WindowBuilder.build`'s
`grouped`): what the backends get is what the points one by one were, per series in the same order, with the same
refusals counted, whatever was logged (tensors, ints, bools, NaN, bad keys and values, attributed keys, new keys
that become known, steps out of range, step ends)."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_train.collect.window_builder import WindowBuilder
from otel_train.ship.framing import decode_window, encode_window
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("r", "r", rank=0)
KEYS = st.sampled_from(["loss", "lr", "acc/top1", "loss{split=val}", "", "a\udc80b", "a\\x80b", "é/🚀", 3,
                        "grad_norm"])  # "a\udc80b" is written as "a\\x80b" (`valid_text`): the two meet
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(1 << 70), 1 << 70), st.booleans(), st.none(),
    st.just("text"), st.floats(-1e6, 1e6).map(torch.tensor), st.just(torch.zeros(2)),
    st.floats(-1e6, 1e6).map(lambda v: torch.tensor(v, dtype=torch.float16)))
RECORD = st.one_of(
    st.tuples(st.integers(0, 6), st.dictionaries(KEYS, VALUES, max_size=5)),
    st.tuples(st.sampled_from([-1, 1 << 63]), st.dictionaries(KEYS, VALUES, max_size=2)),  # out of range
    st.tuples(st.integers(0, 6), st.just("step_end")))


def _records(drawn: list[tuple[int, Any]]) -> list[tuple[Any, ...]]:
    out = []
    for seq, (step, mapping) in enumerate(drawn):
        if mapping == "step_end":  # a step end's numbers, as `step_end_hook` buffers them
            out.append((seq, step, (1_000 * step, 1_000 * step + 600, step + 1, None), 0))
        else:
            out.append((seq, step, dict(mapping), 10 * seq))
    return out


def _builder() -> WindowBuilder:
    builder = WindowBuilder()
    builder._wall_offset_ns = 0  # the same step-end times from both builders
    return builder


def _series(rows: Any) -> dict[str, list[tuple[int, Any, int]]]:
    """Each series' points as a list, in the order the backends get them (NaN as a string: NaN != NaN)."""
    out: dict[str, list[tuple[int, Any, int]]] = {}
    for r in rows:
        value = "nan" if math.isnan(r.value) else r.value
        out.setdefault(r.tag, []).append((r.step, value, r.time_unix_nano))
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(RECORD, max_size=6), min_size=1, max_size=3))
def test_points_handed_over_as_groups_are_the_points_one_by_one(windows: list[list[tuple[int, Any]]]) -> None:
    one_by_one, grouped = _builder(), _builder()
    for drawn in windows:  # several windows: keys become known (the common path) after their first window
        records = _records(drawn)
        a = one_by_one.build(RUN, None, list(records), [], 6, defer_spans=True)
        b = grouped.build(RUN, None, list(records), [], 6, defer_spans=True, grouped=True)
        assert a.groups is None and b.groups is not None and b.points == []
        assert b.point_count == len(a.points)
        by_points, max_a = encode_window(RUN, a.points, a.metrics)
        by_groups, max_b = encode_window(RUN, (), b.metrics, groups=b.groups)
        assert max_a == max_b
        # Each series' steps in the same order (no step moved or written twice), and the same points; only two
        # values of one series at one step (two keys that became one) may come in the other order.
        got, want = _series(decode_window(by_groups).metrics), _series(decode_window(by_points).metrics)
        assert {tag: [p[0] for p in points] for tag, points in got.items()} == {
            tag: [p[0] for p in points] for tag, points in want.items()}
        assert {tag: sorted(points, key=repr) for tag, points in got.items()} == {
            tag: sorted(points, key=repr) for tag, points in want.items()}
    assert grouped.refusals.snapshot() == one_by_one.refusals.snapshot()


def test_a_logged_dict_of_known_tags_and_floats_is_handed_over_as_it_is() -> None:
    builder = _builder()
    first = {"loss": 0.5, "lr": 0.1}
    builder.build(RUN, None, [(0, 1, first, 7)], [], 1, defer_spans=True, grouped=True)  # the tags become known
    later = {"loss": 0.25, "lr": 0.1}
    window = builder.build(RUN, None, [(1, 2, later, 8), (2, 2, {"loss": 1, "lr": 0.1}, 9)], [], 2,
                           defer_spans=True, grouped=True)
    assert window.groups is not None
    assert window.groups[0][2] is later  # no copy, no tuple a point
    assert window.groups[1] == (2, 9, {"lr": 0.1, "loss": 1.0})  # an int converted; each tag its own series
