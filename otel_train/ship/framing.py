"""The window encoding between the training process and the exporter process (and the spool).

A window is one msgpack message: a table of the runs its rows belong to, the ``(tag, step, value, time)``
tuples of `ot.log` points as the reader holds them, and SDK rows and spans as tuples of their fields (a
group of rows names its run by its index in the table). msgpack builds values and nothing else, so a spool
or pipe that someone else wrote cannot run code when it is read (`otel-train replay` reads run folders that
may sit on a shared file system). Values round-trip exactly: floats (NaN, inf, -0.0) as float64, ints of
any size (beyond 64 bits as an extension type: trace ids are 128-bit), bools apart from ints, str (lone
surrogates too), bytes, None; sequences come back as tuples, mappings as dicts. Anything else (a numpy
scalar in an attribute) is written as the int, float or str it stands for.

Encoding runs on the training process's collector thread, so it is written by ormsgpack (a compiled
encoder: no Python call per value) and read by msgpack-python (its tuples and strict map keys); the two
write the same bytes, and msgpack-python also writes the rare window ormsgpack refuses (a lone surrogate, a
non-str mapping key), or every window where ormsgpack is not installed.

Log records (`LogRow`) travel as a seventh element of the message, written only when a window has some: a
window without log records is the six-element message earlier versions wrote and read, and a spool written
before log records existed reads as it did. The layout avoids per-row Python work both ways: rows become tuples by `attrgetter`
and come back by `map`/`starmap` over the row classes; 128-bit trace ids travel as two native columns.
`bench/framing.py` times it against the pickle of tuples it replaced (protocol 5): encoding (the training
process) 0.8x the pickle's cost for a 3,000-row window, 1.0x for a 13-row one; decoding (the exporter
process) 1.06-1.15x, the price of a str object per string where a pickle shares repeated ones.

A window of format 5 is a window of format 4 whose `ot.log` points travel as groups, ``(step, time, {tag:
value})``, one a logged dict: the collector hands a logged dict over as it is (one compiled call packs it) instead
of making a tuple a point, and the exporter process makes the points. Format 4 is still written where points come
as points, and both are read.

A window may travel with its `ot.span` records not yet turned into rows (`pack_span_records`): the training
process hands over each record's fields and the exporter process makes the span rows and phase timings
(`otel_train.ship.span_work`), adds them to the window (`with_rows`) and spools the result, so a spool only ever
holds whole windows. Such a payload starts with `_SPANS_MAGIC`; it never reaches a spool or a backend.

A resume (`otel_train.resume`, or `init(resume_step=)` in the exporter process) travels in the same stream
as a window, spooled and acknowledged like one, so each backend applies it once, in order, across a
restart of the exporter process or `otel-train replay`. Its payload starts with `_RESUME_MAGIC`, a window's
with `_WINDOW_MAGIC`, so a spool can be scanned for resumes without decoding windows. A payload of another
encoding version (a pickle of an earlier otel-train, a msgpack window of format 3) is refused with a
message naming it, never unpickled; a corrupt one with a `ValueError`.
"""

from __future__ import annotations

import dataclasses
import numbers
import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import repeat, starmap
from operator import and_, attrgetter, itemgetter, lshift, or_, rshift
from typing import Any

import msgpack

try:
    import ormsgpack
except ImportError:  # pragma: no cover - a platform without its wheel: msgpack-python writes every window
    ormsgpack = None  # type: ignore[assignment]

from otel_train.backend import Window
from otel_train.vocab.rows import ExponentialBuckets, HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

__all__ = ["Resume", "cut_window", "decode_window", "encode_resume", "encode_window", "has_span_records", "is_resume",
           "pack_span_records", "unpack_span_records", "with_rows"]

