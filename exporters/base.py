"""The backend contract, re-exported from the core (`otel_train.backend`) for backends written against
``otel_train.exporters.base``; new code imports `otel_train.backend`."""

from otel_train.backend import DELTA_TEMPORALITY, LOSS_CAUSES, RowExporter, Window

__all__ = ["DELTA_TEMPORALITY", "LOSS_CAUSES", "RowExporter", "Window"]
