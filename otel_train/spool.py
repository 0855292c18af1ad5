"""A per-rank write-ahead spool of encoded export windows, with one durable cursor per backend.

Layout under ``<run folder>/spool/rank<N>/``: segment files ``<first seq>.seg`` holding records
(``seq``, ``max step``, length, CRC-32, payload) and ``cursors.json`` (backend name -> the last seq
that backend has made durable). A torn tail (the writer killed mid-record) ends a segment's reading;
it is never an error. Segments whose every record every backend acknowledged are deleted.
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

from otel_train.records import run_folder

__all__ = ["Spool", "spool_dir"]

_HEADER = struct.Struct("<qqII")  # seq, max step, payload length, crc32 of the payload
_SEGMENT_BYTES = 16 * 1024 * 1024


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
        for seq, step, _ in self.read(0):  # the tail of an earlier writer (restart, replay)
            self.last_seq = seq
            self.last_step = max(self.last_step, step)
        # Seqs continue after everything ever acknowledged here, even once its segments are gone.
        self.last_seq = max(self.last_seq, *self.cursors.values(), 0)

    # -- writing ------------------------------------------------------------------------------
    def append(self, seq: int, max_step: int, payload: bytes) -> bool:
        """Append one window; a seq at or below the last one is a resend and is skipped."""
        with self._file_lock:
            if seq <= self.last_seq:
                return False
            if self._file is None or self._file_bytes >= _SEGMENT_BYTES:
                self._roll(seq)
            assert self._file is not None
            # One unbuffered write: once `append` returns, a kill -9 of this process cannot lose it.
            self._file.write(_HEADER.pack(seq, max_step, len(payload), zlib.crc32(payload)) + payload)
            self._file_bytes += _HEADER.size + len(payload)
            self.last_seq = seq
            self.last_step = max(self.last_step, max_step)
            return True

    def _roll(self, seq: int) -> None:
        if self._file is not None:
            os.fsync(self._file.fileno())
            self._file.close()
        self._file = open(self.path / f"{seq:016d}.seg", "ab", buffering=0)  # noqa: SIM115 - kept open across appends
        self._file_bytes = 0

    def sync(self) -> None:
        """Make every appended window durable (flush + fsync)."""
        with self._file_lock:
            if self._file is not None:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        self.sync()
        with self._file_lock:
            if self._file is not None:
                self._file.close()
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
        return self.cursors.get(backend, 0)

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
            self.remove_acknowledged(self.backends)  # a long run's spool stays as small as the slowest backend

    def remove_acknowledged(self, backends: list[str]) -> None:
        """Delete segments every one of `backends` has acknowledged entirely (the open one only once closed)."""
        if not backends:
            return
        done = min(self.cursors.get(b, 0) for b in backends)
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
