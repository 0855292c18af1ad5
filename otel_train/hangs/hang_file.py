"""``hang/rank<N>.json`` in the run folder: what one rank's hang watchdog last saw, rewritten atomically.

The file is written at `init()` (state ``running``), again every `heartbeat_s` seconds while the rank lives, at
each hang record (state ``stuck``: the latest record and the history of records of this hang), when the step
ends after a hang (``resumed``) and at shutdown (``ended``; a rank still stuck then adds an ``ended`` record, so
the file does not look like a live hang). Each write goes to a temporary file renamed over the
old one, so a reader sees a whole file, never a torn one. A rank whose file is not ``ended`` and whose heartbeat
is old has stopped (a dead node, a rank holding the GIL in a C call, a kill -9): the roll call names it from its
last record.

One file::

    {"rank": 1, "world_size": 4, "run_id": "...", "host": "...", "pid": 123,
     "state": "stuck", "step": 50, "heartbeat_time": 1764934000.1, "heartbeat_s": 5.0,
     "latest": {<record>}, "history": [{<record>}, ...]}

A record (also the `train.hang` log record's attributes, see docs/semantic-conventions.md)::

    {"event.name": "train.hang", "state": "stuck", "time": 1764934000.1, "step": 50, "phase": "data",
     "spans": ["train", "data"], "waited_s": 12.0, "limit_s": 2.0, "usual_s": 0.01,
     "main_frame": "train.py:41 in load_batch", "user_frame": "train.py:41 in load_batch", "native": true,
     "threads": [{"name": "MainThread", "thread_id": 4242, "main": true, "frames": ["train.py:41 in load_batch", ...]}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["HANG_FOLDER", "STATES", "file_content", "hang_path", "heartbeat_every_s", "native_dump_path",
           "read_hang_files", "write_hang_file"]

HANG_FOLDER = "hang"
STATES = ("running", "stuck", "resumed", "ended")
MAX_HISTORY = 32  # records of one hang kept in the file (the first ones and the latest)


def hang_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` of the run in `run_dir` keeps its hang file."""
    return run_dir / HANG_FOLDER / f"rank{rank}.json"


def native_dump_path(path: Path) -> Path:
    """Beside ``rank<N>.json``: ``rank<N>.native.txt``, where `faulthandler` dumps every thread's stack when the
    watchdog itself could not run (a C call holding the GIL)."""
    return path.with_name(path.stem + ".native.txt")


def heartbeat_every_s(floor_s: float) -> float:
    """How often a live rank rewrites its file: ``OTEL_TRAIN_HANG_AFTER_S`` (`floor_s`) within 1..30 s."""
    return min(30.0, max(1.0, floor_s))


def file_content(identity: Mapping[str, Any], state: str, step: int | None, heartbeat_s: float,
                 records: list[dict[str, Any]], now: float) -> dict[str, Any]:
    """One file as above: `identity` (rank, run, host, pid, ...), the rank's `state` and `step`, and `records`,
    the current (else the last) hang's, oldest first; `now` the heartbeat's wall time.

    Example:
        >>> file_content({"rank": 0}, "running", None, 5.0, [], 1.5)["latest"] is None
        True
    """
    return {**identity, "state": state, "step": step, "heartbeat_time": now, "heartbeat_s": heartbeat_s,
            "latest": records[-1] if records else None, "history": records}


def write_hang_file(path: Path, content: Mapping[str, Any]) -> None:
    """Write `content` as `path`, whole: a temporary file in the same folder, then a rename over it.

    Raises:
        OSError: the folder cannot be created or written (the watchdog logs it once).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=1, default=str)
    os.replace(tmp, path)


def read_hang_files(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's hang file in `run_dir`, by rank; a file that is not a rank's JSON object is skipped. A native
    dump written after the file's last heartbeat is added as ``native_dump``: ``{"time": ..., "main_frames": [...]}``
    (the main thread's stack, innermost first)."""
    out: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / HANG_FOLDER).glob("rank*.json")):
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
            rank = int(path.stem[len("rank"):])
        except (OSError, ValueError):
            continue
        if isinstance(content, dict):
            dump = _native_dump(native_dump_path(path), content)
            if dump is not None:
                content["native_dump"] = dump
            out[rank] = content
    return out


def _native_dump(path: Path, content: Mapping[str, Any]) -> dict[str, Any] | None:
    from otel_train.hangs.stacks import parse_faulthandler

    try:
        written = path.stat().st_mtime
        if not path.stat().st_size or written <= float(content.get("heartbeat_time") or 0.0):
            return None
        stacks = parse_faulthandler(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    main = stacks.get(int(content.get("main_ident") or 0))
    return {"time": written, "main_frames": main or []}
