"""A new local MLflow store starts from a template of an empty one (MLflow's migrations run once per machine and
MLflow version, not once per directory), and is then what MLflow itself would have built."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from backendkit import isolated_mlflow_env


def _lines(sql: str | None) -> list[str]:
    """A CREATE statement's lines in sorted order: MLflow's own builds list a table's constraints in varying order
    (migrations that copy a table iterate over a set)."""
    return sorted(line.strip().rstrip(",") for line in (sql or "").splitlines())


def _dump(path: Path) -> dict[str, Any]:
    """The store's schema and every row, but the default experiment's creation times."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        schema = sorted((kind, name, _lines(sql)) for kind, name, sql in
                        db.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
        rows = {name: sorted(map(repr, db.execute(f'SELECT * FROM "{name}"')))
                for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                if name != "experiments"}
        rows["experiments"] = sorted(db.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage "
                                                "FROM experiments"))
    return {"schema": schema, "rows": rows}


def _experiments(path: Path) -> list[Any]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return list(db.execute("SELECT experiment_id, name FROM experiments"))


def test_a_store_from_the_template_is_the_store_mlflow_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import mlflow.store.db.utils as db_utils

    from otel_train.exporters._mlflow_store import open_store

    isolated_mlflow_env(monkeypatch, tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    migrated: list[str] = []
    upgrade = db_utils._upgrade_db

    def counted(engine: Any) -> Any:
        migrated.append(str(engine.url))
        return upgrade(engine)

    monkeypatch.setattr(db_utils, "_upgrade_db", counted)
    template = tmp_path / "cache" / "otel-train" / f"mlflow-{mlflow_version()}.db"

    first = tmp_path / "a" / "mlflow.db"
    first.parent.mkdir()
    open_store(f"sqlite:///{first}")
    assert len(migrated) == 1  # no template yet: MLflow built it whole
    assert template.is_file() and _experiments(template) == []  # kept without the default experiment

    second = tmp_path / "b" / "mlflow.db"
    second.parent.mkdir()
    client = open_store(f"sqlite:///{second}")
    assert len(migrated) == 1  # from the template: no migration ran
    assert _dump(second) == _dump(first)  # schema, schema version, MLflow's own rows, the default experiment
    run = client.create_run(client.create_experiment("e"))
    client.log_metric(run.info.run_id, "loss", 0.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 0.5)]

    # A template MLflow refuses (another schema revision) is not used: the store is built whole, and the
    # template replaced by a good one.
    with contextlib.closing(sqlite3.connect(template)) as db, db:
        db.execute("UPDATE alembic_version SET version_num = 'not-a-revision'")
    third = tmp_path / "c" / "mlflow.db"
    third.parent.mkdir()
    with caplog.at_level(logging.INFO, logger="otel_train"):
        open_store(f"sqlite:///{third}")
    assert len(migrated) == 2
    assert _dump(third) == _dump(first)
    assert "store template" in caplog.text and "was not used" in caplog.text
    with contextlib.closing(sqlite3.connect(template)) as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == \
            [(_dump(first)["rows"]["alembic_version"][0][2:-3],)]
    assert not list(third.parent.glob("*.creating-*")) and not list(template.parent.glob("*.tmp"))


def test_without_a_writable_cache_the_store_is_built_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters._mlflow_store import open_store

    isolated_mlflow_env(monkeypatch, tmp_path)
    (tmp_path / "cache").write_text("a file, not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "a" / "mlflow.db"
    store.parent.mkdir()
    client = open_store(f"sqlite:///{store}")
    assert [e.name for e in client.search_experiments()] == ["Default"]


def mlflow_version() -> str:
    import mlflow

    return str(mlflow.__version__)
