"""A kill while MLflow creates its local store must not poison later runs in that directory.

MLflow builds a new SQLite store by running its migrations one by one: a process killed (SIGKILL, the whole
job: trainer and exporter process) in the middle used to leave ``mlruns/mlflow.db`` half-built, and every later
run there failed MLflow the same way. Real processes, real kills at varied moments of the creation, then a
normal run whose points are read back with `MlflowClient`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from faultkit import wait_unlocked

SCRIPT = textwrap.dedent("""
    import sys
    import otel_train as ot
    ot.init(exporters=["mlflow"], dir=sys.argv[1], run_id=sys.argv[2], run_name=sys.argv[2])
    for s in ot.steps(range(3)):
        ot.log({"loss": s + 1.0})
    ot.shutdown()
    print("DONE", flush=True)
""")


def _env(tmp_path: Path) -> dict[str, str]:
    # HOME (and no XDG_CACHE_HOME) of its own: no store template, every store is built by MLflow's migrations
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OTEL_", "XDG_CACHE_HOME"))}
    env.update(HOME=str(tmp_path / "home"))
    return env


def _store_files(store: Path) -> list[Path]:
    return [p for p in store.glob("mlflow.db*") if not p.name.endswith(".lock")] if store.is_dir() else []


def _migration_order() -> dict[str, int]:
    """MLflow's schema revisions -> their place in its migration chain (1 = the first)."""
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    chain = [r.revision for r in ScriptDirectory.from_config(_get_alembic_config("sqlite://")).walk_revisions()]
    return {rev: len(chain) - i for i, rev in enumerate(chain)}


def _kill_job(pid: int) -> None:
    """SIGKILL `pid` and every process below it (the exporter process leaves the trainer's session)."""
    family, parents = [pid], {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    for member in family:
        family += parents.get(member, [])
    for member in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _building(store: Path, order: dict[str, int]) -> tuple[bool, bool, int]:
    """What any store file being built shows: tables without a schema version yet, a table half-copied by a
    migration (``_alembic_tmp_*``), and how far the migrations got (0: none yet)."""
    unversioned, copying, furthest = False, False, 0
    for path in _store_files(store):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=0.05)) as db:
                tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                rev = db.execute("SELECT version_num FROM alembic_version").fetchone() \
                    if "alembic_version" in tables else None
        except sqlite3.Error:
            continue
        unversioned |= bool(tables) and rev is None
        copying |= any(name.startswith("_alembic_tmp_") for name in tables)
        furthest = max(furthest, order.get(rev[0], 0) if rev else 0)
    return unversioned, copying, furthest


@pytest.mark.timeout(900)
def test_kills_during_store_creation_then_a_normal_run_works(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
    import readback

    script, out = tmp_path / "train.py", tmp_path / "runs"
    script.write_text(SCRIPT)
    store = out / "mlruns"
    order = _migration_order()
    last = max(order.values())
    # Kill the whole job (trainer and exporter process) at three moments of MLflow's creation of the store:
    # tables made but no schema version yet, a migration halfway through copying a table, one migration before
    # the end. Each leaves what such a kill leaves; with the store built aside, nothing of it is the store.
    moments = (lambda u, c, f: u, lambda u, c, f: c, lambda u, c, f: f >= last - 1)
    for n, moment in enumerate(moments):
        proc = subprocess.Popen([sys.executable, str(script), str(out), f"killed{n}"], env=_env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and not moment(*_building(store, order)):
            time.sleep(0.002)
        _kill_job(proc.pid)
        proc.communicate(timeout=60)
    done = subprocess.run([sys.executable, str(script), str(out), "after"], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.splitlines() == ["DONE"], done.stderr[-3000:]
    # On a loaded machine the trainer may hand off at its shutdown timeout while its exporter process still builds
    # the store: read it once that process is done, not while it renames the store into place.
    wait_unlocked(out / "after" / "spool" / "rank0", 120)
    uri = f"sqlite:///{(store / 'mlflow.db').resolve()}"
    assert sorted((p.name, p.step, p.value) for p in readback.mlflow(uri, "after") if p.name == "loss") == [
        ("loss", 0, 1.0), ("loss", 1, 2.0), ("loss", 2, 3.0)], done.stderr[-3000:]
    assert not [p for p in _store_files(store) if ".creating-" in p.name]  # no temp file left behind
    for run in ("after", "killed0"):  # a killed job's run: replay delivers what its spool kept, then verify
        if run != "after":
            replayed = _cli("replay", str(out / run), env=_env(tmp_path))
            assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
        verified = _cli("verify", str(out / run), env=_env(tmp_path))
        assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
    assert sorted((p.name, p.step, p.value) for p in readback.mlflow(uri, "killed0") if p.name == "loss") == [
        ("loss", 0, 1.0), ("loss", 1, 2.0), ("loss", 2, 3.0)]


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_train.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_a_half_built_store_without_runs_is_set_aside_and_rebuilt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
    import readback
    from backendkit import isolated_mlflow_env

    from otel_train.backend import Window
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.exporters.mlflow import MLflowExporter
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    isolated_mlflow_env(monkeypatch, tmp_path)
    store = tmp_path / "mlruns"
    store.mkdir()
    with sqlite3.connect(store / "mlflow.db") as db:  # what a kill left: a few of MLflow's tables, no runs
        db.execute("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name VARCHAR(256))")
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        db.execute("INSERT INTO alembic_version VALUES ('451aebb31d03')")
    run = RunInfo("half", "half")
    with MLflowExporter(ExporterOptions(directory=tmp_path)) as exporter:
        assert exporter.export_window(Window([MetricRow(run, s, "loss", "loss", s + 1.0, "gauge", 0)
                                              for s in range(3)]))
    said = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert len(said) == 1 and "mlflow.db" in said[0], [r.getMessage() for r in caplog.records]
    (aside,) = store.glob("mlflow.db.broken-*")  # kept, not deleted
    assert aside.stat().st_size > 0
    uri = f"sqlite:///{(store / 'mlflow.db').resolve()}"
    assert sorted((p.name, p.step, p.value) for p in readback.mlflow(uri, "half") if p.name == "loss") == [
        ("loss", 0, 1.0), ("loss", 1, 2.0), ("loss", 2, 3.0)]
