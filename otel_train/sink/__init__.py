"""`otel-train sink`: receives OTLP from a collector and writes every run to the usual backends.

Run it with ``python -m otel_train.sink`` (or ``otel-train sink``); embed it with `Sink`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_train.sink.service import Sink, exporter_factory

__all__ = ["Sink", "exporter_factory"]


def __getattr__(name: str) -> Any:  # lazy: `import otel_train.sink` must not import grpc
    if name in __all__:
        from otel_train.sink import service

        return getattr(service, name)
    raise AttributeError(name)
