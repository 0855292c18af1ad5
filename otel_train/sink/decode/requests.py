"""OTLP requests (protobuf or JSON) -> rows of `otel_train.vocab.rows`.

Decoding is pure: a request is turned into a `Decoded` batch without touching any state, so a
malformed request fails as a whole and nothing of it is written. The run's rules (temporality,
steps of step-less points; `otel_train.sink.runs.temporality`) are applied afterwards, by the router,
with `Decoded.finish`.

Protobuf requests are parsed with a lean copy of the schema (`otel_train.sink.decode.otlp`): gauge and sum
metrics are walked from their encoding (`otel_train.sink.decode.metric_walk`), their points read from theirs
(`otel_train.sink.decode.points`); OTLP/JSON, other metric kinds and shapes no usual encoder writes go through
protobuf's objects, with the same rows; traces in `otel_train.sink.decode.traces`.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from otel_train.capture.step import RANK_ATTRIBUTE, STEP_ATTRIBUTE
from otel_train.sink.decode.metric_walk import MetricHeaders
from otel_train.sink.decode.otlp import (
    BAD_STEP,
    NO_EXTRA,
    DecodeError,
    attributes,
    lean_metric,
    lean_metrics_request,
    lean_points_request,
    number_point,
    parse_metrics,
    parse_traces,
    point_attributes,
    step_value,
)
from otel_train.sink.decode.points import DOUBLE, TIME, TIME_DOUBLE, WHOLE, AttributeCache, split_point
from otel_train.sink.decode.resources import DecodeCache, fallback_run_id, resource_run
from otel_train.sink.decode.wire import GAUGE_KEY, SUM_KEY, walk_metric
from otel_train.sink.runs.temporality import (
    CUMULATIVE_COUNTER,
    CUMULATIVE_UPDOWN,
    DELTA_SUM,
    GAUGE,
    STEPLESS,
    SeriesLedger,
)
from otel_train.vocab.names import KEY_DESCRIPTION_PREFIX, key_from_description
from otel_train.vocab.rows import (
    ExponentialBuckets,
    HistogramRow,
    LogRow,
    MetricRow,
    SpanRow,
    explicit_buckets,
    series_tag,
)
from otel_train.vocab.run_identity import RunInfo

__all__ = [
    "DecodeCache", "DecodeError", "Decoded", "decode_metrics", "fallback_run_id", "parse_metrics", "parse_traces",
]

_DELTA = 1  # AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA in the proto enum
_SERIES_EXCLUDED = frozenset({STEP_ATTRIBUTE, RANK_ATTRIBUTE})
#: Buckets (or quantiles) one histogram point may have; a point with more is refused alone. OTel SDKs
#: default to 16 explicit and 160 exponential buckets; the cap bounds what one request can expand to.
MAX_BUCKETS = 16_384


class Decoded:
    """The rows of one request, with what the router needs to know of them (computed while decoding,
    so the router does not walk the rows again). Number and histogram points stay pending until
    `finish` applies the run's temporality and step rules (`otel_train.sink.runs.temporality`).

    Attributes:
        runs: Every run (one rank of one training run) that sent data, with its highest step.
        tags: The series tags of each training run (`train.run.id`).
        unattributed: Resources without `train.run.id`, by the run name they were given.
        unsupported: Metrics that were not written, by OTLP data type.
        refused: Points refused alone (a step that is no step, too many buckets), by ``(why, metric)``; the
            items of a Resource refused alone (``why`` ``bad_resource``: a run id no backend can name, a metric
            without a name, a malformed point), by ``("bad_resource", reason)``.
    """

    __slots__ = (
        "_gauges",
        "_hists",
        "_numbers",
        "_resource",
        "histograms",
        "logs",
        "metrics",
        "refused",
        "refused_resources",
        "resources",
        "runs",
        "sender",
        "spans",
        "tags",
        "unattributed",
        "unsupported",
    )

    def __init__(self) -> None:
        self.metrics: list[MetricRow] = []
        self.histograms: list[HistogramRow] = []
        self.spans: list[SpanRow] = []
        self.logs: list[LogRow] = []
        # Gauge rows with a step (the hot path), and (row, temporality mode, start time) of the other
        # number points, until `finish`.
        self._gauges: list[MetricRow] = []
        self._numbers: list[tuple[MetricRow, int, int, str]] = []
        # (row, cumulative, start time, has buckets) of histogram and summary points until `finish`.
        self._hists: list[tuple[HistogramRow, bool, int, bool, str]] = []
        #: The sender (`service.instance.id`, else host and pid) of the Resource being decoded.
        self.sender = ""
        self.runs: dict[RunInfo, int] = {}  # highest step of metric points; -1 for none (spans only)
        self.tags: dict[str, set[str]] = {}
        self.unattributed: dict[str, int] = {}
        self.unsupported: dict[str, int] = {}
        self.refused: dict[tuple[str, str], int] = {}
        self.resources = 0  # Resources of the request (counted by `mark`)
        self.refused_resources: list[DecodeError] = []
        # The Resource being decoded: its run id, that run's series before it and its unattributed count before it.
        self._resource: tuple[RunInfo, set[str] | None, int, int | None] | None = None

    def refuse(self, why: str, name: str, count: int = 1) -> None:
        """Count `count` points of metric `name` that are not written (the rest of the request is)."""
        key = (why, name)
        self.refused[key] = self.refused.get(key, 0) + count

    def resource_began(self, run: RunInfo) -> None:
        tags = self.tags.get(run.run_id)
        self._resource = (run, set(tags) if tags else None, self.unattributed.get(run.run_id, 0), self.runs.get(run))

    def mark(self) -> tuple[Any, ...]:
        """Where the rows stand now, as a Resource begins: `refuse_resource` takes back what it added after it."""
        self.resources += 1
        self._resource = None
        return (len(self.metrics), len(self.histograms), len(self.spans), len(self.logs), len(self._gauges),
                len(self._numbers), len(self._hists), len(self.runs))

    def refuse_resource(self, mark: tuple[Any, ...], err: DecodeError, items: int) -> None:
        """Take back every row a malformed Resource added since `mark` and count its `items` as refused: one
        job's bad data (a collector batches many jobs into one request) never costs the other jobs theirs."""
        *lengths, runs = mark
        parts: tuple[list[Any], ...] = (self.metrics, self.histograms, self.spans, self.logs, self._gauges,
                                        self._numbers, self._hists)
        for rows, n in zip(parts, lengths, strict=True):
            del rows[n:]
        # Runs it added go (they come last: a dict keeps its order; not a copy per Resource, which a collector's
        # batch of thousands of runs would make quadratic). A run an earlier Resource also named keeps that one's
        # step (below).
        for run in list(itertools.islice(self.runs, runs, None)):
            del self.runs[run]
        if self._resource is not None:  # its run's series, the step it saw and its count as unattributed go too
            run, tags, unattributed, step = self._resource
            run_id = run.run_id
            if step is not None and run in self.runs:  # named by an earlier Resource: the step that one saw
                self.runs[run] = step
            if tags is None:
                self.tags.pop(run_id, None)
            else:
                self.tags[run_id] = tags
            if unattributed:
                self.unattributed[run_id] = unattributed
            else:
                self.unattributed.pop(run_id, None)
        self.refuse("bad_resource", str(err)[:200], items)
        self.refused_resources.append(err)

    def raise_if_all_refused(self) -> None:
        """Raise the first Resource's error when every Resource of the request was refused: nothing of it is
        written, and the sender is told why (400 / INVALID_ARGUMENT), as for any malformed request."""
        if self.refused_resources and len(self.refused_resources) == self.resources:
            for key in [k for k in self.refused if k[0] == "bad_resource"]:
                del self.refused[key]  # counted as a rejected request instead
            raise self.refused_resources[0]

    @classmethod
    def of_rows(cls, metrics: Sequence[MetricRow] = (), spans: Sequence[SpanRow] = ()) -> Decoded:
        """A batch of rows built elsewhere (the compat API, aggregates)."""
        out = cls()
        out.metrics.extend(metrics)
        out.spans.extend(spans)
        for row in metrics:
            out.saw(row.run, row.step)
            out.tags_of(row.run).add(row.tag)
        for sp in spans:
            out.runs.setdefault(sp.run, -1)
        return out

    @property
    def points(self) -> int:
        return len(self.metrics) + len(self._gauges) + len(self._numbers) + len(self.histograms) + len(self._hists)

    def saw(self, run: RunInfo, step: int) -> None:
        if step > self.runs.get(run, -1):
            self.runs[run] = step

    def tags_of(self, run: RunInfo) -> set[str]:
        tags = self.tags.get(run.run_id)
        if tags is None:
            tags = self.tags[run.run_id] = set()
        return tags

    def finish(self, ledger: SeriesLedger) -> None:
        """Turn pending points into rows by the run's rules (arrival order, step order inside a metric).

        Args:
            ledger: The run's series state (one per `train.run.id`; the router keeps it).
        """
        for step in self.runs.values():  # steps reported in this request count as the run's current step
            ledger.saw_step(step)
        append = self.metrics.append
        ledger.gauges(self._gauges, append)
        self._gauges.clear()
        number = ledger.number
        for row, mode, start, sender in self._numbers:  # rows not yet shared with anyone: set in place
            if number(row, mode, start, sender):
                append(row)
        self._numbers.clear()
        self.metrics.extend(ledger.take_corrections())  # DELTA series whose highest step was written short
        for hist, cumulative, start, buckets, sender in self._hists:
            out = ledger.histogram(hist, cumulative, start, sender)
            if out is None:
                continue
            if buckets:
                self.histograms.append(out)
            self.metrics.extend(_histogram_stats(out))
        self._hists.clear()

    def split_by_run(self) -> dict[str, Decoded]:
        """One `Decoded` per `train.run.id` (a collector batches several runs into one request)."""
        ids = {run.run_id for run in self.runs}
        if len(ids) <= 1:
            return {next(iter(ids)): self} if ids else {}
        out: dict[str, Decoded] = {}

        def part(run_id: str) -> Decoded:
            d = out.get(run_id)
            if d is None:
                d = out[run_id] = Decoded()
            return d

        for run, step in self.runs.items():
            d = part(run.run_id)
            d.runs[run] = step
            d.tags[run.run_id] = self.tags.get(run.run_id, set())
        for m in self.metrics:
            part(m.run.run_id).metrics.append(m)
        for g in self._gauges:
            part(g.run.run_id)._gauges.append(g)
        for n in self._numbers:
            part(n[0].run.run_id)._numbers.append(n)
        for h in self.histograms:
            part(h.run.run_id).histograms.append(h)
        for hp in self._hists:
            part(hp[0].run.run_id)._hists.append(hp)
        for sp in self.spans:
            part(sp.run.run_id).spans.append(sp)
        for record in self.logs:
            part(record.run.run_id).logs.append(record)
        return out


