"""A per-rank write-ahead spool of encoded export windows, with one durable cursor per backend.

Layout under ``<run folder>/spool/rank<N>/``: segment files ``<first seq>.seg`` holding records
(``seq``, ``max step``, length, CRC-32, payload) and ``cursors.json`` (backend name -> the last seq
that backend has made durable). A torn tail (the writer killed mid-record) ends a segment's reading;
it is never an error. Segments whose every record every backend acknowledged are deleted.

A backend whose writes are appends to its own files (`RowExporter.kill_safe_writes`) also has
``written.<backend>``: the last seq whose write reached the OS, one 12-byte record (seq, CRC-32)
overwritten in place after every window (`advance`). A process killed between two flushes resumes
after it, so nothing it wrote is written twice. It is not fsynced per window: a machine crash may keep
it while losing the backend's unsynced data (at most the last second before a flush).

The write and its record are two steps: a kill between them would leave the window in the backend's files and
the record before it, so the restarted process would write it again. A backend that reports the files it is
about to append to (`RowExporter.mark_appending`: JSONL, TensorBoard) also has an intent record, written before
each write at byte 16 of the same ``written.<backend>`` (`otel_train.ship.append_intent`: the last seq recorded,
and each file's size then); whoever resumes delivery cuts the files back to those sizes when the write after it
was not recorded (`cut_unrecorded_appends`), then delivers from the record as before: every window is written
once.

A spool folder deleted during the run (``rm -rf`` of the run folder) is noticed at the next append or cursor
save (one ``fstat``): the folder is created again, with the open segment's records (read back from its still-open
descriptor), the cursors, the written and intent records, the writer lock and whatever `on_recreated` rewrites, and
a warning says so once. Windows of older segments (closed before the deletion) that not every backend had made
durable are counted in `failed_appends`: they are delivered from memory, but no longer written ahead.

A disk full (or any other write error) never stops delivery: the window that could not be written is
cut back out of its segment, counted in `Spool.failed_appends`, and still handed to the backends from
memory (each backend keeps it until it holds it, `BackendFeed`); the first failure and the recovery are each
logged once. Such a window is not written ahead: a crash before a backend made it durable loses it, and
`otel-train replay` cannot bring it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from otel_train._internal.at_fork import after_fork_in_child
from otel_train._internal.ratelimit import LogOnce
from otel_train.ship.append_intent import INTENT_OFFSET, AppendIntent
from otel_train.vocab.run_paths import run_folder

__all__ = ["RunClaim", "Spool", "backend_file", "claim_run", "holder", "last_seq", "rank_spool", "spool_dir", "try_lock"]

_HEADER = struct.Struct("<qqII")  # seq, max step, payload length, crc32 of the payload
_WRITTEN = struct.Struct("<qI")  # seq, crc32 of the seq's bytes
_SEGMENT_BYTES = 16 * 1024 * 1024
_logger = logging.getLogger("otel_train")


def spool_dir(directory: str | os.PathLike[str], run_name: str, rank: int) -> Path:
    """Where rank `rank` of run `run_name` spools its windows."""
    return rank_spool(run_folder(directory, run_name), rank)


def rank_spool(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` of the run whose folder is `run_dir` spools its windows."""
    return run_dir / "spool" / f"rank{rank}"


#: The lock file in a rank's spool folder: whoever holds an exclusive `flock` on it is the rank's one writer.
LOCK_FILE = "writer.lock"
CURSORS = "cursors.json"  # backend -> the last seq it made durable
_MAX_SUFFIX = 100
_WAIT_POLL_S = 0.05


class RunClaim:
    """The exclusive claim of one rank of one run folder (see `claim_run`).

    The lock is an `flock` on ``writer.lock``: it belongs to the open file, so the exporter process that
    inherits `fd` keeps the claim after the training process has gone, until it has drained; the kernel
    drops it when the last holder exits, also after a ``kill -9``.
    """

    def __init__(self, run_id: str, run_name: str, path: Path, fd: int) -> None:
        self.run_id = run_id
        self.run_name = run_name
        #: The rank's spool folder.
        self.path = path
        self.fd = fd
        after_fork_in_child(self._forget)  # held weakly: a released claim is freed

    def _forget(self) -> None:
        # A forked child (a DataLoader worker) must not keep the claim alive after the run is done.
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def release(self) -> None:
        """Close this process's handle (an exporter process holding the same lock keeps it)."""
        self._forget()


