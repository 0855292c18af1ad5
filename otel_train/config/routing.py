"""Per-backend routing: which rows one backend gets, applied on the export side.

Each backend's `WindowWriter` (`otel_train.ship.window_writer`, behind `RowExporter.export_window`) passes
every window through its `RowFilter` before the backend sees it, so routing runs off the training thread (in the exporter process where there is one) and the
same in the sink, whose backends are built from the same `ExporterOptions`. The rules come from
`OTEL_TRAIN_<BACKEND>_{INCLUDE,EXCLUDE,EVERY,RANKS}` and `init(routes=...)`, parsed in
`otel_train.config.settings`.

Log records are routed by logger name only (`OTEL_TRAIN_<BACKEND>_LOGS`): the metric-name globs, `_EVERY` and
`_RANKS` leave them alone, as a warning or a traceback is an event of its rank and step, not a sampled series.

The filter also renames the built-in series to their dashboard names for backends that group by
``/`` (see `otel_train.vocab.semconv`), and remembers which patterns matched a metric, so that a
misspelt pattern is reported once at shutdown instead of leaving a silently empty dashboard.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, TypeVar

from otel_train.config.exporter_options import ExporterOptions
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, SpanRow
from otel_train.vocab.semconv import DISPLAY_NAMES, display_name

if TYPE_CHECKING:
    from otel_train.config.settings import Route

__all__ = ["RowFilter", "bind"]

_logger = logging.getLogger(__name__)
_RowT = TypeVar("_RowT", MetricRow, HistogramRow)


def bind(backend: str, options: ExporterOptions, display_names: bool) -> tuple[ExporterOptions, RowFilter | None]:
    """The options one backend runs with and its filter (``None``: the backend gets every row unchanged).

    The backend's `_RANKS` replaces `options.ranks`, so its own rank handling (folders, run names)
    follows the override too.
    """
    routes = options.routes or {}
    route = routes.get(backend)
    if route is not None and route.ranks is not None and route.ranks != options.ranks:
        options = dataclasses.replace(options, ranks=route.ranks)
    # Rows of other ranks reach a `0` backend in the sink, and in-process when another backend's
    # `_RANKS=all` makes every rank export metrics: drop them here.
    # (With the global `OTEL_TRAIN_RANKS=0` and no `all` anywhere, other ranks never export metrics.)
    rank0_only = options.ranks == "0" and (
        (route is not None and route.ranks is not None) or any(r.ranks == "all" for r in routes.values()))
    if route is None and not display_names and not rank0_only:
        return options, None
    return options, RowFilter(route, rank0_only=rank0_only, display_names=display_names)


class RowFilter:
    """Routes one backend's rows: include/exclude globs, every N-th step, ranks, display names.

    Called on one export thread at a time (the exporter's lock), so its caches need no lock.

    Args:
        route: The backend's rules, or ``None`` for none.
        rank0_only: Drop metric rows of ranks other than 0.
        display_names: Show built-in series under their dashboard names.

    Example:
        >>> from otel_train.config.settings import Route
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> f = RowFilter(Route(include="train/*", every=2), rank0_only=False, display_names=True)
        >>> rows = [MetricRow(RunInfo("r", "r"), s, n, n, 1.0, "gauge", 0)
        ...         for s in (1, 2) for n in ("train/loss", "train.iterations", "eval/acc")]
        >>> [(r.step, r.tag) for r in f.apply(rows, (), ())[0]]
        [(2, 'train/loss'), (2, 'train/iterations')]
    """

    def __init__(self, route: Route | None, *, rank0_only: bool, display_names: bool) -> None:
        self.include = route.include if route is not None and route.include else ()
        self.exclude = route.exclude if route is not None and route.exclude else ()
        self.every = route.every if route is not None and route.every else 1
        #: Logger-name globs to keep (only ``!`` patterns: every logger) and to leave out; None: every record;
        #: ``off`` (no pattern): none.
        logs = route.logs if route is not None else None
        self.logs: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        if logs is not None:
            kept = tuple(p for p in logs if not p.startswith("!"))
            left_out = tuple(p[1:] for p in logs if p.startswith("!"))
            self.logs = (kept or (("*",) if left_out else ()), left_out)
        self._keep_logger: dict[str, bool] = {}
        self.rank0_only = rank0_only
        self.display_names = display_names
        self._settings = (route.include_setting, route.exclude_setting) if route is not None else ("", "")
        self._keep: dict[str, bool] = {}  # metric name -> routed to this backend
        self._hits: set[tuple[int, str]] = set()  # (0 include / 1 exclude, pattern) that matched a name
        self._saw_rank0 = False
        self._reported = False

    def wants(self, name: str) -> bool:
        """Whether metric `name` passes include/exclude (cached; records which patterns matched)."""
        keep = self._keep.get(name)
        if keep is None:
            names = (name, display_name(name))
            included = self._match(0, self.include, names) if self.include else True
            excluded = self._match(1, self.exclude, names)
            keep = self._keep[name] = included and not excluded
        return keep

    def _match(self, which: int, patterns: Sequence[str], names: tuple[str, str]) -> bool:
        matched = False
        for pattern in patterns:  # every pattern, not just the first hit: each one's use is tracked
            if any(fnmatchcase(n, pattern) for n in names):
                self._hits.add((which, pattern))
                matched = True
        return matched

    def _step_ok(self, step: int | None) -> bool:
        return step is None or self.every == 1 or step % self.every == 0

    def _rows(self, rows: Sequence[_RowT]) -> Sequence[_RowT]:
        shown = DISPLAY_NAMES if self.display_names else None
        if not (self.include or self.exclude or self.rank0_only) and self.every == 1:
            # Display names only (the common case): untouched unless a built-in series is in the window.
            if shown is None or not any(row.name in shown for row in rows):
                return rows
            return [self._shown(row, shown) if row.name in shown else row for row in rows]
        out: list[_RowT] = []
        every, rank0_only = self.every, self.rank0_only
        for row in rows:
            name = row.name
            wanted = self.wants(name)  # cached per name
            if row.run.rank:
                if rank0_only:
                    continue
            else:
                self._saw_rank0 = True
            if not wanted or (every != 1 and row.step % every):
                continue
            out.append(self._shown(row, shown) if shown is not None and name in shown else row)
        return out

    @staticmethod
    def _shown(row: _RowT, shown: Mapping[str, str]) -> _RowT:
        """A copy of `row` under its display name (rows are shared by every backend: never changed)."""
        return dataclasses.replace(row, tag=shown[row.name] + row.tag[len(row.name):])

    def apply(
        self, metrics: Sequence[MetricRow], histograms: Sequence[HistogramRow], spans: Sequence[SpanRow]
    ) -> tuple[Sequence[MetricRow], Sequence[HistogramRow], Sequence[SpanRow]]:
        """The rows of one window this backend gets."""
        routed_spans: Sequence[SpanRow] = spans
        if self.every > 1 and spans:
            routed_spans = [s for s in spans if self._step_ok(s.step)]
        return self._rows(metrics), self._rows(histograms), routed_spans

    def apply_logs(self, logs: Sequence[LogRow]) -> Sequence[LogRow]:
        """The log records of one window this backend gets (by logger name; cached per logger)."""
        if self.logs is None or not logs:
            return logs
        keep = self._keep_logger
        out: list[LogRow] = []
        for row in logs:
            wanted = keep.get(row.logger)
            if wanted is None:
                include, exclude = self.logs
                wanted = keep[row.logger] = (any(fnmatchcase(row.logger, p) for p in include) and
                                              not any(fnmatchcase(row.logger, p) for p in exclude))
            if wanted:
                out.append(row)
        return out

    def unmatched(self) -> list[str]:
        """One line per pattern that matched no metric name this backend was offered."""
        lines: list[str] = []
        for which, patterns in ((0, self.include), (1, self.exclude)):
            for pattern in patterns:
                if (which, pattern) not in self._hits:
                    lines.append(f"{self._settings[which]}: pattern {pattern!r} matched no metric")
        return lines

    def report(self) -> None:
        """Log each unmatched pattern once, at shutdown, where rank 0's metrics were seen."""
        if self._reported or not self._saw_rank0:  # other ranks' processes stay quiet
            return
        self._reported = True
        for line in self.unmatched():
            _logger.warning("%s", line)

