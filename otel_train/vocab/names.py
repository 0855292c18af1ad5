"""Metric keys as each backend allows them: any non-empty string is a key (`otel_train.log`).

Most backends take a key as it is (TensorBoard tags, W&B keys, JSONL, ClearML title/series, Trackio).
Two have a rule, so a key is mapped for them, deterministically: the mapping is a pure function of the key
(no counters, no state, no rank), so every rank, every restart and the sink name a series alike.

- OTLP (the `otlp` backend): the OTel instrument-name rule, ``[A-Za-z][A-Za-z0-9_./-]{0,254}``. A key that
  breaks it is sent under `otlp_name` (accents dropped, other characters ``_``, a hash of the key appended so
  two keys never share a wire name) with the original key in the metric's description
  (``otel_train.key=<key>``); `otel-train sink` reads it back (`key_from_description`), so the sink's
  backends show the key as logged.
- MLflow: see `otel_train.exporters.mlflow.mlflow_name` (its key character set).

This module imports nothing of ours.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from functools import lru_cache

__all__ = ["KEY_DESCRIPTION_PREFIX", "key_from_description", "key_hash", "otlp_name"]

#: Metric description carrying the original key of a mapped OTLP name.
KEY_DESCRIPTION_PREFIX = "otel_train.key="
_OTLP_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_./\-]{0,254}\Z")
_OTLP_BAD = re.compile(r"[^A-Za-z0-9_./\-]")
_OTLP_MAX = 255


def key_hash(key: str, digits: int = 6) -> str:
    """A short stable hash of `key` (hex), the same in every process and Python version.

    Example:
        >>> key_hash("val/mAP@0.5")
        '909d36'
    """
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:digits]


@lru_cache(maxsize=4096)
def otlp_name(key: str) -> str:
    """The OTel instrument name `key` is sent under: itself when valid, else a mapped name plus its hash.

    Example:
        >>> otlp_name("train/loss"), otlp_name("val/mAP@0.5"), otlp_name("Loss (val)")
        ('train/loss', 'val/mAP_0.5_909d36', 'Loss__val__47840d')
        >>> otlp_name("épochs/loss")
        'epochs/loss_10f689'
    """
    if _OTLP_NAME.match(key):
        return key
    ascii_key = unicodedata.normalize("NFKD", key).encode("ascii", "ignore").decode("ascii")
    name = _OTLP_BAD.sub("_", ascii_key)
    if not name[:1].isalpha():
        name = "k" + name
    suffix = "_" + key_hash(key)
    return name[:_OTLP_MAX - len(suffix)] + suffix


def key_from_description(name: str, description: str) -> str:
    """The key a metric stands for: the original key in its description (see `otlp_name`), else `name`."""
    if description.startswith(KEY_DESCRIPTION_PREFIX):
        key = description[len(KEY_DESCRIPTION_PREFIX):]
        if key:
            return key
    return name
