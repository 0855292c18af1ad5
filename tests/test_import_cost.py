"""`import otel_train` stays light: no backend, framework or TensorBoard import until used."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "wandb", "clearml", "mlflow", "trackio", "tensorboard", "tensorflow", "grpc", "numpy",
         "lightning", "pytorch_lightning", "transformers", "accelerate"]


def test_import_does_not_load_heavy_modules() -> None:
    code = (
        "import sys, json, otel_train, otel_train.exporters, otel_train.config.registry, otel_train.vocab.rows, otel_train.vocab.run_identity,"
        " otel_train.integrations, otel_train.integrations._session;"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
