"""Every thread's Python stack, from another thread: `sys._current_frames()` named by `threading.enumerate()`.

A frame is written ``file:line in function``, innermost first. File names are written the same on every
machine (`short_path`: ``torch/distributed/distributed_c10d.py``, ``threading.py``, ``train.py``), so ranks on
different hosts group together. The *user frame* is the innermost frame of the user's own code (not in an installed package,
the standard library or otel-train): where the user's loop called into what is stuck.

A thread whose innermost frame has not moved (same frame, same instruction) between two looks is "in native
code": a C call (a collective, a sleep, a kernel launch) that Python cannot see into; the last Python frame is
where it was called from.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import threading
from types import FrameType
from typing import NamedTuple

__all__ = ["ThreadStack", "frame_text", "parse_faulthandler", "thread_stacks"]

_MAX_FRAMES = 64  # per thread, innermost first
_PACKAGE_DIRS = ("site-packages", "dist-packages")
_STDLIB = os.path.normcase(sysconfig.get_paths()["stdlib"])
_OURS = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS_PARENT = os.path.dirname(_OURS)


class ThreadStack(NamedTuple):
    """One thread's stack: innermost frame first."""

    name: str
    thread_id: int  # the native id (as in spans' `thread.id`), else the Python ident
    main: bool
    frames: list[str]
    user_frame: str | None  # the innermost frame of the user's code
    position: tuple[int, int] | None  # (id of the innermost frame, its last instruction): "has it moved?"


def short_path(filename: str) -> str:
    """`filename` as the same on every machine: from its installed package's root (``torch/...``), from the
    standard library's (``threading.py``), from otel-train's parent (``otel_train/...``), relative to the working
    directory when under it (``train.py``), else as given.

    Example:
        >>> short_path("/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py")
        'torch/distributed/distributed_c10d.py'
    """
    for marker in _PACKAGE_DIRS:
        cut = filename.rfind(os.sep + marker + os.sep)
        if cut >= 0:
            return filename[cut + len(marker) + 2:]
    for root in (_STDLIB + os.sep, _OURS_PARENT + os.sep, os.getcwd() + os.sep):
        if filename.startswith(root):
            return filename[len(root):]
    return filename


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


_DUMP_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_DUMP_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> dict[int, list[str]]:
    r"""The stacks of a `faulthandler` dump (written without the GIL), by thread ident, innermost frame first.

    Example:
        >>> dump = 'Timeout (0:00:01)!\nThread 0x00007f5c13203b80 (most recent call first):\n'
        >>> dump += '  File "/w/train.py", line 5 in deep\n  File "/w/train.py", line 8 in <module>\n'
        >>> parse_faulthandler(dump)[0x7f5c13203b80][0].endswith("train.py:5 in deep")
        True
    """
    out: dict[int, list[str]] = {}
    frames: list[str] | None = None
    for line in text.splitlines():
        thread = _DUMP_THREAD.match(line)
        if thread:
            frames = out[int(thread.group(1), 16)] = []
            continue
        frame = _DUMP_FRAME.match(line)
        if frame and frames is not None:
            frames.append(f"{short_path(frame.group(1))}:{frame.group(2)} in {frame.group(3)}")
    return out
