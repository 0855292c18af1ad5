"""A sink run's series state (`otel_train.sink.runs.temporality.SeriesLedger`), kept with the run's spool.

What keeps the sink exactly-once across a restart, an idle or least-recently-used close and the start-up replay
lives in the ledger: counter totals per series, which gauge values each series has written (a window of recent
steps), previous cumulative points, DELTA points and spans already taken (a retried request). It is persisted in
the run's spool folder, next to the spool's segments, so it is as durable as the data the sender was told is
taken:

* ``ledger.journal``: one record per request, appended with one write before the request's window is appended
  to the spool as `seq`: ``[seq, changes]``, the ledger's changes (`SeriesLedger.changes`: set entries, and the
  gauge values written as a block of columns: a series' rank and tag once per run of its values, then the
  steps and values). Records of the previous format (a (rank, tag, step) key per gauge value) are still read. Records are framed
  by their length; a torn last record ends the reading. A record whose seq the spool does not hold (the sink died between the two writes, or the spool's
  write failed and the record was cut back) is ignored on load: the sender was not told OK and sends again.
* ``ledger.snapshot``: the whole state (`SeriesLedger.dump`) with the seq it covers, written to a temporary
  file and renamed over (atomic), then the journal emptied: when the journal outgrows it (compaction), when the
  run opens (after the journal was applied), and when it closes. A run that closes with everything written
  keeps only these files in its spool folder (its size is the ledger's: series x a window of steps).

Both are msgpack (the spool's encoding). The snapshot is versioned (`_VERSION`); version 1 (gauge values as a
flat table) is still read. Like the spool's own records (``written.*``, ``released.*``), the journal is not
fsynced per request: a ``kill -9`` of the sink keeps what the kernel has; a machine crash may
lose its last records, as it may the spool's.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import ormsgpack

__all__ = ["JOURNAL_FILE", "SNAPSHOT_FILE", "RunState"]

_logger = logging.getLogger(__name__)

SNAPSHOT_FILE = "ledger.snapshot"
JOURNAL_FILE = "ledger.journal"
_VERSION = 2  # 2: gauge values as a block of columns (1: a (rank, tag, step) table; still read)
_READABLE = frozenset({1, _VERSION})
_FRAME = struct.Struct("<I")  # the record's length
_MIN_COMPACT_BYTES = 16 << 20  # the journal is folded into the snapshot past this (or twice the snapshot's size)


class RunState:
    """The persisted ledger of one run, in its spool folder `folder` (module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.snapshot_path = folder / SNAPSHOT_FILE
        self.journal_path = folder / JOURNAL_FILE
        self.journal_bytes = 0
        self._compact_at = _MIN_COMPACT_BYTES
        self._fd: int | None = None  # the journal, open for appending while the run is open (`close`)

    def read(self, last_seq: int) -> tuple[Any, list[Any]]:
        """The snapshot (None: none) and the journal's changes after it that the spool holds (seq <= `last_seq`),
        in order.

        A file that cannot be read or parsed is logged: the run starts from what could be read (a point may then
        be written twice, never lost)."""
        snapshot: Any = None
        covered = 0
        try:
            version, seq, state = ormsgpack.unpackb(self.snapshot_path.read_bytes())
            if version in _READABLE:
                snapshot, covered = state, int(seq)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError) as err:
            _logger.warning("cannot read %s (%s): points this run already wrote may be written again",
                            self.snapshot_path, err)
        records: list[Any] = []
        try:
            data = self.journal_path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as err:
            _logger.warning("cannot read %s (%s): points this run already wrote may be written again",
                            self.journal_path, err)
            data = b""
        pos = 0
        while pos + _FRAME.size <= len(data):
            (size,) = _FRAME.unpack_from(data, pos)
            body = data[pos + _FRAME.size:pos + _FRAME.size + size]
            try:
                if len(body) != size:
                    raise ValueError("torn")
                seq, changes = ormsgpack.unpackb(body)
            except (ValueError, TypeError):
                break  # a torn last record (the sink was killed mid-write): its request was not acknowledged
            pos += _FRAME.size + size
            if covered < int(seq) <= last_seq:
                records.append(changes)
        return snapshot, records

    def append(self, seq: int, changes: Any) -> int:
        """Append the record of the request that is about to be spooled as `seq`; returns the journal's size
        before, for `cut`.

        Raises:
            OSError: the journal cannot be written (the request must not be acknowledged).
        """
        body = ormsgpack.packb([seq, changes])
        record = _FRAME.pack(len(body)) + body
        before = self.journal_bytes
        # Kept open while the run is: an open and a close per request cost as much as the write (one descriptor
        # per open run more, as its spool's segment).
        fd = self._fd
        if fd is None:
            fd = self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, record)  # one write: a kill leaves it whole or torn
            if written != len(record):
                os.ftruncate(fd, before)
                raise OSError(f"short write: {written} of {len(record)} bytes (disk full?)")
        except OSError:
            self.close()  # opened afresh by the next request's append
            raise
        self.journal_bytes = before + len(record)
        return before

    def close(self) -> None:
        """Close the journal's descriptor (the run closes; the next `append` opens it again)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def cut(self, size: int) -> None:
        """Cut the journal back to `size` (its request's spool write failed: that request is refused)."""
        try:
            os.truncate(self.journal_path, size)
            self.journal_bytes = size
        except OSError as err:  # the line's seq will be taken by the next request: it must not be read back
            _logger.warning("cannot cut %s back (%s); rewriting it", self.journal_path, err)
            self.journal_bytes = self._compact_at  # the next `due` rewrites the snapshot and empties the journal

    def due(self) -> bool:
        """Whether the journal has outgrown the snapshot (`write` it)."""
        return self.journal_bytes >= self._compact_at

    def write(self, seq: int, state: Any) -> None:
        """Write the whole state, covering the spool up to `seq`, and empty the journal.

        Raises:
            OSError: it could not be written (the journal and the old snapshot stay as they were).
        """
        data = ormsgpack.packb([_VERSION, seq, state])
        tmp = self.snapshot_path.with_name(SNAPSHOT_FILE + ".tmp")
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.snapshot_path)  # atomic: a kill leaves the old snapshot or the new one
        try:
            os.truncate(self.journal_path, 0)
        except FileNotFoundError:
            pass
        self.journal_bytes = 0
        self._compact_at = max(_MIN_COMPACT_BYTES, 2 * len(data))
