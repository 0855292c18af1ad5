"""otel-train's own health as metrics, in the same backends as the run (``otel_train/*`` on dashboards).

Computed in the exporter process, off the training thread, when a window arrives: a few rows per backend,
stamped with that window's highest step (or a higher one seen before: they never go backwards), so a stall
or a failing backend lines up with the loss. The rows go to every backend (so TensorBoard shows that W&B is
failing) but not into the spool: they describe this delivery, not the run. ``OTEL_TRAIN_SELF_METRICS=0`` turns them off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from otel_train.backend import Window
from otel_train.vocab import semconv
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo

__all__ = ["SelfMetrics"]


class SelfMetrics:
    """Adds the health rows to each window (`Delivery.annotate`).

    Args:
        backend_stats: The delivery's `backend_stats` (name -> backlog, exports, export_s, rows, failures, dropped,
            and the step-order counters backwards, order_dropped).
        spool_failed_appends: The spool's count of windows it could not write ahead (disk full).

    Example:
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> stats = {"tensorboard": {"backlog": 1, "exports": 2, "export_s": 0.5, "rows": 9, "failures": 0,
        ...                          "dropped": 0}}
        >>> rows = SelfMetrics(lambda: stats).rows(RunInfo("r", "r"), 3, 10)
        >>> sorted((r.tag, r.value) for r in rows)[:2]
        [('otel_train.backend_errors{exporter=tensorboard}', 0.0), ('otel_train.backlog_windows{exporter=tensorboard}', 1.0)]
    """

    def __init__(self, backend_stats: Callable[[], Mapping[str, Mapping[str, float]]],
                 spool_failed_appends: Callable[[], int] | None = None) -> None:
        self._stats = backend_stats
        self._spool_failed = spool_failed_appends
        self._points = 0
        self._windows = 0
        self._step = -1  # the highest step the rows were stamped with
        self._last: dict[str, tuple[float, float]] = {}  # backend -> (exports, export_s) at the last report

    def __call__(self, window: Window, max_step: int) -> Window:
        self._windows += 1
        self._points += len(window.metrics) + len(window.histograms)
        if max_step < 0 or not window.metrics:  # spans only: no step to put the rows at
            return window
        # Never backwards (a late window for an older step): the health rows would count as steps going
        # backwards themselves (`OTEL_TRAIN_STEP_ORDER`), and they describe now, not that step.
        self._step = max(self._step, max_step)
        rows = self.rows(window.metrics[0].run, self._step, self._points)
        return Window([*window.metrics, *rows], window.histograms, window.spans, window.logs)

    def rows(self, run: RunInfo, step: int, points: int) -> list[MetricRow]:
        """The health rows at `step`: run-wide counts, then per backend."""
        t = time.time_ns()
        out = [MetricRow(run, step, semconv.SELF_POINTS, semconv.SELF_POINTS, float(points), "gauge", t),
               MetricRow(run, step, semconv.SELF_WINDOWS, semconv.SELF_WINDOWS, float(self._windows), "gauge", t)]
        failed = self._spool_failed() if self._spool_failed is not None else 0
        if failed:
            out.append(MetricRow(run, step, semconv.SELF_SPOOL_FAILED_APPENDS, semconv.SELF_SPOOL_FAILED_APPENDS,
                                 float(failed), "gauge", t))
        for name, s in self._stats().items():
            values = {semconv.SELF_BACKLOG: s["backlog"], semconv.SELF_ROWS_WRITTEN: s["rows"],
                      semconv.SELF_BACKEND_ERRORS: s["failures"],
                      semconv.SELF_DROPPED_WINDOWS: s["dropped"]}
            for key, stat in ((semconv.SELF_STEPS_BACKWARDS, "backwards"),
                              (semconv.SELF_STEPS_ORDER_DROPPED, "order_dropped")):
                if s.get(stat):  # only once there is something to see
                    values[key] = s[stat]
            exports, seconds = self._last.get(name, (0.0, 0.0))
            if s["exports"] > exports:  # mean latency of the writes since the last report
                values[semconv.SELF_EXPORT_LATENCY] = (s["export_s"] - seconds) / (s["exports"] - exports)
                self._last[name] = (s["exports"], s["export_s"])
            attrs = {"exporter": name}
            out.extend(MetricRow(run, step, key, f"{key}{{exporter={name}}}", float(v), "gauge", t, attrs)
                       for key, v in values.items())
        return out
