"""An intent record written before a backend appends to its own files, so a kill between the append and the
record that the data was written (`Spool.advance`, `otel_train.sink.released`) does not write it twice.

The record says: "everything up to `mark` is recorded as written, and these files had these sizes then; what
they hold beyond comes from writes not recorded yet". Whoever resumes the delivery finds an intent whose mark is
still the last one recorded, cuts each file back to its size (appends are all that happened since) and delivers
again from the mark, exactly as without the record; an intent whose mark is older than the last record is stale
and ignored.

One record per backend, overwritten in place by one `pwrite` at offset 0 (payload length, CRC-32, JSON
``[mark, [[path, size], ...]]``; paths relative to the record's folder, so a moved run folder still matches),
no rename, no fsync: the same durability as ``written.*``. A torn or unreadable record is no record: delivery
then behaves as it did before intents existed (a window written just before a kill may be written twice); it
never cuts anything it cannot read whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path

__all__ = ["AppendIntent"]

_HEAD = struct.Struct("<II")  # payload length, crc32 of the payload
_MAX_BYTES = 1 << 20  # a record longer than this is not one of ours


class AppendIntent:
    """The intent record in the file `path` (created on the first `write`).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> log = folder / "rows.log"
        >>> _ = log.write_bytes(b"window 1\\n")
        >>> intent = AppendIntent(folder / "appending.log")
        >>> intent.write(1, {str(log): log.stat().st_size})  # window 2 is about to be appended
        >>> with open(log, "ab") as f:
        ...     _ = f.write(b"window 2\\n")  # ... and the process is killed before it records window 2
        >>> mark, files = AppendIntent(folder / "appending.log").read()
        >>> mark, AppendIntent(folder / "appending.log").cut_back(files), log.read_bytes()
        (1, 9, b'window 1\\n')
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._relative: dict[str, str] = {}  # path as the backend gives it -> as recorded

    def write(self, mark: int, files: Mapping[str, int]) -> None:
        """Record that the files are about to be appended after everything up to `mark` was recorded as written.

        Raises:
            OSError: the record could not be written (the caller goes on without it).
        """
        entries = [[self._relative.get(p) or self._relate(p), size] for p, size in files.items()]
        payload = json.dumps([mark, entries], separators=(",", ":")).encode("ascii")  # ensure_ascii: paths escaped
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.pwrite(self._fd, _HEAD.pack(len(payload), zlib.crc32(payload)) + payload, 0)

    def _relate(self, path: str) -> str:
        if len(self._relative) >= 4096:
            self._relative.clear()
        try:
            rel = os.path.relpath(path, self.path.parent)
        except ValueError:  # another drive (Windows): as given
            rel = os.path.abspath(path)
        self._relative[path] = rel
        return rel

    def read(self) -> tuple[int, dict[str, int]] | None:
        """(mark, file path -> size) of the record, or None: no record, or one torn or unreadable."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    return None
                size, crc = _HEAD.unpack(head)
                payload = f.read(size) if size <= _MAX_BYTES else b""
        except OSError:
            return None
        if len(payload) != size or zlib.crc32(payload) != crc:
            return None
        try:
            mark, entries = json.loads(payload)
            folder = os.path.abspath(self.path.parent)
            return int(mark), {os.path.normpath(os.path.join(folder, str(p))): int(s) for p, s in entries}
        except (ValueError, TypeError):
            return None

    def cut_back(self, files: Mapping[str, int]) -> int | None:
        """Cut each file back to its recorded size (a file already at or below it is left alone: never
        extended); the bytes cut, or None if some file could not be cut (then nothing is claimed)."""
        cut = 0
        for path, size in files.items():
            try:
                now = os.stat(path).st_size
                if now > size:
                    os.truncate(path, size)
                    cut += now - size
            except FileNotFoundError:
                continue  # never created, or removed since: nothing of it can be written twice
            except OSError:
                return None
        return cut

    def clear(self) -> None:
        """Forget the record (after it was applied): it is never applied twice."""
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

