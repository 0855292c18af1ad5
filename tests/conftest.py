"""Shared fixtures: every test starts with no otel-train session and a clean OTEL_TRAIN_* env."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# importlib mode puts no test folder on sys.path: the shared scaffolding (`backendkit`) is imported from here.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))


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
