"""DeepSpeed: the monitor interface (always), and a real DeepSpeed engine on the CPU (when installed)."""

from __future__ import annotations

import doctest
import importlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from backendkit import approx_points
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import otel_train as ot
from otel_train.integrations.deepspeed import OtelTrainMonitor


def _scalars(path: Path, tag: str) -> list[tuple[int, float]]:
    """Every point of `tag` as (step, value), in file order: a step written twice shows twice."""
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


class _RecordingMonitor:
    """Stands for DeepSpeed's own MonitorMaster in the contract test."""

    enabled = True

    def __init__(self) -> None:
        self.events: list[tuple[str, float, int]] = []
        self.tb_monitor = "theirs"

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        self.events.extend(event_list)


def test_monitor_interface_writes_at_deepspeeds_steps(run_dir: Path) -> None:
    """Without DeepSpeed: `enabled`, `write_events([(tag, value, step)])`, forwarding, init on first event."""
    engine = type("Engine", (), {})()
    engine.monitor = inner = _RecordingMonitor()
    ours = OtelTrainMonitor.attach(engine)
    assert engine.monitor is ours and ours.enabled and ours.tb_monitor == "theirs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_TRAIN_DIR", str(run_dir))
        mp.setenv("OTEL_TRAIN_RUN_NAME", "ds")
        events = [[("Train/Samples/train_loss", 1.0 / (s + 1), s * 32), ("Train/Samples/lr", 0.1, s * 32)]
                  for s in range(1, 4)]
        for batch in events:
            engine.monitor.write_events(iter(batch))  # a generator is fine too
    assert ot._session is not None and ours._session.started  # it called init itself
    ours.close()
    assert ot._session.closed
    assert _scalars(run_dir / "ds", "Train/Samples/train_loss") == approx_points([(32, 0.5), (64, 1 / 3), (96, 0.25)])
    assert _scalars(run_dir / "ds", "Train/Samples/lr") == approx_points([(32, 0.1), (64, 0.1), (96, 0.1)])
    assert inner.events == [e for batch in events for e in batch]  # DeepSpeed's own monitors still get them


def test_user_session_is_not_shut_down(run_dir: Path) -> None:
    ot.init(exporters="tensorboard", dir=run_dir, run_name="mine")
    monitor = OtelTrainMonitor()
    monitor.write_events([("loss", 2.0, 5)])
    monitor.close()
    assert not ot._session.closed
    ot.shutdown()
    assert _scalars(run_dir / "mine", "loss") == [(5, 2.0)]


def _wait_for_points(path: Path, tag: str, count: int, timeout_s: float = 60.0) -> list[tuple[int, float]]:
    """The (step, value) points of `tag` in a JSONL file once `count` arrived (or what arrived by the timeout)."""
    import time

    from otel_train.exporters.jsonl import read_jsonl

    deadline = time.monotonic() + timeout_s
    points: list[tuple[int, float]] = []
    while time.monotonic() < deadline:
        if path.exists():
            points = [(r["step"], pytest.approx(r["value"])) for r in read_jsonl(path)
                      if r["type"] == "metric" and r["tag"] == tag]
            if len(points) >= count:
                break
        time.sleep(0.05)
    return points


@pytest.fixture
def single_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_real_deepspeed_engine_on_cpu(single_process_group: None, run_dir: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'otel-train[deepspeed]'")
    import torch

    monkeypatch.setenv("OTEL_TRAIN_DIR", str(run_dir))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "ds-real")
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "tensorboard,jsonl")
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_INTERVAL_S", "3600")  # only the logged steps can trigger collection
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "wall_clock_breakdown": True, "csv_monitor": {"enabled": True, "output_path": str(run_dir / "csv"),
                                                            "job_name": "theirs"}}
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel (a minute of C++ on a fresh
    # machine) that a 1-process job never calls; the monitor path under test does not touch it.
    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    monitor = OtelTrainMonitor.attach(engine)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    live = _wait_for_points(run_dir / "ds-real" / "rank0.jsonl", "Train/Samples/lr", 3)
    monitor.close()
    assert live == [(8, 0.05), (16, 0.05), (24, 0.05)]  # on disk before close: each written step is a boundary
    lr = _scalars(run_dir / "ds-real", "Train/Samples/lr")
    assert lr == approx_points([(8, 0.05), (16, 0.05), (24, 0.05)])  # DeepSpeed's own step: global_samples
    assert [s for s, _ in _scalars(run_dir / "ds-real", "Train/Samples/elapsed_time_ms_step")] == [8, 16, 24]
    assert (run_dir / "csv" / "theirs").exists()  # its configured monitors still write


def test_deepspeed_rank_feeds_the_resource_and_ranks_gate_export(run_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's own rank (its process group, here a stand-in) wins over the launcher's variables."""
    fake_comm = type(sys)("deepspeed.comm")
    fake_comm.is_initialized = lambda: True
    fake_comm.get_rank = lambda: 1
    fake_comm.get_world_size = lambda: 2
    monkeypatch.setitem(sys.modules, "deepspeed.comm", fake_comm)
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(run_dir))
    monitor = OtelTrainMonitor()
    monitor.write_events([("Train/Samples/lr", 0.1, 8)])
    assert (ot._session.run.rank, ot._session.run.world_size) == (1, 2)
    assert not ot._session.export_metrics  # OTEL_TRAIN_RANKS=0 (default): rank 1 records spans only
    monitor.close()


def test_docstring_example() -> None:
    import otel_train.integrations.deepspeed as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
