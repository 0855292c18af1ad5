"""OTLP payloads: parsing (protobuf or JSON, gzip) and reading attributes. No state, no rows."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

from otel_train.capture.step import RANK_ATTRIBUTE, STEP_ATTRIBUTE
from otel_train.sink.decode.wire import first_points

__all__ = [
    "BAD_STEP",
    "MAX_RUN_ID_BYTES",
    "NO_EXTRA",
    "DecodeError",
    "any_value",
    "attributes",
    "is_json",
    "lean_metric",
    "lean_metrics_request",
    "lean_points_request",
    "number_point",
    "parse_logs",
    "parse_metrics",
    "parse_traces",
    "point_attributes",
    "rpc_status",
    "step_value",
]

#: Longest `train.run.id` / `train.run.name` taken (a file name is at most 255 bytes).
MAX_RUN_ID_BYTES = 255


class _EmptyAttributes(dict):  # type: ignore[type-arg]
    """The attributes of every row without extra ones: one shared empty dict that refuses to be filled. A
    dict (not a `MappingProxyType`), so the spool's encoder writes it as a map without calling back into
    Python for each row (`otel_train.ship.framing`)."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("these attributes are shared by many rows and cannot be changed")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse


#: Shared by rows without extra attributes (read-only).
NO_EXTRA: Mapping[str, Any] = _EmptyAttributes()


class DecodeError(ValueError):
    """The request is not a valid OTLP payload; the message says why (sent back to the client)."""


# -- AnyValue / KeyValue ------------------------------------------------------------------------
def any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return tuple(any_value(v) for v in value.array_value.values)
    if kind == "kvlist_value":
        return json.dumps({kv.key: any_value(kv.value) for kv in value.kvlist_value.values}, default=str)
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


#: The step of a point whose `train.step` is no step (2.5, NaN, ±inf, below 0 or beyond int64, a word): such a
#: point is refused alone (counted), never written at a made-up step. Steps are 0..2**63-1, as at `ot.log`.
BAD_STEP = -(1 << 64)
_STEPS = range(1 << 63)


def step_value(value: Any) -> int:
    """A `train.step` attribute value as a step: an integer from 0 to 2**63-1, a float with such an integral
    value, or the decimal text of one; anything else is `BAD_STEP`.

    Example:
        >>> step_value(3), step_value(4.0), step_value("5"), step_value(2.5) == BAD_STEP, step_value(1e19) == BAD_STEP
        (3, 4, 5, True, True)
        >>> step_value(-1) == BAD_STEP
        True
    """
    if isinstance(value, bool):
        return BAD_STEP
    if isinstance(value, int):
        return value if value in _STEPS else BAD_STEP
    if isinstance(value, float):
        return int(value) if value.is_integer() and int(value) in _STEPS else BAD_STEP
    if isinstance(value, str):
        try:
            return step_value(int(value.strip()))
        except ValueError:
            return BAD_STEP
    return BAD_STEP


def point_attributes(kvs: Any) -> tuple[int | None, Mapping[str, Any]]:
    """(`train.step` (`BAD_STEP` if it is no step) or None, extra attributes) of a data point's attributes."""
    step: int | None = None
    extra: dict[str, Any] = {}
    for kv in kvs:
        key = kv.key
        if key == STEP_ATTRIBUTE:
            v = kv.value
            step = v.int_value if v.WhichOneof("value") == "int_value" else step_value(any_value(v))
        elif key != RANK_ATTRIBUTE:
            extra[key] = any_value(kv.value)
    return step, (extra or NO_EXTRA)


def number_point(raw: bytes) -> Any:
    from google.protobuf.message import DecodeError as PbDecodeError
    from opentelemetry.proto.metrics.v1.metrics_pb2 import NumberDataPoint

    try:
        return NumberDataPoint.FromString(raw)
    except (PbDecodeError, ValueError, RuntimeError) as err:
        raise DecodeError(f"invalid OTLP protobuf: a data point: {str(err)[:200] or type(err).__name__}") from None



class _LeanSchema(NamedTuple):
    metrics_request: Any  # each metric as its encoding
    points_request: Any  # metrics as messages, gauge and sum points as their encoding
    metric: Any  # gauge and sum points as their encoding