def _describe(fd: int, state: str) -> None:
    """Record who holds the claim and whether it is still training or only draining (read by contenders)."""
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "state": state}).encode()
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)


def mark_draining(fd: int) -> None:
    """The training process is gone (or handed off): the holder only drains now; a restart may wait for it."""
    if fd >= 0:
        _describe(fd, "draining")


def holder(path: Path) -> dict[str, object]:
    """Who holds the claim of the spool folder `path`, as last recorded (empty if unknown)."""
    try:
        data = json.loads((path / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def try_lock(path: Path) -> int | None:
    """Take the exclusive claim of the spool folder `path` without waiting: the open fd, or None if held.

    Raises:
        OSError: the folder cannot be created or the file system has no `flock` (some network file systems).
    """
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    return fd


def claim_run(directory: str | os.PathLike[str], run_id: str, run_name: str, rank: int, *,
              wait_s: float) -> RunClaim:
    """Become the one writer of rank `rank` of the run, or of a distinct run when another process writes it.

    A run folder has one writer per rank at a time. When another process already holds it:
    - if that holder only drains (an earlier attempt's exporter process after its training process ended,
      e.g. a torchrun elastic restart), wait up to `wait_s` for it to finish, then continue the same run;
    - otherwise (another training process with the same run id: two seeds in one allocation), or when the
      wait runs out, take the first free ``<run id>-2``, ``-3``, ... (run id and run name both get the
      suffix, so every backend keeps the two apart), with a warning naming it.

    A file system without `flock` (some network file systems) gets one warning and no lock.

    Raises:
        ConfigError: no free name in `_MAX_SUFFIX` tries.
    """
    from otel_train.errors import ConfigError

    first = spool_dir(directory, run_name, rank)
    for n in range(1, _MAX_SUFFIX + 1):
        suffix = "" if n == 1 else f"-{n}"
        path = spool_dir(directory, run_name + suffix, rank)
        try:
            fd = try_lock(path)
            if fd is None and holder(path).get("state") == "draining" and wait_s > 0:
                who = holder(path)
                _logger.warning("otel-train: the exporter process (pid %s on %s) of an earlier attempt still drains "
                                "%s; waiting up to %.0f s for it before this attempt writes there",
                                who.get("pid"), who.get("host"), path, wait_s)
                deadline = time.monotonic() + wait_s
                while fd is None and time.monotonic() < deadline:
                    time.sleep(_WAIT_POLL_S)
                    fd = try_lock(path)
        except OSError as err:
            _logger.warning("otel-train: cannot lock the run folder %s (%s): another process writing the same run "
                            "and rank would mix with this one; give each process its own OTEL_TRAIN_RUN_ID",
                            path, err)
            return RunClaim(run_id + suffix, run_name + suffix, path, -1)
        if fd is None:
            continue
        _describe(fd, "training")
        if n > 1:
            who = holder(first)
            _logger.warning("otel-train: run %r rank %d is already written by another process (pid %s on %s); "
                            "this process writes run %r instead (set a distinct OTEL_TRAIN_RUN_ID per process "
                            "to choose the names)", run_id, rank, who.get("pid", "?"), who.get("host", "?"),
                            run_id + suffix)
        return RunClaim(run_id + suffix, run_name + suffix, path, fd)
    raise ConfigError(f"OTEL_TRAIN_RUN_ID: {run_id!r} rank {rank} and its {_MAX_SUFFIX - 1} suffixed names are all "
                      "being written by other processes; set a distinct OTEL_TRAIN_RUN_ID")


class Spool:
    """Append-only segments plus per-backend cursors. One writer (one process) at a time.

    Args:
        path: The rank's spool folder (created).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._cursor_file = self.path / CURSORS
        self.cursors: dict[str, int] = self._load_cursors()
        self._cursor_lock = threading.Lock()  # one thread per backend acknowledges
        self._file_lock = threading.Lock()  # the writer appends while a backend's thread reads back
        #: The backends reading this spool: a segment all of them acknowledged is deleted.
        self.backends: list[str] = []
        self.last_seq = 0
        self.last_step = -1
        self._file: io.FileIO | None = None
        self._file_bytes = 0
        #: Windows not written ahead because the spool could not be written (disk full): memory only.
        self.failed_appends = 0
        self._failing = False
        self._log = LogOnce(_logger, interval_s=60.0)  # a disk that keeps flapping cannot flood the log
        self._written_fds: dict[str, int] = {}  # backend -> open fd of its ``written.<backend>``
        self._intents: dict[str, AppendIntent] = {}  # backend -> its intent record (in ``written.<backend>``)
        self._segment_first = 0  # the first seq of the open segment (its file's name)
        self._lock_fd = -1  # the writer lock taken again in a folder created again (`_recreate`)
        self._claimed = (self.path / LOCK_FILE).exists()  # a claimed rank folder (`claim_run`), not a sink's run spool
        self._retired_fds: list[int] = []  # ``written.*`` descriptors of a deleted folder
        #: Called (with no argument) after a deleted spool folder was created again: rewrite files kept there.
        self.on_recreated: list[Callable[[], None]] = []
        for seq, step, _ in self.read(0):  # the tail of an earlier writer (restart, replay)
            self.last_seq = seq
            self.last_step = max(self.last_step, step)
        self.last_seq = max(self.last_seq, _acknowledged(self.path, self.cursors))

    # -- writing ------------------------------------------------------------------------------
    def append(self, seq: int, max_step: int, payload: bytes) -> bool:
        """Append one window; a seq at or below the last one is a resend and is skipped.

        Returns:
            Whether the window was written; False also when the write failed (see the module docstring).
        """
        record = _HEADER.pack(seq, max_step, len(payload), zlib.crc32(payload)) + payload
        with self._file_lock:
            if seq <= self.last_seq:
                return False
            try:
                if self._deleted():
                    self._recreate()
                if self._file is None or self._file_bytes >= _SEGMENT_BYTES:
                    self._roll(seq)
                assert self._file is not None
                # One unbuffered write: once `append` returns, a kill -9 of this process cannot lose it.
                written = self._file.write(record)
                if written != len(record):  # a full disk first shows as a short write
                    raise OSError(f"short write: {written} of {len(record)} bytes (disk full?)")
            except OSError as err:
                self._write_failed(err)
                return False
            if self._failing:
                self._failing = False
                self._log.warning("spool-ok", "otel-train: the spool %s is writable again; %d window(s) so far were "
                                  "delivered from memory only", self.path, self.failed_appends)
            self._file_bytes += len(record)
            self.last_seq = seq
            self.last_step = max(self.last_step, max_step)
            return True

    def _write_failed(self, err: OSError) -> None:
        self.failed_appends += 1
        if not self._failing:
            self._failing = True
            self._log.warning("spool-full", "otel-train: cannot write the spool %s (%s); training goes on and windows "
                              "go to the backends from memory only, not written ahead: a crash before they are "
                              "delivered loses them and `otel-train replay` cannot bring them back", self.path, err)
        if self._file is None:
            return
        try:  # cut a partly written record back out, so the records after it stay readable
            self._file.truncate(self._file_bytes)
        except OSError:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None  # the next append starts a new segment; reading stops at this one's torn tail

    def _roll(self, seq: int) -> None:
        if self._file is not None:
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None  # if the new segment cannot be opened, the next append tries again
        # Kept open across appends, readable: a deleted folder's segment is read back through it (`_recreate`).
        self._file = open(self.path / f"{seq:016d}.seg", "a+b", buffering=0)  # noqa: SIM115
        self._file_bytes = 0
        self._segment_first = seq

    # -- a deleted spool folder -------------------------------------------------------------------
    def _deleted(self) -> bool:
        """Whether the spool folder was deleted since it was opened (the open segment unlinked, or no folder)."""
        try:
            if self._file is not None:
                return os.fstat(self._file.fileno()).st_nlink == 0
            return not self.path.is_dir()
        except OSError:
            return False

    def heal(self) -> bool:
        """Create the spool folder again if it was deleted (module docstring); whether it was."""
        with self._file_lock:
            if not self._deleted():
                return False
            self._recreate()
            return True

    def _recreate(self) -> None:
        """The spool folder is gone: create it again from what this process still holds. Under `_file_lock`."""
        self.path.mkdir(parents=True, exist_ok=True)
        kept = 0
        if self._file is not None:  # the unlinked segment is still readable through its descriptor
            old = self._file
            data = _pread_all(old.fileno(), self._file_bytes)
            self._file = open(self.path / f"{self._segment_first:016d}.seg", "a+b", buffering=0)  # noqa: SIM115
            with contextlib.suppress(OSError):
                old.close()
            kept = sum(1 for _ in _records(data))
            try:
                if self._file.write(data) != len(data):
                    raise OSError("short write (disk full?)")
                self._file_bytes = len(data)
            except OSError:  # those windows are delivered from memory, no longer written ahead: said by `sync`
                with contextlib.suppress(OSError):
                    self._file.truncate(0)  # shrinking needs no space
                self._file_bytes = 0
                self.failed_appends += kept
                kept = 0
        first = self._segment_first if self._file is not None else self.last_seq + 1
        with self._cursor_lock:
            self._save_cursors()
            for backend, fd in list(self._written_fds.items()):
                data = _pread_all(fd, os.fstat(fd).st_size)
                new = os.open(self._written_path(backend), os.O_RDWR | os.O_CREAT, 0o644)
                os.pwrite(new, data, 0)
                self._written_fds[backend] = new
                self._retired_fds.append(fd)  # closed at `close`: a backend's thread may be writing to it now
            done = min((self.cursors.get(b, 0) for b in self.backends), default=self.last_seq)
        if self._claimed and self._lock_fd < 0:  # another writer starting now must not take this rank too
            with contextlib.suppress(OSError):
                lock = try_lock(self.path)
                self._lock_fd = -1 if lock is None else lock
        lost = max(0, first - 1 - done)  # windows of deleted older segments not every backend had made durable
        self.failed_appends += lost
        self._log.warning("spool-recreated", "otel-train: the spool folder %s was deleted during the run; created "
                          "again with the %d window(s) its open segment held%s", self.path, kept,
                          f"; {lost} window(s) of older segments are delivered from memory only, not written "
                          "ahead" if lost else "")
        for hook in self.on_recreated:
            try:
                hook()
            except Exception as err:  # a file kept beside the spool: the spool itself is whole again
                _logger.warning("otel-train: rewriting a file of the spool folder %s failed: %s", self.path, err)

    def sync(self) -> bool:
        """Make every appended window durable (flush + fsync). Returns whether every window given to `append`
        is durable now: the sync succeeded and no append failed (`failed_appends`)."""
        with self._file_lock:
            if self._file is not None:
                try:
                    os.fsync(self._file.fileno())
                except OSError as err:  # a full disk: the windows are still delivered from memory
                    self._log.warning("spool-sync", "otel-train: cannot sync the spool %s: %s", self.path, err)
                    return False
            return self.failed_appends == 0

    def close(self) -> None:
        self.sync()
        with self._cursor_lock:
            fds, self._written_fds = list(self._written_fds.values()), {}
            retired, self._retired_fds = self._retired_fds, []
        for fd in retired:
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in fds:
            try:
                os.fsync(fd)
                os.close(fd)
            except OSError:
                pass
        with self._file_lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None
            lock_fd, self._lock_fd = self._lock_fd, -1
            if lock_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(lock_fd)

    # -- reading ------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        return _segments(self.path)

    def read(self, after: int) -> Iterator[tuple[int, int, bytes]]:
        """Every intact record with seq > `after`, in order: (seq, max step, payload)."""
        return _read(self.path, after)

    # -- cursors --------------------------------------------------------------------------------
    def _load_cursors(self) -> dict[str, int]:
        return _load_cursors(self._cursor_file)

    def cursor(self, backend: str) -> int:
        """The last seq `backend` holds: acknowledged durable, or (kill-safe writers) written."""
        return max(self.cursors.get(backend, 0), self._read_written(self._written_path(backend)))

    def _written_path(self, backend: str) -> Path:
        return self.path / backend_file("written", backend)

    @staticmethod
    def _read_written(path: Path) -> int:
        try:
            data = path.read_bytes()
        except OSError:
            return 0
        if len(data) < _WRITTEN.size:
            return 0
        seq, crc = _WRITTEN.unpack_from(data)
        return seq if zlib.crc32(data[:8]) == crc else 0  # a torn record: fall back to the acknowledged cursor

    def advance(self, backend: str, seq: int) -> None:
        """Record that `backend`'s write of every window up to `seq` reached the OS (see the module docstring).

        One `pwrite` of 12 bytes at offset 0 of an open file: no rename, no fsync (a kill -9 cannot
        lose a write the kernel already has)."""
        record = _WRITTEN.pack(seq, zlib.crc32(struct.pack("<q", seq)))
        fd = self._written_fd(backend)
        os.pwrite(fd, record, 0)
        if self._written_fds.get(backend, fd) != fd:  # the folder was created again meanwhile: into the new file
            os.pwrite(self._written_fd(backend), record, 0)

    def _written_fd(self, backend: str) -> int:
        """The open ``written.<backend>`` (its written record, then its intent record), kept until `close`."""
        fd = self._written_fds.get(backend)
        if fd is None:
            with self._cursor_lock:
                fd = self._written_fds.get(backend)
                if fd is None:
                    fd = self._written_fds[backend] = os.open(self._written_path(backend), os.O_RDWR | os.O_CREAT,
                                                              0o644)
        return fd

    def intent(self, backend: str) -> AppendIntent:
        """`backend`'s intent record, in its ``written.<backend>`` (module docstring)."""
        intent = self._intents.get(backend)
        if intent is None:
            with self._cursor_lock:
                intent = self._intents.setdefault(backend, AppendIntent(
                    self._written_path(backend), INTENT_OFFSET, lambda: self._written_fd(backend)))
        return intent

    def cut_unrecorded_appends(self, backend: str) -> int:
        """Before `backend` is written again by a new process: if the last write announced in its intent record
        was not recorded (`advance`) before the writer died, cut its files back to their sizes before that write,
        so that delivery, resuming from the record, writes those windows once. Returns the bytes cut.

        A stale record (its write was recorded), a torn one, or a file that cannot be cut: nothing is cut and
        delivery resumes as without the record (the last window may then be written twice, never lost)."""
        intent = self.intent(backend)
        found = intent.read()
        if found is None:
            return 0
        mark, files = found
        cursor = self.cursor(backend)
        if mark < cursor:
            return 0  # the write it announced was recorded: nothing after it is unrecorded
        cut = intent.cut_back(files)
        if cut is None:
            self._log.warning("cut-back", "otel-train: cannot cut the files of `%s` back to where they were before "
                              "the write a killed process did not record (%s); that write may appear twice",
                              backend, ", ".join(files))
            return 0
        if mark > cursor:  # the 12-byte record was torn: the intent says how far the writes were recorded
            self.advance(backend, mark)
        intent.clear()
        if cut:
            _logger.info("otel-train: cut %d byte(s) a killed process appended for `%s` but did not record as "
                         "written; they are delivered again once", cut, backend)
        return cut

    def acknowledge(self, backend: str, seq: int) -> None:
        """Record that `backend` has made everything up to `seq` durable; drop fully read segments."""
        with self._cursor_lock:
            if seq <= self.cursors.get(backend, 0):
                return
            self.cursors[backend] = seq
            try:
                self._save_cursors()
                saved = True
            except FileNotFoundError:
                saved = False
        # The folder was deleted: create it again (which saves the cursors); anything else raises here.
        if not saved and not self.heal():
            with self._cursor_lock:
                self._save_cursors()
        if self.backends:
            self.remove_acknowledged()  # a long run's spool stays as small as the slowest backend

    def _save_cursors(self) -> None:
        tmp = self._cursor_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.cursors))
        os.replace(tmp, self._cursor_file)  # atomic: a crash leaves the old cursors or the new ones

    def remove_acknowledged(self) -> None:
        """Delete segments every one of `self.backends` has acknowledged entirely (the open one only once closed)."""
        if not self.backends:
            return
        done = min(self.cursors.get(b, 0) for b in self.backends)
        segments = self.segments()
        ends = [int(nxt.stem) - 1 for nxt in segments[1:]]
        if self._file is None:
            ends.append(self.last_seq)
        for seg, end in zip(segments, ends):
            if end <= done:
                try:
                    seg.unlink()
                except OSError:
                    pass


