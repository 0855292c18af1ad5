"""Compatibility re-exports: what `otel_train.records` held now lives in modules named for what they are.

- `otel_train.rows`: the row types (`MetricRow`, `HistogramRow`, `SpanRow`) and `series_tag`;
- `otel_train.run_identity`: `RunInfo`, the Resource attribute names, `config_hash`;
- `otel_train.run_paths`: `run_folder`, `folder_name`;
- `otel_train.exporter_options`: `ExporterOptions`;
- `otel_train.collect.sdk_rows`: `MetricsConverter`, `span_rows` (SDK export objects -> rows).

Import from those; this module stays only while code outside the package moves over.
"""

from __future__ import annotations

from otel_train.collect.sdk_rows import MetricsConverter, span_rows
from otel_train.exporter_options import ExporterOptions
from otel_train.rows import ExponentialBuckets, HistogramRow, MetricRow, SpanRow, series_tag
from otel_train.run_identity import (
    CONFIG_HASH,
    LOCAL_RANK,
    PREEMPTED,
    RUN_ID,
    RUN_NAME,
    THREAD_ID,
    THREAD_NAME,
    WORLD_SIZE,
    RunInfo,
    config_hash,
)
from otel_train.run_paths import folder_name, run_folder

__all__ = [
    "CONFIG_HASH",
    "LOCAL_RANK",
    "PREEMPTED",
    "RUN_ID",
    "RUN_NAME",
    "THREAD_ID",
    "THREAD_NAME",
    "WORLD_SIZE",
    "ExponentialBuckets",
    "ExporterOptions",
    "HistogramRow",
    "MetricRow",
    "MetricsConverter",
    "RunInfo",
    "SpanRow",
    "config_hash",
    "folder_name",
    "run_folder",
    "series_tag",
    "span_rows",
]