def _histogram_stats(h: HistogramRow) -> list[MetricRow]:
    """The ``/count``, ``/sum``, ``/min``, ``/max`` rows of a histogram (absent min/max: no row)."""
    out = []
    for stat, value in (("count", float(h.count)), ("sum", h.sum), ("min", h.min), ("max", h.max)):
        if math.isnan(value):
            continue
        stat_name = f"{h.name}/{stat}"
        tag = series_tag(stat_name, h.attributes)
        out.append(MetricRow(h.run, h.step, stat_name, tag, value, "histogram", h.time_unix_nano, h.attributes))
    return out


def _step(attrs: Mapping[str, Any]) -> int:
    raw = attrs.get(STEP_ATTRIBUTE)
    return STEPLESS if raw is None else step_value(raw)


def _extra(attrs: Mapping[str, Any]) -> Mapping[str, Any]:
    return {k: v for k, v in attrs.items() if k not in _SERIES_EXCLUDED} if attrs else NO_EXTRA


def _sum_mode(s: Any) -> int:
    if s.aggregation_temporality == _DELTA:
        return DELTA_SUM
    return CUMULATIVE_COUNTER if s.is_monotonic else CUMULATIVE_UPDOWN


def _one_point(p: Any, name: str, kind: str, run: RunInfo, unit: str = "", description: str = "") -> MetricRow:
    step, extra = point_attributes(p.attributes)
    tag = series_tag(name, extra)
    return MetricRow(run, STEPLESS if step is None else step, name, tag, p.as_double or float(p.as_int), kind,
                     p.time_unix_nano, extra, None, unit, description)


