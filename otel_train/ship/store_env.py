"""Where each backend's store is, as the run saw it at `init()`: recorded in the spool's description and used
by `otel-train replay`, so a replay from another shell writes to the run's stores, not to its own.

The backends' clients read their stores from their own variables (MLflow's tracking URI, Trackio's folder,
W&B's folder and mode, ClearML's cache). The exporter process records those variables (set or not: an unset
one is unset again in replay) next to the working directory, which relative paths are resolved against.
No credential is ever recorded. Replay applies them only while it delivers (`applied`), then restores the
shell's values.

Only the variables of the backends the run uses are applied (`of_backends`): a variable of a backend the run
does not use is left as the shell has it. `outside` names recorded locations not under a given folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["LOCATION_VARIABLES", "STORE_VARIABLES", "applied", "of_backends", "outside", "record"]

#: Variables that name where a backend writes (a folder, or MLflow's tracking URI).
LOCATION_VARIABLES = ("MLFLOW_TRACKING_URI", "TRACKIO_DIR", "WANDB_DIR", "CLEARML_CACHE_DIR")
#: Every variable recorded: the locations, and what decides the run inside them (never a credential).
STORE_VARIABLES = LOCATION_VARIABLES + (
    "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY",
    "WANDB_RUN_GROUP", "CLEARML_PROJECT", "CLEARML_TASK",
)


def record(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The store variables as set now (None: unset).

    Example:
        >>> record({"TRACKIO_DIR": "/data/trackio", "WANDB_API_KEY": "secret"})["TRACKIO_DIR"]
        '/data/trackio'
        >>> "WANDB_API_KEY" in record({"WANDB_API_KEY": "secret"})
        False
    """
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name in STORE_VARIABLES}


def of_backends(recorded: Mapping[str, str | None], backends: Sequence[str]) -> dict[str, str | None]:
    """The recorded variables of `backends` (a variable belongs to the backend its prefix names).

    Example:
        >>> of_backends({"TRACKIO_DIR": "/t", "WANDB_MODE": "offline"}, ["jsonl", "wandb"])
        {'WANDB_MODE': 'offline'}
    """
    prefixes = tuple(f"{name.upper()}_" for name in backends)
    return {k: v for k, v in recorded.items() if k in STORE_VARIABLES and k.startswith(prefixes)}


def _path_of(name: str, value: str, cwd: Path) -> Path | None:
    """The local path a location variable names (resolved against `cwd`), or None: not a local path."""
    if name == "MLFLOW_TRACKING_URI":
        parsed = urlparse(value)
        if parsed.scheme == "sqlite":
            value = value.split(":///", 1)[1] if ":///" in value else ""  # sqlite:///rel.db, sqlite:////abs.db
        elif parsed.scheme == "file":
            value = parsed.path
        elif parsed.scheme:
            return None  # a server
    return Path(os.path.normpath(cwd / os.path.expanduser(value))) if value else None


def outside(recorded: Mapping[str, str | None], cwd: Path, root: Path) -> list[str]:
    """``NAME=value`` of each recorded location not under `root` (a server's URI is never under it).

    Example:
        >>> outside({"TRACKIO_DIR": "runs/trackio", "MLFLOW_TRACKING_URI": "http://mlflow:5000"},
        ...         Path("/work"), Path("/work/runs"))
        ['MLFLOW_TRACKING_URI=http://mlflow:5000']
    """
    root = Path(os.path.normpath(root))
    out = []
    for name in LOCATION_VARIABLES:
        value = recorded.get(name)
        if not value:
            continue
        path = _path_of(name, value, cwd)
        if path is None or not (path == root or root in path.parents):
            out.append(f"{name}={value}")
    return out


@contextlib.contextmanager
def applied(recorded: Mapping[str, str | None], cwd: Path) -> Iterator[None]:
    """The variables of `recorded` (`of_backends`) as recorded (relative folders resolved against `cwd`) while the block runs, then
    the process's own values again. Only `otel-train replay` uses it: the library never changes the
    environment of a training process."""
    saved = {name: os.environ.get(name) for name in recorded}
    try:
        for name in recorded:
            value = recorded.get(name)
            if value and name in LOCATION_VARIABLES:
                path = _path_of(name, value, cwd)
                if path is not None:  # a local store: the same one from any working directory
                    value = f"sqlite:///{path}" if value.startswith("sqlite:") else str(path)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