_VERSION = 4
_WINDOW_MAGIC = b"otw\x04"
#: A window whose `ot.log` points travel as groups, ``(step, time, {tag: value})`` (`encode_window`'s `groups`).
_GROUPED_VERSION = 5
_GROUPED_MAGIC = b"otw\x05"
_MAGIC_OF = {_VERSION: _WINDOW_MAGIC, _GROUPED_VERSION: _GROUPED_MAGIC}
_RESUME_MAGIC = b"otel-train:resume:"
_SPANS_MAGIC = b"ots\x01"  # a window whose `ot.span` records travel as fields (`pack_span_records`)
_LENGTH = struct.Struct("<I")
_PICKLE = b"\x80"  # how every pickle of protocol 2 and later starts: what earlier versions wrote
_OTHER_WINDOW = b"otw"  # a window of another format version (the byte after it)
_BIG_INT = 1  # msgpack extension type: an int beyond 64 bits, as signed little-endian bytes
_RUN = attrgetter(*(f.name for f in dataclasses.fields(RunInfo)))
_GET_RUN = attrgetter("run")
# A row as the tuple of its fields after `run` (its group's run), in declaration order. A span's trace id
# travels as two columns (its high and low 64 bits) and `kind` (a small int) holds its place in the tuple: the
# decoder builds every span by one `starmap`, then sets the trace ids by one `map` (no Python frame per span).
_METRIC = attrgetter(*[f.name for f in dataclasses.fields(MetricRow)][1:])
_HIST = attrgetter(*[f.name for f in dataclasses.fields(HistogramRow)][1:])
_SPAN_NO_ID = attrgetter(*[f.name if f.name != "trace_id" else "kind" for f in dataclasses.fields(SpanRow)][1:])
_LOG = attrgetter(*[f.name for f in dataclasses.fields(LogRow)][1:])
_TRACE_ID = attrgetter("trace_id")
_STEP = attrgetter("step")
_POINT_STEP = itemgetter(1)
_GROUP_STEP = itemgetter(0)
_LOW = (1 << 64) - 1
_OLD = ("written by an earlier otel-train (a pickle), which this version never unpickles: "
        "deliver it with the otel-train version that wrote it")
# Beyond 64 bits: to `_default`, an extension.
_PACK_OPTIONS = ormsgpack.OPT_PASSTHROUGH_BIG_INT if ormsgpack is not None else 0


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
    """What ormsgpack cannot write itself: big ints, tuple subclasses (`ExponentialBuckets`: it writes only
    exact tuples), read-only mappings, numpy scalars."""
    if isinstance(obj, int):  # beyond 64 bits (exact ints are written natively)
        return ormsgpack.Ext(_BIG_INT, _int_bytes(obj))
    return _plain(obj)


def _default_slow(obj: Any) -> Any:
    """`_default` for msgpack-python (the fallback encoder)."""
    if isinstance(obj, int):
        return msgpack.ExtType(_BIG_INT, _int_bytes(obj))
    return _plain(obj)


def _int_bytes(value: int) -> bytes:
    return value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)


def _plain(obj: Any) -> Any:
    if isinstance(obj, (tuple, list, set, frozenset)):
        return tuple(obj)
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    try:
        return str(obj)
    except Exception:  # an object whose str() fails must not cost the window it is in
        return f"<{type(obj).__name__}: str() failed>"


def _ext(code: int, data: bytes) -> Any:
    if code == _BIG_INT:
        return int.from_bytes(data, "little", signed=True)
    raise ValueError(f"unknown msgpack extension type {code}")


