"""Appending to a file backend's own files (TensorBoard, JSONL, the Chrome trace) so that storage faults heal.

A full disk: the kernel first takes part of a write (a short write), then refuses the rest with ENOSPC. A
buffered Python file would keep the refused bytes in its buffer and write them again later (a line twice, a
garbled one), and its ``truncate`` flushes that buffer first, fails again and cuts nothing, leaving a torn
record mid-file where TensorBoard's reader stops. So `AppendFile` writes with ``os.write`` on a descriptor
(no buffer of ours) and, when an append fails, cuts the file back to its last good size with ``os.ftruncate``
(which frees space, so it works on a full disk) before raising: the file holds only whole appends, and the
window that failed is written cleanly when its retry finds space again (`is_disk_full` tells delivery it is an
outage to wait out, not a row to skip).

A run folder deleted while the run writes (``rm -rf``): an open descriptor would keep writing to a file no one
can see. `AppendFile.unlinked` says so (one ``fstat``/``stat`` per append, about a microsecond); the backend
then warns once (`warn_recreated`), starts a new file where the deleted one was (the folder is created again)
and writes from there on. What was deleted is gone.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

__all__ = ["AppendFile", "is_disk_full", "warn_recreated"]

_logger = logging.getLogger(__name__)

#: What a write gets when the storage is full (ENOSPC) or the user's quota is spent (EDQUOT).
_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
_FLAGS = os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)  # Windows: no \r\n
_write = os.write  # every append's write: tests put a full disk here (a short write, then ENOSPC)
_warned: set[str] = set()
_warned_lock = threading.Lock()


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (a failed write) says the storage is full: an outage that ends when space returns."""
    return isinstance(err, OSError) and err.errno in _FULL


def warn_recreated(folder: Path, backend: str) -> None:
    """Say once per folder (and process) that `folder` was deleted during the run and is written again."""
    key = os.path.abspath(folder)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    _logger.warning("the run folder %s was deleted while the run wrote to it (`%s` found its file gone): the "
                    "file backends create it again and write new files there from now on; what was deleted is "
                    "gone", key, backend)


class AppendFile:
    """A file appended to in whole pieces: each `append` lands whole or not at all.

    Args:
        path: The file (created with its folder if missing; appended to if it exists).
        keep_open: Hold the descriptor (one per file), or open it for each append (a sink with hundreds of
            runs stays within its file limit).

    Example:
        >>> import tempfile
        >>> f = AppendFile(Path(tempfile.mkdtemp()) / "run" / "rows.log")
        >>> f.append(b"one\\n"); f.append(b"two\\n")
        >>> f.size, f.path.read_bytes(), f.unlinked()
        (8, b'one\\ntwo\\n', False)
        >>> f.close()
    """

    def __init__(self, path: Path, *, keep_open: bool = True) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, _FLAGS | os.O_CREAT, 0o644)
        st = os.fstat(fd)
        #: Bytes on disk, every append a whole one: where a failed append is cut back to.
        self.size = st.st_size
        self._inode = (st.st_dev, st.st_ino)
        self._fd: int | None = fd
        if not keep_open:
            os.close(fd)
            self._fd = None
        self._keep_open = keep_open

    def _open(self) -> int:
        # No O_CREAT: a file deleted since is an error here, never a new file that lacks its header.
        return os.open(self.path, _FLAGS)

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data` whole, or cut the file back to `size` and raise.

        Raises:
            OSError: the write failed (`is_disk_full` for a full disk); the file is as before the call.
        """
        if not data:
            return
        fd = self._fd if self._fd is not None else self._open()
        try:
            with memoryview(data) as view:
                done = 0
                try:
                    while done < len(view):  # a short write is followed by one that raises (ENOSPC)
                        done += _write(fd, view[done:])
                except BaseException:
                    if done:
                        try:
                            os.ftruncate(fd, self.size)  # shrinking needs no space
                        except OSError as cut:
                            _logger.error("could not cut %s back to %d bytes after a failed append: %s", self.path,
                                          self.size, cut)
                            self.size += done  # what is there now: the next append at least does not hide it
                    raise
            self.size += done
        finally:
            if not self._keep_open:
                os.close(fd)

    def unlinked(self) -> bool:
        """Whether the file was deleted (or replaced by another one) since it was opened."""
        try:
            st = os.fstat(self._fd) if self._fd is not None else os.stat(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return st.st_nlink == 0 or (st.st_dev, st.st_ino) != self._inode

    def sync(self) -> None:
        """fsync what was appended (a machine crash keeps it)."""
        if self._fd is not None:
            os.fsync(self._fd)
            return
        fd = self._open()
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fileno(self) -> int | None:
        """The held descriptor, or None (`keep_open=False`, or closed)."""
        return self._fd

    def close(self) -> None:
        """Release the descriptor; safe to call twice."""
        fd, self._fd = self._fd, None
        self._keep_open = False  # an append after this opens the file for itself
        if fd is not None:
            os.close(fd)
