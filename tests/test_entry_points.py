"""Every entry point we declare loads; the OTel-group ones are real exporters buildable with no arguments."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import SpanExporter

from otel_train.registry import known_exporters, load_class


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
