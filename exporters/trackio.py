"""Trackio backend: a local Trackio project and run, one `log(..., step=)` per step.

- Store: Trackio's local SQLite database ``<TRACKIO_DIR>/<project>.db`` (Trackio reads `TRACKIO_DIR`
  when it is imported; default ``$HF_HOME/trackio``). Nothing is deployed: no Space and no server unless
  the user set Trackio's own `TRACKIO_SPACE_ID` / `TRACKIO_SERVER_URL`.
- Run identity: project = the otel-train project (`OTEL_TRAIN_PROJECT`); run name `train.run.name`, opened
  with ``resume="allow"``, so a restarted job (same `train.run.id`) continues its run. Trackio keys runs by
  name, so when the local store already has a run of that name from another `train.run.id`, the run
  is named ``<run name>-<run id>`` instead of merging two training runs.
- Steps: ``step=`` is `train.step`; a resumed run drops (and counts) rows below the last step it already
  holds, and at that step the rows of series it already holds there: steps it holds keep the earlier attempt's
  values, and a step whose values were split over two windows (a kill between them) gets the rest once,
  e.g. from `otel-train replay`; with `OTEL_TRAIN_RESUME_STEP`
  the restart step is in the run config as ``otel_train.resume_step``.
- Ranks: with `OTEL_TRAIN_RANKS=all`, rank N > 0 series get ``{rank=N}`` in the same run, and the run's
  group is `train.run.id`. Trackio keys a run record by an id it draws at random unless it resumes a record
  it finds, and creates the record with its first write, so ranks starting together would make one record
  each: a new run takes an id derived from (project, run name, `train.run.id`) instead, the same on every rank.
- Hyperparameters: the run config (with `train.config.hash`). Histograms: `trackio.Histogram`.
- Durability: Trackio writes its queue to SQLite from a thread of its own (every 0.5 s). `flush` has it write
  the queue now, and `durable_step` reads the store back (the rows of the steps logged since the last look), so
  delivery's cursor never claims a step the database lacks: after a `kill -9`, `otel-train replay` writes it.
- Preemption: a run whose process ended on SIGTERM, SIGUSR1 or SIGHUP gets a WARN alert titled ``preempted``
  (Trackio versions without alerts: the config key ``otel_train.preempted``, best effort).
- Trackio keeps its current run in a context variable; the run is opened in a context of its own, so
  a Trackio run of the user's (on any thread) is never finished or replaced by this exporter.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sqlite3
import uuid
from collections.abc import Sequence
from typing import Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters._runs import (
    StepGate,
    by_step,
    histogram_bins,
    hparams_for,
    rank_tag,
    safe_name,
    wanted,
)
from otel_train.exporters.base import RowExporter
from otel_train.vocab.rows import HistogramRow, MetricRow
from otel_train.vocab.run_identity import PREEMPTED, RUN_ID, RunInfo

__all__ = ["PREEMPTED_KEY", "PREEMPTED_TITLE", "TrackioExporter", "shared_run_id"]

_logger = logging.getLogger(__name__)

#: Alert title (and, without alerts, config key) of a run whose process ended on SIGTERM / SIGUSR1 / SIGHUP.
PREEMPTED_TITLE = "preempted"
PREEMPTED_KEY = PREEMPTED

_MAX_BINS = 512


class TrackioExporter(RowExporter):
    """Writes scalars and histograms to a local Trackio run.

    Args:
        options: Directory, project, hyperparameters and rank policy; default from the env vars.

    Raises:
        ModuleNotFoundError: `trackio` is not installed.
    """

    name = "trackio"
    heavy_client = True  # seconds to import and start: a process of its own beside another such backend
    display_names = True
    handles_metrics = True
    handles_spans = False
    client_module = "trackio"

    def __init__(self, options: ExporterOptions | None = None) -> None:
        self.preload()
        super().__init__(options)
        self._runs: dict[str, Any] = {}  # train.run.id -> trackio Run
        self._gate = StepGate("trackio", monotonic=False)
        # Steps logged to a local run and not yet seen in its database: Trackio run id -> step -> a key logged.
        self._unseen: dict[str, dict[int, str]] = {}

    @property
    def steps_dropped(self) -> int:
        """Rows not written at or below the last step a resumed run holds (its store not readable per series)."""
        return int(self._gate.dropped)

    @property
    def steps_held(self) -> int:
        """Rows skipped because the resumed run holds their series at that step already (not a loss)."""
        return int(self._gate.held)

    # -- hooks -------------------------------------------------------------------------------
    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        per_run: dict[str, tuple[RunInfo, list[MetricRow | HistogramRow]]] = {}
        all_rows: list[MetricRow | HistogramRow] = [*rows, *histograms]
        for row in all_rows:
            if wanted(self.options, row.run):
                per_run.setdefault(row.run.run_id, (row.run, []))[1].append(row)
        for run_id, (info, run_rows) in per_run.items():
            run = self._run(info)
            for step, step_rows in by_step(run_rows):
                # One `log` per step; a series logged twice at one step (two `ot.log` calls) gets a second record
                # for its second value, as Trackio keeps records, not one value per step.
                records: list[dict[str, Any]] = []
                for row in step_rows:
                    key = rank_tag(row.tag, row.name, row.attributes, row.run.rank)
                    if not self._gate.admit((run_id, row.run.rank), step, series=key):
                        continue
                    if isinstance(row, MetricRow):
                        value: Any = row.value
                    else:
                        value = _histogram(row)
                        if value is None:
                            continue
                    data = next((d for d in records if key not in d), None)
                    if data is None:
                        data = {}
                        records.append(data)
                    data[key] = value
                for data in records:
                    run.log(data, step=step)
                    if getattr(run, "_is_local", False) and isinstance(getattr(run, "id", None), str):
                        self._unseen.setdefault(run.id, {}).setdefault(step, next(iter(data)))
                self.mark_written(step_rows)  # a retry after a later step's failure does not log it again

    def flush(self) -> None:
        """Have Trackio write its queue to its database now, as its own thread does every 0.5 s."""
        for run in self._runs.values():
            write, lock = getattr(run, "_flush_queues_inline", None), getattr(run, "_client_lock", None)
            if getattr(run, "_is_local", False) and callable(write) and lock is not None:
                with lock:  # the lock Trackio's thread holds around the same call
                    write()

    def durable_step(self) -> int | None:
        """None when the database holds every step logged to a local run, else the highest step below the first
        one it lacks (read back; also after `close`)."""
        if not any(self._unseen.values()):
            return None
        try:
            self._look_up_unseen()
        except (sqlite3.Error, OSError, ValueError) as err:  # not readable now: claim nothing new
            self._log.warning("read-back", "trackio: cannot read its database back (%s); the steps since are "
                              "kept for replay until it can", err)
        first = min((min(steps) for steps in self._unseen.values() if steps), default=None)
        return None if first is None else first - 1

    def _look_up_unseen(self) -> None:
        from trackio.sqlite_storage import SQLiteStorage

        path = SQLiteStorage.get_project_db_path(self.options.project)
        if not path.exists():
            return
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            for run_id, steps in self._unseen.items():
                if not steps:
                    continue
                found = conn.execute("SELECT step, metrics FROM metrics WHERE run_id = ? AND step BETWEEN ? AND ?",
                                     (run_id, min(steps), max(steps)))
                for step, metrics in found.fetchall():
                    key = steps.get(step)
                    if key is not None and _holds(json.loads(metrics), key):
                        del steps[step]
        finally:
            conn.close()

    def mark_preempted(self, cause: str) -> None:
        """A Trackio alert (level WARN, title ``preempted``) on every run written, where the installed
        Trackio has alerts; else the config note ``otel_train.preempted`` = `cause`."""
        for run in self._runs.values():
            if callable(getattr(run, "alert", None)):
                import trackio

                run.alert(PREEMPTED_TITLE, text=f"otel-train: the training process ended on {cause}",
                          level=trackio.AlertLevel.WARN)
            elif isinstance(getattr(run, "config", None), dict):
                run.config[PREEMPTED_KEY] = cause

    def close(self) -> None:
        for run_id, run in list(self._runs.items()):
            try:
                run.finish()
            except Exception as err:
                _logger.error("trackio: finishing run %s failed: %s", run_id, err)
        self._runs.clear()

    # -- internals -------------------------------------------------------------------------------
    def _run(self, info: RunInfo) -> Any:
        run = self._runs.get(info.run_id)
        if run is not None:
            return run
        import trackio

        name = info.run_name
        if _stored_run_id(self.options.project, name) not in (None, info.run_id):
            name = f"{name}-{safe_name(info.run_id)}"
        kwargs: dict[str, Any] = {
            "project": self.options.project,
            "name": name,
            "resume": "allow",
            "config": hparams_for(self.options, info),
            "embed": False,
            "auto_log_gpu": False,
            "auto_log_cpu": False,
        }
        if self.options.ranks == "all":
            kwargs["group"] = info.run_id
        if self.options.resume_step is not None:  # Trackio cannot delete points: record the restart
            kwargs["config"]["otel_train.resume_step"] = self.options.resume_step
        # A fresh context: trackio.init would finish whatever run is current in the caller's context.
        run = contextvars.Context().run(trackio.init, **kwargs)
        self._runs[info.run_id] = run
        next_step = getattr(run, "_next_step", 0)
        resumed = isinstance(next_step, int) and next_step > 0  # Trackio found a record of this name
        if not resumed and isinstance(getattr(run, "id", None), str):
            run.id = shared_run_id(self.options.project, name, info.run_id)  # before the first write
        # Trackio continues a resumed run after its last step; what it holds is not written again: each series at or
        # below its own last stored step (a series logged ahead costs the others none; another rank's `{rank=N}`
        # series are its own; at the last step of a window split by a kill, only the series stored there). A store
        # that cannot be read: below the run's next step, as Trackio resumes.
        if resumed:
            stored = _stored_steps(self.options.project, name)
            for rank in range(max(1, info.world_size)):
                if stored is None:
                    self._gate.set_floor((info.run_id, rank), next_step - 1)
                else:
                    self._gate.set_series_floors((info.run_id, rank), stored)
        return run


_RUN_IDS = uuid.UUID("5c4f3b7e-0d1a-4e7b-9a51-6f1e2d8c7a90")  # the namespace of `shared_run_id`


def shared_run_id(project: str, name: str, train_run_id: str) -> str:
    """The Trackio run id every rank of one training run gives a new run record (Trackio's own ids are random).

    Example:
        >>> shared_run_id("p", "n", "job-1") == shared_run_id("p", "n", "job-1") != shared_run_id("p", "n", "job-2")
        True
    """
    return uuid.uuid5(_RUN_IDS, f"{project}\0{name}\0{train_run_id}").hex


def _stored_steps(project: str, name: str) -> dict[str, int] | None:
    """The last stored step of each series (key) of run `name`; None when the store cannot be read."""
    try:
        from trackio.sqlite_storage import SQLiteStorage

        logs = SQLiteStorage.get_logs(project, name)
    except Exception:
        return None
    series: dict[str, int] = {}
    for entry in logs:
        step = entry.get("step")
        if not isinstance(step, int):
            continue
        for key in entry:
            if key in ("step", "timestamp"):
                continue
            for k in {key, key.removeprefix("__")}:  # a reserved key is stored as __key
                series[k] = max(step, series.get(k, -1))
    return series


def _holds(stored: Any, key: str) -> bool:
    """Whether a stored metrics record has `key` (Trackio stores a reserved key such as ``step`` as ``__step``)."""
    return isinstance(stored, dict) and (key in stored or f"__{key}" in stored)


def _stored_run_id(project: str, name: str) -> str | None:
    """`train.run.id` of the run `name` already in the local store (None: no such run, or unknown)."""
    try:
        from trackio.sqlite_storage import SQLiteStorage

        config = SQLiteStorage.get_run_config(project, name)
    except Exception:  # a remote store, or another Trackio layout: resume by name as Trackio does
        return None
    if not config or RUN_ID not in config:
        return None
    return str(config[RUN_ID])


def _histogram(row: HistogramRow) -> Any:
    """A `trackio.Histogram` of an explicit-bucket histogram; the outer edges are its min and max."""
    import trackio

    bins = histogram_bins(row, _MAX_BINS)
    if bins is None:
        return None
    return trackio.Histogram(np_histogram=bins)
