"""Gauge and sum points read straight from their encoding: the sink's hot path.

Reading a data point through protobuf's Python objects costs ~2.5 µs (a wrapper object per point,
per attribute, per value), more than writing it to TensorBoard. So protobuf bodies are parsed
with a copy of the OTLP metrics schema in which gauge and sum points are `bytes`
(`otel_train.sink.decode.otlp.lean_metrics_request`): protobuf (C) checks and splits the request, and
each point arrives as its encoding.

A point as every OTLP encoder writes it (fields in number order) is
``[start_time] [time] as_double|as_int <attributes, flags, ...>``. The fixed-size fields in front
are unpacked with `struct`; the remainder, identical for every point of a step with the same
attributes, is parsed by protobuf once and cached. Anything else (fields out of order, a value
field repeated in the remainder) is parsed whole by protobuf, so results never depend on the path.
"""

from __future__ import annotations

import struct
from typing import Any

from otel_train.sink.decode.otlp import number_point, point_attributes

__all__ = ["DOUBLE", "TIME", "TIME_DOUBLE", "WHOLE", "AttributeCache", "split_point"]

_START, TIME, DOUBLE, _INT = 0x11, 0x19, 0x21, 0x31  # field keys: numbers 2, 3, 4, 6, wire type fixed64
#: The common front of a point: time, as_double (the step-aligned reader's gauges), unpacked inline.
TIME_DOUBLE = struct.Struct("<BQBd")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")
#: Cache entry of a remainder that repeats a front field: parse such points whole.
WHOLE = object()


def split_point(raw: bytes) -> tuple[int, int, float, bytes] | None:
    """(start_time_unix_nano, time_unix_nano, value, remainder) of an encoded number point, or None
    to parse it whole."""
    try:
        start = 0
        i = 0
        if raw[0] == _START:
            start = _U64.unpack_from(raw, 1)[0]
            i = 9
        t = 0
        if raw[i] == TIME:
            t = _U64.unpack_from(raw, i + 1)[0]
            i += 9
        key = raw[i]
        if key == DOUBLE:
            return start, t, _F64.unpack_from(raw, i + 1)[0], raw[i + 9:]
        if key == _INT:
            return start, t, float(_I64.unpack_from(raw, i + 1)[0]), raw[i + 9:]
    except (IndexError, struct.error):
        pass
    return None


class AttributeCache:
    """Decoded point remainders by their encoding (bounded; shared by the receiver threads).

    A remainder usually differs only by its step, so entries pay off within the requests of a few
    recent steps; the bound keeps a long run's cache to a few MiB (it is cleared when full).
    """

    def __init__(self, max_entries: int = 16_384) -> None:
        self.entries: dict[bytes, Any] = {}
        self._max = max_entries

    def decode(self, remainder: bytes) -> Any:
        """Decode and cache a remainder: (`train.step` or None, extra attributes), or `WHOLE`."""
        p = number_point(remainder)
        if p.time_unix_nano or p.start_time_unix_nano or p.WhichOneof("value") is not None:
            entry: Any = WHOLE
        else:
            entry = point_attributes(p.attributes)
        if len(self.entries) >= self._max:
            self.entries.clear()
        self.entries[remainder] = entry
        return entry
