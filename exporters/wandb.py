"""Weights & Biases backend: one W&B run per training run, one `log` call per step.

- Run identity: the W&B run id is `train.run.id` (characters W&B reserves become `-`), opened with
  ``resume="allow"``, so a restarted job continues the same run. The name is `train.run.name`.
- Steps: ``step=`` is `train.step`; the rows of one step go into one `log` call, steps in increasing order
  within a window. A row whose step went backwards in its series (without a declared restart) is skipped and
  counted under every `OTEL_TRAIN_STEP_ORDER` (W&B cannot store it; TensorBoard skips it too). W&B has one step
  axis per run: a row of another series for a step older than the last step written is dropped here too and
  counted (`steps_dropped`, one warning that names the cure) instead of W&B's drop with a warning per call.
  A row for the step written last is merged into it (W&B commits a step when a later one arrives, or at
  `finish`), so W&B holds one value per series and step: the last.
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
- Preemption: a run that ended on SIGTERM or SIGUSR1 gets `run.mark_preempting()` and the summary
  field ``otel_train.preempted`` = the signal's name.
- Settings: `WANDB_PROJECT` (default: the otel-train project), `WANDB_ENTITY`, `WANDB_MODE`,
  `WANDB_DIR` (default: the run's folder under `OTEL_TRAIN_DIR`), `WANDB_RUN_GROUP`, `WANDB_CONSOLE`
  (default here: ``off``, so W&B does not wrap the training process's stdout) are W&B's own; they
  are passed to `wandb.init`, never written to `os.environ`.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_train.exporter_options import ExporterOptions
from otel_train.exporters._runs import (
    StepGate,
    by_step,
    histogram_bins,
    hparams_for,
    run_folder,
    wanted,
)
from otel_train.exporters.base import RowExporter
from otel_train.rows import HistogramRow, MetricRow
from otel_train.run_identity import PREEMPTED, RunInfo

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

__all__ = ["PREEMPTED_KEY", "WandbExporter", "wandb_run_id"]

_logger = logging.getLogger(__name__)

#: Summary field of a run that ended on SIGTERM / SIGUSR1 (its value: the signal's name).
PREEMPTED_KEY = PREEMPTED
_RESERVED = ":;,#?/'\\%"
_MAX_BINS = 512  # W&B's limit for a histogram
_FILE_FLUSH_S = 0.25  # how often W&B's service writes the run file (its default, 15 s, is what a kill loses)
_FINISH_WAIT_S = 10.0  # at close, how long to wait for the run file to hold the last step (then: a later replay)


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
    stores_older_steps = False  # a run's history cannot go back (module docstring)
    display_names = True
    handles_metrics = True
    handles_spans = False
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

    @property
    def steps_dropped(self) -> int:
        """Rows' steps dropped because W&B already held a later (or the same, resumed) step."""
        return int(self._gate.dropped)

    # -- hooks -------------------------------------------------------------------------------
    def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
        per_run: dict[tuple[str, int], tuple[RunInfo, list[MetricRow | HistogramRow]]] = {}
        all_rows: list[MetricRow | HistogramRow] = [*rows, *histograms]
        for row in all_rows:
            if not wanted(self.options, row.run):
                continue
            key = (row.run.run_id, row.run.rank)
            per_run.setdefault(key, (row.run, []))[1].append(row)
        for key, (run_info, run_rows) in per_run.items():
            run = self._run(key, run_info)
            for step, step_rows in by_step(run_rows):
                payload = self._payload(step_rows)
                if not payload or not self._gate.admit(key, step):  # nothing W&B can draw, or a step it cannot take
                    self.mark_written(step_rows)
                    continue
                run.log(payload, step=step)
                self.mark_written(step_rows)  # a retry after a later step's failure does not log it again

    def durable_step(self) -> int | None:
        """The last step the run file holds, where a run has steps it does not hold yet (else None)."""
        behind = []
        for key in self._files:  # also after `close`: a run whose finish failed is not all in its file
            held = self._held(key)
            if held is not None and self._gate.last(key) > held:
                behind.append(held)
        return min(behind) if behind else None

    def flush(self) -> None:
        """Read how far each run file got, and record it in the resume marker."""
        for key in self._runs:
            held = self._held(key)
            if held is not None:
                self._write_marker(key, held)

    def mark_preempted(self, cause: str) -> None:
        """W&B's own preemption mark (`run.mark_preempting()`: online, the run shows as preempted
        rather than crashed) and the summary field ``otel_train.preempted`` = `cause`."""
        for run in self._runs.values():
            run.summary[PREEMPTED_KEY] = cause
            run.mark_preempting()

    def close(self) -> None:
        for key, run in list(self._runs.items()):
            try:
                run.finish()
                # W&B's service writes the run file on its own schedule, also after `finish` returned: wait a
                # moment for it, so delivery's cursor can claim the rest now, not at the next replay. The marker
                # claims only what the file holds (without a run file: what was handed, as before).
                held = self._held(key)
                deadline = time.monotonic() + _FINISH_WAIT_S
                while held is not None and held < self._gate.last(key) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    held = self._held(key)
                self._write_marker(key, self._gate.last(key) if held is None else held)
            except Exception as err:  # one failing run must not keep the others open
                _logger.error("wandb: finishing run %s failed: %s", key[0], err)
        self._runs.clear()

    # -- internals -------------------------------------------------------------------------------
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
                for earlier in Path(sync_file).parent.parent.glob(f"*-{wandb_id}/run-{wandb_id}.wandb"):
                    if earlier != Path(sync_file):
                        held = max(held, _RunFile(earlier).last_step())
        self._gate.set_floor(key, held)
        self._floor[key] = held
        return run

    def _held(self, key: tuple[str, int]) -> int | None:
        """The highest step run `key` holds durably (its file, or the earlier attempts); None: unknown."""
        store = self._files.get(key)
        if store is None or not store.path.exists():  # no transaction log (disabled mode, W&B's own setting)
            return None
        return max(store.last_step(), self._floor.get(key, -1))

    @staticmethod
    def _payload(step_rows: list[MetricRow | HistogramRow]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for row in step_rows:
            if isinstance(row, MetricRow):
                data[row.tag] = row.value
            else:
                hist = _histogram(row)
                if hist is not None:
                    data[row.tag] = hist
        return data

    def _write_marker(self, key: tuple[str, int], step: int | None) -> None:
        marker = self._markers.get(key)
        if marker is None or step is None or step < 0 or self._marked.get(key) == step:
            return
        try:
            marker.write_text(str(step))
            self._marked[key] = step
        except OSError as err:
            self._log.warning("marker", "wandb: cannot write %s (%s); a resumed run may repeat steps", marker, err)


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
