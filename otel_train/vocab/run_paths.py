"""Where a run's files go: one folder per run name under the otel-train directory, shared by every local
backend (and the spool), named injectively (`run_folder`)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

__all__ = ["folder_name", "run_folder"]

_UNSAFE_IN_FOLDER = re.compile(r"[/\\\x00-\x1f\x7f]")
_MAX_FOLDER_BYTES = 200


def run_folder(directory: str | os.PathLike[str], run_name: str) -> Path:
    """The run's folder under the otel-train directory, shared by every local backend.

    A run name that is a plain file name is the folder's name as is. Any other name (a path
    separator, a control character, a leading dot or space, longer than 200 bytes, empty) is made
    one readable path component and suffixed with ``~`` and a short hash of the real name, so two
    different names never share a folder (``team/a``, ``team_a``, ``.team_a`` and ``" team_a "``
    are four folders).

    Example:
        >>> run_folder("runs", "exp-1").as_posix()
        'runs/exp-1'
        >>> run_folder("runs", "../a/b").as_posix()
        'runs/_a_b~8e7e11e418'
    """
    return Path(directory) / folder_name(run_name)


def folder_name(run_name: str) -> str:
    """The one path component `run_folder` uses for `run_name` (injective: see `run_folder`)."""
    if (run_name and run_name == run_name.strip() and not run_name.startswith(".")
            and len(run_name.encode("utf-8", "surrogatepass")) <= _MAX_FOLDER_BYTES
            and not _UNSAFE_IN_FOLDER.search(run_name)):
        return run_name
    cleaned = _UNSAFE_IN_FOLDER.sub("_", run_name).strip().lstrip(".").strip()
    cleaned = cleaned.encode("utf-8", "surrogatepass")[:_MAX_FOLDER_BYTES - 16].decode("utf-8", "ignore")
    digest = hashlib.sha256(run_name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{cleaned or 'run'}~{digest}"
