"""Per-step phase timings: where each step's time went, from the spans recorded inside it.

For every finished step (a ``train.step.duration_s`` point from `ot.step`), the top-level spans of
that step become ``phase/<name>_s`` (the summed time of the spans with that name, clipped to the
step) and ``phase/other_s`` (step time covered by no top-level span), so that
``sum(phase/*_s) == train.step.duration_s`` when the phases do not overlap.

"Top-level" means: opened inside the step (in the context of `ot.step`, so not a prefetch thread's
span stamped with the latest step) and not nested in another span of the same step, so ``backward``
inside ``train`` is counted once, in ``train``. Should spans from several threads qualify (a
thread started with a copy of the step's context), the thread whose spans cover most of the step
gives the phases. Spans of a step can arrive in an earlier window than the step's duration
(a collection in the middle of a step); `PhaseTimer` keeps them until the step ends.

Everything here runs on the collector thread, never on the training thread.

Example:
    >>> spans = [Span("data", 1, None, 0, 300, 7, 4), Span("forward", 2, None, 300, 900, 7, 4)]
    >>> phase_values(spans, start_ns=0, end_ns=1000)
    {'phase/data_s': 3e-07, 'phase/forward_s': 6e-07, 'phase/other_s': 1e-07}
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Sequence
from itertools import compress
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from otel_train.capture.instrument import SpanRecord, SpanScope
from otel_train.capture.step import STEP_ATTRIBUTE
from otel_train.vocab import semconv

__all__ = ["DURATION_KEY", "PhaseTimer", "Span", "phase_values", "span_of"]

_logger = logging.getLogger(__name__)

DURATION_KEY = semconv.TRAIN_STEP_DURATION
"""The point `ot.step` records at the end of every step; its arrival closes the step's phases."""
OTHER = "phase/other_s"
MAX_NAMES = 64
"""Distinct phase names per process; spans with further names count as `phase/other_s`."""
_MAX_PENDING_SPANS = 100_000  # spans of steps whose end has not been seen (bounded memory)
_MAX_PENDING_WINDOWS = 1_000  # windows after which a step that never ended is forgotten
_INVALID = re.compile(r"[^A-Za-z0-9_./-]")


class Span(NamedTuple):
    """What phases need of a finished span (built from a `SpanRecord` or an SDK span)."""

    name: str
    span_id: int
    parent_id: int | None
    start_ns: int
    end_ns: int
    thread_id: int
    step: int | None
    in_step: bool = True  # opened in the step's context (raw OTel spans: assumed)


def span_of(span: Any) -> Span | None:
    """The `Span` of an `ot.span` record or an OTel SDK `ReadableSpan` (None without step or times)."""
    if hasattr(span, "start_ns"):  # our SpanRecord
        if span.step is None:
            return None
        return Span(span.name, span.span_id, span.parent_id, span.start_ns, span.end_ns, span.thread_id, span.step,
                    getattr(span, "in_step", True))
    attrs = span.attributes or {}
    step = attrs.get(STEP_ATTRIBUTE)
    ctx = span.context
    if step is None or ctx is None or span.start_time is None or span.end_time is None:
        return None
    parent = span.parent.span_id if span.parent is not None else None
    return Span(span.name, ctx.span_id, parent, span.start_time, span.end_time,
                int(attrs.get("thread.id", 0) or 0), int(step))


_OURS = (SpanScope, SpanRecord)  # an `ot.span` record's exact types
_new_span = tuple.__new__
_SPAN_ID = attrgetter("span_id")
_FIRST = itemgetter(0)  # a point's key, a kept span's thread


@functools.lru_cache(maxsize=1024)
def _phase_key(name: str) -> str:
    cleaned = _INVALID.sub("_", name.strip())[:200] or "unnamed"  # OTel names: at most 255 characters
    return f"phase/{cleaned}_s"