def _unit_description(metric: Any) -> tuple[str, str]:
    """The metric's unit and description as rows keep them (not a description that carries the key)."""
    description = metric.description
    return metric.unit, "" if description.startswith(KEY_DESCRIPTION_PREFIX) else description


def _numbers(points: Any, name: str, kind: str, mode: int, run: RunInfo, seen: Decoded, metric: Any) -> None:
    """Pending rows of gauge or sum points given as protobuf objects (OTLP/JSON requests)."""
    unit, description = _unit_description(metric)
    rows: list[tuple[MetricRow, int, int, str]] = []
    hi = -1
    for p in points:
        hi = max(hi, _pending_point(p, name, kind, mode, run, unit, description, seen, rows))
    if mode != GAUGE:
        rows.sort(key=_by_step)  # running totals follow the step order
    seen._numbers.extend(rows)
    if hi >= 0:
        seen.saw(run, hi)


def _pending_point(p: Any, name: str, kind: str, mode: int, run: RunInfo, unit: str, description: str, out: Decoded,
                   rows: list[tuple[MetricRow, int, int, str]]) -> int:
    """The row of one number point given as a protobuf object, pending: a gauge with a step in `out`, any other
    in `rows` (with its temporality mode, start time and sender). Returns its step; -1 when it is refused."""
    row = _one_point(p, name, kind, run, unit, description)
    if row.step == BAD_STEP:
        out.refuse("bad_step", name)
        return -1
    out.tags_of(run).add(row.tag)
    if mode == GAUGE and row.step != STEPLESS:
        out._gauges.append(row)
    else:
        rows.append((row, mode, p.start_time_unix_nano, out.sender))
    return row.step


