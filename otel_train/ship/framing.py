"""The window encoding between the training process and the exporter process (and the spool).

A window is one msgpack message: a table of the runs its rows belong to, the ``(tag, step, value, time)``
tuples of `ot.log` points the reader already holds, and SDK rows and spans as arrays of their fields (a
row names its run by its index in the table). msgpack builds values and nothing else, so a spool or pipe
that someone else wrote cannot run code when it is read (`otel-train replay` reads run folders that may sit
on a shared file system). Values round-trip exactly: floats (NaN, inf, -0.0) as float64, ints of any size
(beyond 64 bits as an extension type: trace ids are 128-bit), bools apart from ints, str (lone surrogates
too), bytes, None; sequences come back as tuples, mappings as dicts. Anything else (a numpy scalar in an
attribute) is written as the int, float or str it stands for. `bench/framing.py` times it against the
pickle of tuples it replaced (protocol 5).

A resume (`otel_train.resume`, or `init(resume_step=)` in the exporter process) travels in the same stream
as a window, spooled and acknowledged like one, so each backend applies it once, in order, across a
restart of the exporter process or `otel-train replay`. Its payload starts with `_RESUME_MAGIC`, a window's
with `_WINDOW_MAGIC`, so a spool can be scanned for resumes without decoding windows. A payload of an
earlier otel-train (a pickle) is refused with a message, never unpickled.
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
from collections.abc import Mapping, Sequence
from functools import partial
from itertools import repeat, starmap
from operator import and_, attrgetter, itemgetter, lshift, or_, rshift
from typing import Any

import msgpack

from otel_train.backend import Window
from otel_train.rows import ExponentialBuckets, HistogramRow, MetricRow, SpanRow
from otel_train.run_identity import RunInfo

__all__ = ["Resume", "cut_window", "decode_window", "encode_resume", "encode_window", "is_resume"]

_VERSION = 3
_WINDOW_MAGIC = b"otw\x03"
_RESUME_MAGIC = b"otel-train:resume:"
_PICKLE = b"\x80"  # how every pickle of protocol 2 and later starts: what earlier versions wrote
_BIG_INT = 1  # msgpack extension type: an int beyond 64 bits, as signed little-endian bytes
_RUN = attrgetter(*(f.name for f in dataclasses.fields(RunInfo)))
_GET_RUN = attrgetter("run")
# A row as the tuple of its fields after `run` (its group's run), in declaration order.
_METRIC = attrgetter(*[f.name for f in dataclasses.fields(MetricRow)][1:])
_HIST = attrgetter(*[f.name for f in dataclasses.fields(HistogramRow)][1:])
_SPAN = attrgetter(*[f.name for f in dataclasses.fields(SpanRow)][1:])
_SPAN_TAIL_COLUMNS = tuple(attrgetter(f.name) for f in dataclasses.fields(SpanRow)[3:])  # after run, name, trace_id
_NAME = attrgetter("name")
_TRACE_ID = attrgetter("trace_id")
_STEP = attrgetter("step")
_FIRST, _SECOND, _THIRD, _FOURTH = (itemgetter(i) for i in range(4))
_LOW = (1 << 64) - 1
_OLD = ("written by an earlier otel-train (a pickle), which this version never unpickles: "
        "deliver it with the otel-train version that wrote it")


class Resume(Window):
    """A resume in the window stream: the run restarts at `step` (a window with no rows).

    Args:
        run: The run (and rank) that restarts.
        step: The first step of the new attempt: each backend supersedes the earlier attempt's steps >= it.
        cut_after: The last seq of the earlier attempt's windows: rows at steps >= `step` in windows up to
            it that are delivered once this resume is known are dropped (see `cut_window`).
    """

    __slots__ = ("cut_after", "run", "step")

    def __init__(self, run: RunInfo, step: int, cut_after: int) -> None:
        super().__init__()
        self.run = run
        self.step = step
        self.cut_after = cut_after


def _default(obj: Any) -> Any:
    """What msgpack cannot write itself: big ints, read-only mappings, numpy scalars."""
    if isinstance(obj, int):  # beyond 64 bits (exact ints are written natively)
        return msgpack.ExtType(_BIG_INT, obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True))
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (set, frozenset)):
        return tuple(obj)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    return str(obj)


def _ext(code: int, data: bytes) -> Any:
    if code == _BIG_INT:
        return int.from_bytes(data, "little", signed=True)
    raise ValueError(f"unknown msgpack extension type {code}")


_local = threading.local()


def _packb(obj: Any) -> bytes:
    # One packer per thread (a packer holds a buffer): the reader, the sink's router and tests encode at once.
    # str is written by msgpack's fast UTF-8 path; only a window holding a lone surrogate takes the slow one.
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(default=_default, use_bin_type=True)
    try:
        data: bytes = packer.pack(obj)
    except UnicodeEncodeError:
        data = msgpack.packb(obj, default=_default, use_bin_type=True, unicode_errors="surrogatepass")
    return data


def _unpackb(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, use_list=False, ext_hook=_ext, strict_map_key=True)
    except UnicodeDecodeError:
        return msgpack.unpackb(data, use_list=False, ext_hook=_ext, strict_map_key=True,
                               unicode_errors="surrogatepass")


def encode_window(
    run: RunInfo,
    points: Sequence[tuple[str, int, float, int]],
    metrics: Sequence[MetricRow] = (),
    histograms: Sequence[HistogramRow] = (),
    spans: Sequence[SpanRow] = (),
) -> tuple[bytes, int]:
    """One window as bytes, and the highest step in it (-1 when it has none).

    Args:
        run: The run every `points` entry belongs to.
        points: ``(tag, step, value, time_unix_nano)`` of `ot.log` gauges.
        metrics, histograms, spans: Rows from the SDK's instruments and spans (any runs).
    """
    columns = _point_columns(points)
    max_step = max(columns[2]) if points else -1
    if metrics:
        max_step = max(max_step, max(map(_STEP, metrics)))
    runs: dict[RunInfo, int] = {run: 0}
    m = [(i, list(map(_METRIC, rows))) for i, rows in _by_run(metrics, runs)]
    h = [(i, list(map(_HIST, rows))) for i, rows in _by_run(histograms, runs)]
    s = [(i, *_span_columns(rows)) for i, rows in _by_run(spans, runs)]
    payload = _packb((_VERSION, [_RUN(r) for r in runs], columns, m, h, s))
    return _WINDOW_MAGIC + payload, max_step


# Rows travel as tuples of their fields, built by `attrgetter` and rebuilt by `starmap`: C-level loops both
# ways, with no Python frame per row (what pickling the same tuples cost before).


def _point_columns(points: Sequence[tuple[str, int, float, int]]) -> tuple[Any, ...]:
    """`ot.log` points as columns: each tag once, then per point its tag's index, step, value and time (a run
    logs the same keys every step, so the tags table is small)."""
    tags = list(map(_FIRST, points))
    index = {tag: i for i, tag in enumerate(dict.fromkeys(tags))}
    return (list(index), list(map(index.__getitem__, tags)), list(map(_SECOND, points)), list(map(_THIRD, points)),
            list(map(_FOURTH, points)))


def _by_run(rows: Sequence[Any], runs: dict[RunInfo, int]) -> list[tuple[int, Sequence[Any]]]:
    """`rows` grouped by run (each group in the rows' order), with each run's index in `runs` (added)."""
    if not rows:
        return []
    first = rows[0].run
    if len(set(map(id, map(_GET_RUN, rows)))) == 1:  # the usual window: one run (C-level check)
        return [(runs.setdefault(first, len(runs)), rows)]
    groups: dict[RunInfo, list[Any]] = {}
    for r in rows:
        groups.setdefault(r.run, []).append(r)
    return [(runs.setdefault(run, len(runs)), group) for run, group in groups.items()]


def _span_columns(rows: Sequence[SpanRow]) -> tuple[Any, ...]:
    """Spans as columns (one list per field after the trace id) plus the names and the high and low 64 bits
    of the trace ids: a 128-bit trace id as two native ints, not one msgpack extension (a Python call) each,
    and every span rebuilt by one C-level `map`. A trace id outside 128 bits: the fields as tuples, the id as
    an extension."""
    ids = list(map(_TRACE_ID, rows))
    high = list(map(rshift, ids, repeat(64)))
    if max(high) > _LOW or min(high) < 0:
        return (None, None, None, list(map(_SPAN, rows)))
    return (list(map(_NAME, rows)), high, list(map(and_, ids, repeat(_LOW))),
            [list(map(get, rows)) for get in _SPAN_TAIL_COLUMNS])


def encode_resume(run: RunInfo, step: int, cut_after: int) -> bytes:
    """A `Resume` as bytes, for the same channel and spool as windows (its max step is -1)."""
    return _RESUME_MAGIC + _packb((_VERSION, _RUN(run), int(step), int(cut_after)))


def is_resume(payload: bytes) -> bool:
    """Whether an encoded payload is a `Resume` (without decoding it)."""
    return payload.startswith(_RESUME_MAGIC)


def cut_window(window: Window, step: int) -> Window:
    """`window` less its metric and histogram rows at steps >= `step` (spans kept: a span is an event on
    the timeline, not a point of a series; `resolve_resumes` and TensorBoard's purge keep them too).

    Example:
        >>> run = RunInfo("r", "r")
        >>> w = Window([MetricRow(run, s, "loss", "loss", 1.0, "gauge", 0) for s in (3, 4, 5)])
        >>> [r.step for r in cut_window(w, 4).metrics]
        [3]
    """
    metrics = [r for r in window.metrics if r.step < step]
    histograms = [h for h in window.histograms if h.step < step]
    if len(metrics) == len(window.metrics) and len(histograms) == len(window.histograms):
        return window
    return Window(metrics, histograms, window.spans)


def decode_window(payload: bytes) -> Window:
    """The rows of an encoded window, or a `Resume` (a `Window` with no rows).

    Raises:
        ValueError: `payload` is not a window of this version (one of an earlier otel-train, a pickle, is
            never unpickled).
    """
    if is_resume(payload):
        body = payload[len(_RESUME_MAGIC):]
        if body.startswith(_PICKLE):
            raise ValueError(f"a resume {_OLD}")
        _, run_fields, step, cut_after = _checked(_unpackb(body), 4, "resume")
        return Resume(RunInfo(*run_fields), int(step), int(cut_after))
    if not payload.startswith(_WINDOW_MAGIC):
        if payload.startswith(_PICKLE):
            raise ValueError(f"a window {_OLD}")
        raise ValueError("not an otel-train window (unknown leading bytes)")
    _, run_table, points, metrics, hists, spans = _checked(_unpackb(payload[len(_WINDOW_MAGIC):]), 6, "window")
    runs = [RunInfo(*fields) for fields in run_table]
    run = runs[0]
    table, tag_index, steps, values, times = points
    keys = list(map(table.__getitem__, tag_index))
    rows = list(map(MetricRow, repeat(run), steps, keys, keys, values, repeat("gauge"), times))
    for i, group in metrics:
        rows.extend(starmap(partial(MetricRow, runs[i]), group))
    histograms: list[HistogramRow] = []
    for i, group in hists:
        histograms.extend(starmap(partial(HistogramRow, runs[i]), group))
    for h in histograms:
        if h.exponential is not None:
            h.exponential = ExponentialBuckets(*h.exponential)
    span_rows: list[SpanRow] = []
    for i, names, high, low, fields in spans:
        if names is None:
            span_rows.extend(starmap(partial(SpanRow, runs[i]), fields))
        else:
            ids = map(or_, map(lshift, high, repeat(64)), low)
            span_rows.extend(map(SpanRow, repeat(runs[i]), names, ids, *fields))
    return Window(rows, histograms, span_rows)


def _checked(message: Any, size: int, what: str) -> tuple[Any, ...]:
    if not isinstance(message, tuple) or len(message) != size or message[0] != _VERSION:
        version = message[0] if isinstance(message, tuple) and message else "?"
        raise ValueError(f"{what} encoding version {version} is not {_VERSION}")
    return message
