"""Gauge and sum metrics read from their encoding: the sink's hot path at one point per metric.

A step-aligned reader exporting every step sends each metric with one point, so what a metric costs
matters as much as what a point costs (`otel_train.sink.decode.points`): reading ``metric.name``,
``.description``, ``.unit``, ``.WhichOneof("data")`` and ``.gauge.data_points`` through protobuf's
Python objects builds an object per access, ~0.9 µs a metric. So the lean schema
(`otel_train.sink.decode.otlp.lean_metrics_request`) keeps each `Metric` as its encoding, and
`otel_train.sink.decode.requests` walks it (`otel_train.sink.decode.wire.walk_metric`) in the shape every OTLP encoder
writes (fields in number order)::

    [0x0A name] [0x12 description] [0x1A unit]     the header, decoded once by protobuf (`MetricHeaders`)
    0x2A <gauge: [0x0A point]*>                     or
    0x3A <sum: [0x0A point]* [0x10 temporality] [0x18 is_monotonic]>

and nothing after it. The most common metric, a name and a gauge of one point, is recognised by its first
bytes alone (`MetricHeaders.usual`). Any other shape (histograms, exponential histograms, summaries,
metadata, an unknown field, a data field repeated or out of order, a varint too long for the walk, a
truncated encoding) is parsed by protobuf (`otel_train.sink.decode.otlp.lean_metric`) and read as before, so
rows never depend on the path taken, and a malformed metric fails its request with `DecodeError`.

When the first metric of a request holds several points (4 or more), protobuf splitting them in C costs
less than the walk, so `otel_train.sink.decode.otlp.parse_metrics` parses such a request with metrics as messages
and only the points as their encoding (`otel_train.sink.decode.wire.first_points` counts; rows do not depend on
the choice).
"""

from __future__ import annotations

from typing import Any

from otel_train.sink.decode.otlp import DecodeError, lean_metric
from otel_train.sink.decode.wire import GAUGE_KEY
from otel_train.vocab.names import KEY_DESCRIPTION_PREFIX, key_from_description

__all__ = ["MetricHeaders", "metric_names"]


def metric_names(name: str, description: str) -> tuple[str, str]:
    """(name, description) of a metric as rows keep them: the key as logged when the description carries
    it (`otel_train.vocab.names`), and then no description.

    Raises:
        DecodeError: the name is empty.
    """
    if not name:
        raise DecodeError("a metric has an empty name")
    if description:
        name = key_from_description(name, description)
        if description.startswith(KEY_DESCRIPTION_PREFIX):
            description = ""
    return name, description


class MetricHeaders:
    """What the walk learns of metrics by their encoding (bounded; shared by the receiver threads; cleared
    when full). A run sends the same metrics every step, so each holds a few hundred entries per kind of
    job.

    Attributes:
        entries: (name, description, unit) by header.
        usual: (name, description, unit, size of the metric) by the first bytes of a metric in the usual
            shape, up to its point: ``0x0A <name> 0x2A <len> 0x0A <len>`` (one-byte lengths: the walk
            computes where the point starts from the name's length alone, and a hit on these exact bytes
            with the stored size is that shape).
    """

    def __init__(self, max_entries: int = 16_384) -> None:
        self.entries: dict[bytes, tuple[str, str, str]] = {}
        self.usual: dict[bytes, tuple[str, str, str, int]] = {}
        self._max = max_entries

    def decode(self, header: bytes) -> tuple[str, str, str]:
        """Decode (by protobuf: UTF-8 checked, the last of repeated fields wins) and cache a header.

        Raises:
            DecodeError: the header is not valid, or the name is empty.
        """
        metric: Any = lean_metric(header)
        name, description = metric_names(metric.name, metric.description)
        entry = (name, description, metric.unit)
        if len(self.entries) >= self._max:
            self.entries.clear()
        self.entries[header] = entry
        return entry

    def learn_usual(self, m: bytes, header_end: int, name: str, description: str, unit: str) -> None:
        """Remember a gauge metric of one point (walked, its header decoded) if it is in the usual shape."""
        if (m[0] == 0x0A and m[1] < 0x80 and header_end == m[1] + 2 and m[header_end] == GAUGE_KEY
                and m[header_end + 1] < 0x80 and m[header_end + 2] == 0x0A and m[header_end + 1] == m[header_end + 3] + 2
                and len(m) == header_end + 2 + m[header_end + 1]):
            if len(self.usual) >= self._max:
                self.usual.clear()
            self.usual[m[:header_end + 4]] = (name, description, unit, len(m))
