"""The window encoding (msgpack): rows round-trip exactly, and nothing read from a spool or a run folder is ever
unpickled — `otel-train replay` refuses an earlier version's pickles with a message and runs none of them."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_train.config.exporter_options import ExporterOptions, options_from_json, options_to_json
from otel_train.ship.framing import Resume, decode_window, encode_resume, encode_window
from otel_train.vocab.rows import ExponentialBuckets, HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
STEP = st.integers(0, (1 << 63) - 1)
TEXT = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(["", "a\udc80b", "é/🚀"])
FLOAT = st.floats(allow_nan=True, allow_infinity=True)
SCALAR = st.one_of(st.booleans(), st.integers(-(1 << 100), 1 << 100), FLOAT, TEXT, st.binary(max_size=8))
VALUE = SCALAR | st.tuples(SCALAR, SCALAR) | st.lists(st.booleans(), max_size=3).map(tuple)
ATTRS = st.dictionaries(TEXT, VALUE, max_size=4)
RUNS = st.builds(RunInfo, TEXT, TEXT, INT64, INT64, INT64, TEXT, TEXT, INT64, TEXT)


def _metric(run: RunInfo) -> Any:
    return st.builds(MetricRow, st.just(run), STEP, TEXT, TEXT, FLOAT, TEXT, INT64, ATTRS, st.none() | FLOAT, TEXT,
                     TEXT)


def _hist(run: RunInfo) -> Any:
    counts = st.lists(st.integers(0, 1 << 62), max_size=4).map(tuple)
    exp = st.none() | st.builds(ExponentialBuckets, st.integers(-10, 20), st.integers(0, 1 << 62), INT64, counts,
                                INT64, counts, FLOAT)
    return st.builds(HistogramRow, st.just(run), INT64, TEXT, TEXT, st.integers(0, 1 << 62), FLOAT, FLOAT, FLOAT,
                     st.lists(FLOAT, max_size=4).map(tuple), counts, INT64, ATTRS, TEXT, TEXT, exp)


def _span(run: RunInfo) -> Any:
    ids = st.integers(0, (1 << 128) - 1)
    events = st.lists(st.tuples(TEXT, INT64, ATTRS), max_size=2).map(tuple)
    links = st.lists(st.tuples(ids, st.integers(0, (1 << 64) - 1), ATTRS), max_size=2).map(tuple)
    return st.builds(SpanRow, st.just(run), TEXT, ids | st.integers(1 << 128, 1 << 130), st.integers(0, (1 << 64) - 1),
                     st.none() | st.integers(0, (1 << 64) - 1), INT64, INT64, INT64, TEXT, st.none() | INT64, ATTRS,
                     st.booleans(), TEXT, events, st.integers(0, 4), links)


def _log(run: RunInfo) -> Any:
    return st.builds(LogRow, st.just(run), st.none() | STEP, INT64, st.integers(0, 24), TEXT, TEXT, TEXT, ATTRS,
                     st.integers(0, (1 << 128) - 1), st.integers(0, (1 << 64) - 1))


@st.composite
def windows(draw: Any) -> tuple[Any, ...]:
    runs = draw(st.lists(RUNS, min_size=1, max_size=3))
    points = draw(st.lists(st.tuples(TEXT, STEP, FLOAT, INT64), max_size=5))
    pick = st.sampled_from(runs)
    metrics = draw(st.lists(pick.flatmap(_metric), max_size=5))
    hists = draw(st.lists(pick.flatmap(_hist), max_size=3))
    spans = draw(st.lists(pick.flatmap(_span), max_size=3))
    logs = draw(st.lists(pick.flatmap(_log), max_size=3))
    return runs[0], points, metrics, hists, spans, logs


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same type at every level (True is not 1, a tuple is not a list); NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return bool(a == b)


@settings(max_examples=200, deadline=None)
@given(windows())
def test_every_row_round_trips_exactly(window: tuple[Any, ...]) -> None:
    run, points, metrics, hists, spans, logs = window
    payload, max_step = encode_window(run, points, metrics, hists, spans, logs)
    got = decode_window(payload)
    want_points = [MetricRow(run, s, key, key, v, "gauge", t) for key, s, v, t in points]
    assert same(got.metrics[:len(points)], want_points)
    # Grouped by run on the wire: each run's rows keep their order.
    for want, have in ((metrics, got.metrics[len(points):]), (hists, got.histograms), (spans, got.spans),
                       (logs, got.logs)):
        for r in {id(x.run): x.run for x in want}.values():
            assert same([x for x in have if x.run == r], [x for x in want if x.run == r])
        assert len(have) == len(want)
    assert max_step == max([-1] + [p[1] for p in points] + [m.step for m in metrics])  # -1: no step


@settings(max_examples=200, deadline=None)
@given(windows())
def test_points_sent_as_groups_read_back_as_the_same_rows_in_order(window: tuple[Any, ...]) -> None:
    """The collector hands a logged dict over as it is, ``(step, time, {tag: value})`` (format 5): read back, the
    rows are those of the same points sent one by one (format 4), in order, and the highest step is the same; both
    encoders write the same bytes."""
    from unittest import mock

    from otel_train.ship import framing

    run, points, metrics, hists, spans, logs = window
    groups = [(step, t, {tag: value}) for tag, step, value, t in points]
    if len(points) > 1:  # one group of several tags, as a logged dict is
        tag, step, value, t = points[0]
        groups = [(step, t, {tag: value, f"{tag}/2": 2.5}), *groups[1:]]
        points = [points[0], (f"{tag}/2", step, 2.5, t), *points[1:]]
    by_points, max_step = encode_window(run, points, metrics, hists, spans, logs)
    by_groups, grouped_max_step = encode_window(run, (), metrics, hists, spans, logs, groups)
    assert by_groups.startswith(b"otw\x05" if groups else b"otw\x04") and by_points.startswith(b"otw\x04")
    assert grouped_max_step == max_step
    a, b = decode_window(by_groups), decode_window(by_points)
    assert all(same(list(getattr(a, part)), list(getattr(b, part))) for part in ("metrics", "histograms", "spans",
                                                                                  "logs"))
    with mock.patch.object(framing, "ormsgpack", None):
        assert encode_window(run, (), metrics, hists, spans, logs, groups)[0] == by_groups


def test_a_window_takes_its_points_as_points_or_as_groups_not_both() -> None:
    run = RunInfo("r", "name", 1)
    try:
        encode_window(run, [("loss", 3, 0.5, 7)], groups=[(4, 8, {"loss": 0.25})])
    except ValueError as err:
        assert "not both" in str(err)
    else:
        raise AssertionError("points and groups were both taken")


def test_rows_added_to_a_grouped_window_keep_its_format_and_order() -> None:
    """The exporter process adds phase timings and span rows to a window (`with_rows`): to a grouped window as
    groups after its own, and what it spools decodes to what the backends get."""
    from otel_train.ship.framing import with_rows

    run = RunInfo("r", "name", 1)
    payload, _ = encode_window(run, (), groups=[(3, 7, {"loss": 0.5, "lr": 0.1}), (4, 8, {"loss": 0.25})])
    seen = []

    def add(r: RunInfo, points: Any) -> tuple[Any, Any]:
        seen.extend(points)
        return [("phase/forward_s", 4, 0.01, 9)], []

    whole, window = with_rows(payload, add)
    assert seen == [("loss", 3, 0.5, 7), ("lr", 3, 0.1, 7), ("loss", 4, 0.25, 8)]
    assert whole.startswith(b"otw\x05")
    got = [(m.tag, m.step, m.value, m.time_unix_nano) for m in decode_window(whole).metrics]
    assert got == [*seen, ("phase/forward_s", 4, 0.01, 9)]
    assert [(m.tag, m.step) for m in window.metrics] == [(tag, step) for tag, step, _, _ in got]


@settings(max_examples=100, deadline=None)
@given(windows())
def test_both_encoders_write_the_same_bytes(window: tuple[Any, ...]) -> None:
    """ormsgpack writes windows; msgpack-python writes those it refuses (and all where it is missing): one
    format, so a spool never depends on which one wrote a window."""
    from unittest import mock

    from otel_train.ship import framing

    fast, _ = encode_window(*window)
    with mock.patch.object(framing, "ormsgpack", None):
        slow, _ = encode_window(*window)
    assert fast == slow


def test_a_window_without_log_records_is_the_message_earlier_versions_wrote() -> None:
    """Log records are an added seventh element: a window without them is byte for byte what a spool written
    before log records existed holds, and such a spool's windows read as they did."""
    import msgpack

    from otel_train.ship import framing

    run = RunInfo("r", "name", 1)
    points = [("loss", 3, 0.5, 7)]
    payload, _ = encode_window(run, points)
    earlier = b"otw\x04" + msgpack.packb((4, [framing._RUN(run)], points, (), (), ()), use_bin_type=True)
    assert payload == earlier
    got = decode_window(earlier)
    assert [(r.tag, r.step, r.value) for r in got.metrics] == [("loss", 3, 0.5)] and list(got.logs) == []
    row = LogRow(run, 3, 9, 13, "WARNING", "careful", "train", {"exception.type": "ValueError"}, 1 << 100, 5)
    with_logs, max_step = encode_window(run, points, logs=[row])
    assert max_step == 3  # log records, like spans, do not move the window's highest step
    assert same(list(decode_window(with_logs).logs), [row])


