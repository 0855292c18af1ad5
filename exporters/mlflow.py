"""MLflow backend: one MLflow run per training run, one `log_batch` per window.

- Store: `MLFLOW_TRACKING_URI` when set; else a local SQLite store ``<OTEL_TRAIN_DIR>/mlruns/mlflow.db``
  with artifacts under ``<OTEL_TRAIN_DIR>/mlruns/artifacts`` (MLflow 3 refuses new file stores).
  The experiment is `MLFLOW_EXPERIMENT_ID` / `MLFLOW_EXPERIMENT_NAME` when set, else the otel-train
  project.
- Run identity: the run carries the tag `train.run.id`; a later process with the same run id (a restarted
  job, another rank) finds it and continues it. Two processes creating it at once both keep the oldest
  such run and delete the other, so they agree without talking.
- Keys: MLflow allows only letters (any script), digits, ``_ - . / space`` and ``:`` (not on Windows) in
  metric and param keys, and no empty, ``.`` or ``..`` path segment. A key it accepts is used as is; any other
  is mapped by `mlflow_name`, a pure function of the key (the same on every rank and run): each other
  character -> ``_``, empty segments dropped, ``.``/``..`` segments -> ``_``/``__``, then ``_`` plus a hash of
  the key, so two keys never share a name (``val/mAP@0.5`` -> ``val/mAP_0.5_909d36``). The series suffix
  of extra attributes is mapped too: ``{`` -> ``__``, ``,`` -> ``__``, ``=`` -> ``-``, ``}`` dropped
  (``eval/acc{split=val}`` -> ``eval/acc__split-val``).
- Steps: ``step`` is `train.step`. A resumed run records the last step of each rank in the tag
  ``otel_train.last_step[.rankN]`` (the highest step stored: a late row never lowers it); rows at or below
  it are dropped and counted, so no step is written twice.
  MLflow cannot delete points, so a resume (`OTEL_TRAIN_RESUME_STEP` = N) is recorded in the tag
  ``otel_train.resume_step[.rankN]``; steps the run already holds keep the earlier attempt's values.
- Ranks: with `OTEL_TRAIN_RANKS=all`, rank N > 0 writes into the same run with ``{rank=N}`` in its keys
  (``train/loss__rank-1``, ``train/step_duration_s__rank-1``); MLflow runs can be shared by processes.
  Processes opening the default store at once take turns (a file lock ``mlflow.db.lock`` beside it) while
  MLflow creates or migrates it and the experiment is found or created. A new local store is built aside and
  renamed into place, so a kill during its creation cannot leave a half-built store; one a kill left so
  (by an older version) is set aside as ``mlflow.db.broken-<time>`` when it holds no run, and built again.
  A new local store starts as a copy of an empty one kept in the user's cache folder (MLflow's migrations run
  once per machine and MLflow version: `otel_train.exporters._mlflow_store`).
- Preemption: a run that ended on SIGTERM, SIGUSR1 or SIGHUP gets the tag ``otel_train.preempted`` = the signal's
  name and ends with status KILLED (else FINISHED).
- Hyperparameters: params, nested keys flattened with ``/``; `train.config.hash` also as a tag.
- Log records: text artifacts of the run, one per window and rank that has some,
  ``otel-train-logs/rank<N>/step<first step, 9 digits>-<time of its first record, ns>.log``, a line each
  (``[step S] LEVEL logger: message``, the traceback after it); sorted by name they are in step order. MLflow has
  no per-step text, and an artifact cannot be appended to, so a window never rewrites an earlier one. Ranks as for
  metrics (`OTEL_TRAIN_RANKS`).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import posixpath
import re
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters._mlflow_store import open_store, store_lock
from otel_train.exporters._runs import (
    LOGS_FOLDER,
    RANK_SUFFIX_KEY,
    StepGate,
    bounded,
    by_step,
    flatten,
    hparams_for,
    log_line,
    logs_by_rank,
    series_name,
    wanted,
)
from otel_train.exporters.base import RowExporter
from otel_train.vocab.names import key_hash
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, series_tag
from otel_train.vocab.run_identity import CONFIG_HASH, PREEMPTED, RUN_ID, RunInfo

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

__all__ = ["LAST_STEP_TAG", "PREEMPTED_TAG", "RESUME_STEP_TAG", "MLflowExporter", "mlflow_key", "mlflow_name",
           "tracking_uri_for"]

_logger = logging.getLogger(__name__)

LAST_STEP_TAG = "otel_train.last_step"
RESUME_STEP_TAG = "otel_train.resume_step"
PREEMPTED_TAG = PREEMPTED
_MAX_KEY = 250
_MAX_PARAM_VALUE = 6000
_METRICS_PER_BATCH = 1000
_STAMPS_KEPT = 65_536  # recent (run, key, step, value)s whose timestamp a repeat must not take (`_unique_stamp`)
_PARAMS_PER_BATCH = 100
_SUFFIX_MAP = str.maketrans({"{": "__", ",": "__", "=": "-", "}": ""})
_ALLOWED = r"/\w.\- " if os.name == "nt" else r"/\w.\- :"  # MLflow's own rule (no `:` on Windows)
_DISALLOWED = re.compile(f"[^{_ALLOWED}]")
_KEY = re.compile(f"[{_ALLOWED}]+\\Z")


@functools.lru_cache(maxsize=4096)
def mlflow_name(key: str) -> str:
    """The MLflow metric/param key of `key`: itself when MLflow accepts it, else mapped plus a hash of `key`.

    Example:
        >>> mlflow_name("train/loss"), mlflow_name("épochs/loss"), mlflow_name("val/mAP@0.5")
        ('train/loss', 'épochs/loss', 'val/mAP_0.5_909d36')
        >>> mlflow_name("Loss (val)"), mlflow_name("..a/b")
        ('Loss _val__47840d', '_.a/b_d0420f')
    """
    if _KEY.match(key) and len(key) <= _MAX_KEY and not path_not_unique(key):
        return key
    mapped = _DISALLOWED.sub("_", key)
    # MLflow treats keys as paths: no empty, `.` or `..` segments, no leading `/`.
    parts = [p if p not in (".", "..") else p.replace(".", "_") for p in mapped.split("/") if p]
    if parts and parts[0].startswith(".."):  # MLflow refuses any key that starts with `..`, not only the segment
        parts[0] = "_" + parts[0][1:]
    suffix = "_" + key_hash(key)
    return "/".join(parts)[:_MAX_KEY - len(suffix)] + suffix


def mlflow_key(name: str, attributes: Mapping[str, Any] | None = None) -> str:
    """The MLflow key of series `name` with `attributes`: `mlflow_name`, then the suffix of the extra attributes.

    Example:
        >>> mlflow_key("eval/acc", {"fold": 1, "split": "val"})
        'eval/acc__fold-1__split-val'
        >>> mlflow_key("loss", {"rank": 2})
        'loss__rank-2'
    """
    base = mlflow_name(name)
    suffix = series_tag("", attributes)
    if not suffix:
        return base
    key = base + _DISALLOWED.sub("_", suffix.translate(_SUFFIX_MAP))
    key = "/".join(p if p not in (".", "..") else p.replace(".", "_") for p in key.split("/") if p)
    if len(key) > _MAX_KEY:
        digest = key_hash(name + suffix, 8)
        key = f"{key[:_MAX_KEY - 9]}-{digest}"
    return key


def tracking_uri_for(directory: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> str:
    """The store a backend with the otel-train `directory` writes to under the environment `env` (default: this
    process's): `MLFLOW_TRACKING_URI`, else the local SQLite store under `directory` (`_local_store`)."""
    uri = (os.environ if env is None else env).get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{_local_store(directory) / 'mlflow.db'}"


def _local_store(directory: str | os.PathLike[str]) -> Path:
    """The folder of the default store (and its artifacts) under the otel-train `directory`."""
    return (Path(directory) / "mlruns").resolve()


def path_not_unique(key: str) -> bool:
    """MLflow's path rule: `key` must be its own normal form (no ``//``, ``/`` at either end, ``.`` segments)."""
    norm = posixpath.normpath(key)
    return norm != key or norm == "." or norm.startswith(("..", "/"))


def _remember(memory: collections.OrderedDict[Any, int], key: Any, stamp: int) -> None:
    """`memory[key] = stamp`, newest last, the oldest forgotten past `_STAMPS_KEPT`."""
    memory[key] = stamp
    memory.move_to_end(key)
    if len(memory) > _STAMPS_KEPT:
        memory.popitem(last=False)


def _last_step_tag(rank: int) -> str:
    return LAST_STEP_TAG if rank == 0 else f"{LAST_STEP_TAG}.rank{rank}"


def _resume_tag(rank: int) -> str:
    return RESUME_STEP_TAG if rank == 0 else f"{RESUME_STEP_TAG}.rank{rank}"


class MLflowExporter(RowExporter):
    """Writes scalars (histograms as their count/sum/min/max series) to MLflow runs.

    Args:
        options: Directory, project, hyperparameters and rank policy; default from the env vars.

    Raises:
        ModuleNotFoundError: `mlflow` is not installed.
    """

    name = "mlflow"
    heavy_client = True  # seconds to import and start: a process of its own beside another such backend
    display_names = True
    handles_metrics = True
    handles_spans = False
    handles_logs = True
    client_module = "mlflow"

    def __init__(self, options: ExporterOptions | None = None) -> None:
        self.preload()
        super().__init__(options)
        self._client: MlflowClient | None = None
        self._uri = ""
        self._default_store: Path | None = None
        self._experiment_id: str | None = None
        self._runs: dict[str, str] = {}  # train.run.id -> MLflow run id
        self._tags: dict[str, dict[str, str]] = {}  # MLflow run id -> its tags when found
        self._gate = StepGate("mlflow", monotonic=False)
        self._floored: set[tuple[str, int]] = set()
        self._last_stored: dict[tuple[str, int], int] = {}  # (MLflow run, rank) -> highest step its tag claims
        self._held_steps: dict[str, dict[str, int]] = {}  # MLflow run id -> metric key -> its last step when found
        self._keys: dict[tuple[str, str, int], str] = {}  # row's series -> MLflow key
        # `_unique_stamp`'s memory, the latest `_STAMPS_KEPT` entries of each: a row (its point and its time in ns)
        # -> the timestamp it was given; a point (MLflow run, key, step, value's bits) -> the last timestamp given.
        self._stamp_of_row: collections.OrderedDict[tuple[str, str, int, bytes, int], int] = collections.OrderedDict()
        self._last_stamp: collections.OrderedDict[tuple[str, str, int, bytes], int] = collections.OrderedDict()
        self._end_status = "FINISHED"  # KILLED once the run was preempted

    @property
    def steps_dropped(self) -> int:
        """Rows not written at or below the highest step a resumed run holds (its series not known per series)."""
        return int(self._gate.dropped)

    @property
    def steps_held(self) -> int:
        """Rows skipped because the resumed run holds their series at that step already (not a loss)."""
        return int(self._gate.held)

    @property
    def run_ids(self) -> dict[str, str]:
        """`train.run.id` -> MLflow run id of every run written so far."""
        return dict(self._runs)

    @property
    def tracking_uri(self) -> str:
        """`MLFLOW_TRACKING_URI`, else the local SQLite store under the otel-train directory."""
        return tracking_uri_for(self.options.directory)

    @classmethod
    def store_fields(cls, options: ExporterOptions) -> dict[str, str]:
        return {"tracking_uri": tracking_uri_for(options.directory)}

    # -- hooks -------------------------------------------------------------------------------
    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        from mlflow.entities import Metric, RunTag

        per_run: dict[str, tuple[RunInfo, list[MetricRow]]] = {}
        for row in rows:
            if wanted(self.options, row.run):
                per_run.setdefault(row.run.run_id, (row.run, []))[1].append(row)
        client = self._get_client()
        for run_info, run_rows in per_run.values():
            mlflow_id = self._run(run_info)
            metrics: list[Any] = []
            last: dict[int, int] = {}
            for step, step_rows in by_step(run_rows):
                for row in step_rows:
                    rank = row.run.rank
                    self._ensure_floor(mlflow_id, rank)
                    key = self._key(row)
                    if not self._gate.admit((mlflow_id, rank), step, series=key):
                        continue
                    last[rank] = max(step, last.get(rank, step))
                    stamp = self._unique_stamp(mlflow_id, key, row)
                    metrics.append(Metric(key, row.value, stamp, step))
            tags = []
            for rank, step in sorted(last.items()):
                # The highest step stored, never lowered by a late row (a restarted job reads it as its floor).
                claimed = self._last_stored.get((mlflow_id, rank), -1)
                if step > claimed:
                    tags.append(RunTag(_last_step_tag(rank), str(step)))
            chunks = list(bounded(metrics, _METRICS_PER_BATCH)) or [[]]
            for i, chunk in enumerate(chunks):
                # The last-step tags go with the last chunk: they claim only what is stored.
                client.log_batch(mlflow_id, metrics=list(chunk), tags=tags if i == len(chunks) - 1 else [])
            for rank, step in last.items():
                if step > self._last_stored.get((mlflow_id, rank), -1):
                    self._last_stored[(mlflow_id, rank)] = step

    def _unique_stamp(self, mlflow_id: str, key: str, row: MetricRow) -> int:
        """The row's timestamp in ms. MLflow keeps one row per (run, key, step, value, millisecond): a value logged
        again at the same step of a series within the millisecond of the earlier one would be stored once, so the
        later one is stored a millisecond after (its wall time moves by that much; step and value are as logged).
        A row written again (a retried window) gets the timestamp it got the first time: MLflow's key then keeps
        one copy, as it does without this."""
        point = (mlflow_id, key, row.step, struct.pack("<d", row.value))
        this = (*point, row.time_unix_nano)
        stamp = self._stamp_of_row.get(this)
        if stamp is None:
            stamp = row.time_unix_nano // 1_000_000 or int(time.time() * 1000)
            last = self._last_stamp.get(point)
            if last is not None and stamp <= last:
                stamp = last + 1
            _remember(self._last_stamp, point, stamp)
        _remember(self._stamp_of_row, this, stamp)
        return stamp

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        per_rank = logs_by_rank(self.options, rows)
        if not per_rank:
            return
        client = self._get_client()
        for run_info, records in per_rank.values():
            mlflow_id = self._run(run_info)
            first = min((r.step for r in records if r.step is not None), default=0)
            name = f"{LOGS_FOLDER}/rank{run_info.rank}/step{first:09d}-{records[0].time_unix_nano}.log"
            client.log_text(mlflow_id, "".join(log_line(r) for r in records), name)
            self.mark_written(records)

    def _key(self, row: MetricRow) -> str:
        """The row's MLflow key: `mlflow_key` of the name rank 0 shows, with ``rank=N`` for rank N > 0."""
        ident = (row.tag, row.name, row.run.rank)  # the tag holds the attributes' suffix
        key = self._keys.get(ident)
        if key is None:
            attributes = dict(row.attributes)
            if row.run.rank:
                attributes[RANK_SUFFIX_KEY] = row.run.rank
            key = mlflow_key(series_name(row.tag, row.name), attributes)
            if len(self._keys) >= 65_536:  # unbounded series sets must not grow memory
                self._keys.clear()
            self._keys[ident] = key
        return key

    def mark_preempted(self, cause: str) -> None:
        """Tag ``otel_train.preempted`` = `cause` on every run written; `close` ends them as KILLED."""
        if self._client is None:
            return
        for mlflow_id in self._runs.values():
            self._client.set_tag(mlflow_id, PREEMPTED_TAG, cause)
        self._end_status = "KILLED"

    def close(self) -> None:
        if self._client is None:
            return
        for mlflow_id in self._runs.values():
            try:
                self._client.set_terminated(mlflow_id, status=self._end_status)
            except Exception as err:
                _logger.error("mlflow: ending run %s failed: %s", mlflow_id, err)

    # -- internals -------------------------------------------------------------------------------
    def _get_client(self) -> MlflowClient:
        if self._client is None:

            uri = self._uri = self.tracking_uri
            if not os.environ.get("MLFLOW_TRACKING_URI"):  # the default store, with its artifacts beside it
                self._default_store = _local_store(self.options.directory)
                self._default_store.mkdir(parents=True, exist_ok=True)
            client = open_store(uri)  # a local store: built aside, or rebuilt when a kill left it half-built
            with store_lock(uri):  # one process at a time finds or creates the experiment
                self._experiment(client)
            self._client = client
        return self._client

    def _experiment(self, client: MlflowClient) -> str:
        if self._experiment_id is None:
            env_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
            if env_id:
                self._experiment_id = env_id
            else:
                name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.options.project
                found = client.get_experiment_by_name(name)
                if found is not None:
                    self._experiment_id = found.experiment_id
                else:
                    artifacts = None
                    if self._default_store is not None:
                        artifacts = (self._default_store / "artifacts").as_uri()
                    try:
                        self._experiment_id = client.create_experiment(name, artifact_location=artifacts)
                    except Exception:  # created by another process meanwhile (a store without our lock)
                        found = client.get_experiment_by_name(name)
                        if found is None:
                            raise
                        self._experiment_id = found.experiment_id
        return self._experiment_id

    def _find(self, client: MlflowClient, experiment_id: str, run_id: str) -> list[Any]:
        quoted = run_id.replace("\\", "\\\\").replace("'", "\\'")
        runs = client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_ID}` = '{quoted}'", max_results=50,
            order_by=["attributes.start_time ASC"],
        )
        return sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))

    def _run(self, info: RunInfo) -> str:
        mlflow_id = self._runs.get(info.run_id)
        if mlflow_id is not None:
            return mlflow_id
        client = self._get_client()
        experiment_id = self._experiment(client)
        params = hparams_for(self.options, info)
        with store_lock(self._uri):  # a local store: one process at a time finds or creates the run
            found = self._find(client, experiment_id, info.run_id)
            if found:
                run = found[0]
                if run.info.status != "RUNNING":
                    client.update_run(run.info.run_id, status="RUNNING")
            else:
                tags = {RUN_ID: info.run_id}
                if params.get(CONFIG_HASH):
                    tags[CONFIG_HASH] = str(params[CONFIG_HASH])
                created = client.create_run(experiment_id, run_name=info.run_name, tags=tags)
                # A store without our lock (a server): another process may have created it at the same
                # moment; everyone keeps the oldest.
                found = self._find(client, experiment_id, info.run_id)
                run = found[0] if found else created
                if run.info.run_id != created.info.run_id:
                    client.delete_run(created.info.run_id)
        mlflow_id = str(run.info.run_id)
        self._runs[info.run_id] = mlflow_id
        self._tags[mlflow_id] = dict(run.data.tags)
        # The last step stored of each metric (MLflow's latest metric of a key is its highest step): a resumed run's
        # floor per series, so a series that lags another (logged ahead with `step=`) loses none of its steps.
        held: dict[str, int] = {}
        for metric in run.data.to_proto().metrics:
            held[metric.key] = max(int(metric.step), held.get(metric.key, -1))
        self._held_steps[mlflow_id] = held
        if self.options.resume_step is not None:
            # MLflow cannot delete points: record where the run restarted (its steps >= N before this
            # are the earlier attempt's; the ones it already holds are not written again).
            client.set_tag(mlflow_id, _resume_tag(info.rank), str(self.options.resume_step))
        self._log_params(client, mlflow_id, params, dict(run.data.params))
        return mlflow_id

    def write_resume(self, run: RunInfo, step: int) -> None:
        """Record the restart in the tag `otel_train.resume_step[.rankN]` (now, if the run is open)."""
        super().write_resume(run, step)
        mlflow_id = self._runs.get(run.run_id)
        if mlflow_id is not None:
            self._get_client().set_tag(mlflow_id, _resume_tag(run.rank), str(step))

    def _ensure_floor(self, mlflow_id: str, rank: int) -> None:
        if (mlflow_id, rank) in self._floored:
            return
        self._floored.add((mlflow_id, rank))
        held = self._tags.get(mlflow_id, {}).get(_last_step_tag(rank))
        if held is not None:
            try:
                step = int(held)
            except ValueError:
                return
            self._gate.set_floor((mlflow_id, rank), step)
            self._last_stored[(mlflow_id, rank)] = step
            self._gate.set_series_floors((mlflow_id, rank), self._held_steps.get(mlflow_id, {}))

    def _log_params(self, client: MlflowClient, mlflow_id: str, params: dict[str, Any], held: dict[str, str]) -> None:
        from mlflow.entities import Param

        new: list[Any] = []
        for key, value in flatten(params).items():
            k, v = mlflow_name(key), str(value)[:_MAX_PARAM_VALUE]
            if k not in held:
                new.append(Param(k, v))
            elif held[k] != v:  # params are immutable in MLflow: keep the first, say so once
                self._log.warning(f"param-{k}", "mlflow: run %s already has param %s=%r; not changing it to %r",
                                  mlflow_id, k, held[k], v)
        for chunk in bounded(new, _PARAMS_PER_BATCH):
            client.log_batch(mlflow_id, params=list(chunk))
