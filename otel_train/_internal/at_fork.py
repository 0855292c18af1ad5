"""Fork hooks that do not keep their objects alive.

`os.register_at_fork` has no way to unregister, so a bound method given to it holds its object (a session, a
reader, an exporter-process handle, a run claim) for the life of the process: every `init()`/`shutdown()` cycle
would leave one of each behind. Here each object is held weakly: one process-wide hook calls the methods of the
objects still alive, in the order they were registered, and forgets each object when it is collected.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["after_fork_in_child", "registered"]

_logger = logging.getLogger("otel_train")
_lock = threading.Lock()
#: key -> (the object, weakly; its method's function). Not `WeakMethod`, whose callback fails at interpreter exit.
_hooks: dict[int, tuple[weakref.ref[Any], Callable[[Any], None]]] = {}
_ids = itertools.count()
_installed = False


def after_fork_in_child(method: Callable[[], None]) -> None:
    """Call the bound `method` in every forked child while its object is alive (nothing once it is collected).

    Raises:
        TypeError: `method` is not a bound method (a plain function would never be collected: register it
            with `os.register_at_fork` directly).
    """
    global _installed
    if not hasattr(os, "register_at_fork"):  # not on Windows: nothing forks there
        return
    obj, function = getattr(method, "__self__", None), getattr(method, "__func__", None)
    if obj is None or function is None:
        raise TypeError(f"after_fork_in_child takes a bound method, got {method!r}")
    key = next(_ids)
    ref = weakref.ref(obj, lambda _: _forget(key))
    with _lock:
        _hooks[key] = (ref, function)
        if not _installed:
            _installed = True
            os.register_at_fork(after_in_child=_run_hooks)


def registered() -> int:
    """How many objects' hooks are held now (for tests: it must not grow with `init()`/`shutdown()` cycles)."""
    with _lock:
        return len(_hooks)


def _forget(key: int) -> None:
    hooks = _hooks  # None while the interpreter tears this module down
    if hooks is not None:
        hooks.pop(key, None)  # atomic; no lock: this runs from the garbage collector


def _run_hooks() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    for ref, function in list(_hooks.values()):
        obj = ref()
        if obj is None:
            continue
        try:
            function(obj)
        except Exception:  # one object's hook must not keep the others' from running
            _logger.warning("otel-train: a hook after fork failed", exc_info=True)
