"""Giving memory back once runs have closed.

A closed run's objects form reference cycles (backends, their feeds and callbacks), and the sink's cycle collector
runs rarely (`otel_train._internal.gc_tuning`: its young generation is large and it is never run while no requests
allocate), so with every run closed the sink's memory stayed at its peak. Then glibc's allocator keeps freed pages
of its heaps and per-thread arenas. `trim` collects the cycles and asks glibc to return its free pages
(`malloc_trim(0)`; elsewhere only the collection); the sink's housekeeping calls it once a wave of run closes has
ended, and every `TRIM_EVERY_S` while one goes on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable

__all__ = ["TRIM_EVERY_S", "trim"]

#: Seconds between two trims while runs keep closing (a full collection walks every object the sink holds beyond
#: those frozen at start: milliseconds per thousand open runs).
TRIM_EVERY_S = 10.0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim() -> None:
    """Free what closed runs left in reference cycles, then return the allocator's free pages (glibc)."""
    gc.collect()
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
