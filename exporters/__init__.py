"""Backends of otel-train: one module per backend, each consuming rows from `otel_train.vocab.rows`.

Import a backend by its module (``otel_train.exporters.tensorboard``); this package imports none
of them, so naming one never loads another's client library.
"""

from otel_train.exporters.base import RowExporter

__all__ = ["RowExporter"]
