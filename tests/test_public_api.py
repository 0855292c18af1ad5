"""The public surface is deliberate: this test fails whenever a public name is added or removed."""

from __future__ import annotations

import doctest
import importlib
import inspect
from pathlib import Path

import otel_train


def test_public_names() -> None:
    assert sorted(otel_train.__all__) == sorted([
        "STEP_ATTRIBUTE", "ConfigError", "OtelTrainError", "Route", "RunIdentity", "Session", "StepOrderError",
        "current_session", "current_step", "flush", "get_meter", "get_tracer",
        "init", "log", "resume", "set_placement", "shutdown", "span", "step", "step_ended", "steps", "traced",
    ])
    for name in otel_train.__all__:
        assert hasattr(otel_train, name)


def test_init_returns_the_typed_session(tmp_path: Path) -> None:
    """`init()` is annotated with the public `Session` protocol (mypy checks both runtime classes against it in
    `init`), and what it returns has every member of it, running or disabled."""
    annotation = inspect.signature(otel_train.init).return_annotation  # a string: postponed annotations
    assert getattr(otel_train, annotation) is otel_train.Session
    members = [name for name in vars(otel_train.Session) if not name.startswith("_")]
    assert sorted(members) == ["add_config", "closed", "enabled", "export_progress", "flush", "log", "resume",
                               "run", "shutdown", "span"]
    disabled = otel_train.init(disabled=True)
    assert isinstance(disabled, otel_train.Session)
    assert (disabled.enabled, disabled.run, disabled.export_progress()) == (False, None, None)
    otel_train.shutdown()
    running = otel_train.init(exporters=[], dir=tmp_path, run_name="typed", rank=0, world_size=1)
    assert isinstance(running, otel_train.Session) and isinstance(running.run, otel_train.RunIdentity)
    assert running.run is not None
    assert (running.enabled, running.closed, running.run.run_name, running.run.rank) == (True, False, "typed", 0)
    assert otel_train.init() is running  # a second call returns the running session
    running.shutdown()
    assert running.closed


def test_the_session_example_runs() -> None:
    result = doctest.testmod(importlib.import_module("otel_train._internal.session_type"))
    assert (result.attempted, result.failed) == (4, 0)


def test_log_signature() -> None:
    """`log`'s parameters are a contract: `attributes=` was added deliberately, positional-or-keyword
    because a keyword-only parameter keeps CPython from specialising the call (~40 ns on every `log`)."""
    params = inspect.signature(otel_train.log).parameters
    assert [(p.name, p.kind.name, p.default) for p in params.values()] == [
        ("mapping", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("step", "POSITIONAL_OR_KEYWORD", None),
        ("attributes", "POSITIONAL_OR_KEYWORD", None),
    ]
    assert list(inspect.signature(otel_train.Session.log).parameters) == ["self", "mapping", "step", "attributes"]
