"""The rows and phase timings of `ot.span` records, made where a window is delivered rather than where it is logged.

At a fast step the collector thread shares the training core: turning every `ot.span` record into a span row
and every step's spans into ``phase/<name>_s`` points was the larger part of its work. Where every backend runs in
the exporter process, the training process hands each record's fields over with the window instead
(`otel_train.ship.framing.pack_span_records`), and the exporter process makes them here, with the same functions
the collector uses (`otel_train.collect.window_builder.span_record_rows`, `otel_train.collect.phases.PhaseTimer`),
before the window is recorded, spooled and delivered: the spool, the backends and `otel-train verify` see the
same whole window as before. The training process's fallback (the exporter process could not be restarted)
completes windows the same way.

Delivery completes a window only when it takes it (`Delivery.spans`): one sent again after a restart that the
spool holds already is neither made nor counted twice. A restarted exporter process starts a new `PhaseTimer`, so
the spans of a step that began in a window the earlier process had spooled are not known to it: that one step
gets no phase timings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from otel_train.backend import Window
from otel_train.capture.instrument import SpanRecord
from otel_train.collect.phases import PhaseTimer, Span
from otel_train.collect.window_builder import span_record_rows
from otel_train.ship.framing import has_span_records, unpack_span_records, with_rows
from otel_train.vocab.rows import SpanRow
from otel_train.vocab.run_identity import RunInfo

__all__ = ["SPANS_NOT_MADE", "SpanCompleter"]

_logger = logging.getLogger("otel_train")
#: The loss cause (with its unit) of `ot.span` records whose rows could not be made.
SPANS_NOT_MADE = "spans whose rows could not be made"


class SpanCompleter:
    """Turns a window's `ot.span` records into span rows and phase points (`complete`); one per delivering process,
    as its phase timings keep the spans of steps that have not ended yet.

    Args:
        lost: Counts what could not be made, ``(cause, n)`` (`Delivery.count_lost`).
    """

    def __init__(self, lost: Callable[[str, int], None]) -> None:
        self._lost = lost
        self._phases: PhaseTimer | None = None
        #: Phase points added so far (the shutdown summary counts them with the training process's points).
        self.points_added = 0

    def complete(self, payload: bytes) -> tuple[bytes, Window | None]:
        """`payload` as the whole window it stands for, and that window decoded (None: decode the payload
        returned). Never raises: a payload whose records cannot be read goes on as it came (delivery then says and
        counts it unreadable); a window whose rows cannot be made goes on without them, said and counted."""
        if not has_span_records(payload):
            return payload, None
        try:
            window_payload, fields, phase_spans, phases = unpack_span_records(payload)
        except ValueError as err:
            _logger.error("otel-train: a window's span records could not be read (%s)", err)
            return payload, None
        records = [SpanRecord(*f) for f in fields]

        def add(run: RunInfo, points: Sequence[tuple[str, int, float, int]],
                ) -> tuple[list[tuple[str, int, float, int]], list[SpanRow]]:
            more: list[tuple[str, int, float, int]] = []
            if phases:
                if self._phases is None:
                    self._phases = PhaseTimer()
                spans: list[Any] = records
                if phase_spans:
                    spans = [*records, *(Span(*s) for s in phase_spans)]
                more = self._phases.points(spans, points)
                self.points_added += len(more)
            return more, span_record_rows(run, records)

        try:
            return with_rows(window_payload, add)
        except Exception as err:  # a fault here must not cost the window's other rows: it goes on without these
            _logger.error("otel-train: the rows of %d span(s) could not be made (%s: %s); their window is delivered "
                          "without them", len(records), type(err).__name__, err)
            self._lost(SPANS_NOT_MADE, len(records))
            return window_payload, None
