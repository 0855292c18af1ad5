"""The run's record of what was logged: every window the delivery engine hands its backends, kept for
`otel-train verify` (`otel_train.verify`).

Where: ``<run folder>/verify/rank<R>.<pid>.rec``, one file per process that delivers (the exporter process, a
restarted one, the training process for its in-process backends), appended only by that process. Each entry
is a 4-byte little-endian length and one msgpack map (msgpack builds values and nothing else, so reading a
record runs no code). Entries, by their ``k``:

- ``h`` (first): the writer's pid and rank, the run id, and per backend what verify needs to read it back
  (``stores``: where its store is, as that process saw it) and which rows it gets (``routes``: the routing
  rule, rebuilt by verify to tell "skipped by rule" from "missing").
- ``w``: one window as the backends get it: new series (``S``: id, tag, name, rank, kind, extra attributes), then per series
  its steps (``[first, count]`` when consecutive, else the list) and values (float64, packed little-endian),
  and spans (series id of the span name, step, span id). ``side``: a child process's window; ``q``: a spooled
  window's sequence number (recorded before it is spooled; a window recorded by two writers counts once).
- ``l``: per backend the rows it did not write, by cause, and its step-order drops; cumulative for this
  writer, written at every flush and at close (verify takes each writer's last).
- ``b``: one backend's ``h`` information again, written when a backend that starts on a thread of its own
  (`otel_train.ship.backend_start`) is up: its options, routing rule and store are only known then (it
  replaces that backend's part of ``h``, whose entry was written before).
- ``r``: a declared resume (`ot.resume`, `resume_step`) of ``rank`` at ``step``: what was recorded before it at
  steps >= ``step`` is superseded.
- ``f`` (second, a placeholder with n = 0) and ``F``: the record's n-th wait for space (a full disk) began after
  the windows up to ``step`` (written over the placeholder in place); an ``F`` of the same n: everything
  waiting was written after all. An ``f`` without its ``F`` stops verify at that step, like ``x``.
- ``x``: the record reached its cap (`OTEL_TRAIN_VERIFY_RECORD_MB`) after windows up to ``step``; nothing
  after it is recorded, and verify says "not checked past step S".
- ``c`` (last): the writer closed its record. A window a writer without it recorded and no spool of the rank holds
  was recorded right before a kill that took it (the whole job: nobody sent it again): verify counts what a
  backend lacks of it as lost to the kill ("killed before written ahead") instead of failing.

Beside them, ``rank<R>.session.json``: the values the training process refused at the call (`Session.refusals`),
written at shutdown.

A torn last entry (a process killed mid-write) is cut off when a process opens the record (only this
writer's own file, whose tail it can prove torn), and a reader stops before it. Histograms are not
recorded: verify checks scalars and spans.

Cost (measured, docs/performance.md): about 9 bytes per scalar point plus the series ids and step ranges
of each window; the writing happens where the delivery runs (the exporter process by default), never on
the training thread.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from otel_train.ship.file_append import AppendFile, is_disk_full, warn_recreated
from otel_train.vocab.rows import extra_attributes

if TYPE_CHECKING:
    from otel_train.backend import RowExporter, Window
    from otel_train.vocab.run_identity import RunInfo

__all__ = ["FOLDER", "FULL_MARK", "SESSION_FILE", "LoggedRecord", "backend_header", "backend_info", "open_record", "read_entries", "record_files",
           "write_session_record"]

_logger = logging.getLogger(__name__)

#: The folder under the run folder that holds every rank's record.
FOLDER = "verify"
#: The training process's own part, written at shutdown: the values it refused at the call, by cause.
SESSION_FILE = "rank{rank}.session.json"
_LEN = struct.Struct("<I")
_STOP_ROOM = 64  # bytes kept free under the cap for the stop entry


def record_files(run_dir: Path) -> list[Path]:
    """Every record file of a run folder, in name order."""
    return sorted((run_dir / FOLDER).glob("rank*.rec"))


def read_entries(path: Path) -> Iterator[dict[str, Any]]:
    """The entries of one record file in order, stopping before a torn or unreadable tail."""
    import msgpack

    data = path.read_bytes()
    off = 0
    while off + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, off)
        end = off + _LEN.size + n
        if end > len(data):
            return
        try:
            entry = msgpack.unpackb(data[off + _LEN.size:end], raw=False, strict_map_key=False)
        except Exception:
            return
        if not isinstance(entry, dict):
            return
        yield entry
        off = end


def _whole_entries_end(path: Path) -> int:
    """The size of `path` up to its last whole entry (what an append may start after)."""
    size = path.stat().st_size
    off = 0
    with open(path, "rb") as f:
        while off + _LEN.size <= size:
            f.seek(off)
            (n,) = _LEN.unpack(f.read(_LEN.size))
            if off + _LEN.size + n > size:
                break
            off += _LEN.size + n
    return off


class LoggedRecord:
    """Appends what one process's delivery hands its backends to that process's record file.

    Never raises. Storage faults heal as in the file backends (`otel_train.ship.file_append`): on a full disk an
    entry is cut back whole and kept in memory (within the cap) until space returns, so a disk that is freed
    leaves a complete record; a run folder deleted during the run gets a new record file (its header again)
    from the next window on, beside the backends' new files. Any other write error stops the record, logged
    once, and verify then says the record is incomplete rather than pass.

    Args:
        run_dir: The run's folder (`otel_train.vocab.run_paths.run_folder`).
        rank: This process's rank.
        cap_bytes: Stop recording past this many bytes (a stop entry says where).
        header: What verify needs besides the windows (run id, per backend its store and routing rule).
    """

    def __init__(self, run_dir: Path, rank: int, cap_bytes: int, header: Mapping[str, Any]) -> None:
        self.run_dir = run_dir
        self.path = run_dir / FOLDER / f"rank{rank}.{os.getpid()}.rec"
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        self._series: dict[tuple[str, int, str], int] = {}
        self._size = 0  # bytes written and waiting: what the cap counts
        self._last_step = -1
        self.stopped = False
        self._file: AppendFile | None = None
        # Entries a full disk refused, in order, each with its highest step: written once there is space.
        self._waiting: list[tuple[bytes, int]] = []
        self._said_full = False
        self._written_step = -1  # the highest step of the windows written so far
        self._mark_at: int | None = None  # where this file's "waiting for space" mark is (`FULL_MARK`)
        self._fulls = 0  # times the disk filled under this file: the mark's number
        self._marked = False  # the mark says the record waits for space now
        # The file is made with the first entry after the header: a run that logs nothing leaves no folder.
        self._header: dict[str, Any] = {"k": "h", "pid": os.getpid(), "rank": rank, "t": time.time(), **header}
        self._header_due = True

    def _open(self) -> bool:
        """Create (or continue) the file; False when it cannot be (the record stops, logged once)."""
        try:
            if self.path.exists():  # a pid reused by a later process of the same run: continue after its entries
                os.truncate(self.path, _whole_entries_end(self.path))
            self._file = AppendFile(self.path)
        except OSError as err:
            self._fail(err)
            return False
        self._size = self._file.size + sum(len(b) for b, _ in self._waiting)
        return True

    def _start_again_if_deleted(self) -> None:
        """The run folder was deleted (``rm -rf``): a new file, its header and series again, from here on."""
        if self._file is None or not self._file.unlinked():
            return
        warn_recreated(self.run_dir, "verify record")
        self._file.close()
        self._file = None
        self._series = {}
        self._waiting.clear()  # entries naming series of the deleted file
        self._header_due = True

    def add(self, window: Window, side: bool = False, seq: int | None = None) -> None:
        """Record one window as the backends get it (any thread; cheap next to the backends' writes). `seq`: its
        spool sequence number (a window two writers recorded, around a restart, counts once)."""
        if self.stopped or not window:
            return
        new: list[list[Any]] = []
        blocks: dict[int, tuple[list[int], array[float]]] = {}
        with self._lock:
            self._start_again_if_deleted()
            series = self._series
            for row in window.metrics:
                rank = row.run.rank
                key = (row.tag, rank, "m")
                sid = series.get(key)
                if sid is None:
                    sid = series[key] = len(series)
                    new.append([sid, row.tag, row.name, rank, row.kind, extra_attributes(row.attributes)])
                block = blocks.get(sid)
                if block is None:
                    block = blocks[sid] = ([], array("d"))
                block[0].append(row.step)
                try:
                    block[1].append(row.value)
                except TypeError:
                    block[1].append(float("nan"))  # a value no backend takes either: `row_problem` refuses it
            spans = []
            for span in window.spans:
                key = (span.name, span.run.rank, "s")
                sid = series.get(key)
                if sid is None:
                    sid = series[key] = len(series)
                    new.append([sid, span.name, span.name, span.run.rank, "span", {}])
                spans.append([sid, span.step, span.span_id])
            metrics = []
            top = self._last_step
            for sid, (steps, values) in blocks.items():
                first = steps[0]
                if steps == list(range(first, first + len(steps))):
                    metrics.append([sid, first, len(steps), values.tobytes()])
                else:
                    metrics.append([sid, steps, values.tobytes()])
                top = max(top, max(steps))
            entry: dict[str, Any] = {"k": "w", "S": new, "m": metrics, "sp": spans}
            if side:
                entry["side"] = True
            if seq is not None:
                entry["q"] = seq
            if self._append_locked(entry, top):  # else the record stopped for good (its cap, a write error)
                self._last_step = top

    def note_backend(self, name: str, info: Mapping[str, Any]) -> None:
        """What verify needs of backend `name`, now that it is up (replaces its part of the header)."""
        with self._lock:
            self._header.setdefault("backends", {})[name] = dict(info)  # a header written again says it too
            if self._header_due:  # the header is not written yet: it says it itself
                return
        self._append({"k": "b", "name": name, "info": dict(info)})

    def note_resume(self, rank: int, step: int) -> None:
        """The run of `rank` restarts at `step` (rows recorded before it at steps >= `step` are superseded)."""
        self._append({"k": "r", "rank": int(rank), "step": int(step)})

    def note_losses(self, rows_lost: Mapping[str, Mapping[str, int]], order_dropped: Mapping[str, int]) -> None:
        """Per backend, the rows it did not write so far, by cause, and its step-order drops (cumulative)."""
        if self._file is None and (self.stopped or not any(any(c.values()) for c in rows_lost.values())
                                   and not any(order_dropped.values())):
            return  # nothing recorded and nothing lost: no file for it
        with self._lock:
            self._write({"k": "l", "lost": {n: dict(c) for n, c in rows_lost.items()},
                         "order": {n: int(v) for n, v in order_dropped.items() if v}})

    def close(self) -> None:
        with self._lock:
            if self._waiting and self._file is not None:
                self._drain()
                if self._waiting:
                    _logger.warning("the run's record of what was logged could not write its last %d entries (the "
                                    "disk is still full): `otel-train verify` finds it incomplete", len(self._waiting))
            if self._file is not None and not self.stopped and not self._waiting:
                # The writer ended: a window it recorded and its spool lacks was not lost to a kill (verify).
                self._write({"k": "c"})
            if self._file is not None:
                self._file.close()
                self._file = None
            self.stopped = True

    # -- writing -----------------------------------------------------------------------------------
    def _append(self, entry: Mapping[str, Any]) -> bool:
        with self._lock:
            return self._append_locked(entry)

    def _append_locked(self, entry: Mapping[str, Any], top: int = -1) -> bool:
        """Write `entry` (`top`: its highest step) unless it would pass the cap (then write the stop entry and
        stop)."""
        if self.stopped:
            return False
        payload = _pack(entry)
        if self._size + _LEN.size + len(payload) > self.cap_bytes - _STOP_ROOM:
            self._write({"k": "x", "step": self._last_step})
            self.stopped = True
            _logger.warning("the run's record of what was logged reached OTEL_TRAIN_VERIFY_RECORD_MB (%.1f MiB) at "
                            "step %d; `otel-train verify` checks no step past it", self.cap_bytes / 2**20,
                            self._last_step)
            return False
        return self._write_payload(payload, top)

    def _write(self, entry: Mapping[str, Any]) -> bool:
        return self._write_payload(_pack(entry))

    def _write_payload(self, payload: bytes, top: int = -1) -> bool:
        """Append one entry (after the header, and after what a full disk kept waiting); True once it is written
        or waiting for space, False when the record stopped."""
        if self.stopped:
            return False
        if self._file is None and not self._open():
            return False
        if self._header_due:
            self._header_due = False
            self._mark_at = None
            for first, top_of in ((_pack(self._header), -1), (FULL_MARK.pack(0, -1), -2)):  # -2: the mark's place
                self._waiting.append((_LEN.pack(len(first)) + first, top_of))
                self._size += _LEN.size + len(first)
        self._waiting.append((_LEN.pack(len(payload)) + payload, top))
        self._size += _LEN.size + len(payload)
        self._drain()
        return not self.stopped

    def _drain(self) -> None:
        """Write the waiting entries in order, each whole; a full disk keeps the rest waiting."""
        assert self._file is not None
        while self._waiting:
            data, top = self._waiting[0]
            at = self._file.size
            try:
                self._file.append(data)
            except OSError as err:
                if not is_disk_full(err):
                    self._fail(err)
                    return
                if not self._said_full:
                    self._said_full = True
                    _logger.warning("the run's record of what was logged waits for space (%s: %s); it is written "
                                    "once the disk has room", self.path, err)
                if not self._marked:
                    self._mark_full()
                return
            self._waiting.pop(0)
            if top == -2:
                self._mark_at = at
            self._written_step = max(self._written_step, top)
        if self._marked:  # everything waiting is written: the mark no longer holds
            self._marked = False
            healed = FULL_MARK.pack(self._fulls, -1, healed=True)
            self._waiting.append((_LEN.pack(len(healed)) + healed, -1))
            self._size += _LEN.size + len(healed)
            self._drain()

    def _mark_full(self) -> None:
        """Say in the file, in place (a full disk takes no new bytes), that the record waits for space after the
        steps written so far: should it never get space, verify checks no step past them."""
        if self._mark_at is None:
            return  # the disk filled before the mark's place was written: nothing to say it with
        self._fulls += 1
        mark = FULL_MARK.pack(self._fulls, self._written_step)
        try:
            fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))  # no O_APPEND: pwrite in place
            try:
                os.pwrite(fd, _LEN.pack(len(mark)) + mark, self._mark_at)
            finally:
                os.close(fd)
        except OSError as err:
            _logger.debug("cannot mark the record %s as waiting for space: %s", self.path, err)
            return
        self._marked = True

    def _fail(self, err: OSError) -> None:
        self.stopped = True
        if self._file is not None:
            self._file.close()
        self._file = None
        self._waiting.clear()
        _logger.warning("the run's record of what was logged cannot be written (%s: %s); `otel-train verify` will "
                        "say the record is incomplete", self.path, err)


def write_session_record(run_dir: Path, rank: int, refusals: Mapping[str, int]) -> None:
    """The session's refusals at the call (values never logged, so in no window), for verify; never raises."""
    import json

    path = run_dir / FOLDER / SESSION_FILE.format(rank=rank)
    if not any(refusals.values()) and not path.parent.exists():
        return  # nothing refused and nothing recorded: no folder for it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"refusals": {str(k): int(v) for k, v in refusals.items() if v}}))
    except OSError as err:
        _logger.debug("no session record at %s: %s", path, err)


def open_record(backends: Mapping[str, Any], run: RunInfo, directory: str | os.PathLike[str], cap_bytes: int,
                resume_step: int | None = None) -> LoggedRecord | None:
    """This process's record of `run`'s windows to `backends` (None when `cap_bytes` is 0: no record)."""
    from otel_train.vocab.run_paths import run_folder

    if cap_bytes <= 0 or not backends:
        return None
    record = LoggedRecord(run_folder(directory, run.run_name), run.rank, cap_bytes,
                          {**backend_header(backends, run.run_id, run.run_name), "world_size": run.world_size})
    if resume_step is not None:
        record.note_resume(run.rank, resume_step)
    from otel_train.ship.backend_start import StartingBackend

    def noting(name: str) -> Callable[[RowExporter], None]:
        return lambda up: record.note_backend(name, backend_info(name, up))

    for name, ex in backends.items():
        if isinstance(ex, StartingBackend):  # its routing rule and store are known once it is up
            ex.when_started(noting(name))
    return record


#: The variables that say where a backend's store is (recorded as the delivering process saw them).
_STORE_VARIABLES = ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "TRACKIO_DIR",
                    "CLEARML_CACHE_DIR", "CLEARML_API_HOST", "CLEARML_CONFIG_FILE")


