"""Rows: the one shape every backend consumes.

Both paths end here. In-process, the step-aligned reader turns SDK `MetricsData` and spans into rows
(`otel_train.collect.sdk_rows`); in the sink, OTLP requests become the same rows (`otel_train.sink.decode.requests`). A
backend is written once against `MetricRow`, `HistogramRow`, `SpanRow` and `LogRow`.

Rows carry what OTLP carries besides the values — a metric's unit and description, an exponential
histogram's buckets — so the `otlp` backend sends a window on without losing them. Who produced a row
is its `RunInfo` (`otel_train.vocab.run_identity`); where a run's files go is `otel_train.vocab.run_paths`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from otel_train.vocab import semconv
from otel_train.vocab.run_identity import RunInfo

__all__ = [
    "LOSS_CAUSES",
    "ExponentialBuckets",
    "HistogramRow",
    "LogRow",
    "MetricRow",
    "SpanRow",
    "Window",
    "explicit_buckets",
    "extra_attributes",
    "series_tag",
]

#: Attributes that identify a point's step and rank; every other attribute makes a distinct series.
_SERIES_EXCLUDED = frozenset({semconv.TRAIN_STEP, semconv.TRAIN_RANK})


@dataclasses.dataclass(slots=True, eq=False)
class MetricRow:
    """One value of one series at one step.

    Rows are shared by every exporter of a window: read them, never change them (not frozen
    only because frozen dataclasses cost ~4x more to build, on the export thread).

    Attributes:
        tag: `name` plus a deterministic ``{k=v,...}`` suffix for extra attributes: the key every
            backend shows (``train/loss``, ``eval/acc{split=val}``).
        kind: ``gauge``, ``counter`` (running total), ``sum`` (up-down running total) or
            ``histogram`` (count/sum/min/max rows of a histogram, tagged ``name/count`` ...).
        delta: For a sum from a DELTA point, that point's own value (what this collection added at
            this step); the `otlp` backend sends it as a DELTA point again. None otherwise.
        unit, description: The instrument's (``""`` when it has none), as OTLP carries them.
    """

    run: RunInfo
    step: int
    name: str
    tag: str
    value: float
    kind: str
    time_unix_nano: int
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    delta: float | None = None
    unit: str = ""
    description: str = ""

    @property
    def rank(self) -> int:
        return self.run.rank


class ExponentialBuckets(NamedTuple):
    """The buckets of an OTel exponential histogram point, as the data model has them.

    Bucket ``offset + i`` of `positive_counts` covers ``(base**(offset+i), base**(offset+i+1)]`` with
    ``base = 2**(2**-scale)``; negative buckets mirror it; `zero_count` values are within `zero_threshold`
    of zero.
    """

    scale: int
    zero_count: int
    positive_offset: int
    positive_counts: tuple[int, ...]
    negative_offset: int = 0
    negative_counts: tuple[int, ...] = ()
    zero_threshold: float = 0.0


@dataclasses.dataclass(slots=True, eq=False)
class HistogramRow:
    """A full histogram at one step, for backends that draw histograms.

    `explicit_bounds` / `bucket_counts` are always set: for an exponential histogram they are its buckets
    as explicit ones (`explicit_buckets`), so every backend draws it; `exponential` keeps the original
    buckets (None for an explicit-bucket histogram), which the `otlp` backend sends on as they came.
    """

    run: RunInfo
    step: int
    name: str
    tag: str
    count: int
    sum: float
    min: float
    max: float
    explicit_bounds: Sequence[float]
    bucket_counts: Sequence[int]
    time_unix_nano: int
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    unit: str = ""
    description: str = ""
    exponential: ExponentialBuckets | None = None


@dataclasses.dataclass(slots=True, eq=False)
class SpanRow:
    """One finished span, with the thread that started it and its step (if any)."""

    run: RunInfo
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    start_unix_nano: int
    end_unix_nano: int
    thread_id: int
    thread_name: str
    step: int | None
    attributes: Mapping[str, Any]
    error: bool = False
    status_message: str = ""
    #: The span's events (``span.add_event``, ``record_exception``) as (name, time_unix_nano, attributes).
    events: tuple[tuple[str, int, Mapping[str, Any]], ...] = ()
    #: `opentelemetry.trace.SpanKind` as its value (0 = internal) and links as (trace_id, span_id, attributes).
    kind: int = 0
    links: tuple[tuple[int, int, Mapping[str, Any]], ...] = ()


@dataclasses.dataclass(slots=True, eq=False)
class LogRow:
    """One OTel log record: a `logging` record, an uncaught exception, a line of stdout/stderr.

    Attributes:
        step: The step it was recorded in (``train.step``), None outside any step.
        severity_number, severity_text: As the OTel log data model has them (``WARN`` is 13, ``ERROR`` 17).
        body: The message, formatted (``%``-args applied).
        logger: Who emitted it (the `logging` logger's name; the OTel instrumentation scope).
        attributes: Semantic-convention attributes (``exception.*``, ``thread.*``, ``code.*``, ``event.name``)
            and the record's extras; never the step or the rank (fields of the row).
        trace_id, span_id: The span active where it was emitted (0: none).
    """

    run: RunInfo
    step: int | None
    time_unix_nano: int
    severity_number: int
    severity_text: str
    body: str
    logger: str
    attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    trace_id: int = 0
    span_id: int = 0

    @property
    def rank(self) -> int:
        return self.run.rank


#: Why a backend did not write a row (`RowExporter.rows_lost`), as the shutdown summary words it.
LOSS_CAUSES: dict[str, str] = {
    "bad_step": "bad step",
    "bad_value": "bad value",
    "refused": "refused by the backend",
    "gave_up": "given up after retries",
    "disk_full": "disk full",
    "not_started": "the backend did not start",
    "at_close": "still failing at shutdown",
    "abandoned": "not written when shutdown's time ran out",
}


class Window:
    """The rows of one export window."""

    __slots__ = ("histograms", "logs", "metrics", "spans")

    def __init__(
        self,
        metrics: Sequence[MetricRow] = (),
        histograms: Sequence[HistogramRow] = (),
        spans: Sequence[SpanRow] = (),
        logs: Sequence[LogRow] = (),
    ) -> None:
        self.metrics = metrics
        self.histograms = histograms
        self.spans = spans
        self.logs = logs

    def __bool__(self) -> bool:
        return bool(self.metrics or self.histograms or self.spans or self.logs)


def series_tag(name: str, attributes: Mapping[str, Any] | None) -> str:
    r"""The series key: `name`, plus sorted extra attributes as ``{k=v,...}``.

    Distinct series never share a tag: in attribute keys and values a backslash, ``,``, ``=``, ``{`` and ``}`` are
    escaped with a backslash; the name is written as it is unless it holds a ``{`` or the series has attributes,
    where its backslashes and ``{`` are escaped too (so a key ``acc{a=1}`` is not the series ``acc`` with ``a=1``).
    Ordinary names and values are unchanged. Values are shown as text: ``1`` and ``"1"`` name the same series.

    Example:
        >>> series_tag("eval/acc", {"split": "val", "train.step": 3})
        'eval/acc{split=val}'
        >>> series_tag("acc", {"a": "1,b=2"}), series_tag("acc", {"a": "1", "b": "2"}), series_tag("acc{a=1,b=2}", None)
        ('acc{a=1\\,b\\=2}', 'acc{a=1,b=2}', 'acc\\{a=1,b=2}')
    """
    extra = [(k, v) for k, v in attributes.items() if k not in _SERIES_EXCLUDED] if attributes else None
    if not extra:
        return name if "{" not in name else _escape_name(name)
    extra.sort()
    items = ",".join([f"{k}={v}" for k, v in extra])
    if (items.count("=") != len(extra) or items.count(",") != len(extra) - 1  # more than its own `,` and `=`
            or "\\" in items or "{" in items or "}" in items):
        items = ",".join([f"{_escape_item(str(k))}={_escape_item(str(v))}" for k, v in extra])
    return (name if "\\" not in name and "{" not in name else _escape_name(name)) + "{" + items + "}"


_ITEM_SPECIAL = re.compile(r"[\\,={}]")
_NAME_SPECIAL = re.compile(r"[\\{]")


def _escape_item(text: str) -> str:
    r"""An attribute key or value inside a tag's ``{...}``: ``\ , = { }`` each after a backslash."""
    return _ITEM_SPECIAL.sub(r"\\\g<0>", text)


def _escape_name(name: str) -> str:
    r"""The name part of a tag that has ``{``: ``\`` and ``{`` each after a backslash."""
    return _NAME_SPECIAL.sub(r"\\\g<0>", name)


def extra_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """`attributes` less the step and rank (what makes a distinct series)."""
    if not attributes:
        return {}
    return {k: v for k, v in attributes.items() if k not in _SERIES_EXCLUDED}


def explicit_buckets(buckets: ExponentialBuckets) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Explicit (bounds, counts) of exponential buckets, for backends that draw histograms.

    Each explicit bucket ends at the upper edge of its exponential bucket; the zero bucket sits between the
    negative and positive ones; the first explicit bucket is open below, the last (empty) above.

    Example:
        >>> explicit_buckets(ExponentialBuckets(0, 1, 0, (2, 3)))
        ((0.0, 2.0, 4.0), (1, 2, 3, 0))
    """
    scale = buckets.scale

    def edge(index: int) -> float:
        try:
            return float(2.0 ** (index * 2.0 ** -scale))
        except OverflowError:
            return math.inf

    bounds: list[float] = []
    counts: list[int] = []
    neg_counts = buckets.negative_counts
    for i in range(len(neg_counts) - 1, -1, -1):  # most negative first
        bounds.append(-edge(buckets.negative_offset + i))
        counts.append(int(neg_counts[i]))
    if buckets.zero_count or neg_counts or buckets.positive_counts:
        bounds.append(0.0)
        counts.append(int(buckets.zero_count))
    for i, c in enumerate(buckets.positive_counts):
        bounds.append(edge(buckets.positive_offset + i + 1))
        counts.append(int(c))
    counts.append(0)
    return tuple(bounds), tuple(counts)
