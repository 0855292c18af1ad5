"""What `otel-train replay` hands each backend when the run has a record: only what verify finds missing.

Replay reads the windows a backend has not acknowledged from the spool; with a verify report it hands that
backend only the metric rows the report lists as missing there (by the name the backend shows the series under),
so a backend that holds more than its cursor says (a kill after its write, before the record) gets nothing twice.
A backend that passed gets nothing more; one that could not be checked, and every span, follow the cursor alone.
"""

from __future__ import annotations

from collections.abc import Callable

from otel_train.rows import HistogramRow, MetricRow, SpanRow
from otel_train.verify import VerifyReport

__all__ = ["rows_missing"]


def _names(row: MetricRow | HistogramRow, backend: str) -> set[str]:
    """The names `backend` may show `row`'s series under (the ones verify reports missing points by)."""
    from otel_train.exporters._runs import RANK_SUFFIX_KEY, rank_tag, series_name

    names = {row.tag, rank_tag(row.tag, row.name, dict(row.attributes), row.run.rank)}
    if backend == "mlflow":
        from otel_train.exporters.mlflow import mlflow_key

        attributes = dict(row.attributes)
        if row.run.rank:
            attributes[RANK_SUFFIX_KEY] = row.run.rank
        names.add(mlflow_key(series_name(row.tag, row.name), attributes))
    return names


def rows_missing(report: VerifyReport) -> Callable[[str, str, MetricRow | HistogramRow | SpanRow], bool]:
    """`otel_train.ship.replay.replay`'s `wanted`: (rank folder, backend, row) -> whether that backend lacks it.

    Example:
        >>> from pathlib import Path
        >>> from otel_train.run_identity import RunInfo
        >>> from otel_train.verify import BackendReport
        >>> from otel_train.verify.compare import SeriesResult
        >>> report = VerifyReport(Path("run"), [BackendReport(0, "jsonl", "fail", series=[
        ...     SeriesResult("loss", 0, missing=[3])])])
        >>> wanted = rows_missing(report)
        >>> run = RunInfo("r", "r")
        >>> [wanted("rank0", "jsonl", MetricRow(run, s, "loss", "loss", 1.0, "gauge", 0, {})) for s in (2, 3)]
        [False, True]
    """
    status = {(b.rank, b.backend): b.status for b in report.backends}
    missing = {(b.rank, b.backend): set(b.missing_points()) for b in report.backends}
    checked_to = {(b.rank, b.backend): b.not_checked_past for b in report.backends}

    def wanted(label: str, backend: str, row: MetricRow | HistogramRow | SpanRow) -> bool:
        try:
            rank = int(label.removeprefix("rank"))
        except ValueError:
            return True
        state = status.get((rank, backend))
        if state is None or state == "not checked":
            return True  # no verdict: as the cursor says
        past = checked_to[(rank, backend)]
        if past is not None and (isinstance(row, SpanRow) or row.step is None or row.step > past):
            return True  # beyond the record's cap: as the cursor says
        if state == "pass":
            return False  # it holds every value once already
        if isinstance(row, SpanRow):
            return True
        lacks = missing[(rank, backend)]
        return any((name, row.step) in lacks for name in _names(row, backend))

    return wanted
