"""Step-bucketed system metrics: bucketing (fake clock of steps) and a real sampler into TensorBoard."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from backendkit import by_step, tb_scalars

import otel_train as ot
from otel_train.collect.system_metrics import SystemSampler


def _gpus_visible() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0


def test_samples_are_bucketed_per_step_as_mean_and_max() -> None:
    got: list[tuple[int, dict[str, float], int]] = []
    step = [0]
    sampler = SystemSampler(lambda s, values, t: got.append((s, dict(values), t)), 1.0, lambda: step[0])
    readings = iter([10.0, 30.0, 50.0])
    sampler.read = lambda: {"system/cpu_percent": next(readings)}  # type: ignore[method-assign]
    sampler.sample_now()
    sampler.sample_now()
    assert got == []  # step 0 is still running
    step[0] = 1
    sampler.sample_now()  # the first sample of step 1 closes step 0
    assert [(s, v) for s, v, _ in got] == [(0, {"system/cpu_percent/mean": 20.0, "system/cpu_percent/max": 30.0})]
    sampler.stop()
    assert [(s, v) for s, v, _ in got][1] == (1, {"system/cpu_percent/mean": 50.0, "system/cpu_percent/max": 50.0})


def test_no_sample_before_the_first_step() -> None:
    got: list[object] = []
    sampler = SystemSampler(lambda s, v, t: got.append(s), 1.0, lambda: None)
    sampler.sample_now()
    sampler.stop()
    assert got == []


def test_cpu_and_rss_for_every_step_and_no_gpu_series_without_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRAIN_SYSTEM_METRICS", "1")
    monkeypatch.setenv("OTEL_TRAIN_SYSTEM_INTERVAL_S", "0.002")
    caplog.set_level(logging.WARNING)
    session = ot.init(exporters=["tensorboard"], dir=tmp_path, run_name="sys")
    sampler = session.sampler
    assert sampler is not None
    steps = 8
    for _ in ot.steps(range(steps)):
        before = sampler.samples
        deadline = time.monotonic() + 10
        # Each step holds >= 1 sample. Two samples, not one: a sample files itself under the step it read before
        # reading psutil, so the first one counted here may have read the previous step (a loaded machine slows
        # that read); the sampler thread takes the second after the first, so inside this step.
        while sampler.samples <= before + 1 and time.monotonic() < deadline:
            sum(range(20_000))
            time.sleep(0.001)
        ot.log({"train/loss": 0.5})
    ot.shutdown()
    series = tb_scalars(tmp_path / "sys")
    for tag in ("system/cpu_percent/mean", "system/cpu_percent/max", "system/rss_mb/mean", "system/rss_mb/max",
                "system/host_memory_percent/mean"):
        assert [s for s, _ in series[tag]] == list(range(steps)), tag
    assert all(v > 1 for _, v in series["system/rss_mb/mean"])  # a Python process holds > 1 MB
    rss_max, rss_mean = by_step(series["system/rss_mb/max"]), by_step(series["system/rss_mb/mean"])
    for s in range(steps):
        assert rss_max[s] >= rss_mean[s]
    gpu_tags = [t for t in series if t.startswith(("gpu", "cuda"))]
    if _gpus_visible():  # a GPU host (with nvidia-ml-py): per-GPU series for every step instead
        assert [s for s, _ in series["gpu0/memory_used_mb/mean"]] == list(range(steps))
    else:
        assert gpu_tags == []
    # No error at all; on a host without NVIDIA devices not even the "install nvidia-ml-py" hint.
    ours = [r for r in caplog.records if r.name.startswith("otel_train")]
    limit = logging.WARNING if os.path.exists("/dev/nvidiactl") else 0
    assert [r.getMessage() for r in ours if r.levelno > limit] == []
