"""The protobuf wire format, read by hand where protobuf's Python objects cost too much: varints, and the
field keys of an OTLP `Metric` (see `otel_train.sink.decode.metric_walk`)."""

from __future__ import annotations

__all__ = ["GAUGE_KEY", "HEADER_KEYS", "SUM_KEY", "first_points", "varint", "walk_metric"]

#: Field keys (number << 3 | wire type 2) of `Metric`: name, description, unit; gauge; sum.
HEADER_KEYS = frozenset({0x0A, 0x12, 0x1A})
GAUGE_KEY, SUM_KEY = 0x2A, 0x3A


def varint(buf: bytes, i: int) -> tuple[int, int]:
    """(value, index after it) of the varint at `buf[i]`.

    Raises:
        IndexError: it runs past the end or over 10 bytes (the walk then leaves the metric to protobuf).

    Example:
        >>> varint(bytes([0x96, 0x01, 0xFF]), 0)
        (150, 2)
    """
    value = shift = 0
    while shift < 70:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
    raise IndexError("varint over 10 bytes")


def walk_metric(m: bytes) -> tuple[int, int, list[bytes], int, int] | None:
    """(end of the header, `GAUGE_KEY` or `SUM_KEY`, points, aggregation temporality, is_monotonic) of an
    encoded `Metric` in the shape `otel_train.sink.decode.metric_walk` describes; None for any other shape.

    Example:
        >>> walk_metric(bytes.fromhex("0a016d" "3a08" "0a020801" "1001" "1801"))  # sum `m`: 1 point, DELTA, monotonic
        (3, 58, [b'\\x08\\x01'], 1, 1)
    """
    try:
        i = 0
        key = m[0]
        while key in HEADER_KEYS:
            n = m[i + 1]
            if n < 0x80:
                i += 2 + n
            else:
                n, i = varint(m, i + 1)
                i += n
            key = m[i]
        if key != GAUGE_KEY and key != SUM_KEY:
            return None
        n = m[i + 1]
        if n < 0x80:
            j = i + 2
        else:
            n, j = varint(m, i + 1)
        end = j + n
        if end != len(m):
            return None
        points = []
        while j < end and m[j] == 0x0A:
            n = m[j + 1]
            if n < 0x80:
                k = j + 2
            else:
                n, k = varint(m, j + 1)
            j = k + n
            points.append(m[k:j])
        temporality = monotonic = 0
        if key == SUM_KEY:
            if j < end and m[j] == 0x10:
                temporality = m[j + 1]
                j += 2
            if j < end and m[j] == 0x18:
                monotonic = m[j + 1]
                j += 2
        if j != end or temporality >= 0x80 or monotonic >= 0x80:
            return None
        return i, key, points, temporality, monotonic
    except IndexError:  # ran past the end: protobuf says what is wrong
        return None


#: The way down to the first metric's points: (keys passed over, key followed) in a request, a
#: ResourceMetrics (resource; scope_metrics), a ScopeMetrics (scope; metrics), a Metric (header; data).
_TO_FIRST_POINTS: tuple[tuple[frozenset[int], frozenset[int]], ...] = ((frozenset(), frozenset({0x0A})), (frozenset({0x0A}), frozenset({0x12})),
                    (frozenset({0x0A}), frozenset({0x12})), (HEADER_KEYS, frozenset({GAUGE_KEY, SUM_KEY})))


def first_points(body: bytes, most: int) -> int:
    """How many points (counted up to `most`) the first metric of an encoded `ExportMetricsServiceRequest`
    holds, if it is a gauge or sum (fields as encoders write them; 0 when not found so). A few µs: it
    chooses the lean schema (`otel_train.sink.decode.otlp.parse_metrics`); rows do not depend on the choice.

    Example:
        >>> two, one = "0a0d120b12090a016d2a040a000a00", "0a0b120912070a016d2a020a00"  # gauge `m`: 2, 1 points
        >>> first_points(bytes.fromhex(two), 4), first_points(bytes.fromhex(one), 4), first_points(b"", 4)
        (2, 1, 0)
    """
    try:
        i, end = 0, len(body)
        for passed, followed in _TO_FIRST_POINTS:
            while True:
                if i >= end:
                    return 0
                key = body[i]
                n, j = varint(body, i + 1)
                if key in followed:
                    i, end = j, j + n
                    break
                if key not in passed:
                    return 0
                i = j + n
        points = 0
        while points < most and i < end and body[i] == 0x0A:
            points += 1
            n, j = varint(body, i + 1)
            i = j + n
        return points
    except IndexError:
        return 0
