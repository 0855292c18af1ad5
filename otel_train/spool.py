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

A disk full (or any other write error) never stops delivery: the window that could not be written is
cut back out of its segment, counted in `Spool.failed_appends`, and still handed to the backends from
memory; the first failure and the recovery are each logged once. Such a window is not written ahead:
a crash before a backend made it durable loses it, and `otel-train replay` cannot bring it back.
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

from otel_train._internal.ratelimit import LogOnce
from otel_train.records import run_folder

__all__ = ["Spool", "spool_dir"]

_HEADER = struct.Struct("<qqII")  # seq, max step, payload length, crc32 of the payload
_WRITTEN = struct.Struct("<qI")  # seq, crc32 of the seq's bytes
_SEGMENT_BYTES = 16 * 1024 * 1024
_logger = logging.getLogger("otel_train")


def spool_dir(directory: str | os.PathLike[str], run_name: str, rank: int) -> Path:
    """Where rank `rank` of run `run_name` spools its windows."""
    return run_folder(directory, run_name) / "spool" / f"rank{rank}"


class Spool:
    """Append-only segments plus per-backend cursors. One writer (one process) at a time.

    Args:
        path: The rank's spool folder (created).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._cursor_file = self.path / "cursors.json"
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
        for seq, step, _ in self.read(0):  # the tail of an earlier writer (restart, replay)
            self.last_seq = seq
            self.last_step = max(self.last_step, step)
        # Seqs continue after everything ever acknowledged here, even once its segments are gone.
        self.last_seq = max(self.last_seq, *self.cursors.values(), 0)
        for written in self.path.glob("written.*"):
            self.last_seq = max(self.last_seq, self._read_written(written))

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
        self._file = open(self.path / f"{seq:016d}.seg", "ab", buffering=0)  # noqa: SIM115 - kept open across appends
        self._file_bytes = 0

    def sync(self) -> None:
        """Make every appended window durable (flush + fsync)."""
        with self._file_lock:
            if self._file is not None:
                try:
                    os.fsync(self._file.fileno())
                except OSError as err:  # a full disk: the windows are still delivered from memory
                    self._log.warning("spool-sync", "otel-train: cannot sync the spool %s: %s", self.path, err)

    def close(self) -> None:
        self.sync()
        with self._cursor_lock:
            fds, self._written_fds = list(self._written_fds.values()), {}
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

    # -- reading ------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        return sorted(self.path.glob("*.seg"))

    def read(self, after: int) -> Iterator[tuple[int, int, bytes]]:
        """Every intact record with seq > `after`, in order: (seq, max step, payload)."""
        segments = self.segments()
        for i, seg in enumerate(segments):
            if i + 1 < len(segments) and int(segments[i + 1].stem) <= after + 1:
                continue  # the next segment starts at or before what we need: skip this one whole
            try:
                data = seg.read_bytes()
            except OSError:
                continue
            pos = 0
            while pos + _HEADER.size <= len(data):
                seq, step, size, crc = _HEADER.unpack_from(data, pos)
                body = data[pos + _HEADER.size: pos + _HEADER.size + size]
                if len(body) < size or zlib.crc32(body) != crc:
                    break  # a torn tail
                pos += _HEADER.size + size
                if seq > after:
                    yield seq, step, body

    # -- cursors --------------------------------------------------------------------------------
    def _load_cursors(self) -> dict[str, int]:
        try:
            data = json.loads(self._cursor_file.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def cursor(self, backend: str) -> int:
        """The last seq `backend` holds: acknowledged durable, or (kill-safe writers) written."""
        return max(self.cursors.get(backend, 0), self._read_written(self._written_path(backend)))

    def _written_path(self, backend: str) -> Path:
        return self.path / ("written." + "".join(c if c.isalnum() or c in "-_" else "_" for c in backend))

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
        fd = self._written_fds.get(backend)
        if fd is None:
            with self._cursor_lock:
                fd = self._written_fds.get(backend)
                if fd is None:
                    fd = self._written_fds[backend] = os.open(self._written_path(backend), os.O_RDWR | os.O_CREAT,
                                                              0o644)
        os.pwrite(fd, record, 0)

    def acknowledge(self, backend: str, seq: int) -> None:
        """Record that `backend` has made everything up to `seq` durable; drop fully read segments."""
        with self._cursor_lock:
            if seq <= self.cursors.get(backend, 0):
                return
            self.cursors[backend] = seq
            tmp = self._cursor_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.cursors))
            os.replace(tmp, self._cursor_file)  # atomic: a crash leaves the old cursors or the new ones
        if self.backends:
            self.remove_acknowledged()  # a long run's spool stays as small as the slowest backend

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
