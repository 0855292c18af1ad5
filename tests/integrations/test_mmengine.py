"""MMEngine: a real Runner on the CPU with a tiny model; read back from TensorBoard and the Chrome trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from backendkit import approx_points

pytest.importorskip("mmengine", reason="MMEngine is not installed: pip install 'otel-train[mmengine]'")
torch = pytest.importorskip("torch", reason="MMEngine needs torch: pip install torch==2.13.0")

from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.runner import Runner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import otel_train.integrations.mmengine  # noqa: F401  (registers the hook and the vis backend)
from otel_train.exporters.chrome_trace import trace_path
from otel_train.trace_merge import load_trace


class TinyModel(BaseModel):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, inputs: Any, labels: Any, mode: str = "tensor") -> Any:
        out = self.linear(inputs)
        if mode == "loss":
            return {"loss": torch.nn.functional.mse_loss(out.squeeze(-1), labels)}
        return [(out.squeeze(-1), labels)]


class MSEMetric(BaseMetric):  # type: ignore[misc]
    def process(self, data_batch: Any, data_samples: Any) -> None:
        for out, labels in data_samples:
            self.results.append(float(((out - labels) ** 2).mean()))

    def compute_metrics(self, results: list[float]) -> dict[str, float]:
        return {"mse": sum(results) / len(results)}


def _dataset() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, generator=g)
    return [{"inputs": x[i], "labels": x[i].sum()} for i in range(16)]


def _runner(tmp_path: Path, **extra: Any) -> Runner:
    loader = {"dataset": _dataset(), "sampler": {"type": "DefaultSampler", "shuffle": False},
              "batch_size": 4, "collate_fn": {"type": "default_collate"}}
    return Runner(
        model=TinyModel(), work_dir=str(tmp_path / "work"), experiment_name="mm",
        train_dataloader=loader, val_dataloader=loader, val_evaluator=[MSEMetric()],
        train_cfg={"by_epoch": False, "max_iters": 6, "val_interval": 3}, val_cfg={},
        optim_wrapper={"optimizer": {"type": "SGD", "lr": 0.01}},
        default_hooks={"logger": {"type": "LoggerHook", "interval": 2, "log_metric_by_epoch": False}, "checkpoint": None},
        **extra,
    )


def _scalars(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_hook_writes_message_hub_values_at_mmengine_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    runner = _runner(tmp_path, custom_hooks=[{"type": "OtelTrainHook"}])
    hook = next(h for h in runner.hooks if type(h).__name__ == "OtelTrainHook")
    names = [type(h).__name__ for h in runner.hooks]
    assert names.index("OtelTrainHook") > names.index("LoggerHook")  # runs after MMEngine's logger
    runner.train()
    assert not hook._session.started  # shut down at after_run
    history, _ = runner.message_hub.get_scalar("train/loss").data  # MMEngine's own loss per iteration
    losses = [(i + 1, float(v)) for i, v in enumerate(history)]

    name = runner.experiment_name  # MMEngine's run name ("mm_<timestamp>") names the run
    acc = _scalars(tmp_path / "runs" / name)
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == approx_points(losses)
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in acc.Scalars("val/mse")] == [3, 6]
    events = load_trace(trace_path(tmp_path / "runs", name, 0))
    iters = [e for e in events if e.get("ph") == "X" and e["name"] == "mmengine/train_iter"]
    assert sorted(e["args"]["train.step"] for e in iters) == [1, 2, 3, 4, 5, 6]
    assert len([e for e in events if e.get("ph") == "X" and e["name"] == "mmengine/val"]) == 2


def test_vis_backend_gets_what_the_logger_hook_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    visualizer = {"type": "Visualizer", "name": "vis-otel", "vis_backends": [{"type": "OtelTrainVisBackend"}]}
    runner = _runner(tmp_path, visualizer=visualizer)
    runner.train()
    runner.visualizer.close()
    acc = _scalars(tmp_path / "runs" / runner.experiment_name)  # the run is named as the hook names it
    assert [e.step for e in acc.Scalars("loss")] == [2, 4, 6]  # LoggerHook interval=2, its own step
    assert [e.step for e in acc.Scalars("mse")] == [3, 6]


def test_import_registers_without_importing_at_otel_train_import() -> None:
    # A fresh interpreter for the "not imported" half only; this process imported the integration at the top of
    # this file, which is what registered the hook and the vis backend (no second MMEngine import needed).
    code = "import sys, otel_train, otel_train.integrations; assert 'mmengine' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    from mmengine.registry import HOOKS, VISBACKENDS

    assert HOOKS.get("OtelTrainHook") and VISBACKENDS.get("OtelTrainVisBackend")


def test_hook_feeds_mmengines_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank MMEngine reports (a stand-in for a distributed job) is the run's rank; rank 1 does not export."""
    import mmengine.dist

    import otel_train as ot
    from otel_train.integrations.mmengine import OtelTrainHook

    monkeypatch.setattr(mmengine.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(mmengine.dist, "get_world_size", lambda: 2)
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    hook = OtelTrainHook()
    hook.before_run(type("Runner", (), {"cfg": None, "experiment_name": "ranked"})())
    assert (ot._session.run.rank, ot._session.run.world_size, ot._session.run.run_name) == (1, 2, "ranked")
    assert not ot._session.export_metrics
    hook.after_run(None)
    assert ot._session.closed


def test_missing_extra_names_the_pip_line() -> None:
    code = ("import sys; sys.modules['mmengine'] = None\n"
            "try:\n    import otel_train.integrations.mmengine\nexcept ModuleNotFoundError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'otel-train[mmengine]'" in out


def _wait_for_points(path: Path, tag: str, count: int, timeout_s: float = 60.0) -> list[tuple[int, float]]:
    """The (step, value) points of `tag` in a JSONL file, once `count` have arrived (or what arrived by the timeout)."""
    import time

    from otel_train.exporters.jsonl import read_jsonl

    deadline = time.monotonic() + timeout_s
    points: list[tuple[int, float]] = []
    while time.monotonic() < deadline:
        if path.exists():
            points = [(r["step"], r["value"]) for r in read_jsonl(path) if r["type"] == "metric" and r["tag"] == tag]
            if len(points) >= count:
                break
        time.sleep(0.05)
    return points


def test_vis_backend_steps_are_collected_before_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an hour between timed collections, what MMEngine's LoggerHook wrote is on disk while the session is
    still open: each logged step is a step boundary."""
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "jsonl")
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_INTERVAL_S", "3600")
    visualizer = {"type": "Visualizer", "name": "vis-live", "vis_backends": [{"type": "OtelTrainVisBackend"}]}
    runner = _runner(tmp_path, visualizer=visualizer)
    runner.train()
    path = tmp_path / "runs" / runner.experiment_name / "rank0.jsonl"
    points = _wait_for_points(path, "loss", 3)
    runner.visualizer.close()
    assert [s for s, _ in points] == [2, 4, 6]  # LoggerHook interval=2: its steps, before any shutdown
