"""What each backend holds, read back with that backend's own reader, as LISTS of points.

The readers are the package's own (`otel_train.verify.readers`, which `otel-train verify` uses), so tests and
verify read every backend one way. Names are as the backend shows them; mapping a logged key to that name is
the caller's business (see tests/differential/test_differential.py).
"""

from __future__ import annotations

from otel_train.verify.readers import (
    chrome_counters,
    chrome_spans,
    clearml,
    clearml_folders,
    finite_only,
    jsonl,
    jsonl_spans,
    mlflow,
    tensorboard,
    trackio,
    wandb,
)

__all__ = ["chrome_counters", "chrome_spans", "clearml", "clearml_folders", "finite_only", "jsonl", "jsonl_spans",
           "mlflow", "tensorboard", "trackio", "wandb"]