def _segments(path: Path) -> list[Path]:
    return sorted(path.glob("*.seg"))


def _read(path: Path, after: int) -> Iterator[tuple[int, int, bytes]]:
    """Every intact record of the spool folder `path` with seq > `after`, in order: (seq, max step, payload)."""
    segments = _segments(path)
    for i, seg in enumerate(segments):
        if i + 1 < len(segments) and int(segments[i + 1].stem) <= after + 1:
            continue  # the next segment starts at or before what we need: skip this one whole
        try:
            data = seg.read_bytes()
        except OSError:
            continue
        for seq, step, body in _records(data):
            if seq > after:
                yield seq, step, body


def _records(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """The intact records of one segment's bytes, in order, up to a torn tail."""
    pos = 0
    while pos + _HEADER.size <= len(data):
        seq, step, size, crc = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size: pos + _HEADER.size + size]
        if len(body) < size or zlib.crc32(body) != crc:
            return  # a torn tail
        pos += _HEADER.size + size
        yield seq, step, body


def _pread_all(fd: int, size: int) -> bytes:
    """The first `size` bytes of the open file `fd` (fewer if it is shorter)."""
    parts, pos = [], 0
    while pos < size:
        part = os.pread(fd, size - pos, pos)
        if not part:
            break
        parts.append(part)
        pos += len(part)
    return b"".join(parts)


