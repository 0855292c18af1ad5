"""Every entry point we declare loads; the OTel-group ones are real exporters buildable with no arguments."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import SpanExporter

from otel_train.config.registry import known_exporters, load_class


def test_otel_train_group_matches_the_registry() -> None:
    eps = {ep.name: ep for ep in entry_points(group="otel_train.exporters")}
    assert {"tensorboard", "chrome_trace", "jsonl", "console"} <= set(eps)
    known = known_exporters()
    for name, ep in eps.items():
        assert known[name].target == ep.value
        assert ep.load() is load_class(known[name])


@pytest.mark.parametrize(
    ("group", "base"), [("opentelemetry_metrics_exporter", MetricExporter), ("opentelemetry_traces_exporter", SpanExporter)]
)
def test_otel_groups_build_with_no_arguments(
    group: str, base: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path))
    ours = [ep for ep in entry_points(group=group) if ep.value.startswith("otel_train.")]
    assert ours
    for ep in ours:
        exporter = ep.load()()
        assert isinstance(exporter, base)
        exporter.shutdown()


def test_every_builtin_target_imports() -> None:
    for spec in known_exporters().values():
        if spec.target.startswith("otel_train."):
            cls = load_class(spec)
            assert isinstance(cls, type), spec.name


def test_opentelemetry_instrument_can_name_our_exporters(tmp_path: Path) -> None:
    """`OTEL_METRICS_EXPORTER=tensorboard opentelemetry-instrument python train.py` with no otel-train code."""
    import os
    import shutil
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from otel_train.trace_merge import load_trace

    script = tmp_path / "train.py"
    script.write_text(
        "from opentelemetry import metrics, trace\n"
        "gauge = metrics.get_meter('user').create_gauge('train/loss')\n"
        "tracer = trace.get_tracer('user')\n"
        "for i in range(5):\n"
        "    with tracer.start_as_current_span('step', attributes={'train.step': i}):\n"
        "        gauge.set(1.0 / (i + 1), {'train.step': i})\n"
    )
    env = {
        **os.environ,
        "OTEL_TRAIN_DIR": str(tmp_path / "runs"),
        "OTEL_RESOURCE_ATTRIBUTES": "train.run.id=oi-1,train.run.name=instrumented",
        "OTEL_METRICS_EXPORTER": "tensorboard",
        "OTEL_TRACES_EXPORTER": "chrome_trace",
        "OTEL_LOGS_EXPORTER": "none",
    }
    instrument = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    assert instrument, "opentelemetry-distro is part of the [test] extra"
    subprocess.run([instrument, sys.executable, str(script)], env=env, cwd=tmp_path, check=True, timeout=120)
    acc = EventAccumulator(str(tmp_path / "runs" / "instrumented"))
    acc.Reload()
    assert {e.step: round(e.value, 6) for e in acc.Scalars("train/loss")} == {
        i: round(1.0 / (i + 1), 6) for i in range(5)}
    spans = [e for e in load_trace(tmp_path / "runs" / "instrumented" / "trace" / "rank0.trace.json") if e["ph"] == "X"]
    assert sorted(e["args"]["train.step"] for e in spans) == [0, 1, 2, 3, 4]