def _packb(obj: Any) -> bytes:
    if ormsgpack is not None:
        try:
            return ormsgpack.packb(obj, default=_default, option=_PACK_OPTIONS)
        except TypeError:  # a lone surrogate, a non-str key, nesting past its limit: msgpack-python writes it
            pass
    try:
        data: bytes = msgpack.packb(obj, default=_default_slow, use_bin_type=True)
    except UnicodeEncodeError:
        data = msgpack.packb(obj, default=_default_slow, use_bin_type=True, unicode_errors="surrogatepass")
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
    logs: Sequence[LogRow] = (),
    groups: Sequence[tuple[int, int, Mapping[str, float]]] = (),
) -> tuple[bytes, int]:
    """One window as bytes, and the highest step in it (-1 when it has none).

    Args:
        run: The run every `points` entry belongs to.
        points: ``(tag, step, value, time_unix_nano)`` of `ot.log` gauges.
        metrics, histograms, spans: Rows from the SDK's instruments and spans (any runs).
        logs: Log records (any runs); like spans, they do not count towards the highest step.
        groups: Instead of `points` (not both), the same points grouped as ``(step, time_unix_nano, {tag:
            value})``, in order: one `ot.log` call's dict is packed by one compiled call, not one tuple a point
            (a window of format 5; `points` alone write format 4, as before).

    Raises:
        ValueError: both `points` and `groups` given.
    """
    if groups:
        if points:
            raise ValueError("a window's points go either as points or as groups, not both")
        max_step = max(map(_GROUP_STEP, groups))
        version, magic, points = _GROUPED_VERSION, _GROUPED_MAGIC, groups  # type: ignore[assignment]
    else:
        max_step = max(map(_POINT_STEP, points)) if points else -1
        version, magic = _VERSION, _WINDOW_MAGIC
    if metrics:
        max_step = max(max_step, max(map(_STEP, metrics)))
    runs: dict[RunInfo, int] = {run: 0}
    m = [(i, list(map(_METRIC, rows))) for i, rows in _by_run(run, metrics, runs)] if metrics else ()
    h = [(i, list(map(_HIST, rows))) for i, rows in _by_run(run, histograms, runs)] if histograms else ()
    s = [(i, *_span_columns(rows)) for i, rows in _by_run(run, spans, runs)] if spans else ()
    if logs:
        g = [(i, list(map(_LOG, rows))) for i, rows in _by_run(run, logs, runs)]
        payload = _packb((version, list(map(_RUN, runs)), points, m, h, s, g))
    else:  # the message every version since 4 reads
        payload = _packb((version, list(map(_RUN, runs)), points, m, h, s))
    return magic + payload, max_step


def _by_run(run: RunInfo, rows: Sequence[Any], runs: dict[RunInfo, int]) -> list[tuple[int, Sequence[Any]]]:
    """`rows` grouped by run (each group in the rows' order), with each run's index in `runs` (added)."""
    ids = set(map(id, map(_GET_RUN, rows)))
    if len(ids) == 1:  # the usual window: one run (C-level check), most often the points' (no hashing)
        first = rows[0].run
        return [(0 if first is run else runs.setdefault(first, len(runs)), rows)]
    groups: dict[RunInfo, list[Any]] = {}
    for r in rows:
        groups.setdefault(r.run, []).append(r)
    return [(runs.setdefault(key, len(runs)), group) for key, group in groups.items()]


def _span_columns(rows: Sequence[SpanRow]) -> tuple[list[int], list[int], list[tuple[Any, ...]]]:
    """The high and low 64 bits of the spans' trace ids, and the spans' other fields as tuples: a 128-bit
    trace id as two native ints, not one extension (a Python call) each. An id outside 128 bits round-trips
    too (its high part, an extension)."""
    ids = list(map(_TRACE_ID, rows))
    return list(map(rshift, ids, repeat(64))), list(map(and_, ids, repeat(_LOW))), list(map(_SPAN_NO_ID, rows))


#: An `ot.span` record's fields but its trace id, in `SpanRecord`'s argument order (the trace id after the name).
_RECORD_NO_ID = attrgetter("name", "span_id", "parent_id", "start_ns", "end_ns", "thread_id", "thread_name", "step",
                           "attributes", "error", "in_step")


def pack_span_records(payload: bytes, records: Sequence[Any], phase_spans: Sequence[tuple[Any, ...]],
                      phases: bool) -> bytes:
    """An encoded window (`payload`, from `encode_window`) with `ot.span` records (`SpanRecord`s) whose rows and
    phase timings the receiver makes (`unpack_span_records`, `with_rows`); `phase_spans`: the phase fields
    (`otel_train.collect.phases.Span`) of raw OTel spans whose rows the window holds already; `phases`: whether
    the receiver computes phase timings."""
    ids = list(map(_TRACE_ID, records))
    raw = _packb((list(map(rshift, ids, repeat(64))), list(map(and_, ids, repeat(_LOW))),
                  list(map(_RECORD_NO_ID, records)), [tuple(s) for s in phase_spans], bool(phases)))
    return _SPANS_MAGIC + _LENGTH.pack(len(payload)) + payload + raw


