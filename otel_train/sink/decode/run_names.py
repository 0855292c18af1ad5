"""Distinct runs stay distinct: a run name that one run id holds is given to no other run id.

Every local backend names a run's folder after the run's *name* (`otel_train.vocab.run_paths.run_folder`),
and names are not unique: two jobs both called ``exp1`` would write one folder. The sink gives each
name to the first run id that arrives with it (recorded on disk, so a restarted sink keeps the
choice) and every later run id with that name the name ``<name>~<hash of its run id>``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from otel_train.vocab.run_paths import run_folder

__all__ = ["CLAIM_FILE", "RunNames"]

_logger = logging.getLogger(__name__)

#: The file in a run's folder that says which run id the folder belongs to.
CLAIM_FILE = ".otel-train-run-id"


class RunNames:
    """Run name by (run id, name the sender gave); see the module docstring.

    Args:
        directory: Where the sink's local backends write; ``None`` keeps the claims in memory only.
        max_entries: Names remembered in memory (the claim files stay the truth past it).
    """

    def __init__(self, directory: Path | None, max_entries: int = 100_000) -> None:
        self._directory = directory
        self._max = max_entries
        self._owner: dict[str, str] = {}  # name -> run id holding it
        self._given: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def name_for(self, run_id: str, run_name: str) -> str:
        """The name `run_id` is written under, given the name its sender chose. Thread-safe: gRPC requests
        (several handler threads) and the compat API (the event loop) name runs at once."""
        key = (run_id, run_name)
        name = self._given.get(key)
        if name is not None:
            return name
        with self._lock:  # two runs sharing a name must not both claim it
            return self._name_new(key, run_id, run_name)

    def _name_new(self, key: tuple[str, str], run_id: str, run_name: str) -> str:
        name = self._given.get(key)
        if name is not None:
            return name
        if len(self._given) >= self._max:
            self._given.clear()
            self._owner.clear()
        name = run_name
        if self._holder(run_name, run_id) != run_id:
            name = f"{run_name}~{hashlib.sha256(run_id.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"
            if self._holder(name, run_id) != run_id:  # only if a sender chose that very name for another run
                name = f"{run_name}~{hashlib.sha256(run_id.encode('utf-8', 'surrogatepass')).hexdigest()}"
            _logger.warning("run %r is named %r, like another run already in the sink; written as %r", run_id,
                            run_name, name)
        self._given[key] = name
        return name

    def _holder(self, name: str, run_id: str) -> str:
        """The run id holding `name`, claiming it for `run_id` when nobody does."""
        owner = self._owner.get(name)
        if owner is None:
            owner = self._owner[name] = self._claim(name, run_id)
        return owner

    def _claim(self, name: str, run_id: str) -> str:
        if self._directory is None:
            return run_id
        folder = run_folder(self._directory, name)
        path = folder / CLAIM_FILE
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                return path.read_text(encoding="utf-8", errors="surrogateescape") or run_id
            except OSError:
                return run_id
        except OSError as err:  # an unwritable directory fails in the backends too, with their own message
            _logger.debug("cannot record the run of %s: %s", folder, err)
            return run_id
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(run_id)
        return run_id
