"""What `otel-train replay` hands each backend when the run has a record: only what verify finds missing.

Replay reads the windows a backend has not acknowledged from the spool; with a verify report it hands that
backend only the metric rows the report lists as missing there (by the name the backend shows the series under),
so a backend that holds more than its cursor says (a kill after its write, before the record) gets nothing twice.
A backend that passed with nothing missing gets nothing more (one whose missing values were counted as lost, a
full disk say, gets them: counted is not held), unless replay's resume cuts back a killed process's unrecorded
append (`otel_train.ship.backend_feed`: verify counted those bytes, so that backend follows its cursor); what
verify could not compare (a backend it cannot read back, the Chrome trace's counters, steps past the record's cap)
and the spans of a backend that failed follow the cursor alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_train.verify import BackendReport, VerifyReport
from otel_train.verify.compare import SeriesResult
from otel_train.vocab.rows import HistogramRow, MetricRow, SpanRow

__all__ = ["report_from_json", "rows_missing"]


def report_from_json(data: dict[str, Any]) -> VerifyReport:
    """The report `VerifyReport.to_json` describes (`otel-train verify --json`, run in a process of its own
    by replay: reading the stores back imports backend clients that fix their store at import, e.g. Trackio).

    Raises:
        ValueError: `data` is not such a description.
    """
    try:
        backends = []
        for raw in data["backends"]:
            fields = dict(raw)
            fields["series"] = [SeriesResult(**s) for s in fields.get("series", [])]
            backends.append(BackendReport(**fields))
        return VerifyReport(Path(str(data["run_dir"])), backends, dict(data.get("refusals") or {}),
                            str(data.get("problem") or ""))
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a verify report ({err!r})") from None


def _names(row: MetricRow | HistogramRow, backend: str) -> set[str]:
    """The names `backend` may show `row`'s series under (the ones verify reports missing points by)."""
    from otel_train.exporters._runs import RANK_SUFFIX_KEY, rank_tag, series_name
    from otel_train.vocab.semconv import DISPLAY_NAMES

    tags = {row.tag}
    if row.name in DISPLAY_NAMES:  # a built-in series, as a backend with display names shows it (`routing`)
        tags.add(DISPLAY_NAMES[row.name] + row.tag[len(row.name):])
    names = set()
    for tag in tags:
        names |= {tag, rank_tag(tag, row.name, dict(row.attributes), row.run.rank)}
        if backend == "clearml":
            from otel_train.exporters.clearml import title_series

            title, series = title_series(row.name, rank_tag(tag, row.name, dict(row.attributes), row.run.rank))
            names.add(f"{title}/{series}")
        if backend == "mlflow":
            from otel_train.exporters.mlflow import mlflow_key

            attributes = dict(row.attributes)
            if row.run.rank:
                attributes[RANK_SUFFIX_KEY] = row.run.rank
            names.add(mlflow_key(series_name(tag, row.name), attributes))
    return names


def rows_missing(report: VerifyReport) -> Callable[[str, str, MetricRow | HistogramRow | SpanRow], bool]:
    """`otel_train.ship.replay.replay`'s `wanted`: (rank folder, backend, row) -> whether that backend lacks it.

    Example:
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> report = VerifyReport(Path("run"), [BackendReport(0, "jsonl", "fail", expected=2, present=1, series=[
        ...     SeriesResult("loss", 0, missing=[3])])])
        >>> wanted = rows_missing(report)
        >>> run = RunInfo("r", "r")
        >>> [wanted("rank0", "jsonl", MetricRow(run, s, "loss", "loss", 1.0, "gauge", 0, {})) for s in (2, 3)]
        [False, True]
    """
    status = {(b.rank, b.backend): b.status for b in report.backends}
    missing = {(b.rank, b.backend): set(b.missing_points()) for b in report.backends}
    checked_to = {(b.rank, b.backend): b.not_checked_past for b in report.backends}
    # What verify compared there: scalars (the Chrome trace's counters carry no step), spans.
    scalars = {(b.rank, b.backend) for b in report.backends if b.expected or b.present}
    spans = {(b.rank, b.backend) for b in report.backends if b.spans_expected}
    spans_missing = {(b.rank, b.backend) for b in report.backends if b.spans_missing}

    def wanted(label: str, backend: str, row: MetricRow | HistogramRow | SpanRow) -> bool:
        try:
            rank = int(label.removeprefix("rank"))
        except ValueError:
            return True
        key = (rank, backend)
        state = status.get(key)
        if state is None or state == "not checked":
            return True  # no verdict: as the cursor says
        past = checked_to[key]
        if past is not None and (isinstance(row, SpanRow) or row.step is None or row.step > past):
            return True  # beyond the record's cap: as the cursor says
        if isinstance(row, SpanRow):
            return key not in spans or state != "pass" or key in spans_missing
        if key not in scalars:
            return True  # its scalars were not compared: as the cursor says
        lacks = missing[key]
        if state == "pass" and not lacks:
            return False  # it holds every value once already
        return any((name, row.step) in lacks for name in _names(row, backend))

    return wanted