def has_span_records(payload: bytes) -> bool:
    """Whether a payload is a window with `ot.span` records to make rows of (`pack_span_records`)."""
    return payload.startswith(_SPANS_MAGIC)


def unpack_span_records(data: bytes) -> tuple[bytes, list[tuple[Any, ...]], list[tuple[Any, ...]], bool]:
    """What `pack_span_records` packed: the window's payload, each record's `SpanRecord` arguments, the raw OTel
    spans' phase fields and whether phases are computed.

    Raises:
        ValueError: a corrupt payload.
    """
    at = len(_SPANS_MAGIC)
    try:
        (n,) = _LENGTH.unpack_from(data, at)
    except struct.error:
        raise ValueError("a corrupt window with span records (its length)") from None
    payload, raw = data[at + _LENGTH.size:at + _LENGTH.size + n], data[at + _LENGTH.size + n:]
    try:
        high, low, fields, phase_spans, phases = _unpack_body(raw)
        ids = map(or_, map(lshift, high, repeat(64)), low)
        records = [(f[0], trace_id, *f[1:]) for f, trace_id in zip(fields, ids, strict=True)]
    except (TypeError, ValueError) as err:
        raise ValueError(f"a corrupt window with span records ({type(err).__name__}: {err})") from None
    return payload, records, list(phase_spans), bool(phases)


def with_rows(payload: bytes, add: Callable[[RunInfo, Sequence[tuple[str, int, float, int]]],
                                             tuple[Sequence[tuple[str, int, float, int]], Sequence[SpanRow]]],
              ) -> tuple[bytes, Window]:
    """The encoded window `payload` with the rows `add(run, points)` makes from its run and its ``(tag, step, value,
    time)`` points (more such points, and span rows of that run) added; and that window decoded.

    Raises:
        ValueError: `payload` is not a window of this version, or is corrupt.
    """
    version = _window_version(payload)
    if version is None:
        raise ValueError("not an otel-train window (unknown leading bytes)")
    message = list(_checked(_unpack_body(payload[len(_WINDOW_MAGIC):]), (6, 7), "window", version))
    try:
        run = RunInfo(*message[1][0])
        points = _ungrouped(message[2]) if version == _GROUPED_VERSION else message[2]
    except (TypeError, IndexError, ValueError, AttributeError) as err:
        raise ValueError(f"a corrupt window ({type(err).__name__}: {err})") from None
    more, spans = add(run, points)
    if more:
        message[2] = (*message[2], *(_grouped(more) if version == _GROUPED_VERSION else more))
    if spans:
        message[5] = (*message[5], (0, *_span_columns(spans)))
    try:
        window = _rows(*message)
    except (TypeError, ValueError, IndexError, AttributeError) as err:
        raise ValueError(f"a corrupt window ({type(err).__name__}: {err})") from None
    return _MAGIC_OF[version] + _packb(tuple(message)), window


def _window_version(payload: bytes) -> int | None:
    """The format of a window's payload (4, or 5: its points grouped), by its leading bytes; None: no window."""
    if payload.startswith(_WINDOW_MAGIC):
        return _VERSION
    return _GROUPED_VERSION if payload.startswith(_GROUPED_MAGIC) else None


def _ungrouped(groups: Sequence[tuple[int, int, Mapping[str, float]]]) -> list[tuple[str, int, float, int]]:
    """Grouped points as ``(tag, step, value, time)`` points, in order."""
    return [(tag, step, value, t) for step, t, values in groups for tag, value in values.items()]


def _grouped(points: Sequence[tuple[str, int, float, int]]) -> list[tuple[int, int, dict[str, float]]]:
    """Points as groups of one point each (added to a grouped window), in order."""
    return [(step, t, {tag: value}) for tag, step, value, t in points]


def encode_resume(run: RunInfo, step: int, cut_after: int) -> bytes:
    """A `Resume` as bytes, for the same channel and spool as windows (its max step is -1)."""
    return _RESUME_MAGIC + _packb((_VERSION, _RUN(run), int(step), int(cut_after)))


