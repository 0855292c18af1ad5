"""Every thread's Python stack, from another thread: `sys._current_frames()` named by `threading.enumerate()`.

A frame is written ``file:line in function``, innermost first. Files under a ``site-packages`` or
``dist-packages`` folder are shown from there (``torch/distributed/distributed_c10d.py``), files under the working
directory relative to it (``train.py``); the rest as the code object names them. The *user frame* is the innermost frame of the user's own code (not in an installed package,
the standard library or otel-train): where the user's loop called into what is stuck.

A thread whose innermost frame has not moved (same frame, same instruction) between two looks is "in native
code": a C call (a collective, a sleep, a kernel launch) that Python cannot see into; the last Python frame is
where it was called from.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from types import FrameType
from typing import NamedTuple

__all__ = ["ThreadStack", "frame_text", "thread_stacks"]

_MAX_FRAMES = 64  # per thread, innermost first
_PACKAGE_DIRS = ("site-packages", "dist-packages")
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"])
_OURS = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ThreadStack(NamedTuple):
    """One thread's stack: innermost frame first."""

    name: str
    thread_id: int  # the native id (as in spans' `thread.id`), else the Python ident
    main: bool
    frames: list[str]
    user_frame: str | None  # the innermost frame of the user's code
    position: tuple[int, int] | None  # (id of the innermost frame, its last instruction): "has it moved?"


def short_path(filename: str) -> str:
    """`filename` from its installed package's root, else relative to the working directory when under it, else
    as given.

    Example:
        >>> short_path("/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py")
        'torch/distributed/distributed_c10d.py'
    """
    for marker in _PACKAGE_DIRS:
        cut = filename.rfind(os.sep + marker + os.sep)
        if cut >= 0:
            return filename[cut + len(marker) + 2:]
    cwd = os.getcwd() + os.sep
    return filename.removeprefix(cwd)


def frame_text(frame: FrameType) -> str:
    """``file:line in function`` for `frame`."""
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _is_user_code(filename: str) -> bool:
    path = os.path.normcase(os.path.abspath(filename)) if not filename.startswith("<") else filename
    if path.startswith("<"):
        return False
    if any(os.sep + marker + os.sep in path for marker in _PACKAGE_DIRS):
        return False
    return not path.startswith((_STDLIB + os.sep, _OURS + os.sep))


def thread_stacks(skip_ident: int | None = None) -> list[ThreadStack]:
    """Every live thread's stack (the main thread first), except the thread of ident `skip_ident`."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    out = []
    for ident, top in frames.items():
        if ident == skip_ident:
            continue
        thread = threads.get(ident)
        texts: list[str] = []
        user: str | None = None
        frame: FrameType | None = top
        while frame is not None and len(texts) < _MAX_FRAMES:
            texts.append(frame_text(frame))
            if user is None and _is_user_code(frame.f_code.co_filename):
                user = texts[-1]
            frame = frame.f_back
        out.append(ThreadStack(
            name=thread.name if thread is not None else f"thread {ident}",
            thread_id=(thread.native_id if thread is not None and thread.native_id else ident),
            main=ident == main_ident, frames=texts, user_frame=user, position=(id(top), top.f_lasti)))
    out.sort(key=lambda s: (not s.main, s.name))
    return out