def _by_step(item: tuple[MetricRow, int, int, str]) -> int:
    return item[0].step


def _named_metrics(scope_metrics: Any) -> Iterator[tuple[str, str | None, Any]]:
    """(name, data kind, metric) of every metric of a Resource; an empty name fails the Resource."""
    for sm in scope_metrics:
        for metric in sm.metrics:
            name = metric.name
            if not name:
                raise DecodeError("a metric has an empty name")
            if metric.description:  # the key as logged, when `otlp` had to map it (`otel_train.vocab.names`)
                name = key_from_description(name, metric.description)
            yield name, metric.WhichOneof("data"), metric


def _lean_resource(scope_metrics: Any, run: RunInfo, out: Decoded, cache: AttributeCache,
                   headers: MetricHeaders, walk: bool) -> None:
    """Pending rows of one Resource's metrics from a lean request: each gauge or sum metric walked from
    its encoding when `walk` (`otel_train.sink.decode.metric_walk`; any other shape is parsed by protobuf), else
    read from a lean `Metric`; their points from their own encoding (`otel_train.sink.decode.points`). The
    sink's hot loop, kept flat: one call per Resource, not per metric (a request often holds one point
    per metric), no Python object per field."""
    entries = cache.entries
    known_headers = headers.entries
    usual_shapes = headers.usual
    unpack = TIME_DOUBLE.unpack_from
    tags = out.tags_of(run)
    gauge_rows = out._gauges.append
    sender = out.sender
    hi = -1
    entry: Any
    points: Any
    for sm in scope_metrics:
        for m in sm.metrics:
            points = None
            if walk:  # `otel_train.sink.decode.metric_walk`
                try:
                    i = m[1] + 6  # the usual shape's prefix: name, gauge key and length, point key and length
                except IndexError:  # under 2 bytes: protobuf says what it is
                    i = 0
                usual = usual_shapes.get(m[:i])
                if usual is not None and len(m) == usual[3]:
                    name, description, unit, _ = usual
                    # The hottest path: a gauge point [time, as_double, attributes with a step] read in place
                    # (the loop below reads every other point, and this one when it is not that).
                    try:
                        time_key, t, value_key, value = unpack(m, i)
                    except struct.error:  # shorter than the common front
                        time_key = value_key = 0
                    if time_key == TIME and value_key == DOUBLE:
                        rem = m[i + 18:]
                        entry = entries.get(rem) or cache.decode(rem)
                        if entry is not WHOLE:
                            step, extra = entry
                            if step is not None and step != BAD_STEP:
                                tag = (name if "{" not in name else series_tag(name, None)) if extra is NO_EXTRA \
                                    else series_tag(name, extra)  # a key holding `{` is escaped in its tag
                                tags.add(tag)
                                if step > hi:  # noqa: PLR1730 - cheaper than a max() call per point
                                    hi = step
                                gauge_rows(MetricRow(run, step, name, tag, value, "gauge", t, extra, None, unit,
                                                     description))
                                continue
                    key, points = GAUGE_KEY, (m[i:],)
                else:
                    shape = walk_metric(m)
                    if shape is None:
                        m = lean_metric(m)
                    else:
                        i, key, points, temporality, monotonic = shape
                        header = m[:i]
                        name, description, unit = known_headers.get(header) or headers.decode(header)
                        if key == GAUGE_KEY and len(points) == 1:
                            headers.learn_usual(m, i, name, description, unit)
            if points is None:  # a lean `Metric`: its fields read once (each read builds a Python object)
                name = m.name
                if not name:
                    raise DecodeError("a metric has an empty name")
                description = m.description
                if description:  # the key as logged, when `otlp` had to map it (`otel_train.vocab.names`)
                    name = key_from_description(name, description)
                    if description.startswith(KEY_DESCRIPTION_PREFIX):
                        description = ""  # rows keep a description, not the key it carried
                kind = m.WhichOneof("data")
                if kind == "gauge":
                    points, key = m.gauge.data_points, GAUGE_KEY
                elif kind == "sum":
                    s = m.sum
                    points, key, temporality, monotonic = s.data_points, SUM_KEY, s.aggregation_temporality, s.is_monotonic
                else:
                    _other_metric(m, kind, name, run, out)
                    continue
                unit = m.unit
            if key == GAUGE_KEY:
                row_kind, mode = "gauge", GAUGE
                rows = out._numbers  # step-less gauges; those with a step go to `gauge_rows`
            else:
                row_kind = "counter" if monotonic else "sum"
                mode = DELTA_SUM if temporality == _DELTA else CUMULATIVE_COUNTER if monotonic else CUMULATIVE_UPDOWN
                rows = []
            append = rows.append
            plain = False
            for raw in points:
                try:
                    time_key, t, value_key, value = unpack(raw)
                except struct.error:  # shorter than the common front
                    time_key = value_key = 0
                start = 0
                if time_key == TIME and value_key == DOUBLE:
                    rem = raw[18:]
                    entry = entries.get(rem) or cache.decode(rem)
                else:
                    parts = split_point(raw)
                    if parts is None:
                        entry = WHOLE
                    else:
                        start, t, value, rem = parts
                        entry = entries.get(rem) or cache.decode(rem)
                if entry is WHOLE:  # a layout the fast read does not take: protobuf parses the point
                    hi = max(hi, _pending_point(number_point(raw), name, row_kind, mode, run, unit, description, out,
                                                   rows))
                    continue
                step, extra = entry
                if step == BAD_STEP:
                    out.refuse("bad_step", name)
                    continue
                if extra is NO_EXTRA:
                    plain = True
                    tag = name if "{" not in name else series_tag(name, None)  # a key holding `{`: escaped
                else:
                    tag = series_tag(name, extra)
                    tags.add(tag)
                if step is None:
                    step = STEPLESS
                elif mode == GAUGE:  # the hot path: a gauge with a step
                    if step > hi:  # noqa: PLR1730 - cheaper than a max() call per point
                        hi = step
                    gauge_rows(MetricRow(run, step, name, tag, value, row_kind, t, extra, None, unit, description))
                    continue
                if step > hi:  # noqa: PLR1730
                    hi = step
                append((MetricRow(run, step, name, tag, value, row_kind, t, extra, None, unit, description), mode,
                        start, sender))
            if plain:
                tags.add(series_tag(name, None))
            if mode != GAUGE:
                rows.sort(key=_by_step)  # running totals follow the step order
                out._numbers.extend(rows)
    if hi >= 0:
        out.saw(run, hi)


