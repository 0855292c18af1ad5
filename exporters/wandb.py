"""Weights & Biases backend: one W&B run per training run, one `log` call per step.

- Run identity: the W&B run id is `train.run.id` (characters W&B reserves become `-`), opened with
  ``resume="allow"``, so a restarted job continues the same run. The name is `train.run.name`.
- Steps: ``step=`` is `train.step`; the rows of one step go into one `log` call, steps in increasing order.
  W&B has one step axis per run and cannot go back, so rows are held `hold_s` seconds (2 s) before they are
  written, and then go out by the sink's reorder rule: once a step has been held that long it is written, with
  every held step below it, in step order. Rows that arrive out of order by less than that (a DataLoader
  worker's values logged with ``step=`` ahead of the loop, a child's values reaching the exporter process after
  the loop's next window) are written at their step with the rest of it. A row whose step went backwards in
  its series (without a declared restart) is skipped and counted under every `OTEL_TRAIN_STEP_ORDER` (W&B
  cannot store it; TensorBoard skips it too). A row of another series for a step older than the last step
  written (later than the hold) is dropped here too, instead of W&B's drop with a warning per call. A row for
  the step written last is merged into it (W&B commits a step when a later one arrives, or at `finish`). W&B
  holds one value per series and step: the last; every row not written, one going back or one whose value a
  later one of its series and step replaced, is counted in `steps_dropped` (rows; the summary's "not
  written"), with one warning per cause. `flush` writes the steps held long enough, an explicit flush
  (`ot.flush()`, delivery's `write_held_at_next_flush`) and `close` everything; the cursor of the exporter
  process's spool never passes a held row (`durable_step`). Behind the sink's reorder hold, that hold takes
  the place of this one.
- Keys: the series tag as is, except a key W&B reserves for its own history (`_step`, `_runtime`,
  `_timestamp`, anything starting with `_wandb`), which W&B would overwrite or hide: such a key, and one of
  the same shape with more leading underscores, gets one more ``_`` (`_step` -> `__step`, `__step` ->
  `___step`), so two keys never share a name (`wandb_key`).
- Resume (`OTEL_TRAIN_RESUME_STEP` = N): online, the run is rewound with W&B's ``resume_from``
  (``<id>?_step=N``), so the new values replace steps >= N; when W&B refuses (offline, or rewind not
  enabled for the account) the run is resumed with ``resume="allow"`` and steps it already holds
  keep the earlier attempt's values (the new rows for them are dropped and counted): never two values
  for one step.
- Ranks: with `OTEL_TRAIN_RANKS=all`, rank N > 0 writes its own run ``<run id>-rank<N>`` named
  ``<run name>-rank<N>``; every rank's run is in the group `train.run.id`. W&B runs cannot be shared
  by processes, and the sink does the same, so a run looks alike on both paths.
- Durability: W&B's service process writes the run's ``.wandb`` file on its own schedule (otel-train asks it to
  every 0.25 s) and keeps the step logged last open until a later one arrives. The exporter reads its own
  run file back and reports the last step it holds (`durable_step`), so delivery's cursor never claims a
  step the file lacks: after a `kill -9` of the whole job, `otel-train replay` writes the rest, once (a
  resumed run reads the steps the earlier attempts' files hold, and drops those rows). The open step is
  in the file after `finish`, at the close. The resume marker (``otel-train-<id>.last-step``) also holds
  only steps the file has.
- Log records (`logging` records, uncaught exceptions): appended as text lines (``[step S] LEVEL logger:
  message``, a traceback below it) to ``otel-train-logs/rank<N>.log`` in the run's files folder (``run.dir``),
  saved with ``policy="live"``: W&B's Files tab shows it (online, uploaded as it grows; offline, with `wandb sync`).
  W&B's own Logs tab is its console capture, which would see only the exporter process.
- Preemption: a run that ended on SIGTERM, SIGUSR1 or SIGHUP gets `run.mark_preempting()` and the summary
  field ``otel_train.preempted`` = the signal's name.
- Settings: `WANDB_PROJECT` (default: the otel-train project), `WANDB_ENTITY`, `WANDB_MODE`,
  `WANDB_DIR` (default: the run's folder under `OTEL_TRAIN_DIR`), `WANDB_RUN_GROUP`, `WANDB_CONSOLE`
  (default here: ``off``, so W&B does not wrap the training process's stdout) are W&B's own; they
  are passed to `wandb.init`, never written to `os.environ`.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters._runs import (
    LOGS_FOLDER,
    StepGate,
    histogram_bins,
    hparams_for,
    log_line,
    logs_by_rank,
    run_folder,
    wanted,
)
from otel_train.exporters.base import LOSS_CAUSES, RowExporter
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow
from otel_train.vocab.run_identity import PREEMPTED, RunInfo

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

__all__ = ["PREEMPTED_KEY", "WandbExporter", "offline_run_files", "wandb_key", "wandb_run_id"]

_logger = logging.getLogger(__name__)

#: Summary field of a run that ended on SIGTERM / SIGUSR1 / SIGHUP (its value: the signal's name).
PREEMPTED_KEY = PREEMPTED
_RESERVED = ":;,#?/'\\%"
_MAX_BINS = 512  # W&B's limit for a histogram
_FILE_FLUSH_S = 0.25  # how often W&B's service writes the run file (its default, 15 s, is what a kill loses)
_FINISH_WAIT_S = 10.0  # at close, how long to wait for the run file to hold the last step (then: a later replay)


#: Keys of W&B's own history (`_step` is replaced by the step, `_runtime` by W&B's clock, `_timestamp` is taken
#: for the row's time) and its namespace (`_wandb...`), with any number of extra leading underscores.
_RESERVED_KEY = re.compile(r"_+(?:step|runtime|timestamp|wandb.*)", re.DOTALL)
#: Rows held at most, over every run of the exporter: past it the oldest steps are written early.
_MAX_HELD_ROWS = 200_000


def offline_run_files(wandb_dir: Path, wandb_id: str) -> list[Path]:
    """The run files of W&B run `wandb_id` under a ``wandb`` folder, oldest process first: one folder per process,
    ``<mode>-run-<YYYYmmdd_HHMMSS>-<id>``, and W&B adds ``-<n>`` when a process of that run started in the same
    second (a quick resume).

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> for name in ("offline-run-20261205_113230-a-1", "offline-run-20261205_113230-a", "offline-run-20261205_113229-a"):
        ...     (root / name).mkdir(); (root / name / "run-a.wandb").touch()
        >>> [p.parent.name for p in offline_run_files(root, "a")]
        ['offline-run-20261205_113229-a', 'offline-run-20261205_113230-a', 'offline-run-20261205_113230-a-1']
    """
    found = []
    for path in wandb_dir.glob(f"*-{wandb_id}*/run-{wandb_id}.wandb"):
        head, sep, rest = path.parent.name.rpartition(f"-{wandb_id}")
        if not sep or not (rest == "" or (rest[:1] == "-" and rest[1:].isdigit())):
            continue  # another run's id that begins with this one
        found.append(((head.rsplit("-", 1)[-1], int(rest[1:] or 0)), path))
    return [path for _, path in sorted(found)]


def wandb_key(tag: str) -> str:
    """The W&B key of a series tag: as is, but one more leading ``_`` on a key W&B reserves (and on one of the
    same shape with more underscores, so the mapping never merges two keys).

    Example:
        >>> [wandb_key(k) for k in ("train/loss", "_step", "__step", "_wandb_x", "_x", "_step{worker=1}")]
        ['train/loss', '__step', '___step', '__wandb_x', '_x', '_step{worker=1}']
    """
    return "_" + tag if _RESERVED_KEY.fullmatch(tag) else tag


def wandb_run_id(run: RunInfo) -> str:
    """The W&B run id of one rank of a training run.

    Example:
        >>> wandb_run_id(RunInfo("job/42", "n", rank=3))
        'job-42-rank3'
    """
    base = "".join("-" if c in _RESERVED else c for c in run.run_id.strip()) or "run"
    return base if run.rank == 0 else f"{base}-rank{run.rank}"


class WandbExporter(RowExporter):
    """Writes scalars and histograms to Weights & Biases runs.

    Args:
        options: Directory, project, hyperparameters and rank policy; default from the env vars.

    Raises:
        ModuleNotFoundError: `wandb` is not installed.

    Example:
        >>> import otel_train as ot
        >>> ot.init(exporters=["wandb"], run_id="job-1", config={"lr": 0.1})  # doctest: +SKIP
    """

    name = "wandb"
    heavy_client = True  # seconds to import and start: a process of its own beside another such backend
    stores_older_steps = False  # a run's history cannot go back (module docstring)
    #: Seconds a row is held before it is written (module docstring, "Steps"); 0 writes each window at once.
    hold_s: float = 2.0
    display_names = True
    handles_metrics = True
    handles_spans = False
    handles_logs = True
    client_module = "wandb"

    def __init__(self, options: ExporterOptions | None = None, *, entity: str | None = None,
                 group: str | None = None) -> None:
        self.preload()
        super().__init__(options)
        # `WANDB_ENTITY` / `WANDB_RUN_GROUP` win over these (the migration layer's `args.wandb_team/_group`).
        self.entity = entity
        self.group = group
        self._runs: dict[tuple[str, int], Run] = {}
        self._markers: dict[tuple[str, int], Path] = {}
        self._marked: dict[tuple[str, int], int] = {}
        self._gate = StepGate("wandb", monotonic=True)
        self._files: dict[tuple[str, int], _RunFile] = {}
        self._floor: dict[tuple[str, int], int] = {}  # steps earlier attempts hold
        # Held rows per run: step -> rows, and when each step first arrived (`hold_s`).
        self._held: dict[tuple[str, int], dict[int, list[MetricRow | HistogramRow]]] = {}
        self._arrived: dict[tuple[str, int], dict[int, float]] = {}
        self._infos: dict[tuple[str, int], RunInfo] = {}
        self._held_rows = 0
        self._open_step: dict[tuple[str, int], tuple[int, set[str]]] = {}  # W&B's open step and its keys
        self._replaced = 0
        self._tries: dict[tuple[tuple[str, int], int], int] = {}  # failed writes of a held step
        self._write_all = False  # the next flush writes everything held (an explicit flush)
        self._log_files: set[tuple[str, int]] = set()  # runs whose log file W&B was told to save

    @property
    def steps_dropped(self) -> int:
        """Rows not written: their step was below one W&B already held (or one a resumed run holds), or a later
        value of their series at the same step replaced them (W&B keeps one per series and step)."""
        return int(self._gate.dropped) + self._replaced

    # -- hooks -------------------------------------------------------------------------------
    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        # What was held long enough goes first: should it raise, this window is retried and nothing of it is held.
        self._release(everything=False)
        given: list[MetricRow | HistogramRow] = [*rows, *histograms]
        taken = [row for row in given if wanted(self.options, row.run)]
        for row in taken:  # opened with their first rows (W&B starts early), before any row is held
            key = (row.run.run_id, row.run.rank)
            if key not in self._infos:
                self._run(key, row.run)
                self._infos[key] = row.run
        now = time.monotonic()  # after opening a run (seconds): its first rows are held `hold_s` from here
        for row in taken:
            key = (row.run.run_id, row.run.rank)
            self._held.setdefault(key, {}).setdefault(row.step, []).append(row)
            self._arrived.setdefault(key, {}).setdefault(row.step, now)
        self._held_rows += len(taken)
        self.mark_written(taken)  # held now: a retry of this window does not hold them twice
        if self.hold_s <= 0 or self._held_rows > _MAX_HELD_ROWS:
            self._release(everything=self.hold_s <= 0, oldest_first=self._held_rows > _MAX_HELD_ROWS)

    def write_logs(self, rows: Sequence[LogRow]) -> None:
        """Append the log records to each run's ``otel-train-logs/rank<N>.log`` (module docstring)."""
        for key, (info, records) in logs_by_rank(self.options, rows).items():
            run = self._run(key, info)
            self._infos.setdefault(key, info)
            path = Path(run.dir) / LOGS_FOLDER / f"rank{info.rank}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write("".join(log_line(r) for r in records))
            self.mark_written(records)
            if key not in self._log_files:
                self._log_files.add(key)
                try:
                    run.save(str(path), base_path=run.dir, policy="live")
                except Exception as err:  # the file is in the run's folder all the same (uploaded at the end)
                    _logger.debug("wandb: run.save(%s) failed: %s", path, err)

    def durable_step(self) -> int | None:
        """The last step the run file holds, where a run has steps it does not hold yet, and one below the
        lowest step held back (else None)."""
        behind = []
        for key in self._files:  # also after `close`: a run whose finish failed is not all in its file
            held = self._file_step(key)
            if held is not None and self._gate.last(key) > held:
                behind.append(held)
        behind.extend(min(steps) - 1 for steps in self._held.values() if steps)
        return min(behind) if behind else None

    def write_held_at_next_flush(self) -> None:
        """Have the next `flush` write everything held (delivery asks at an explicit flush: `ot.flush()`)."""
        self._write_all = True

    def flush(self) -> None:
        """Write the steps held long enough (everything, when asked); read how far each run file got, and
        record it in the resume marker."""
        everything, self._write_all = self._write_all, False
        self._release(everything=everything)
        for key in self._runs:
            held = self._file_step(key)
            if held is not None:
                self._write_marker(key, held)

    def write_resume(self, run: RunInfo, step: int) -> None:
        """What was logged before the restart is written first (everything held), then the restart applies."""
        self._release(everything=True)
        super().write_resume(run, step)

    def mark_preempted(self, cause: str) -> None:
        """W&B's own preemption mark (`run.mark_preempting()`: online, the run shows as preempted
        rather than crashed) and the summary field ``otel_train.preempted`` = `cause`."""
        for run in self._runs.values():
            run.summary[PREEMPTED_KEY] = cause
            run.mark_preempting()

    def close(self) -> None:
        try:
            self._release(everything=True)
        except Exception as err:  # the runs are finished all the same; what is held stays in the spool
            _logger.error("wandb: writing the rows held back failed: %s", err)
        for key, run in list(self._runs.items()):
            try:
                run.finish()
                # W&B's service writes the run file on its own schedule, also after `finish` returned: wait a
                # moment for it, so delivery's cursor can claim the rest now, not at the next replay. The marker
                # claims only what the file holds (without a run file: what was handed, as before).
                held = self._file_step(key)
                deadline = time.monotonic() + _FINISH_WAIT_S
                while held is not None and held < self._gate.last(key) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    held = self._file_step(key)
                self._write_marker(key, self._gate.last(key) if held is None else held)
            except Exception as err:  # one failing run must not keep the others open
                _logger.error("wandb: finishing run %s failed: %s", key[0], err)
        self._runs.clear()

    # -- internals -------------------------------------------------------------------------------
    def _release(self, everything: bool, oldest_first: bool = False) -> None:
        """Write the held steps that are due: per run, every step held `hold_s` and every held step below the
        highest of those, in step order (everything: all of them; oldest_first: at least the oldest step, to
        bound memory). A step leaves the hold only once W&B took it: should `log` raise, the rest stays held."""
        try:
            self._release_due(time.monotonic() - self.hold_s, everything, oldest_first)
        finally:
            self._held_rows = sum(len(rows) for steps in self._held.values() for rows in steps.values())

    def _release_due(self, cutoff: float, everything: bool, oldest_first: bool) -> None:
        for key, steps in self._held.items():
            if not steps:
                continue
            arrived = self._arrived[key]
            due = [s for s, t in arrived.items() if t <= cutoff]
            if everything:
                upto = max(steps)
            elif due:
                upto = max(due)
            elif oldest_first:
                upto = min(arrived, key=arrived.__getitem__)
            else:
                continue
            for step in sorted(s for s in steps if s <= upto):
                try:
                    self._write_step(key, step, steps[step])
                except Exception as err:
                    tries = self._tries[(key, step)] = self._tries.get((key, step), 0) + 1
                    if tries < max(1, self.max_attempts):
                        raise  # W&B is down: the step stays held, the next flush tries it again
                    self._count_lost("gave_up", steps[step], err)
                self._tries.pop((key, step), None)
                del steps[step]
                del arrived[step]

    def _write_step(self, key: tuple[str, int], step: int, step_rows: list[MetricRow | HistogramRow]) -> None:
        """Log one held step. When W&B raises, each row is tried alone: a row that fails alone while others land
        is one W&B refuses (skipped, counted, warned once per series); when none lands, W&B is down (raised)."""
        run = self._run(key, self._infos[key])  # first: a resumed run's floor is known once it is open
        try:
            self._log_step(key, run, step, step_rows)
        except Exception:
            if len(step_rows) == 1:
                raise
            refused: list[tuple[MetricRow | HistogramRow, Exception]] = []
            for row in step_rows:
                try:
                    self._log_step(key, run, step, [row])
                except Exception as err:
                    refused.append((row, err))
            if len(refused) == len(step_rows):
                raise
            for row, why in refused:
                self._count_lost("refused", [row], why)

    def _count_lost(self, cause: str, rows: list[MetricRow | HistogramRow], err: Exception) -> None:
        """Rows held here that W&B will never get: counted in this backend's `rows_lost` (the summary's line),
        warned about once per cause and series."""
        lost = self.rows_lost  # delivery's counters of this backend (a window's rows are taken when held)
        lost[cause] = lost.get(cause, 0) + len(rows)
        for series in dict.fromkeys(row.tag for row in rows):
            self._log.warning(f"{cause}:{series}", "exporter `wandb` skipped a row of series `%s` at step %r: %s "
                              "(%s: %s); later rows of this series that fail the same way are counted, not warned "
                              "about", series, rows[0].step, LOSS_CAUSES.get(cause, cause), type(err).__name__, err)

    def _log_step(self, key: tuple[str, int], run: Run, step: int,
                  step_rows: list[MetricRow | HistogramRow]) -> None:
        payload, replaced = self._payload(step_rows)
        if not payload:  # nothing W&B can draw
            return
        if not self._gate.admit(key, step, rows=len(payload) + replaced):  # a step it cannot take
            return
        open_step, open_keys = self._open_step.get(key, (None, set()))
        if open_step != step:
            open_keys = set()
        gauges = {wandb_key(r.tag) for r in step_rows if _logged_value(r)}
        replaced += len(open_keys & gauges)  # W&B's open step already has them: the later value wins
        run.log(payload, step=step)
        self._open_step[key] = (step, open_keys | gauges)
        if replaced:
            self._count_replaced(replaced, step)

    def _count_replaced(self, n: int, step: int) -> None:
        self._replaced += n
        self._log.warning(
            "replaced", "wandb: %d value(s) at step %d replaced by a later value of the same series and step (W&B "
            "keeps one value per series and step: the last); counted in `steps_dropped`, warned once", n, step)

    def _run(self, key: tuple[str, int], info: RunInfo) -> Run:
        run = self._runs.get(key)
        if run is not None:
            return run
        import wandb

        env = os.environ
        wandb_id = wandb_run_id(info)
        name = info.run_name if info.rank == 0 else f"{info.run_name}-rank{info.rank}"
        kwargs: dict[str, Any] = {
            "project": env.get("WANDB_PROJECT") or self.options.project,
            "id": wandb_id,
            "name": name,
            "resume": "allow",
            "reinit": "create_new",  # the sink writes several runs from one process
            "config": hparams_for(self.options, info),
        }
        if not env.get("WANDB_DIR"):
            folder = run_folder(self.options, info)
            folder.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(folder)
        group = env.get("WANDB_RUN_GROUP") or self.group
        if self.options.ranks == "all" or group:
            kwargs["group"] = group or info.run_id
        if self.entity and not env.get("WANDB_ENTITY"):
            kwargs["entity"] = self.entity
        settings: dict[str, Any] = {}
        if not env.get("WANDB_CONSOLE"):
            settings["console"] = "off"
        if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
            settings["x_transaction_log_flush_interval"] = _FILE_FLUSH_S
        resume_step = self.options.resume_step
        rewind = resume_step is not None and _can_rewind(env)
        if rewind:
            del kwargs["resume"]  # W&B allows one of resume / resume_from
            kwargs["resume_from"] = f"{wandb_id}?_step={resume_step}"
        try:
            run = wandb.init(settings=wandb.Settings(**settings), **kwargs)
        except Exception as err:
            if not rewind:
                raise
            self._log.warning("rewind", "wandb: cannot rewind run %s to step %s (%s); resuming it instead: steps "
                              "it already holds keep their earlier values", wandb_id, resume_step, err)
            rewind = False
            kwargs.pop("resume_from")
            kwargs["resume"] = "allow"
            run = wandb.init(settings=wandb.Settings(**settings), **kwargs)
        self._runs[key] = run
        # Steps a resumed run already holds: W&B's own count online, our marker offline.
        marker = Path(run.settings.wandb_dir) / f"otel-train-{wandb_id}.last-step"
        self._markers[key] = marker
        if rewind and resume_step is not None:
            held = resume_step - 1  # W&B dropped the steps >= N
        else:
            held = max(int(run.starting_step or 0) - 1, _read_marker(marker))
        sync_file = getattr(run.settings, "sync_file", None)
        if sync_file:
            self._files[key] = _RunFile(Path(sync_file))
            if not rewind:  # what earlier attempts' run files hold, read back (a killed one's marker lags)
                for earlier in offline_run_files(Path(sync_file).parent.parent, wandb_id):
                    if earlier != Path(sync_file):
                        held = max(held, _RunFile(earlier).last_step())
        self._gate.set_floor(key, held)
        self._floor[key] = held
        return run

    def _file_step(self, key: tuple[str, int]) -> int | None:
        """The highest step run `key` holds durably (its file, or the earlier attempts); None: unknown."""
        store = self._files.get(key)
        if store is None:
            return None
        if not store.path.exists():
            if not store.seen:  # no transaction log (disabled mode, W&B's own setting)
                return None
            # It was there: deleted under the run (its folder removed). W&B goes on writing into the deleted file,
            # so nothing written from now on is held: the windows stay in the spool for `otel-train replay`.
            self._log.warning(f"deleted-{key}", "wandb: the run file %s was deleted while the run wrote to it; "
                              "what the run logs from now on stays in the spool for `otel-train replay` (warned "
                              "once)", store.path)
            return -1
        store.seen = True
        return max(store.last_step(), self._floor.get(key, -1))

    @staticmethod
    def _payload(step_rows: list[MetricRow | HistogramRow]) -> tuple[dict[str, Any], int]:
        """One `log` call's data: W&B keys (`wandb_key`) to values; a key given twice keeps the last. Also how
        many logged values were so replaced (`_logged_value`)."""
        data: dict[str, Any] = {}
        replaced = 0
        for row in step_rows:
            value = row.value if isinstance(row, MetricRow) else _histogram(row)
            if value is None:
                continue
            key = wandb_key(row.tag)
            replaced += key in data and _logged_value(row)
            data[key] = value
        return data, replaced

    def _write_marker(self, key: tuple[str, int], step: int | None) -> None:
        marker = self._markers.get(key)
        if marker is None or step is None or step < 0 or self._marked.get(key) == step:
            return
        try:
            marker.write_text(str(step))
            self._marked[key] = step
        except OSError as err:
            self._log.warning("marker", "wandb: cannot write %s (%s); a resumed run may repeat steps", marker, err)


