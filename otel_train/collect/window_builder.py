"""One collection's data as one window, converted once: what the reader hands every channel.

The collector drains the `ot.log` and span buffers and collects the SDK's instruments; `WindowBuilder`
turns that into the parts of a window: ``(tag, step, value, time)`` tuples for `ot.log` values (and the
per-step phase timings), rows for the SDK's points and histograms (only where this rank exports metrics),
and span rows (from every rank). `DropCounter` adds the drop counts to the window once they change.

What cannot be a point is refused here, counted by cause in `WindowBuilder.refusals` (the session's
`refusals`) and warned about once per key: a value that is no number or no scalar, a key that is not a
non-empty string, a step outside 0..2**63-1 (a raw OTel point's `train.step`; `ot.log` refuses one at the call).
A window never carries such a row, so one bad value never costs the values beside it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from opentelemetry.sdk.metrics.export import MetricsData

from otel_train._internal.ratelimit import LogOnce
from otel_train._internal.values import RefusalCounts, refusal, to_floats, valid_name, valid_text
from otel_train.capture.instrument import AttributedValues, LogBuffer, SpanBuffer, SpanRecord
from otel_train.capture.log_records import CapturedLog
from otel_train.capture.step import MAX_STEP, STEP_ATTRIBUTE, StepEnd
from otel_train.collect.phases import PhaseTimer, Span, span_of
from otel_train.collect.sdk_rows import MetricsConverter, span_rows
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow, series_tag
from otel_train.vocab.run_identity import THREAD_ID, THREAD_NAME, RunInfo

__all__ = ["DropCounter", "WindowBuilder", "WindowParts", "has_points", "span_record_rows"]

_logger = logging.getLogger("otel_train.collect.reader")
#: Keys known to be their own tag (valid, without `{`) are remembered, up to this many: the common point's check
#: is then one set lookup.
_PLAIN_KEYS_MAX = 65536
_VALUES = itemgetter(2)


@dataclasses.dataclass
class WindowParts:
    """One window, as the channels take it (`send_window`)."""

    run: RunInfo
    points: list[tuple[str, int, float, int]]
    metrics: list[MetricRow]
    histograms: list[HistogramRow]
    spans: list[SpanRow]
    logs: list[LogRow] = dataclasses.field(default_factory=list)
    #: `ot.span` records left for the exporter process to make rows of (`WindowBuilder.build`'s `defer_spans`;
    #: None: `spans` holds their rows).
    span_records: list[SpanRecord] | None = None
    #: With `span_records`: the phase fields of the raw OTel spans in `spans`, and whether phases are computed.
    phase_spans: list[Span] = dataclasses.field(default_factory=list)
    phases: bool = False
    #: The `ot.log` points as ``(step, time, {tag: value})`` groups, one a record, for the exporter process to make
    #: points of (`WindowBuilder.build`'s `grouped`; None: `points` holds them).
    groups: list[tuple[int, int, dict[str, float]]] | None = None

    @property
    def point_count(self) -> int:
        """How many `ot.log` points the window holds, as points or in groups."""
        return len(self.points) + (sum(map(len, map(_VALUES, self.groups))) if self.groups else 0)


class WindowBuilder:
    """Converts what one collection drained into `WindowParts`.

    Args:
        export_metrics: Whether this rank exports metrics (else a window holds only its spans).
        phases: Add per-step ``phase/<name>_s`` points computed from the spans of each step.
        refusals: Where refusals are counted (default: counts of its own).
    """

    def __init__(self, export_metrics: bool = True, phases: bool = True, refusals: RefusalCounts | None = None) -> None:
        self.export_metrics = export_metrics
        self.converter = MetricsConverter()
        self._phases = PhaseTimer() if phases and export_metrics else None
        self._wall_offset_ns = wall_offset_ns()  # step ends carry perf_counter times
        self._log = LogOnce(_logger)
        #: What was refused, by cause (`otel_train._internal.values.REFUSAL_CAUSES`); the session's `refusals`.
        self.refusals = refusals if refusals is not None else RefusalCounts()
        self._plain_keys: set[str] = set()

    def run_for(self, resource_attributes: Any) -> RunInfo:
        return self.converter.run_for(resource_attributes)

    def build(self, run: RunInfo, metrics_data: MetricsData | None, records: list[tuple[Any, ...]],
              spans: list[tuple[Any, Any]], step: int, defer_spans: bool = False, grouped: bool = False,
              ) -> WindowParts:
        """The window of one collection; `step` is the step that ends it (for SDK points without one).

        `defer_spans`: leave the `ot.span` records as they are (`WindowParts.span_records`), with the phase fields
        of raw OTel spans: the exporter process makes their rows and the phase timings (`otel_train.ship.span_work`).
        `grouped` (with `defer_spans`): the `ot.log` points as groups (`WindowParts.groups`), which the exporter
        process makes points of.
        """
        attributed: list[MetricRow] = []
        logs: list[LogRow] = []
        grouped = grouped and defer_spans  # in-process phase timings read the points
        points = self._log_points(records, run, attributed, logs, grouped)
        groups = None
        if grouped:
            groups, points = points, []
        if self._phases is not None and not defer_spans:  # phase timings are plain gauges from here on
            points.extend(self._phases.points([s for _, s in spans], points))
        sdk_rows: list[MetricRow] = []
        hists: list[HistogramRow] = []
        # Metric rows only where this rank exports metrics (spans: every rank).
        if self.export_metrics and has_points(metrics_data):
            sdk_rows, hists = self.converter.rows(metrics_data, step)  # type: ignore[arg-type]
            sdk_rows, hists = self._in_range(sdk_rows), self._in_range(hists)
        row_spans: list[SpanRow] = []
        deferred: list[SpanRecord] | None = [] if defer_spans else None
        phase_spans: list[Span] = []
        if spans:
            recs = [s for _, s in spans if isinstance(s, SpanRecord)]
            for rec in recs:
                _valid_span_text(rec)
            sdk_spans = [s for _, s in spans if not isinstance(s, SpanRecord)]
            row_spans = span_rows(sdk_spans, self.converter) if sdk_spans else []
            if deferred is None:
                row_spans = span_record_rows(run, recs) + row_spans
            else:
                deferred = recs
                if self._phases is not None and sdk_spans:
                    phase_spans = [p for p in map(span_of, sdk_spans) if p is not None]
        if not self.export_metrics:  # log records, like spans, from every rank
            return WindowParts(run, [], [], [], row_spans, logs, deferred)
        return WindowParts(run, points, attributed + sdk_rows if attributed else sdk_rows, hists, row_spans, logs,
                           deferred, phase_spans, self._phases is not None, groups)

    def _log_points(self, records: list[tuple[Any, ...]], run: RunInfo, attributed: list[MetricRow],
                    logs: list[LogRow], grouped: bool = False) -> list[Any]:
        """The `ot.log` points of `records`, ``(tag, step, value, time)``; values logged with `attributes=` go to
        `attributed` as gauge rows (the shape a gauge set with those attributes has), converted by the same rules;
        log records to `logs`. `grouped`: as ``(step, time, {tag: value})`` groups, one a record, in order; a
        logged dict whose keys are all known tags and values all floats is its own group (no tuple a point)."""
        out: list[Any] = []
        append = out.append
        plain = self._plain_keys
        slow: list[tuple[Any, ...]] = []  # (where: an index in `out`, or a group's dict; key, step, value, time)
        for _, step, mapping, t in records:
            if type(mapping) is not dict:
                if type(mapping) is tuple:  # a step end's numbers, from `step_end_hook`; its time from `end_ns`
                    t = mapping[1] + self._wall_offset_ns
                    if grouped and 0 <= step <= MAX_STEP:  # its gauges' names are valid and its values floats
                        append((step, t, StepEnd.gauges_from_times(mapping)))
                        continue
                    mapping = StepEnd.from_times(step, mapping)
                elif type(mapping) is AttributedValues:
                    self._attributed_rows(run, step, mapping, t, attributed)
                    continue
                elif type(mapping) is CapturedLog:
                    logs.append(LogRow(run, *mapping.fields()))
                    continue
            if not 0 <= step <= MAX_STEP:  # `ot.log` refuses such a step at the call: this is the last guard
                self.refusals.add("step_out_of_range", len(mapping.items()))
                continue
            if grouped:
                if (type(mapping) is dict and plain.issuperset(mapping)
                        and list(map(type, mapping.values())).count(float) == len(mapping)):  # checked in C
                    append((step, t, mapping))  # the record's own dict: `ot.log` copied it
                    continue
                values: dict[str, float] = {}
                append((step, t, values))
                for key, value in mapping.items():
                    if type(value) is float and key in plain:
                        values[key] = value
                    else:  # converted together below; a group's tags in any order (each its own series)
                        slow.append((values, key, step, value, t))
                continue
            for key, value in mapping.items():
                if type(value) is float and key in plain:  # the common case: nothing to convert
                    append((key, step, value, t))
                else:  # tensors, ints, new or bad keys: converted together below, order kept
                    slow.append((len(out), key, step, value, t))
                    append(None)
        extra: dict[int, list[tuple[int, int, dict[str, float]]]] = {}  # by id of a group's dict: groups after it
        if slow:
            floats = to_floats([s[3] for s in slow])
            for (at, key, step, raw, t), value in zip(slow, floats):
                if type(key) is str:
                    key = valid_text(key)  # a lone surrogate would stop every backend's writes
                if self._usable(key, raw, value) and value is not None:
                    if "{" in key:  # its tag is escaped (`series_tag`): a row, so the key stays its name
                        attributed.append(MetricRow(run, step, key, series_tag(key, None), value, "gauge", t))
                    elif grouped and key in at:  # two keys `valid_text` made one: both kept, as two points were
                        extra.setdefault(id(at), []).append((step, t, {key: value}))
                    elif grouped:
                        at[key] = value
                    else:
                        out[at] = (key, step, value, t)
        if grouped:
            if extra:
                out = [g for group in out for g in (group, *extra.get(id(group[2]), ()))]
            return [g for g in out if g[2]]
        return [p for p in out if p is not None] if slow else out

    def _attributed_rows(self, run: RunInfo, step: int, record: AttributedValues, t: int,
                         rows: list[MetricRow]) -> None:
        attrs = {k: valid_text(v) if type(v) is str else v for k, v in record.attributes.items()}
        items = [(valid_text(k) if type(k) is str else k, v) for k, v in record.values.items()]
        if not 0 <= step <= MAX_STEP:
            self.refusals.add("step_out_of_range", len(items))
            return
        floats = to_floats([v for _, v in items])
        for (key, raw), value in zip(items, floats):
            if self._usable(key, raw, value) and value is not None:
                rows.append(MetricRow(run, step, key, series_tag(key, attrs), value, "gauge", t, attrs))

    def _usable(self, key: Any, raw: Any, value: float | None) -> bool:
        """Whether `key` -> `value` (converted from `raw`) is written; counted and warned about once per key when
        it is not."""
        if not valid_name(key):
            self.refusals.add("bad_key")
            self._log.warning(f"name:{key!r}", "otel_train.log: key %r is not a non-empty string; skipped "
                              "(warned once per key)", key)
            return False
        if value is None:
            cause = refusal(raw)
            self.refusals.add(cause)
            self._log.warning(f"value:{key}", "otel_train.log: key %r has a %s value that is not a %s; skipped "
                              "(warned once per key)", key, type(raw).__name__,
                              "scalar" if cause == "not_a_scalar" else "number")
            return False
        if len(self._plain_keys) < _PLAIN_KEYS_MAX and "{" not in key:
            self._plain_keys.add(key)
        return True

    def _in_range(self, rows: list[Any]) -> list[Any]:
        """`rows` less those whose step is outside 0..2**63-1 (a raw OTel point's `train.step`), counted."""
        kept = [r for r in rows if 0 <= r.step <= MAX_STEP]
        if len(kept) != len(rows):
            self.refusals.add("step_out_of_range", len(rows) - len(kept))
            self._log.warning("step_range", "otel-train: %d points with a `train.step` outside 0..2**63-1 were "
                              "not written (warned once)", len(rows) - len(kept))
        return kept


class DropCounter:
    """Counts what was dropped to keep memory bounded; warns once and adds the counts to the next window
    whenever they change (``otel_train.dropped_records`` / ``_spans`` / ``_batches``).

    Args:
        log_buffer, span_buffer: The buffers whose drops count.
        dropped_windows: Windows the backends of this process dropped so far.
    """

    def __init__(self, log_buffer: LogBuffer, span_buffer: SpanBuffer, dropped_windows: Callable[[], int]) -> None:
        self._log_buffer = log_buffer
        self._span_buffer = span_buffer
        self._dropped_windows = dropped_windows
        self._reported = (0, 0, 0)
        self._log = LogOnce(_logger)

    def report(self, step: int, records: list[tuple[Any, ...]]) -> None:
        """Append a record of the counts at `step` to `records` when they changed since the last call."""
        drops = (self._log_buffer.dropped, self._span_buffer.dropped, self._dropped_windows())
        if drops == self._reported:
            return
        self._reported = drops
        self._log.warning("dropped", "otel-train dropped data to keep memory bounded: %d log records, "
                          "%d spans, %d export windows so far (warned once; see otel_train.dropped_* "
                          "metrics)", *drops)
        records.append((-1, step, {"otel_train.dropped_records": drops[0], "otel_train.dropped_spans": drops[1],
                                   "otel_train.dropped_batches": drops[2]}, time.time_ns()))


def wall_offset_ns(tries: int = 8) -> int:
    """``time.time_ns() - time.perf_counter_ns()``, from the tightest of a few reads: a thread preempted between
    the two clocks' reads would shift every step end it converts by that long, and a step's phases clip its spans
    to the step (a span ending just before the step would fall outside it)."""
    best_gap, offset = -1, 0
    for _ in range(tries):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best_gap < 0 or after - before < best_gap:
            best_gap, offset = after - before, wall - (before + after) // 2
    return offset


def has_points(md: MetricsData | None) -> bool:
    """Whether `md` holds any metric."""
    return md is not None and any(sm.metrics for rm in md.resource_metrics for sm in rm.scope_metrics)


def _valid_span_text(rec: SpanRecord) -> None:
    """A span's name and text attributes as valid Unicode (`valid_text`), set in place (off the training thread)."""
    if not rec.name.isascii():
        rec.name = valid_text(rec.name)
    attrs = rec.attributes
    if attrs and any(type(v) is str and not v.isascii() for v in attrs.values()):
        rec.attributes = {k: valid_text(v) if type(v) is str else v for k, v in attrs.items()}


def span_record_rows(run: RunInfo, recs: list[SpanRecord]) -> list[SpanRow]:
    """The rows of `ot.span` records: their attributes plus the thread, the step and an error message."""
    out: list[SpanRow] = []
    append = out.append
    for rec in recs:
        attrs: dict[str, Any] = dict(rec.attributes) if rec.attributes else {}
        thread_id, thread_name, step, error = rec.thread_id, rec.thread_name, rec.step, rec.error
        attrs[THREAD_ID] = thread_id
        attrs[THREAD_NAME] = thread_name
        if step is not None:
            attrs[STEP_ATTRIBUTE] = step
        if error:
            attrs["error.message"] = error
        append(SpanRow(run, rec.name, rec.trace_id, rec.span_id, rec.parent_id, rec.start_ns, rec.end_ns,
                       thread_id, thread_name, step, attrs, error is not None, error or ""))
    return out
