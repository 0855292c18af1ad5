"""Shared fixtures: every test starts with no otel-train session and a clean OTEL_TRAIN_* env."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# importlib mode puts no test folder on sys.path: the shared scaffolding (`backendkit`) is imported from here.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))


def pytest_configure(config: pytest.Config) -> None:
    # A suite started in the background by a script (`pytest &`, job control off) has SIGINT ignored, and every
    # process the tests start inherits that: a training script sent Ctrl-C (SIGINT) would never stop. Tests
    # expect what a terminal gives: a handled SIGINT here, the default in the processes started from here.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # the controller (or a serial run): before any worker imports
        _write_first_import_caches()


def _write_first_import_caches() -> None:
    """Import once, here, what writes a cache file at its first import in a fresh environment: parallel workers
    importing it at the same moment would read it half-written. yapf (imported by MMEngine) pickles its grammars
    (`EOFError: Ran out of input` while collecting `tests/integrations/test_mmengine.py`)."""
    import contextlib

    with contextlib.suppress(Exception):  # not installed, or broken: the tests that need it say so
        import yapf  # noqa: F401


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers per core (most tests wait on real processes they started); `PYTEST_XDIST_AUTO_NUM_WORKERS`
    still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return 2 * len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2 * (os.cpu_count() or 1)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("OTEL_TRAIN_", "OTEL_SDK_", "OTEL_EXPORTER_", "OTEL_SERVICE", "OTEL_RESOURCE")) or key in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
        ):
            monkeypatch.delenv(key, raising=False)


@pytest.fixture(autouse=True)
def _no_session() -> Iterator[None]:
    """Shut down whatever session a test left and forget it."""
    import importlib

    import otel_train

    step_mod = importlib.import_module("otel_train.capture.step")  # the module, not the `step` class it exports

    otel_train._session = None
    step_mod._reset_for_tests()
    yield
    if otel_train._session is not None:
        otel_train._session.shutdown()
    otel_train._session = None
    step_mod._reset_for_tests()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"


@pytest.fixture
def backend_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B, ClearML and MLflow offline/local under a temporary folder (the exporter process inherits it)."""
    from backendkit import isolated_backends_env

    root = tmp_path / "backend-home"
    isolated_backends_env(monkeypatch, root)
    return root


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, created once per session (MLflow migrates a new store: seconds each time)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments(max_results=1)  # creates and migrates it
    return path


@pytest.fixture
def seed_mlflow_store(mlflow_store_template: Path) -> Callable[[Path], None]:
    """Puts a copy of that store where the MLflow backend opens its default store, ``<OTEL_TRAIN_DIR>/mlruns``.

    For tests about what reaches MLflow (keys, placements, preemption marks), not about creating its store: the
    backend then opens an existing store, as every rank but the first and every resumed job does. Creating it
    from nothing stays tested by tests/exporters/test_mlflow.py and tests/faults/test_mlflow_ranks.py (ranks
    creating it at once).
    """
    def seed(otel_train_dir: Path) -> None:
        store = otel_train_dir / "mlruns"
        store.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(mlflow_store_template, store / "mlflow.db")

    return seed
