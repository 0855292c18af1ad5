"""Opening MLflow's local SQLite store so that a kill while it is created cannot poison later runs.

MLflow creates a new SQLite store by making its first tables, then running some 70 migrations, each committed
on its own, some copying a table through ``_alembic_tmp_<table>``. A process killed in the middle (SIGTERM or
SIGKILL during a job's first seconds) leaves a store that every later MLflow client fails to open or migrate
("table _alembic_tmp_runs already exists", "duplicate column name"), so every later run in that directory
lost its MLflow data. Here:

- a store that does not exist yet is built aside, in ``mlflow.db.creating-<pid>``, and renamed into place once
  MLflow opened it whole (a rename is atomic): a kill leaves at most a temp file, removed by the next build;
- a store that exists and that MLflow cannot open, and that holds no run (so nothing of the user's is in it:
  what a kill during creation leaves), is set aside as ``mlflow.db.broken-<time>`` (kept, never deleted),
  said once, and built again; one that holds runs is left alone and MLflow's error stands.

Processes opening the store at once take turns (an exclusive lock on ``mlflow.db.lock``), as MLflow has no lock
of its own for its creation and migrations.

Creating a store runs all of MLflow's ~70 migrations, about a second of CPU in every new directory. The first store this machine
builds with an MLflow version is kept, without its default experiment (whose artifact location depends on the
working directory), as a template in ``<XDG_CACHE_HOME or ~/.cache>/otel-train/mlflow-<version>.db``; a later new
store starts as a copy of it, which MLflow then opens like any store of its schema (it checks the schema revision
and adds the default experiment). A template that is missing, unwritable or that MLflow refuses is not used: the
store is built as before (and a refused template is replaced).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

__all__ = ["open_store", "sqlite_path", "store_lock"]

_logger = logging.getLogger(__name__)


def sqlite_path(uri: str) -> Path | None:
    """The file of a local SQLite store URI (``sqlite:///<path>``), or None (another store, in memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[bool]:
    """An exclusive lock on ``<db>.lock`` beside a local SQLite store; yields whether it is held (not for other
    stores, a folder that does not exist, or where there is no `fcntl`)."""
    path = sqlite_path(uri)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here
        path = None
    if path is None or not path.parent.is_dir():
        yield False
        return
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def open_store(uri: str) -> MlflowClient:
    """A client of the store at `uri` that MLflow has opened (created or migrated). A local SQLite store is built
    aside and renamed into place, or set aside and built again when a kill left it half-built (module docstring).

    Raises:
        Exception: MLflow's own error, for a store this cannot repair (one that holds runs, a server).
    """
    with store_lock(uri) as locked:
        path = sqlite_path(uri) if locked else None
        if path is None:
            return _open(uri)
        if not path.exists():
            _build_aside(path)
        try:
            return _open(uri)
        except Exception as err:
            if "locked" in str(err) or _holds_runs(path):  # busy, or the user's runs: never moved
                raise
            aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            _logger.warning("mlflow: the store %s could not be opened (%s: %s) and holds no run (a process killed "
                            "while creating it leaves it so): set aside as %s, and a new store is created",
                            path, type(err).__name__, str(err).splitlines()[0] if str(err) else "", aside.name)
        _build_aside(path)
        return _open(uri)


def _open(uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)  # MLflow creates or migrates the store here ...
        client.search_experiments(max_results=1)  # ... or here, in versions that open it lazily
    except Exception:
        _forget_engine(uri)  # the file may be set aside: no pooled connection may keep pointing at it
        raise
    return client


def _build_aside(path: Path) -> None:
    """Have MLflow create the store in a temp file beside `path` (from the template when there is one), then
    rename it to `path`."""
    for stale in path.parent.glob(f"{path.name}.creating-*"):  # left by a kill during an earlier build
        with contextlib.suppress(OSError):
            stale.unlink()
    temp = path.with_name(f"{path.name}.creating-{os.getpid()}")
    uri = f"sqlite:///{temp}"
    template = _template_path()
    if template is not None and _copy(template, temp):
        try:
            _open(uri)
        except Exception as err:  # another schema (an MLflow built from source), a damaged file: build it whole
            _logger.info("mlflow: the store template %s was not used (%s); the store is built in full", template,
                         str(err).splitlines()[0] if str(err) else type(err).__name__)
            _forget_engine(uri)
            temp.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                template.unlink()
        else:
            _forget_engine(uri)
            os.replace(temp, path)
            return
    try:
        _open(uri)
    finally:
        _forget_engine(uri)  # closes its connections: nothing holds the file when it is renamed
    if template is not None:
        _keep_template(temp, template)
    os.replace(temp, path)


def _template_path() -> Path | None:
    """Where this MLflow version's empty-store template is (or goes); None where there is no cache folder."""
    try:
        import mlflow

        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    except (ImportError, RuntimeError):  # no home folder
        return None
    version = re.sub(r"[^A-Za-z0-9._+-]", "_", str(getattr(mlflow, "__version__", "unknown")))
    return Path(cache) / "otel-train" / f"mlflow-{version}.db"


def _copy(src: Path, dst: Path) -> bool:
    """Copy `src` to `dst`; whether it was copied (False when `src` is missing or either side fails)."""
    try:
        shutil.copyfile(src, dst)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            dst.unlink()
        return False


def _keep_template(store: Path, template: Path) -> None:
    """Keep a copy of the new, empty `store` as `template`, without its default experiment; best effort."""
    temp = template.with_name(f"{template.name}.{os.getpid()}.tmp")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        for stale in template.parent.glob(f"{template.name}.*.tmp"):  # a process killed while keeping one
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > 3600:
                    stale.unlink()
        shutil.copyfile(store, temp)
        with contextlib.closing(sqlite3.connect(temp, timeout=5.0)) as db, db:
            db.execute("DELETE FROM experiment_tags")
            db.execute("DELETE FROM experiments")
        os.replace(temp, template)  # whole or not at all, for the processes copying it meanwhile
    except (OSError, sqlite3.Error) as err:
        _logger.debug("mlflow: no store template kept in %s: %s", template.parent, err)
        with contextlib.suppress(OSError):
            temp.unlink()


def _forget_engine(uri: str) -> None:
    """Close and forget what MLflow cached for `uri`: its engine (`SqlAlchemyStore._engine_map`) and its store
    object (the tracking store registry's cache). Private to MLflow (3.x): where either is not there, it stays
    cached, idle, holding a descriptor, and a store set aside can then not be reopened in this process."""
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
        from mlflow.tracking._tracking_service import utils
    except ImportError:
        return
    engines = getattr(SqlAlchemyStore, "_engine_map", None)
    engine = engines.pop(uri, None) if isinstance(engines, dict) else None
    if engine is not None:
        engine.dispose()
    registry = getattr(utils, "_tracking_store_registry", None)
    clear = getattr(getattr(registry, "_get_store_with_resolved_uri", None), "cache_clear", None)
    if callable(clear):
        clear()


def _holds_runs(path: Path) -> bool:
    """Whether the SQLite file at `path` may hold an MLflow run: False only when it has no ``runs`` table, an
    empty one, or is no SQLite file at all; any other error answers True (it is then left alone)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)) as db:
            (n,) = db.execute("SELECT count(*) FROM runs").fetchone()
    except sqlite3.DatabaseError as err:
        return not ("no such table" in str(err) or "not a database" in str(err))
    return bool(n)