def _load_cursors(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _acknowledged(path: Path, cursors: dict[str, int]) -> int:
    """The last seq any backend acknowledged or recorded written in the spool folder `path`: seqs continue after
    it even once its segments are gone."""
    return max([0, *cursors.values(), *(Spool._read_written(w) for w in path.glob("written.*"))])


def last_seq(path: Path) -> int:
    """The last window seq of the spool folder `path`, as `Spool(path).last_seq` finds it, without opening the
    spool: nothing is created, written or cut, and only the newest segment holding a record is read. The
    training process numbers its windows on from it before its exporter process has opened the spool."""
    path = Path(path)
    found = 0
    for segment in reversed(_segments(path)):
        for seq, _, _ in _read(path, int(segment.stem) - 1):  # this segment on: the newer ones held nothing
            found = seq
        if found:
            break
    return max(found, _acknowledged(path, _load_cursors(path / CURSORS)))


def acknowledged_by(path: Path, backend: str) -> int:
    """The last seq `backend` holds in the spool folder `path` (`Spool.cursor`), without opening the spool."""
    path = Path(path)
    return max(_load_cursors(path / CURSORS).get(backend, 0),
               Spool._read_written(path / backend_file("written", backend)))


def backend_file(prefix: str, backend: str) -> str:
    """The name of `backend`'s file `prefix` in a spool folder (the backend's name made file-safe).

    Example:
        >>> backend_file("released", "tensorboard (sink)")
        'released.tensorboard__sink_'
    """
    return prefix + "." + "".join(c if c.isalnum() or c in "-_" else "_" for c in backend)
