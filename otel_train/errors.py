"""Exceptions raised by otel-train.

Only `init` (and direct construction of exporters) raise; after `init` nothing raises into the
training loop, except `StepOrderError` when the user asked for it (``OTEL_TRAIN_STEP_ORDER=raise``).
"""

from __future__ import annotations

__all__ = ["ConfigError", "OtelTrainError", "StepOrderError"]


class OtelTrainError(Exception):
    """Base class for every error otel-train raises."""


class ConfigError(OtelTrainError, ValueError):
    """A setting (environment variable or `init` keyword) has a value that is not allowed.

    The message is one line: the setting, the bad value and what is allowed.
    """


class StepOrderError(OtelTrainError, ValueError):
    """Under ``OTEL_TRAIN_STEP_ORDER=raise``: `step()` or `log(..., step=)` went below the latest step.

    Raised on the training thread where the mistake is made (API misuse, like a wrong argument),
    never from the export path.
    """