def _other_metric(metric: Any, kind: str | None, name: str, run: RunInfo, out: Decoded) -> None:
    """Histograms, exponential histograms and summaries; anything else is counted as unsupported."""
    if kind == "histogram":
        h = metric.histogram
        cumulative = h.aggregation_temporality != _DELTA
        for p in h.data_points:
            if len(p.bucket_counts) not in (0, len(p.explicit_bounds) + 1):
                out.refuse("bad_buckets", name)  # no histogram can be made of it
                continue
            if len(p.explicit_bounds) >= MAX_BUCKETS:
                out.refuse("too_many_buckets", name)
                continue
            _pending_histogram(out, run, name, p, tuple(p.explicit_bounds), tuple(p.bucket_counts), cumulative, True,
                               metric)
    elif kind == "exponential_histogram":
        h = metric.exponential_histogram
        cumulative = h.aggregation_temporality != _DELTA
        for p in h.data_points:
            if len(p.positive.bucket_counts) + len(p.negative.bucket_counts) >= MAX_BUCKETS:
                out.refuse("too_many_buckets", name)  # before expanding them: 8M buckets fit in 8 MiB
                continue
            # Kept as they came for DELTA points (the `otlp` backend sends them on); a CUMULATIVE point's
            # increase is computed on the explicit form, so its row has that form only.
            exp = ExponentialBuckets(p.scale, p.zero_count, p.positive.offset, tuple(p.positive.bucket_counts),
                                     p.negative.offset, tuple(p.negative.bucket_counts), p.zero_threshold)
            bounds, counts = explicit_buckets(exp)
            _pending_histogram(out, run, name, p, bounds, counts, cumulative, True, metric,
                               None if cumulative else exp)
    elif kind == "summary":
        for p in metric.summary.data_points:  # count and sum are cumulative by the data model
            if len(p.quantile_values) >= MAX_BUCKETS:
                out.refuse("too_many_buckets", name)
                continue
            row = _pending_histogram(out, run, name, p, (), (), True, False, metric)
            if row is None:
                continue
            tags = out.tags_of(run)
            for q in p.quantile_values:
                q_name = f"{name}/p{q.quantile * 100:g}"
                tag = series_tag(q_name, row.attributes)
                tags.add(tag)
                out._numbers.append((MetricRow(run, row.step, q_name, tag, float(q.value), "gauge",
                                               p.time_unix_nano, row.attributes), GAUGE, 0, out.sender))
    else:
        kind = kind or "empty"
        out.unsupported[kind] = out.unsupported.get(kind, 0) + 1


