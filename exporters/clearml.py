"""ClearML backend: one ClearML Task per training run, scalars with `report_scalar`.

- Task: the running task when the process already has one (the user's own `Task.init`), else a new
  Task in project `CLEARML_PROJECT` / the otel-train project, named `CLEARML_TASK` / `train.run.name`
  (the two variables as in Hugging Face accelerate),
  tagged ``train.run.id:<id>`` and ``train.config.hash:<hash>``. When no ClearML server is configured
  (no `CLEARML_API_HOST`, `CLEARML_API_ACCESS_KEY`, `CLEARML_AUTH_TOKEN` or credentials in
  `CLEARML_CONFIG_FILE` / ``~/.clearml.conf``) the Task runs offline: ClearML stores a session folder
  (and a zip at close) under ``<CLEARML_CACHE_DIR>/offline/``, to import later. A Task we created
  reports in-process (ClearML's reporter subprocess costs a process and ~10 s at close).
- Names: instrument ``train/loss`` -> title ``train``, series ``loss``; the title is everything before
  the last ``/`` (``optim/lr/group0`` -> ``optim/lr`` / ``group0``); a name without ``/`` is both title
  and series. The ``{k=v}`` suffix (extra attributes, ``rank=N``) stays on the series
  (``eval/acc{split=val}`` -> ``eval`` / ``acc{split=val}``); a built-in series splits under its display
  name (``train.step.duration_s`` -> ``train`` / ``step_duration_s``). Iteration = `train.step`. Histograms: `report_histogram` of the bucket counts.
- Ranks: with `OTEL_TRAIN_RANKS=all`, rank N > 0 series get ``{rank=N}`` in the run's Task (the sink
  sees every rank in one instance, so one Task holds them all). In-process, each rank's process opens
  its own Task of the same name (offline sessions cannot be shared), its series still suffixed.
- Hyperparameters: `Task.connect` in section ``General`` (with `train.config.hash`).
- Resume (`OTEL_TRAIN_RESUME_STEP` = N): the Task is tagged ``otel_train.resume_step:N``; a continued
  Task's initial-iteration offset is reset to 0, since `train.step` is already absolute.
- Preemption: a process that ended on SIGTERM, SIGUSR1 or SIGHUP tags the Task ``otel_train.preempted:<signal>``
  and adds ``otel-train: preempted by <signal>`` to its comment.
- Log records: the Task's console log (`Logger.report_text`, at the record's `logging` level, not printed), each
  line ``[step S rank R] LEVEL logger: message`` with the traceback after it; ClearML's console has no
  iteration, so the step is in the line. Ranks as for metrics (`OTEL_TRAIN_RANKS`).
- One Task per process: rows of a second run id in the same exporter are dropped with a warning.
- Offline, what the session folder holds is read back (`durable_step`): ClearML's reporter logs a failed write
  (a full disk, a read-only file) and goes on, so a step is claimed only once its ``metrics.jsonl`` holds it, and
  the windows after it stay in the spool for `otel-train replay`.
- Offline, a process that opens a new Task for a run that earlier sessions hold (the exporter process restarted,
  a replay, a job restarted) skips each series' rows at or below the last iteration those sessions hold of it,
  as the other run-based backends skip steps they hold (counted in `steps_held`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters._runs import StepGate, by_step, hparams_for, rank_tag, series_name, wanted
from otel_train.exporters.base import RowExporter
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, series_tag
from otel_train.vocab.run_identity import CONFIG_HASH, PREEMPTED, RunInfo

__all__ = ["PREEMPTED_TAG", "ClearMLExporter", "offline_scalars", "offline_sessions_of", "title_series"]

_logger = logging.getLogger(__name__)

#: Tag prefix of a Task whose process ended on SIGTERM / SIGUSR1 / SIGHUP (``otel_train.preempted:SIGTERM``).
PREEMPTED_TAG = PREEMPTED


def title_series(name: str, tag: str) -> tuple[str, str]:
    """ClearML (title, series) of a series tag: split the name at its last ``/``, suffix on the series.

    `name` is the row's metric name (``train.step.duration_s``), `tag` its series tag as routing shows it
    (``train/step_duration_s{rank=1}``): the name part of the tag is split, its ``{k=v}`` suffix (extra
    attributes, rank) always stays on the series, so distinct series never share one ClearML series.

    Example:
        >>> title_series("train/loss", "train/loss")
        ('train', 'loss')
        >>> title_series("eval/acc", "eval/acc{split=val}")
        ('eval', 'acc{split=val}')
        >>> title_series("lr", "lr{rank=1}")
        ('lr', 'lr{rank=1}')
        >>> title_series("eval/acc{a=1}", "eval/acc\\\\{a=1}")  # a key holding `{`, not the series `a=1`
        ('eval', 'acc\\\\{a=1}')
        >>> title_series("train.step.duration_s", "train/step_duration_s{rank=1}")
        ('train', 'step_duration_s{rank=1}')
    """
    shown = series_name(tag, name)
    if not tag.startswith(shown) and "{" in name:  # a name holding `{` is escaped in its tag (`series_tag`)
        shown = series_tag(name, None)
    if tag.startswith(shown):
        base, suffix = shown, tag[len(shown):]
    else:  # a tag not built from this name: its own name part, never dropping the suffix
        brace = tag.find("{")
        base, suffix = (tag[:brace], tag[brace:]) if brace > 0 else (tag, "")
    title, sep, series = base.rpartition("/")
    if not sep or not title or not series:
        return base, base + suffix
    return title, series + suffix


def offline_scalars(folder: Path) -> Iterator[tuple[str, int, float]]:
    """``(title/series, iteration, value)`` of each scalar an offline session folder holds (its ``metrics.jsonl``)."""
    path = folder / "metrics.jsonl"
    if path.exists():
        yield from _scalars_in(path.read_bytes())


def _scalars_in(data: bytes) -> Iterator[tuple[str, int, float]]:
    """The scalars of whole ``metrics.jsonl`` lines (a line a kill cut off is skipped)."""
    for line in data.decode("utf-8", "replace").splitlines():
        if not line.strip():
            continue
        try:
            events = json.loads(line)
        except ValueError:
            continue
        for ev in events if isinstance(events, list) else ():
            if isinstance(ev, dict) and ev.get("type") == "training_stats_scalar":
                yield f"{ev['metric']}/{ev['variant']}", ev["iter"], ev["value"]


def offline_sessions_of(offline_dir: Path, run_id: str) -> list[Path]:
    """The offline session folders under `offline_dir` of the run `run_id` (tagged ``train.run.id:<id>``)."""
    mark = f"train.run.id:{run_id}"
    return [folder for folder in sorted(p for p in offline_dir.glob("*") if p.is_dir()) if _mentions(folder, mark)]


def _mentions(folder: Path, text: str) -> bool:
    for path in folder.rglob("*.json*"):
        try:
            if text in path.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _server_configured() -> bool:
    """Whether ClearML has a server to talk to (env or its config file); else we go offline."""
    import os

    if any(os.environ.get(v) for v in ("CLEARML_API_HOST", "CLEARML_API_ACCESS_KEY", "CLEARML_AUTH_TOKEN",
                                        "TRAINS_API_HOST", "TRAINS_API_ACCESS_KEY")):
        return True
    try:
        from clearml.config import config_obj

        return bool(config_obj.get("api.credentials.access_key", None))
    except Exception:
        return False


class ClearMLExporter(RowExporter):
    """Writes scalars and histograms to a ClearML Task.

    Args:
        options: Directory, project, hyperparameters and rank policy; default from the env vars.

    Raises:
        ModuleNotFoundError: `clearml` is not installed.
    """

    name = "clearml"
    heavy_client = True  # seconds to import and start: a process of its own beside another such backend
    display_names = True
    handles_metrics = True
    handles_spans = False
    handles_logs = True
    client_module = "clearml"

    def __init__(self, options: ExporterOptions | None = None) -> None:
        self.preload()
        super().__init__(options)
        self._task: Any = None
        self._own_task = False
        self._run_id: str | None = None
        self.rows_dropped = 0
        self._gate = StepGate("clearml", monotonic=False)
        self._folder: Path | None = None  # our offline session's folder (read back), else None
        self._unseen: dict[int, str] = {}  # step -> a scalar reported at it that the folder was not seen to hold
        self._read_to = 0  # bytes of the session's metrics.jsonl read back so far (whole lines)

    @property
    def steps_held(self) -> int:
        """Rows skipped because an earlier session of the run holds their series at that step or later (not a
        loss)."""
        return int(self._gate.held)

    @property
    def task(self) -> Any:
        """The ClearML Task written to (None before the first rows)."""
        return self._task

    # -- hooks -------------------------------------------------------------------------------
    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        all_rows: list[MetricRow | HistogramRow] = [*rows, *histograms]
        candidates = [r for r in all_rows if wanted(self.options, r.run)]
        if not candidates:
            return
        logger = self._open(candidates[0].run).get_logger()
        mine = [r for r in candidates if self._accept(r.run)]
        for step, step_rows in by_step(mine):
            for row in step_rows:
                tag = rank_tag(row.tag, row.name, row.attributes, row.run.rank)
                title, series = title_series(row.name, tag)
                if not self._gate.admit(row.run.run_id, step, series=f"{title}/{series}"):
                    self.mark_written((row,))  # held by an earlier session: handled
                    continue
                if isinstance(row, MetricRow):
                    logger.report_scalar(title, series, value=row.value, iteration=step)
                    if self._folder is not None and step not in self._unseen:
                        self._unseen[step] = f"{title}/{series}"
                elif row.count:
                    logger.report_histogram(title, series, values=list(row.bucket_counts), iteration=step,
                                            xlabels=_bucket_labels(row.explicit_bounds), xaxis=row.name,
                                            yaxis="count")
                self.mark_written((row,))  # one report per row: a retry does not report it again

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        candidates = [r for r in rows if wanted(self.options, r.run)]
        if not candidates:
            return
        logger = self._open(candidates[0].run).get_logger()
        for row in candidates:
            if not self._accept(row.run):
                continue
            step = "-" if row.step is None else row.step
            text = f"[step {step} rank {row.run.rank}] {row.severity_text} {row.logger}: {row.body}"
            stack = row.attributes.get("exception.stacktrace")
            logger.report_text(f"{text}\n{stack}" if stack else text, level=_logging_level(row.severity_number),
                               print_console=False)
            self.mark_written((row,))

    def flush(self) -> None:
        if self._task is not None:
            self._task.get_logger().flush(wait=True)

    def durable_step(self) -> int | None:
        """Offline: None when the session's ``metrics.jsonl`` holds a scalar of every step reported, else the step
        below the first it lacks (read back, also after `close`: ClearML only logs a write it could not make)."""
        if not self._unseen or self._folder is None:
            return None
        path = self._folder / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(self._read_to)
                data = f.read()
        except FileNotFoundError:  # nothing written yet
            data = b""
        except OSError as err:
            self._log.warning("read-back", "clearml: cannot read its session back (%s); the steps since are kept for "
                              "replay until it can", err)
            data = b""
        whole = data[:data.rfind(b"\n") + 1]  # a line being written is read with the next look
        self._read_to += len(whole)
        for name, step, _ in _scalars_in(whole):
            if self._unseen.get(step) == name:
                del self._unseen[step]
        return min(self._unseen) - 1 if self._unseen else None

    def mark_preempted(self, cause: str) -> None:
        """Tag the Task ``otel_train.preempted:<cause>`` and add a line to its comment."""
        task = self._task
        if task is None:
            return
        task.add_tags([f"{PREEMPTED_TAG}:{cause}"])
        comment = task.comment or ""
        note = f"otel-train: preempted by {cause}"
        task.set_comment(f"{comment}\n{note}" if comment else note)

    def close(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if self._own_task:
            task.close()
        else:
            task.get_logger().flush(wait=True)

    # -- internals -------------------------------------------------------------------------------
    def _accept(self, run: RunInfo) -> bool:
        if self._run_id is None or run.run_id == self._run_id:
            return True
        self.rows_dropped += 1
        self._log.warning("second-run", "clearml: one Task per process; rows of run %r dropped (writing run %r)",
                          run.run_id, self._run_id)
        return False

    def write_resume(self, run: RunInfo, step: int) -> None:
        """Tag the Task ``otel_train.resume_step:N`` (now, if it is open)."""
        super().write_resume(run, step)
        if self._task is not None and run.run_id == self._run_id:
            self._task.add_tags([f"otel_train.resume_step:{step}"])

    def _open(self, info: RunInfo) -> Any:
        if self._task is not None:
            return self._task
        import os

        from clearml import Task

        task: Any = Task.current_task()
        if task is None:
            if not _server_configured():
                Task.set_offline(True)
            # Report in-process: the reporter subprocess costs a process and ~10 s at close.
            if hasattr(Task, "_report_subprocess_enabled"):
                Task._report_subprocess_enabled = False  # type: ignore[assignment]
            task = Task.init(
                project_name=os.environ.get("CLEARML_PROJECT") or self.options.project,
                task_name=os.environ.get("CLEARML_TASK") or info.run_name,
                reuse_last_task_id=False,
                auto_connect_frameworks=False,
                auto_connect_arg_parser=False,
                auto_connect_streams=False,
                auto_resource_monitoring=False,
            )
            self._own_task = True
        self._task = task
        self._run_id = info.run_id
        params = hparams_for(self.options, info)
        tags = [f"train.run.id:{info.run_id}"]
        if params.get(CONFIG_HASH):
            tags.append(f"{CONFIG_HASH}:{params[CONFIG_HASH]}")
        if self.options.resume_step is not None:
            tags.append(f"otel_train.resume_step:{self.options.resume_step}")
            # A continued Task offsets reported iterations by its last one; our steps are absolute.
            if task.get_initial_iteration():
                task.set_initial_iteration(0)
        task.add_tags(tags)
        task.connect(params)
        if self._own_task:
            self._floor_from_earlier_sessions(task, info.run_id)
        return task

    def _session_folder(self, task: Any) -> Path | None:
        """Our offline session's folder (None: online, or a ClearML without the call)."""
        try:
            folder = task.get_offline_mode_folder() if task.is_offline() else None
        except Exception:
            return None
        return None if folder is None else Path(folder)

    def _floor_from_earlier_sessions(self, task: Any, run_id: str) -> None:
        """Offline: each series' last iteration in the run's earlier sessions (the Task is new per process, so a
        restarted exporter process handed windows its previous session had written would write them twice)."""
        own = self._folder = self._session_folder(task)
        if own is None:  # online, or another ClearML version: without the floor and the read-back, as before
            return
        held: dict[str, int] = {}
        for session in offline_sessions_of(own.parent, run_id):
            if session == own:
                continue
            for name, iteration, _ in offline_scalars(session):
                held[name] = max(int(iteration), held.get(name, -1))
        if held:
            self._gate.set_series_floors(run_id, held)


def _logging_level(severity_number: int) -> int:
    """The `logging` level of an OTel severity number (WARN 13..16 -> WARNING ...)."""
    for floor, level in ((21, logging.CRITICAL), (17, logging.ERROR), (13, logging.WARNING), (9, logging.INFO)):
        if severity_number >= floor:
            return level
    return logging.DEBUG


def _bucket_labels(bounds: Sequence[float]) -> list[str]:
    """``(-inf, b0]``, ``(b0, b1]``, ..., ``(bn, +inf)``: one label per explicit bucket."""
    edges = [-math.inf, *bounds, math.inf]
    return [f"({lo:g}, {hi:g}]" if not math.isinf(hi) else f"({lo:g}, +inf)" for lo, hi in itertools.pairwise(edges)]
