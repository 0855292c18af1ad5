"""OTLP log requests -> log rows (`otel_train.vocab.rows.LogRow`), one run per Resource.

A record's ``train.step`` attribute is its step (a value that is no step leaves it without one); the router gives
a record without a step the run's latest step of its rank (as the sink does for step-less points), where it has
seen one. The body is kept as text (a non-string body as its JSON-like text); the scope name is the logger; an
``event_name`` (the OTLP field) is kept as the ``event.name`` attribute, as otel-train's own records carry it.
"""

from __future__ import annotations

import json
from typing import Any

from otel_train.capture.step import STEP_ATTRIBUTE
from otel_train.sink.decode.otlp import BAD_STEP, DecodeError, any_value, attributes, step_value
from otel_train.sink.decode.requests import Decoded
from otel_train.sink.decode.resources import DecodeCache, resource_run
from otel_train.vocab.rows import LogRow

__all__ = ["decode_logs"]


def _step(raw: Any) -> int | None:
    if raw is None:
        return None
    step = step_value(raw)
    return None if step == BAD_STEP else step


def _id(raw: bytes, size: int, what: str) -> int:
    if not raw:
        return 0
    if len(raw) != size:
        raise DecodeError(f"{what} has {len(raw)} bytes; expected {size}")
    return int.from_bytes(raw, "big")


def _body(value: Any) -> str:
    body = any_value(value)
    if body is None:
        return ""
    return body if isinstance(body, str) else json.dumps(body, default=str)


def decode_logs(request: Any, runs: DecodeCache) -> Decoded:
    """Log rows of an `ExportLogsServiceRequest`."""
    out = Decoded()
    for rl in request.resource_logs:
        mark = out.mark()
        try:
            run = resource_run(attributes(rl.resource.attributes), bool(rl.scope_logs), runs, out)
            for sl in rl.scope_logs:
                scope = sl.scope.name
                for record in sl.log_records:
                    attrs = attributes(record.attributes)
                    step = _step(attrs.pop(STEP_ATTRIBUTE, None))
                    if record.event_name:
                        attrs.setdefault("event.name", record.event_name)
                    out.logs.append(LogRow(
                        run=run, step=step, time_unix_nano=record.time_unix_nano or record.observed_time_unix_nano,
                        severity_number=int(record.severity_number), severity_text=record.severity_text,
                        body=_body(record.body), logger=scope, attributes=attrs,
                        trace_id=_id(record.trace_id, 16, "trace_id"), span_id=_id(record.span_id, 8, "span_id"),
                    ))
        except DecodeError as err:  # this Resource alone: the other jobs of a collector's batch are written
            out.refuse_resource(mark, err, sum(len(s.log_records) for s in rl.scope_logs))
    out.raise_if_all_refused()
    return out
