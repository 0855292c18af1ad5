"""The examples in docstrings run."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "otel_train",
    "otel_train.capture.step",
    "otel_train.vocab.rows",
    "otel_train.vocab.run_paths",
    "otel_train.ship.framing",
    "otel_train.ship.append_intent",
    "otel_train.ship.file_append",
    "otel_train.collect.reader",
    "otel_train.testing",
    "otel_train.sink.runs.temporality",
    "otel_train.sink.decode.resources",
    "otel_train.sink.runs.feed",
    "otel_train.sink.runs.released",
    "otel_train.sink.runs.reorder",
    "otel_train.sink.receive.event_loop",
    "otel_train.sink.fd_limits",
    "otel_train.exporters.tensorboard",
    "otel_train.exporters.chrome_trace",
    "otel_train.exporters.wandb",
    "otel_train.exporters.mlflow",
    "otel_train.exporters._runs",
    "otel_train.verify.wanted",
    "otel_train.collect.phases",
    "otel_train.session.summary",
    "otel_train.collect.system_metrics",
    "otel_train.trace_merge",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
