"""The window encoding between the training process and the exporter process (and the spool).

`ot.log` points travel as columns (a tag table, then tag indices, steps, values and times as packed
arrays) so the training process pays for a few C-level copies per window, not per-point Python objects;
SDK rows and spans travel as plain tuples of their fields. One pickle (protocol 5) per window.
"""

from __future__ import annotations

import dataclasses
import pickle
from array import array
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from otel_train.exporters.base import Window
from otel_train.records import HistogramRow, MetricRow, RunInfo, SpanRow

__all__ = ["decode_window", "encode_window"]

_VERSION = 1
_METRIC = attrgetter(*(f.name for f in dataclasses.fields(MetricRow)))
_HIST = attrgetter(*(f.name for f in dataclasses.fields(HistogramRow)))
_SPAN = attrgetter(*(f.name for f in dataclasses.fields(SpanRow)))


def encode_window(
    run: RunInfo,
    points: Sequence[tuple[str, int, float, int]],
    metrics: Sequence[MetricRow] = (),
    histograms: Sequence[HistogramRow] = (),
    spans: Sequence[SpanRow] = (),
) -> tuple[bytes, int]:
    """One window as bytes, and the highest step in it (-1 when it has none).

    Args:
        run: The run every `points` entry belongs to.
        points: ``(tag, step, value, time_unix_nano)`` of `ot.log` gauges.
        metrics, histograms, spans: Rows from the SDK's instruments and spans.
    """
    max_step = -1
    cols: tuple[Any, ...] = ()
    if points:
        keys, steps, values, times = zip(*points)
        tags = list(dict.fromkeys(keys))
        index = {k: i for i, k in enumerate(tags)}
        cols = (tags, array("I", map(index.__getitem__, keys)), array("q", steps), array("d", values),
                array("q", times))
        max_step = max(steps)
    if metrics:
        max_step = max(max_step, max(r.step for r in metrics))
    payload = pickle.dumps((_VERSION, run, cols, list(map(_METRIC, metrics)), list(map(_HIST, histograms)),
                            list(map(_SPAN, spans))), protocol=5)
    return payload, max_step


def decode_window(payload: bytes) -> Window:
    """The rows of an encoded window."""
    version, run, cols, metrics, hists, spans = pickle.loads(payload)  # noqa: S301 - our own spool/pipe
    if version != _VERSION:
        raise ValueError(f"window encoding version {version} is not {_VERSION}")
    rows = [MetricRow(*t) for t in metrics]
    if cols:
        tags, idx, steps, values, times = cols
        rows[:0] = [MetricRow(run, s, tags[i], tags[i], v, "gauge", t) for i, s, v, t in zip(idx, steps, values, times)]
    return Window(rows, [HistogramRow(*t) for t in hists], [SpanRow(*t) for t in spans])
