"""An intent record written before a backend appends to its own files, so a kill between the append and the
record that the data was written (`Spool.advance`, `otel_train.sink.runs.released`) does not write it twice.

The record says: "everything up to `mark` is recorded as written, and these files had these sizes then; what
they hold beyond comes from writes not recorded yet". Whoever resumes the delivery finds an intent whose mark is
still the last one recorded, cuts each file back to its size (appends are all that happened since) and delivers
again from the mark, exactly as without the record; an intent whose mark is older than the last record is stale
and ignored.

One record per backend, overwritten in place by one `pwrite` (payload length, CRC-32; the payload is the mark,
then per file its size and path, relative to the record's folder so that a moved run folder still matches), no
rename, no fsync: the same durability as ``written.*``, at offset `INTENT_OFFSET` of the spool's
``written.<backend>`` (its open file: no descriptor more per run), or in a file of its own (the sink's held
backends, written about once a second: opened per write). A torn or unreadable record is no record: delivery then
behaves as it did before intents existed (a window written just before a kill may be written twice); it never
cuts anything it cannot read whole.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["INTENT_OFFSET", "AppendIntent"]

#: Where the record starts in a spool's ``written.<backend>`` (after its 12-byte record of what was written).
INTENT_OFFSET = 16
_HEAD = struct.Struct("<II")  # payload length, crc32 of the payload
_MARK = struct.Struct("<qI")  # the mark, the number of files
_FILE = struct.Struct("<q")  # a file's size, then its path
_LENGTH = struct.Struct("<I")  # a path's length in bytes, then the path
_MAX_BYTES = 1 << 20  # a record longer than this is not one of ours
_NONE = _HEAD.pack(0, 0)  # a cleared record (shorter than any mark)


class AppendIntent:
    """The intent record at `offset` of the file `path` (created on the first `write`).

    Args:
        path: The file.
        offset: Where in it the record starts.
        fd: Returns an open descriptor of `path` that its owner keeps (and closes); None: opened per write.

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

    def __init__(self, path: Path, offset: int = 0, fd: Callable[[], int] | None = None) -> None:
        self.path = path
        self.offset = offset
        self._fd = fd
        self._encoded: dict[str, bytes] = {}  # path as the backend gives it -> as recorded

    def write(self, mark: int, files: Mapping[str, int]) -> None:
        """Record that the files are about to be appended after everything up to `mark` was recorded as written.

        Raises:
            OSError: the record could not be written (the caller goes on without it).
        """
        parts = [_MARK.pack(mark, len(files))]
        encoded = self._encoded
        for path, size in files.items():
            parts.append(_FILE.pack(size))
            parts.append(encoded.get(path) or self._encode(path))
        payload = b"".join(parts)
        self._pwrite(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)

    def _pwrite(self, data: bytes) -> None:
        if self._fd is not None:
            os.pwrite(self._fd(), data, self.offset)
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, data, self.offset)
        finally:
            os.close(fd)

    def _encode(self, path: str) -> bytes:
        """`path` as recorded: relative to the record's folder, length-prefixed (kept: a backend's files recur)."""
        if len(self._encoded) >= 4096:
            self._encoded.clear()
        try:
            rel = os.path.relpath(path, self.path.parent)
        except ValueError:  # another drive (Windows): as given
            rel = os.path.abspath(path)
        raw = os.fsencode(rel)
        self._encoded[path] = out = _LENGTH.pack(len(raw)) + raw
        return out

    def read(self) -> tuple[int, dict[str, int]] | None:
        """(mark, file path -> size) of the record, or None: no record, or one torn or unreadable."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                head = f.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    return None
                size, crc = _HEAD.unpack(head)
                if not _MARK.size <= size <= _MAX_BYTES:
                    return None  # cleared, or not a record
                payload = f.read(size)
        except OSError:
            return None
        if len(payload) != size or zlib.crc32(payload) != crc:
            return None
        try:
            mark, count = _MARK.unpack_from(payload)
            pos = _MARK.size
            folder = os.path.abspath(self.path.parent)
            files = {}
            for _ in range(count):
                (file_size,) = _FILE.unpack_from(payload, pos)
                (length,) = _LENGTH.unpack_from(payload, pos + _FILE.size)
                start = pos + _FILE.size + _LENGTH.size
                raw = payload[start:start + length]
                if len(raw) != length:
                    return None
                files[os.path.normpath(os.path.join(folder, os.fsdecode(raw)))] = file_size
                pos = start + length
        except struct.error:
            return None
        return mark, files

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
        with contextlib.suppress(OSError):
            if self._fd is not None:
                self._pwrite(_NONE)
            elif self.offset == 0:
                self.path.unlink()
            else:
                self._pwrite(_NONE)
