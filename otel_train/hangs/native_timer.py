"""faulthandler's one `dump_traceback_later` timer, as the hang watchdog uses it, made safe across `fork`.

The timer is a C thread that writes every thread's stack without the GIL. CPython has no fork handling for it:
a child forked while it is armed inherits its lock held by a thread that does not exist there, and hangs at
its first re-arm, cancel or normal interpreter exit. So the timer is cancelled before every fork (under a lock
that the watchdog's arming also takes) and re-armed in the parent after it, for the time it had left; the child
starts without one.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from typing import IO, Any

__all__ = ["NATIVE_TIMER", "NativeTimer"]


class NativeTimer:
    """The process's faulthandler timer as armed by otel-train (one per process: `NATIVE_TIMER`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline: float | None = None  # time.monotonic() at which it fires, while armed
        self._file: IO[Any] | None = None
        self._fork_hooks = False

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    def arm(self, due_s: float, file: IO[Any]) -> None:
        """Dump every thread's stack to `file` in `due_s` seconds unless re-armed or cancelled before."""
        if not self._fork_hooks and hasattr(os, "register_at_fork"):
            self._fork_hooks = True
            os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_in_parent,
                                after_in_child=self._after_fork_in_child)
        with self._lock:
            faulthandler.dump_traceback_later(due_s, repeat=False, file=file)
            self._deadline, self._file = time.monotonic() + due_s, file

    def cancel(self) -> None:
        with self._lock:
            if self._deadline is not None:
                faulthandler.cancel_dump_traceback_later()
                self._deadline = self._file = None

    def _before_fork(self) -> None:
        self._lock.acquire()  # released after the fork: nobody arms in between
        if self._deadline is not None:
            faulthandler.cancel_dump_traceback_later()

    def _after_fork_in_parent(self) -> None:
        try:
            if self._deadline is not None and self._file is not None:
                left_s = max(self._deadline - time.monotonic(), 0.01)
                faulthandler.dump_traceback_later(left_s, repeat=False, file=self._file)
        finally:
            self._lock.release()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._deadline = self._file = None


NATIVE_TIMER = NativeTimer()
