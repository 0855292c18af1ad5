"""OTLP trace requests -> span rows (`otel_train.vocab.rows.SpanRow`), one run per Resource."""

from __future__ import annotations

from typing import Any

from otel_train.capture.step import STEP_ATTRIBUTE
from otel_train.sink.decode.otlp import BAD_STEP, DecodeError, attributes, step_value
from otel_train.sink.decode.requests import Decoded
from otel_train.sink.decode.resources import DecodeCache, resource_run
from otel_train.vocab.rows import SpanRow
from otel_train.vocab.run_identity import as_int

__all__ = ["decode_traces"]

_STATUS_ERROR = 2  # Status.STATUS_CODE_ERROR


def _span_step(raw: Any) -> int | None:
    """A span's step; a `train.step` that is no step leaves the span without one (the span is kept)."""
    if raw is None:
        return None
    step = step_value(raw)
    return None if step == BAD_STEP else step


def _id(raw: bytes, size: int, what: str) -> int:
    if len(raw) != size:
        raise DecodeError(f"{what} has {len(raw)} bytes; expected {size}")
    return int.from_bytes(raw, "big")


def decode_traces(request: Any, runs: DecodeCache) -> Decoded:
    """Span rows of an `ExportTraceServiceRequest`."""
    out = Decoded()
    for rs in request.resource_spans:
        mark = out.mark()
        try:
            run = resource_run(attributes(rs.resource.attributes), bool(rs.scope_spans), runs, out)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = attributes(span.attributes)
                    step = attrs.get(STEP_ATTRIBUTE)
                    parent = _id(span.parent_span_id, 8, "parent_span_id") if span.parent_span_id else None
                    out.spans.append(SpanRow(
                        run=run,
                        name=span.name,
                        trace_id=_id(span.trace_id, 16, "trace_id"),
                        span_id=_id(span.span_id, 8, "span_id"),
                        parent_span_id=parent,
                        start_unix_nano=span.start_time_unix_nano,
                        end_unix_nano=span.end_time_unix_nano or span.start_time_unix_nano,
                        thread_id=as_int(attrs.get("thread.id")),
                        thread_name=str(attrs.get("thread.name", "")),
                        step=_span_step(step),
                        attributes=attrs,
                        error=span.status.code == _STATUS_ERROR,
                        status_message=span.status.message,
                        events=tuple((e.name, e.time_unix_nano, attributes(e.attributes)) for e in span.events),
                        kind=max(0, span.kind - 1),  # OTLP counts from UNSPECIFIED = 0, INTERNAL = 1
                        links=tuple((int.from_bytes(link.trace_id, "big"), int.from_bytes(link.span_id, "big"),
                                     attributes(link.attributes)) for link in span.links
                                    if len(link.trace_id) == 16 and len(link.span_id) == 8),  # a bad link only is left out
                    ))
        except DecodeError as err:  # this Resource alone: the other jobs of a collector's batch are written
            out.refuse_resource(mark, err, sum(len(s.spans) for s in rs.scope_spans))
    out.raise_if_all_refused()
    return out
