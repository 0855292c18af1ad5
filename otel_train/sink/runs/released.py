"""What a held backend of one sink run already holds, kept next to the run's spool cursors.

The reorder hold (`otel_train.sink.runs.reorder`) keeps the spool's cursor below every held row, and the cursor is
one per run and backend: while the ranks of a run are at different steps, it follows the slowest, so windows
whose rows for a faster rank were written stay unacknowledged. After a sink restart the spool hands them over
again, and the restarted backend's step-order memory is empty: TensorBoard and W&B would write those steps a
second time. `ReleasedSteps` records, per (run, rank, series), the highest step the hold has released and the
backend has made durable, in a small file written after the backend's flush succeeds and before delivery moves
the cursor; a restarted hold skips a row at or below it (counted as a redelivery, not as a step-order skip).

Why not read back what the backend's store holds on open: TensorBoard's event files would have to be read
whole for every run reopened (and every LRU reopen of 10,000 runs), W&B's offline run file is written by
another process on its own schedule; this file is one append per flush that released rows, for any backend.

File format: JSON lines, each a list of ``[run id, rank, tag, step]`` (a step recorded), ``[run id, rank]``
(that rank restarted: forget its steps) or ``[generation]`` (every write of that generation is recorded, below);
later lines win. Appended without fsync, like the spool's ``written.*``: a ``kill -9`` of the sink keeps what
the kernel has. A torn last line is ignored, which can only cost a repeat, never a loss (the next record
rewrites the file). The file is rewritten whole (atomically) when it grows past eight times what it holds (and
1 MiB).

The backend's write and this record are two steps, and a kill between them would leave rows in the backend's
files that the record does not have, so the restarted sink would write them again. A backend that reports the
files it is about to append to (`RowExporter.mark_appending`: TensorBoard's event files) gets an intent record
first, ``appending.<this file's name>`` (`otel_train.ship.append_intent`): a generation number (the writes since
the last record) and each file's size before them. A restarted sink whose record lacks that generation cuts the
files back to those sizes (`cut_unrecorded_appends`, before the backend writes again): the spool, whose cursor
never passes what is not recorded here, hands those rows over again and they are written once. A generation
whose writes include a row at or below a step already recorded for its series gets no intent (those writes are
not cut back: a restart would skip that row as one the backend holds, i.e. lose it) and keeps the older
behaviour, as does a torn intent.

Limits: W&B cannot be cut back (its run file is written by its own service process): a row written between
W&B's write and this record may still be written twice after a kill. A later row of the same (rank, series,
step) as the last one released is skipped after a restart if the spool hands it over again (several values of
one series in one step, sent far apart).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from otel_train._internal.ratelimit import LogOnce
from otel_train.ship.append_intent import AppendIntent

__all__ = ["ReleasedSteps"]

_logger = logging.getLogger(__name__)
_Key = tuple[str, int]  # (run id, rank)
_RowT = TypeVar("_RowT")
_MIN_COMPACT_BYTES = 1 << 20  # read whole when a run reopens: ~10 ms at most


class ReleasedSteps:
    """Per (run, rank, series), the highest step a backend holds, in the file `path` (module docstring).

    Args:
        path: The file (read now if it exists; its folder is created on the first write).

    Example:
        >>> import tempfile
        >>> from otel_train.vocab.rows import MetricRow
        >>> from otel_train.vocab.run_identity import RunInfo
        >>> run = RunInfo("r", "r")
        >>> rows = lambda steps: [MetricRow(run, s, "loss", "loss", float(s), "gauge", 0) for s in steps]
        >>> path = Path(tempfile.mkdtemp()) / "released"
        >>> before = ReleasedSteps(path)
        >>> before.note(rows([1, 2, 3])); before.save(durable=None)
        >>> after = ReleasedSteps(path)  # a restarted sink
        >>> kept, skipped = after.drop_redelivered(rows([2, 3, 4]))
        >>> [r.step for r in kept], skipped
        ([4], 2)
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._log = LogOnce(_logger, interval_s=60.0)
        self._saved: dict[_Key, dict[str, int]] = {}
        self._bytes = 0
        self._torn = False
        self._completed = 0  # the last generation of writes recorded whole (module docstring)
        self._load()
        #: What the store held when this process opened it: rows at or below are a redelivery.
        self._before: dict[_Key, dict[str, int]] = {k: dict(v) for k, v in self._saved.items()}
        self._pending: dict[_Key, dict[str, int]] = {}  # written, not yet recorded (or not yet durable)
        self._compact_at = max(_MIN_COMPACT_BYTES, 8 * self._bytes)
        # -- the intent record of the writes since the last `save` --
        self._intent = AppendIntent(path.with_name("appending." + path.name))  # opened per write: no fd per run
        found = self._intent.read()
        self._gen = max(self._completed, found[0] if found is not None else 0)  # generations only go up
        self._open: int | None = None  # the generation of the writes since the last save (None: none yet)
        self._files: dict[str, int] = {}  # its files, with their sizes before its first write
        self._cuttable = True  # False: the open generation's writes must not be cut back
        self._recording = True  # False after a record failed to be written, until the file is rewritten whole
        self._top: dict[_Key, int] = {k: max(v.values(), default=-1) for k, v in self._saved.items()}

    # -- the intent record ----------------------------------------------------------------------------
    def cut_unrecorded_appends(self) -> int:
        """Before the backend writes again (a restarted sink): cut the files the intent record names back to their
        sizes if its generation was not recorded here; returns the bytes cut. A stale or torn record, or a file
        that cannot be cut: nothing is cut (a repeat, never a loss)."""
        found = self._intent.read()
        if found is None:
            return 0
        gen, files = found
        if gen <= self._completed:
            return 0
        cut = self._intent.cut_back(files)
        if cut is None:
            self._log.warning("cut", "cannot cut %s back to where they were before writes a killed sink did not "
                              "record; those rows may appear twice", ", ".join(files))
            return 0
        self._intent.clear()
        if cut:
            _logger.info("cut %d byte(s) a killed sink wrote but had not recorded in %s; they are written again "
                         "once", cut, self.path)
        return cut

    def intend(self, files: Sequence[tuple[str, int]]) -> None:
        """The backend is about to append to `files` (`RowExporter.mark_appending`): record each file's size before
        the first write since the last `save`, under a new generation, before the write."""
        changed = self._open is None
        if changed:
            self._gen += 1
            self._open = self._gen
            self._files = {}
            self._cuttable = self._recording
        if not self._cuttable:
            return
        known = self._files
        for path, size in files:
            if path not in known:
                known[path] = size
                changed = True
        if changed:
            try:
                self._intent.write(self._gen, known)
            except OSError as err:  # a repeat after a kill, as without the record
                self._log.warning("intent", "cannot record the files about to be written in %s (%s)",
                                  self._intent.path, err)

    def check_before_write(self, rows: Sequence[Any]) -> None:
        """`rows` are about to be handed to the backend: if one is at or below the step recorded for its series,
        the writes since the last `save` must not be cut back after a kill (a restart would skip that row as one
        the backend holds): their intent record is dropped."""
        if not self._cuttable:
            return
        top = self._top
        run: Any = None
        high = -1
        marks: dict[str, int] = {}
        for r in rows:
            if r.run is not run:  # rows come in long stretches of one rank: one lookup per stretch
                run = r.run
                key = (run.run_id, run.rank)
                high = top.get(key, -1)
                marks = self._saved.get(key, {})
            if r.step <= high:
                mark = marks.get(r.tag)
                if mark is not None and r.step <= mark:
                    self._no_cut_back()
                    return

    def _no_cut_back(self) -> None:
        if self._open is None:
            self._gen += 1
            self._open = self._gen
        self._cuttable = False
        self._intent.clear()

    # -- the restarted backend ----------------------------------------------------------------------
    def drop_redelivered(self, rows: Sequence[_RowT]) -> tuple[Sequence[_RowT], int]:
        """`rows` less those the store held before this process opened it; returns (kept, skipped)."""
        before = self._before
        if not before:
            return rows, 0
        kept: list[_RowT] | None = None
        run: Any = None
        marks: dict[str, int] = {}
        for i, row in enumerate(rows):
            r: Any = row
            if r.run is not run:  # rows come in long stretches of one rank: one lookup per stretch
                run = r.run
                marks = before.get((run.run_id, run.rank), {})
            mark = marks.get(r.tag)
            if mark is not None and r.step <= mark:
                if kept is None:
                    kept = list(rows[:i])
            elif kept is not None:
                kept.append(row)
        if kept is None:
            return rows, 0
        return kept, len(rows) - len(kept)

    # -- the backend's writes -------------------------------------------------------------------------
    def note(self, rows: Sequence[Any]) -> None:
        """`rows` were handed to the backend (recorded at the next `save`). The hold hands each (run, rank) over
        in step order, so a series' last row is its highest; rows out of order only make it claim less (a
        repeat after a restart, never a loss)."""
        run: Any = None
        pending: dict[str, int] = {}
        for r in rows:
            if r.run is not run:
                run = r.run
                pending = self._pending.setdefault((run.run_id, run.rank), {})
            pending[r.tag] = r.step

    def save(self, durable: int | None) -> None:
        """Record what was noted, after the backend's flush succeeded (its store holds steps up to `durable`;
        None: everything it was handed), and that every write since the last save is recorded. A step above
        `durable` stays noted for a later save."""
        if not self._pending:
            self._complete([])
            return
        entries: list[list[Any]] = []
        keep: dict[_Key, dict[str, int]] = {}
        for key, tags in self._pending.items():
            saved = self._saved.setdefault(key, {})
            for tag, step in tags.items():
                held = step if durable is None else min(step, durable)
                if held > saved.get(tag, held - 1):
                    saved[tag] = held
                    entries.append([key[0], key[1], tag, held])
                    if held > self._top.get(key, -1):
                        self._top[key] = held
                if held < step:
                    keep.setdefault(key, {})[tag] = step
        self._pending = keep
        self._complete(entries)

    def _complete(self, entries: list[list[Any]]) -> None:
        """Append `entries`, and the open generation as recorded (in the same line: one write)."""
        if self._open is not None:
            entries.append([self._open])
            self._completed = self._open
            self._open = None
        if entries:
            self._append(entries)

    def forget(self, run_id: str, rank: int) -> None:
        """A declared restart of one rank: its steps start over, none of them is a redelivery."""
        key = (run_id, rank)
        self._pending.pop(key, None)
        self._before.pop(key, None)
        self._top.pop(key, None)
        if self._saved.pop(key, None) is not None:
            self._append([[run_id, rank]])

    # -- the file -------------------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as err:
            _logger.warning("cannot read %s (%s): steps the backend already holds may be written again", self.path,
                            err)
            return
        self._bytes = len(data)
        self._torn = bool(data) and not data.endswith(b"\n")  # a kill tore the last line: rewrite before appending after it
        for line in data.splitlines():
            try:
                entries = json.loads(line)
            except ValueError:
                continue  # a torn last line: its records are lost, which only costs a repeat
            for entry in entries if isinstance(entries, list) else ():
                if isinstance(entry, list) and len(entry) == 4:
                    run_id, rank, tag, step = entry
                    self._saved.setdefault((str(run_id), int(rank)), {})[str(tag)] = int(step)
                elif isinstance(entry, list) and len(entry) == 2:
                    self._saved.pop((str(entry[0]), int(entry[1])), None)
                elif isinstance(entry, list) and len(entry) == 1:
                    self._completed = max(self._completed, int(entry[0]))

    def _append(self, entries: list[list[Any]]) -> None:
        line = (json.dumps(entries, separators=(",", ":")) + "\n").encode("utf-8", "surrogatepass")
        try:
            if not self._bytes:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._torn or self._bytes + len(line) > self._compact_at:
                self._rewrite()
                return
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write: a kill leaves it whole or torn, never interleaved
            finally:
                os.close(fd)
            self._bytes += len(line)
        except OSError as err:
            self._log.warning("write", "cannot record the steps written in %s (%s): after a restart they may be "
                              "written again (logged at most once a minute)", self.path, err)
            # What the file holds may now lag behind `_saved` (a restart lost a rank's forget): nothing is cut back
            # until it is rewritten whole.
            self._recording = False
            if self._cuttable:
                self._no_cut_back()

    def _rewrite(self) -> None:
        entries: list[list[Any]] = [[run_id, rank, tag, step] for (run_id, rank), tags in self._saved.items()
                                    for tag, step in tags.items()]
        if self._completed:
            entries.append([self._completed])
        data = (json.dumps(entries, separators=(",", ":")) + "\n").encode("utf-8", "surrogatepass")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)  # atomic: a kill leaves the old file or the new one
        self._bytes = len(data)
        self._torn = False
        self._compact_at = max(_MIN_COMPACT_BYTES, 8 * self._bytes)
        self._recording = True