def is_resume(payload: bytes) -> bool:
    """Whether an encoded payload is a `Resume` (without decoding it)."""
    return payload.startswith(_RESUME_MAGIC)


def cut_window(window: Window, step: int) -> Window:
    """`window` less its metric and histogram rows at steps >= `step` (spans and log records kept: a span is an event on
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
    return Window(metrics, histograms, window.spans, window.logs)


def decode_window(payload: bytes) -> Window:
    """The rows of an encoded window, or a `Resume` (a `Window` with no rows).

    Raises:
        ValueError: `payload` is not a window of this version (one of an earlier otel-train, a pickle, is
            never unpickled), or is corrupt.
    """
    if is_resume(payload):
        body = payload[len(_RESUME_MAGIC):]
        if body.startswith(_PICKLE):
            raise ValueError(f"a resume {_OLD}")
        message = _checked(_unpack_body(body), (4,), "resume")
        try:
            return Resume(RunInfo(*message[1]), int(message[2]), int(message[3]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"a corrupt resume ({type(err).__name__}: {err})") from None
    version = _window_version(payload)
    if version is None:
        if payload.startswith(_PICKLE):
            raise ValueError(f"a window {_OLD}")
        if payload.startswith(_OTHER_WINDOW) and len(payload) > len(_OTHER_WINDOW):
            raise ValueError(f"a window of encoding version {payload[len(_OTHER_WINDOW)]}, which this version "
                             f"({_VERSION} and {_GROUPED_VERSION}) does not read: deliver it with the otel-train "
                             "version that wrote it")
        raise ValueError("not an otel-train window (unknown leading bytes)")
    message = _checked(_unpack_body(payload[len(_WINDOW_MAGIC):]), (6, 7), "window", version)
    try:
        return _rows(*message)
    except (TypeError, ValueError, IndexError, AttributeError) as err:  # the right framing, the wrong shapes
        raise ValueError(f"a corrupt window ({type(err).__name__}: {err})") from None


def _unpack_body(body: bytes) -> Any:
    try:
        return _unpackb(body)
    except (ValueError, msgpack.UnpackException) as err:
        raise ValueError(f"a corrupt payload ({type(err).__name__}: {err})") from None


def _rows(version: int, run_table: Any, points: Any, metrics: Any, hists: Any, spans: Any, logs: Any = ()) -> Window:
    runs = [RunInfo(*fields) for fields in run_table]
    run = runs[0]
    if version == _GROUPED_VERSION:
        rows = [MetricRow(run, step, tag, tag, value, "gauge", t) for step, t, values in points
                for tag, value in values.items()]
    else:
        rows = [MetricRow(run, step, tag, tag, value, "gauge", t) for tag, step, value, t in points]
    for i, group in metrics:
        rows.extend(starmap(partial(MetricRow, runs[i]), group))
    histograms: list[HistogramRow] = []
    for i, group in hists:
        histograms.extend(starmap(partial(HistogramRow, runs[i]), group))
    for h in histograms:
        if h.exponential is not None:
            h.exponential = ExponentialBuckets(*h.exponential)
    span_rows: list[SpanRow] = []
    for i, high, low, fields in spans:
        if not len(high) == len(low) == len(fields):
            raise ValueError("trace id columns and spans of different lengths")
        group = list(starmap(partial(SpanRow, runs[i]), fields))
        ids = map(or_, map(lshift, high, repeat(64)), low)
        deque(map(setattr, group, repeat("trace_id"), ids), maxlen=0)  # consumed in C, nothing kept
        span_rows.extend(group)
    log_rows: list[LogRow] = []
    for i, group in logs:
        log_rows.extend(starmap(partial(LogRow, runs[i]), group))
    return Window(rows, histograms, span_rows, log_rows)


def _checked(message: Any, sizes: tuple[int, ...], what: str, version: int = _VERSION) -> tuple[Any, ...]:
    """`message`, checked to be a tuple of one of `sizes` elements whose first is `version` (its leading bytes')."""
    if not isinstance(message, tuple) or len(message) not in sizes or message[0] != version:
        found = message[0] if isinstance(message, tuple) and message else "?"
        raise ValueError(f"{what} encoding version {found} is not {version}")
    return message