def _has(p: Any, field: str) -> bool:
    """Whether a point carries `field` (optional fields by presence; summaries have no min/max)."""
    desc = p.DESCRIPTOR.fields_by_name.get(field)
    if desc is None:
        return False
    return bool(p.HasField(field)) if desc.has_presence else True


def _pending_histogram(out: Decoded, run: RunInfo, name: str, p: Any, bounds: tuple[float, ...],
                       counts: tuple[int, ...], cumulative: bool, buckets: bool, metric: Any,
                       exponential: ExponentialBuckets | None = None) -> HistogramRow | None:
    """The pending row of a histogram or summary point; None (counted) when its step is no step."""
    attrs = attributes(p.attributes)
    step = _step(attrs)
    if step == BAD_STEP:
        out.refuse("bad_step", name)
        return None
    extra = _extra(attrs)
    total = float(p.sum) if _has(p, "sum") else 0.0
    lo = float(p.min) if _has(p, "min") else math.nan
    hi = float(p.max) if _has(p, "max") else math.nan
    tag = series_tag(name, extra)
    tags = out.tags_of(run)
    tags.add(tag)
    for stat in ("count", "sum", "min", "max"):
        tags.add(series_tag(f"{name}/{stat}", extra))
    out.saw(run, step)
    row = HistogramRow(run, step, name, tag, int(p.count), total, lo, hi, bounds, counts, p.time_unix_nano, extra,
                       *_unit_description(metric), exponential)
    out._hists.append((row, cumulative, p.start_time_unix_nano, buckets, out.sender))
    return row