def _logged_value(row: MetricRow | HistogramRow) -> bool:
    """Whether a later value of `row`'s series at its step loses it: a gauge, not otel-train's own readings
    (``otel_train.*``, re-read every window) nor a counter's running total (the later one holds it)."""
    return isinstance(row, MetricRow) and row.kind == "gauge" and not row.name.startswith("otel_train.")


def _can_rewind(env: os._Environ[str] | dict[str, str]) -> bool:
    """Whether to ask W&B to rewind: only online (offline runs have no server history to rewind)."""
    import wandb

    mode = (env.get("WANDB_MODE") or "").strip().lower()
    return mode not in ("offline", "dryrun", "disabled") and "resume_from" in wandb.Settings.model_fields


def _below(held: int | None, step: int) -> bool:
    return held is None or held < step


def _read_marker(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


def _histogram(row: HistogramRow) -> Any:
    """A `wandb.Histogram` of an explicit-bucket histogram; the outer edges are its min and max."""
    import numpy as np
    import wandb

    bins = histogram_bins(row, _MAX_BINS)
    if bins is None:
        return None
    counts, edges = bins
    return wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges, dtype=float)))


class _RunFile:
    """Reads a `.wandb` run file as W&B's service appends it: the last history step written so far.

    The file is a LevelDB log of protobuf `Record`s (32 KiB blocks of framed chunks); only complete chunks
    are read, so a block the service is still writing is read again later from where it stopped.
    """

    _BLOCK = 32768
    _HEADER = struct.Struct("<IHB")  # checksum, length, chunk type

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen = False  # the file was found once (a file gone after that was deleted)
        self._offset = 0
        self._pending = b""
        self._last = -1

    def last_step(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return self._last
        if self._offset == 0:
            if len(data) < 7:
                return self._last
            data, self._offset = data[7:], 7  # ":W&B", magic, version
        self._parse(data)
        return self._last

    def _parse(self, data: bytes) -> None:
        from wandb.proto import wandb_internal_pb2 as pb

        pos = 0
        size = self._HEADER.size
        while True:
            left = self._BLOCK - (self._offset + pos) % self._BLOCK
            if left < size:  # zero padding at the end of a block
                if pos + left > len(data):
                    break
                pos += left
                continue
            if pos + size > len(data):
                break
            _, length, kind = self._HEADER.unpack_from(data, pos)
            if kind == 0 and length == 0:  # the rest of the block is padding
                if pos + left > len(data):
                    break
                pos += left
                continue
            end = pos + size + length
            if end > len(data):
                break
            chunk = data[pos + size:end]
            pos = end
            if kind == 2:  # FIRST
                self._pending = chunk
                continue
            if kind == 3:  # MIDDLE
                self._pending += chunk
                continue
            payload = self._pending + chunk if kind == 4 else chunk
            self._pending = b""
            record = pb.Record()  # type: ignore[attr-defined]
            try:
                record.ParseFromString(payload)
            except Exception:  # a record this W&B version cannot read: not a history step
                record = None
            if record is None:
                continue
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    if (item.key or "/".join(item.nested_key)) == "_step":
                        try:
                            self._last = max(self._last, int(float(item.value_json)))
                        except ValueError:
                            pass
                        break
        self._offset += pos
