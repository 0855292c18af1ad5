"""Exceptions raised by otel-train.

Only `init` (and direct construction of exporters) raise; after `init` nothing raises into the
training loop.
"""

from __future__ import annotations

__all__ = ["ConfigError", "OtelTrainError"]


class OtelTrainError(Exception):
    """Base class for every error otel-train raises."""


class ConfigError(OtelTrainError, ValueError):
    """A setting (environment variable or `init` keyword) has a value that is not allowed.

    The message is one line: the setting, the bad value and what is allowed.
    """