# -- requests -> rows ----------------------------------------------------------------------------
def decode_metrics(request: Any, runs: DecodeCache) -> Decoded:
    """Rows of an `ExportMetricsServiceRequest` (the usual class or one of `parse_metrics`'s lean ones).

    Points stay pending until `Decoded.finish` (steps of step-less points, temporality).
    """
    walked = lean_metrics_request()
    out = Decoded()
    if walked is not None and isinstance(request, (walked, lean_points_request())):
        walk = isinstance(request, walked)
        for rm in request.resource_metrics:
            mark = out.mark()
            try:
                run = resource_run(attributes(rm.resource.attributes), bool(rm.scope_metrics), runs, out)
                _lean_resource(rm.scope_metrics, run, out, runs.points, runs.headers, walk)
            except DecodeError as err:
                out.refuse_resource(mark, err, _metric_points(rm.scope_metrics))
        out.raise_if_all_refused()
        return out
    for rm in request.resource_metrics:
        mark = out.mark()
        try:
            run = resource_run(attributes(rm.resource.attributes), bool(rm.scope_metrics), runs, out)
            for name, kind, metric in _named_metrics(rm.scope_metrics):
                if kind == "gauge":
                    _numbers(metric.gauge.data_points, name, "gauge", GAUGE, run, out, metric)
                elif kind == "sum":
                    s = metric.sum
                    _numbers(s.data_points, name, "counter" if s.is_monotonic else "sum", _sum_mode(s), run, out,
                             metric)
                else:
                    _other_metric(metric, kind, name, run, out)
        except DecodeError as err:
            out.refuse_resource(mark, err, _metric_points(rm.scope_metrics))
    out.raise_if_all_refused()
    return out


def _metric_points(scope_metrics: Any) -> int:
    """The data points of a Resource's metrics (a metric that cannot be read counts as one)."""
    count = 0
    for sm in scope_metrics:
        for m in sm.metrics:
            try:
                metric = lean_metric(m) if isinstance(m, bytes) else m
                kind = metric.WhichOneof("data")
                count += max(1, len(getattr(metric, kind).data_points)) if kind else 1
            except (DecodeError, AttributeError):
                count += 1
    return count
