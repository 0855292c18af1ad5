"""The public surface is deliberate: this test fails whenever a public name is added or removed."""

from __future__ import annotations

import otel_train


def test_public_names() -> None:
    assert sorted(otel_train.__all__) == sorted([
        "STEP_ATTRIBUTE", "ConfigError", "OtelTrainError", "Route", "StepOrderError", "current_session", "current_step", "flush", "get_meter", "get_tracer",
        "init", "log", "resume", "set_placement", "shutdown", "span", "step", "step_ended", "steps", "traced",
    ])
    for name in otel_train.__all__:
        assert hasattr(otel_train, name)