def _lean_class(as_bytes: set[tuple[str, str]], name: str) -> Any:
    """Message `name` of a copy of the OTLP metrics schema in which the fields `as_bytes` ((message,
    field) pairs) are `bytes`: protobuf keeps them as they were encoded."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.metrics.v1 import metrics_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2

    pool = descriptor_pool.DescriptorPool()  # private: the real classes are untouched
    for module in (common_pb2, resource_pb2, metrics_pb2, metrics_service_pb2):
        file = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(file)
        for message in file.message_type:
            for field in message.field:
                if (message.name, field.name) in as_bytes:
                    field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                    field.ClearField("type_name")
        pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


class _Once:
    """The lean schema, built once for every thread. Not `functools.cache`: it lets two threads that miss at
    once (a sink's first requests, on the receivers' loops and the large-request threads) each build classes of
    their own, and the request one parsed then is not an instance of the class the other cached, so it was
    decoded as the usual class (``AttributeError: 'bytes' object has no attribute 'name'``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built = False
        self._schema: _LeanSchema | None = None

    def get(self) -> _LeanSchema | None:
        if not self._built:
            with self._lock:
                if not self._built:
                    self._schema = _build_lean_schema()
                    self._built = True
        return self._schema

    def reset(self) -> None:
        """Build again on the next use (tests)."""
        with self._lock:
            self._built = False
            self._schema = None


def _build_lean_schema() -> _LeanSchema | None:
    try:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

        points = {("Gauge", "data_points"), ("Sum", "data_points")}
        request = ExportMetricsServiceRequest.DESCRIPTOR.full_name
        return _LeanSchema(_lean_class({*points, ("ScopeMetrics", "metrics")}, request),
                           _lean_class(points, request), _lean_class(points, Metric.DESCRIPTOR.full_name))
    except Exception:  # pragma: no cover - a protobuf without these APIs: decode the usual way
        return None


_LEAN_SCHEMA = _Once()
_lean_schema = _LEAN_SCHEMA.get


#: Points per metric from which protobuf splitting them (in C, with the metric's other fields as
#: objects) costs less than walking the metric in Python (measured, 100 gauges a request: 3 points
#: 0.96 µs a point walked against 1.01; 4 points 0.95 against 0.90; 10 points 0.78 against 0.68).
_PROTOBUF_SPLITS_FROM = 4


def lean_metrics_request() -> Any:
    """`ExportMetricsServiceRequest` with each metric as its encoding (`bytes`), or None if unavailable.

    Protobuf (C) checks the request's frame and the Resources; each metric is read from its encoding
    (`otel_train.sink.decode.metric_walk`) or, when it is not in the usual shape, parsed by `lean_metric`.
    """
    schema = _lean_schema()
    return None if schema is None else schema.metrics_request


def lean_points_request() -> Any:
    """`ExportMetricsServiceRequest` with gauge and sum points as their encoding (`bytes`), or None if
    unavailable: for requests whose metrics hold several points each, where protobuf (C) splitting them
    costs less than walking each metric in Python (`otel_train.sink.decode.metric_walk`)."""
    schema = _lean_schema()
    return None if schema is None else schema.points_request


def lean_metric(raw: bytes) -> Any:
    """A `Metric` of the lean schema (gauge and sum points as their encoding) parsed from `raw`.

    Raises:
        DecodeError: `raw` is no valid `Metric`.
    """
    from google.protobuf.message import DecodeError as PbDecodeError

    schema = _lean_schema()
    if schema is None:  # pragma: no cover - only lean requests hold metrics as bytes
        raise DecodeError("invalid OTLP protobuf: a metric as bytes without the lean schema")
    try:
        return schema.metric.FromString(raw)
    except RecursionError:
        raise DecodeError("invalid OTLP protobuf: a metric: nested too deeply") from None
    except (PbDecodeError, ValueError, RuntimeError) as err:
        raise DecodeError(f"invalid OTLP protobuf: a metric: {str(err)[:200] or type(err).__name__}") from None


# -- parsing -------------------------------------------------------------------------------------
def _decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    enc = (encoding or "").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc == "gzip":
        import zlib

        # A gzip body may hold several members (RFC 1952, e.g. written in chunks): read every one.
        parts: list[bytes] = []
        size = 0
        rest = body
        try:
            while rest:
                d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                out = d.decompress(rest, limit + 1 - size)
                size += len(out)
                parts.append(out)
                if size > limit:
                    raise OverflowError(f"decompressed body exceeds {limit} bytes")
                if not d.eof:
                    raise DecodeError("invalid gzip body: truncated")
                rest = d.unused_data
        except zlib.error as err:
            raise DecodeError(f"invalid gzip body: {err}") from None
        return b"".join(parts)
    raise DecodeError(f"unsupported content-encoding {encoding!r}; use gzip or none")


def _hex_ids_to_base64(obj: Any, keys: tuple[str, ...]) -> None:
    """OTLP/JSON writes trace and span ids as hex; protobuf's JSON mapping expects base64."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in keys and isinstance(v, str) and v:
                try:
                    obj[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise DecodeError(f"`{k}` {v[:40]!r} is not a hex id") from None
            else:
                _hex_ids_to_base64(v, keys)
    elif isinstance(obj, list):
        for v in obj:
            _hex_ids_to_base64(v, keys)


_ID_KEYS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == "application/json"


def _parse(message: Any, body: bytes, content_type: str | None) -> Any:
    ctype = (content_type or "application/x-protobuf").split(";")[0].strip().lower()
    if ctype == "application/json":
        from google.protobuf import json_format

        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise DecodeError(f"invalid JSON: {err}") from None
        except RecursionError:
            raise DecodeError("invalid OTLP/JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise DecodeError("invalid OTLP/JSON: expected an object")
        _hex_ids_to_base64(data, _ID_KEYS)
        try:
            json_format.ParseDict(data, message, ignore_unknown_fields=True)
        except RecursionError:
            raise DecodeError("invalid OTLP/JSON: nested too deeply") from None
        except (json_format.ParseError, ValueError, TypeError) as err:
            raise DecodeError(f"invalid OTLP/JSON: {str(err)[:200]}") from None
        return message
    if ctype in ("application/x-protobuf", "application/protobuf", "application/octet-stream"):
        from google.protobuf.message import DecodeError as PbDecodeError

        try:
            message.ParseFromString(body)
        except RecursionError:
            raise DecodeError("invalid OTLP protobuf: nested too deeply") from None
        except (PbDecodeError, ValueError, RuntimeError) as err:
            raise DecodeError(f"invalid OTLP protobuf: {str(err)[:200] or type(err).__name__}") from None
        return message
    raise DecodeError(f"unsupported content-type {content_type!r}; use application/x-protobuf or application/json")


def parse_metrics(body: bytes, content_type: str | None = None, encoding: str | None = None,
                  limit: int = 1 << 62) -> Any:
    """Parse an `ExportMetricsServiceRequest` from a (possibly gzipped) protobuf or JSON body.

    Protobuf bodies are parsed into a lean class (`lean_metrics_request`, or `lean_points_request` when
    the first metric holds `_PROTOBUF_SPLITS_FROM` points or more), whose metrics or points are read from
    their encoding.
    """
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    body = _decompress(body, encoding, limit)
    schema = _lean_schema()
    if schema is None or is_json(content_type):
        message = ExportMetricsServiceRequest()
    else:
        split_by_protobuf = first_points(body, _PROTOBUF_SPLITS_FROM) >= _PROTOBUF_SPLITS_FROM
        message = (schema.points_request if split_by_protobuf else schema.metrics_request)()
    return _parse(message, body, content_type)


def parse_traces(body: bytes, content_type: str | None = None, encoding: str | None = None,
                 limit: int = 1 << 62) -> Any:
    """Parse an `ExportTraceServiceRequest` from a (possibly gzipped) protobuf or JSON body."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return _parse(ExportTraceServiceRequest(), _decompress(body, encoding, limit), content_type)


def parse_logs(body: bytes, content_type: str | None = None, encoding: str | None = None,
               limit: int = 1 << 62) -> Any:
    """Parse an `ExportLogsServiceRequest` from a (possibly gzipped) protobuf or JSON body."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    return _parse(ExportLogsServiceRequest(), _decompress(body, encoding, limit), content_type)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def rpc_status(code: int, message: str, retry_after_s: float | None = None) -> bytes:
    """An encoded `google.rpc.Status`, with a `google.rpc.RetryInfo` detail when `retry_after_s` is given
    (what OTLP senders read as the server's throttling hint). Hand-encoded: five fields do not warrant
    the googleapis protos as a dependency.

    Example:
        >>> rpc_status(14, "busy").hex()
        '080e120462757379'
    """
    out = _varint(1 << 3) + _varint(code) + (_field(2, message.encode()) if message else b"")
    if retry_after_s is not None:
        seconds = int(retry_after_s)
        nanos = round((retry_after_s - seconds) * 1e9)
        duration = _varint(1 << 3) + _varint(seconds) + (_varint(2 << 3) + _varint(nanos) if nanos else b"")
        retry_info = _field(1, duration)
        detail = _field(1, b"type.googleapis.com/google.rpc.RetryInfo") + _field(2, retry_info)
        out += _field(3, detail)
    return out