def backend_header(backends: Mapping[str, Any], run_id: str, run_name: str) -> dict[str, Any]:
    """The ``h`` entry's content: the run, and per backend its kind, options, store and routing rule."""
    out = {name: backend_info(name, ex) for name, ex in backends.items()}
    env = {v: os.environ[v] for v in _STORE_VARIABLES if os.environ.get(v)}
    return {"run_id": run_id, "run_name": run_name, "backends": out, "env": env}


@runtime_checkable
class RecordedElsewhere(Protocol):
    """A backend that runs in another process (`otel_train.ship.backend_host`): its entry was made there."""

    record_entry: dict[str, Any]


def backend_info(name: str, ex: Any) -> dict[str, Any]:
    """One backend's part of the ``h`` entry (a backend still starting: what is known before it is up)."""
    if isinstance(ex, RecordedElsewhere):  # a backend in a process of its own: as that process saw it
        return dict(ex.record_entry)
    from otel_train.backend import RowExporter
    from otel_train.ship.backend_start import StartingBackend

    options = getattr(ex, "options", None)
    # Its filter and class: a backend still starting knows them from its class, so windows recorded before it is
    # up (or by a job killed before) are checked by the right names, in the right store.
    route = None
    cls: type[RowExporter] | None = None
    if isinstance(ex, StartingBackend):
        route, cls = ex.route, ex.backend_class
    elif isinstance(ex, RowExporter):
        route, cls = ex.window_writer.route, type(ex)
    entry: dict[str, Any] = {"kind": str(getattr(ex, "name", name)), "class": (cls or type(ex)).__module__}
    if options is not None:
        entry.update(directory=str(Path(options.directory).resolve()), project=str(options.project),
                     ranks=str(options.ranks), trace_counters=bool(options.trace_counters),
                     trace_steps=options.trace_steps is not None)
    if route is not None:
        entry["route"] = {"include": list(route.include), "exclude": list(route.exclude),
                          "every": int(route.every), "rank0_only": bool(route.rank0_only),
                          "display_names": bool(route.display_names)}
    if cls is not None and options is not None:
        try:  # where its store is (MLflow's tracking URI), known before it is up
            entry.update(cls.store_fields(options))
        except Exception as err:  # verify then reads the store it finds, or says "not checked"
            _logger.debug("no store fields for `%s`: %s", name, err)
    return entry


class FullMark:
    """The ``f`` entry: the record's n-th wait for space began after the windows up to ``step``; a later ``F``
    entry of the same n says everything waiting was written. Fixed size, so it is written over its placeholder
    (n = 0, right after the header) in place, on a disk that has no room for a new entry."""

    def pack(self, n: int, step: int, healed: bool = False) -> bytes:
        return _pack({"k": "F" if healed else "f", "v": struct.pack("<qq", n, step)})

    @staticmethod
    def unpack(entry: Mapping[str, Any]) -> tuple[int, int]:
        n, step = struct.unpack("<qq", entry["v"])
        return int(n), int(step)


FULL_MARK = FullMark()


def _pack(entry: Mapping[str, Any]) -> bytes:
    import msgpack

    try:
        out: bytes = msgpack.packb(entry, use_bin_type=True, default=str)
    except UnicodeEncodeError:  # a lone surrogate in a name: kept as the window carries it
        out = msgpack.packb(entry, use_bin_type=True, default=str, unicode_errors="surrogatepass")
    return out
