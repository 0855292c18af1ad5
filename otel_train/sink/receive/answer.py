"""What the sink answers a request it took: nothing more, or OTLP's partial success naming what it refused alone.

A request is taken whole or refused whole (400, 413, 503) unless some of its points, spans or log records are
refused alone (a step that is no step, a malformed Resource among a collector's batch of jobs): then the answer
is still a success, with ``partial_success`` holding how many were rejected and why (the first reason), as the
OTLP specification asks, so the sender can log it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Taken", "refusal_reason", "success_body"]

_WHY = {
    "bad_step": "a `train.step` that is no step (not an integer in int64 range)",
    "too_many_buckets": "more buckets than the sink takes",
    "bad_buckets": "bucket counts that do not match its bounds (one more count than bounds)",
}


def refusal_reason(why: str, name: str) -> str:
    """What was wrong with what a `Decoded.refused` entry ``(why, name)`` counts, in words (the log line, the answer):
    for ``bad_resource`` `name` is the reason itself; else the metric and its cause."""
    return name if why == "bad_resource" else f"metric `{name}`: {_WHY.get(why, why)}"


class Taken(NamedTuple):
    """A request the sink took: its rows, and what of it was refused alone."""

    rows: int
    rejected: int = 0
    reason: str = ""


def taken(rows: int, refused: dict[tuple[str, str], int]) -> Taken:
    """The `Taken` of a request with `refused` ``(why, metric or reason) -> count`` (`Decoded.refused`)."""
    if not refused:
        return Taken(rows)
    first = refusal_reason(*next(iter(refused)))
    n = sum(refused.values())
    return Taken(rows, n, f"{n} refused (counted in the sink's /health `points_refused`); first: {first}")


def success_body(signal: str, answer: Taken, protobuf: bool) -> bytes:
    """The body of a success answer to an export of `signal` (metrics, traces, logs)."""
    if not answer.rejected:
        return b"" if protobuf else b"{}"
    response: Any
    if signal == "metrics":
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as pb

        response = pb.ExportMetricsServiceResponse(partial_success=pb.ExportMetricsPartialSuccess(
            rejected_data_points=answer.rejected, error_message=answer.reason))
    elif signal == "traces":
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb

        response = tpb.ExportTraceServiceResponse(partial_success=tpb.ExportTracePartialSuccess(
            rejected_spans=answer.rejected, error_message=answer.reason))
    else:
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as lpb

        response = lpb.ExportLogsServiceResponse(partial_success=lpb.ExportLogsPartialSuccess(
            rejected_log_records=answer.rejected, error_message=answer.reason))
    if protobuf:
        return bytes(response.SerializeToString())
    from google.protobuf import json_format

    text: str = json_format.MessageToJson(response, indent=None)
    return text.encode()