def _covered_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of `intervals` (overlaps counted once)."""
    total = 0
    cur_start, cur_end = -1, -1
    for start, end in sorted(intervals):
        if start > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    return total + (cur_end - cur_start)


def phase_values(spans: Sequence[Span], start_ns: int, end_ns: int,
                 allowed_names: set[str] | None = None) -> dict[str, float]:
    """``phase/<name>_s`` and ``phase/other_s`` (seconds) of one step from the spans recorded in it.

    Args:
        spans: The finished spans stamped with the step (any thread, any nesting).
        start_ns: When the step started (Unix ns, the clock of the spans).
        end_ns: When the step ended.
        allowed_names: Phase keys that may be emitted; spans with another name count as other time.
            None allows every name.

    Returns:
        Phase key -> seconds; empty when no span overlaps the step.
    """
    duration = max(0, end_ns - start_ns)
    ids = set(map(_SPAN_ID, spans))
    kept: list[tuple[int, str, int, int]] = []  # (thread, name, start, end) of top-level spans, clipped to the step
    for name, _, parent_id, s_start, s_end, thread_id, _, in_step in spans:
        if not in_step or (parent_id is not None and parent_id in ids):
            continue  # nested in a span of this step: counted in its parent
        start, end = max(s_start, start_ns), min(s_end, end_ns)
        if end > start:
            kept.append((thread_id, name, start, end))
    if not kept:
        return {}
    if len(set(map(_FIRST, kept))) == 1:  # one thread ran the step's spans: the common case
        main = [(name, start, end) for _, name, start, end in kept]
    else:  # the thread that ran the step: the one whose top-level spans cover most of it
        top: dict[int, list[tuple[str, int, int]]] = {}
        for thread_id, name, start, end in kept:
            top.setdefault(thread_id, []).append((name, start, end))
        main = max(top.values(), key=lambda items: _covered_ns([(a, b) for _, a, b in items]))
    values: dict[str, float] = {}
    named: list[tuple[int, int]] = []
    for name, start, end in main:
        key = _phase_key(name)
        if allowed_names is not None and key not in allowed_names:
            continue
        values[key] = values.get(key, 0.0) + (end - start)
        named.append((start, end))
    values[OTHER] = float(max(0, duration - _covered_ns(named))) if named else float(duration)
    return {k: v / 1e9 for k, v in values.items()}


class PhaseTimer:
    """Turns the spans and step durations of successive windows into phase points.

    Keeps the spans of steps that have not ended yet (a collection inside a step). Spans not opened
    inside a step (another thread's, or code between steps, stamped with the latest step) are never
    phases and are not kept. Steps that never end (spans with an explicit `train.step` but no
    `ot.step`) are forgotten after 1,000 windows, and at most 100,000 spans are kept.
    """

    def __init__(self) -> None:
        self._pending: dict[int, list[Span]] = {}
        self._first_window: dict[int, int] = {}
        self._pending_count = 0
        self._window = 0
        self._names: set[str] = set()
        self._warned_names = False

    def points(self, spans: Iterable[Any],
               points: Sequence[tuple[str, int, float, int]]) -> list[tuple[str, int, float, int]]:
        """Phase points ``(key, step, seconds, time_ns)`` for the steps that ended in this window.

        Args:
            spans: This window's finished spans (`SpanRecord`s and SDK spans).
            points: This window's logged points ``(key, step, value, time_ns)``; the
                ``train.step.duration_s`` ones mark the steps that ended.
        """
        self._window += 1
        pending_of, first_window = self._pending, self._first_window
        kept = 0
        for raw in spans:
            if type(raw) in _OURS:  # `ot.span`'s, the common case: no `span_of` call, the `Span` built in C
                step = raw.step
                if step is None or not raw.in_step:
                    continue
                s = _new_span(Span, (raw.name, raw.span_id, raw.parent_id, raw.start_ns, raw.end_ns, raw.thread_id,
                                     step, True))
            else:
                found = span_of(raw)
                if found is None or found.step is None or not found.in_step:
                    continue
                s, step = found, found.step
            pending = pending_of.get(step)
            if pending is None:
                pending = pending_of[step] = []
                first_window[step] = self._window
            pending.append(s)
            kept += 1
        self._pending_count += kept
        out: list[tuple[str, int, float, int]] = []
        # The step ends' duration points, picked in C (`compress`): a window holds ~20 other points per step.
        for _, step, value, t in compress(points, map(DURATION_KEY.__eq__, map(_FIRST, points))):
            if step not in pending_of:
                continue
            step_spans = self._drop(step)
            # The duration point is recorded right after the step's end: the step spans [t - d, t].
            values = phase_values(step_spans, t - int(value * 1e9), t, self._allowed(step_spans))
            out.extend([(k, step, v, t) for k, v in values.items()])
        if self._pending:
            self._bound()
        return out

    def _drop(self, step: int) -> list[Span]:
        spans = self._pending.pop(step)
        del self._first_window[step]
        self._pending_count -= len(spans)
        return spans

    def _allowed(self, spans: Sequence[Span]) -> set[str]:
        for s in spans:
            key = _phase_key(s.name)
            if key in self._names:
                continue
            if len(self._names) < MAX_NAMES:
                self._names.add(key)
            elif not self._warned_names:
                self._warned_names = True
                _logger.warning("phases: more than %d distinct span names inside steps; spans named like %r "
                                "count as phase/other_s (warned once)", MAX_NAMES, s.name)
        return self._names

    def _bound(self) -> None:
        stale = [k for k, w in self._first_window.items() if self._window - w > _MAX_PENDING_WINDOWS]
        for step in stale:
            self._drop(step)
        if self._pending_count > _MAX_PENDING_SPANS:  # keep the newest half of the steps
            steps = sorted(self._first_window, key=self._first_window.__getitem__)
            for step in steps[: len(steps) // 2 + 1]:
                self._drop(step)