def test_a_resume_round_trips() -> None:
    run = RunInfo("r", "name", 3)
    got = decode_window(encode_resume(run, 40, 7))
    assert isinstance(got, Resume) and (got.run, got.step, got.cut_after) == (run, 40, 7)


class _Plant:
    """Unpickling this touches a file: the proof that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_an_earlier_versions_pickle_is_refused_not_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    crafted = pickle.dumps((2, _Plant(marker)), protocol=5)
    for payload in (crafted, b"otel-train:resume:" + crafted):
        try:
            decode_window(payload)
        except ValueError as err:
            assert "earlier otel-train (a pickle), which this version never unpickles" in str(err)
        else:
            raise AssertionError("a pickle was decoded")
    assert not marker.exists()


def _replay(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_train.cli", "replay", str(run_dir), "--stall", "5"],
                          capture_output=True, text=True, timeout=120, check=False)


def test_replay_never_runs_a_crafted_pickle_in_the_run_folder(tmp_path: Path) -> None:
    """An earlier version's exporter description (or a crafted one) is refused with one line; a crafted window in
    an otherwise valid spool is skipped with a message while the windows around it are delivered."""
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl
    from otel_train.ship.export_child import _write_meta
    from otel_train.ship.spool import Spool, spool_dir

    directory, marker = tmp_path / "runs", tmp_path / "ran"
    crafted = pickle.dumps(_Plant(marker), protocol=5)
    old = spool_dir(directory, "old", 0)
    old.mkdir(parents=True)
    (old / "exporters.pickle").write_bytes(crafted)
    done = _replay(directory / "old")
    assert done.returncode == 0, done.stderr
    assert "rank0: skipped: its spool was written by an earlier otel-train (exporters.pickle), which this version " \
           "never unpickles" in done.stderr
    assert not marker.exists()

    run = RunInfo("new", "new")
    path = spool_dir(directory, "new", 0)
    spool = Spool(path)
    spool.append(1, 0, encode_window(run, [("train/loss", 0, 0.5, 1)])[0])
    spool.append(2, 1, crafted)
    spool.append(3, 2, encode_window(run, [("train/loss", 2, 0.25, 3)])[0])
    spool.close()
    _write_meta(path, {"names": ["jsonl"], "options": ExporterOptions(directory=directory)})
    done = _replay(directory / "new")
    assert done.returncode == 0, done.stderr
    assert "spool window 2 unreadable for `jsonl` (a window written by an earlier otel-train (a pickle), which " \
           "this version never unpickles" in done.stderr
    assert not marker.exists()
    points = [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(directory, "new", 0)) if r["type"] == "metric"]
    assert points == [(0, 0.5), (2, 0.25)]


def test_exporter_options_round_trip_through_json() -> None:
    from otel_train.config.settings import Route, parse_step_selection

    options = ExporterOptions(
        directory=Path("/runs"), project="p", hparams={"lr": 0.1, "layers": [1, 2], "act": object}, ranks="all",
        trace_counters=False, routes={"wandb": Route(include="train/*", every=10, ranks="all")},
        trace_steps=parse_step_selection("S", "100-120,every:1000:5"), trace_gzip=True, step_order="drop",
        resume_step=None)
    back = options_from_json(json.loads(json.dumps(options_to_json(options))))
    assert back == ExporterOptions(**{**options.__dict__, "hparams": {"lr": 0.1, "layers": [1, 2],
                                                                       "act": str(object)}})


def _a_window() -> bytes:
    run = RunInfo("r", "r", 1)
    span = SpanRow(run, "forward", (7 << 64) | 9, 1, None, 10, 20, 3, "MainThread", 4, {"train.step": 4})
    hist = HistogramRow(run, 4, "h", "h", 2, 1.0, 0.5, 0.5, (1.0,), (1, 1), 5)
    return encode_window(run, [("loss", 4, 0.5, 5)], [MetricRow(run, 4, "g", "g", 1.0, "gauge", 5)], [hist],
                         [span])[0]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_corrupt_window_is_refused_with_a_value_error(data: Any) -> None:
    """Whatever the bytes after a window's header (cut, flipped, replaced), decoding gives rows or a
    ValueError naming the problem: never another exception, so one bad spool record is skipped, not fatal."""
    good = _a_window()
    how = data.draw(st.sampled_from(["cut", "flip", "random"]))
    if how == "cut":
        payload = good[:data.draw(st.integers(0, len(good) - 1))]
    elif how == "flip":
        at = data.draw(st.integers(0, len(good) - 1))
        payload = good[:at] + bytes([good[at] ^ data.draw(st.integers(1, 255))]) + good[at + 1:]
    else:
        payload = good[:4] + data.draw(st.binary(max_size=64))
    try:
        decode_window(payload)
    except ValueError:
        pass


def test_a_window_of_another_format_version_is_refused_by_name() -> None:
    payload = b"otw\x03" + _a_window()[4:]
    try:
        decode_window(payload)
    except ValueError as err:
        assert str(err) == ("a window of encoding version 3, which this version (4 and 5) does not read: deliver it "
                            "with the otel-train version that wrote it")
    else:
        raise AssertionError("a window of format 3 was decoded")
