"""A failing or hanging run backend never costs the other backends a step (through `ot.init`)."""

from __future__ import annotations

import importlib.machinery
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

import otel_train as ot
from otel_train.exporters.jsonl import jsonl_path, read_jsonl

STEPS = 6


class _Run:
    def __init__(self, behaviour: str, gate: threading.Event) -> None:
        self.behaviour = behaviour
        self.gate = gate
        self.starting_step = 0
        self.settings = types.SimpleNamespace(wandb_dir=os.devnull)
        self.calls = 0

    def log(self, data: dict[str, Any], step: int) -> None:
        self.calls += 1
        if self.behaviour == "raise":
            raise ConnectionError("injected: W&B is down")
        self.gate.wait(60)  # "hang": until the test lets go

    def finish(self) -> None:
        pass


def fake_wandb(monkeypatch: pytest.MonkeyPatch, behaviour: str) -> tuple[list[_Run], threading.Event]:
    """A `wandb` module whose runs raise or hang in `log` (a real module object: the registry checks its spec)."""
    runs: list[_Run] = []
    gate = threading.Event()
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(settings: Any = None, **kwargs: Any) -> _Run:
        runs.append(_Run(behaviour, gate))
        return runs[-1]

    module.init = init  # type: ignore[attr-defined]
    module.Settings = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    # The fake lives in this process's modules: these tests cover the in-process path; the exporter
    # process gets the same checks in tests/test_export_process.py (a fake on disk it can import).
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", "off")
    for key in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    return runs, gate


def jsonl_points(directory: Path, run_name: str) -> list[tuple[int, float]]:
    return [(r["step"], r["value"]) for r in read_jsonl(jsonl_path(directory, run_name, 0))
            if r["type"] == "metric" and r["tag"] == "train/loss"]


def test_raising_backend_does_not_stop_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    runs, _ = fake_wandb(monkeypatch, "raise")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    session = ot.init(exporters=["wandb", "mlflow", "jsonl"], dir=tmp_path / "runs", run_id="iso-1",
                      run_name="iso", project="iso-project", export_every=1)
    for step in range(STEPS):
        with ot.step(step):
            ot.log({"train/loss": 1.0 / (step + 1)})
    ot.flush(timeout_s=30)
    wandb_exporter, mlflow_exporter, _ = session.exporters
    mlflow_id = mlflow_exporter.run_ids["iso-1"]
    ot.shutdown()

    expected = [(s, 1.0 / (s + 1)) for s in range(STEPS)]
    assert runs and runs[0].calls >= 1 and wandb_exporter.failures >= 1  # it really failed
    assert jsonl_points(tmp_path / "runs", "iso") == expected
    client = MlflowClient(mlflow_exporter.tracking_uri)
    assert sorted((m.step, m.value) for m in client.get_metric_history(mlflow_id, "train/loss")) == expected


def test_hanging_backend_does_not_block_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs, gate = fake_wandb(monkeypatch, "hang")
    try:
        ot.init(exporters=["wandb", "jsonl"], dir=tmp_path / "runs", run_id="iso-2", run_name="iso2",
                export_every=1, shutdown_timeout_s=2)
        for step in range(STEPS):
            with ot.step(step):
                ot.log({"train/loss": float(step)})
        ot.flush(timeout_s=2)  # returns when jsonl is done; W&B is still stuck in its first `log`
        assert jsonl_points(tmp_path / "runs", "iso2") == [(s, float(s)) for s in range(STEPS)]
        assert runs and runs[0].calls == 1
    finally:
        gate.set()  # let the stuck thread go, so the test leaves nothing behind
        ot.shutdown()
