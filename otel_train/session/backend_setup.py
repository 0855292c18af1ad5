"""The named backends of a session: which run in this process and which in the exporter process
(`split_backends`), and building the ones that run here (`build_backends`)."""

from __future__ import annotations

import os
import sys
from typing import Any

from otel_train.config import settings as cfg
from otel_train.config.exporter_options import ExporterOptions
from otel_train.config.registry import check_available, get_spec
from otel_train.errors import ConfigError

__all__ = ["build_backends", "split_backends"]


def build_backends(names: tuple[str, ...], options: ExporterOptions) -> list[Any]:
    """The backends named `names`, each given `options`, each starting on a thread of its own
    (`otel_train.ship.backend_start`): nobody waits for a backend's client to import or its run to open.

    Raises:
        ConfigError: an unknown name or a missing package, before anything starts.
    """
    if not names:  # the common case (every backend in the exporter process): the backend contract's imports wait
        return []
    from otel_train.ship.backend_start import starting_backends

    built = starting_backends(names, options, spooled=False)
    for backend in built.values():
        backend.start()
    return list(built.values())


#: Backends whose job is the trainer's terminal: they stay in the training process, whose stderr that is (the
#: exporter process writes its own stdout/stderr to a log file in the spool, so a table written there is never seen).
_TERMINAL_BACKENDS = frozenset({"console"})


#: What the `otlp` backend speaks (its `PROTOCOLS`): checked here, as the backend itself starts later, elsewhere.
_OTLP_PROTOCOLS = ("grpc", "http/protobuf")


def _check_otlp_protocols() -> None:
    """An unsupported ``OTEL_EXPORTER_OTLP_*PROTOCOL`` fails `init()`, with the line the backend would give."""
    for var in ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = os.environ.get(var)
        if raw is not None and raw.strip() and raw.strip().lower() not in _OTLP_PROTOCOLS:
            raise ConfigError(f"{var}: {raw!r} is not supported; use one of {', '.join(_OTLP_PROTOCOLS)}")


def _is_builtin(target: str) -> bool:
    """Whether a registry target (``module:Class``) is one of our own backends."""
    return target.partition(":")[0].split(".")[:2] == ["otel_train", "exporters"]


def split_backends(settings: cfg.Settings) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split the named exporters into (built here, built in the exporter process).

    Built-in backends (`otlp` included) go to the exporter process unless `OTEL_TRAIN_EXPORT_PROCESS=off`.
    Staying here: third-party names (entry points; their classes may not expect to run elsewhere) and `console`
    (it writes to this process's standard error, the terminal the user watches).
    Unknown names and missing packages fail here, before anything starts.
    """
    names = settings.exporters
    for spec in [get_spec(n) for n in names]:
        check_available(spec)
    if "otlp" in names:
        _check_otlp_protocols()
    if settings.export_process == "off" or (settings.export_process == "auto" and (
            os.name != "posix" or not sys.executable)):
        return names, ()  # the exporter process needs Unix sockets, fd passing and an interpreter to start
    remote = tuple(n for n in names if _is_builtin(get_spec(n).target) and n not in _TERMINAL_BACKENDS)
    return tuple(n for n in names if n not in remote), remote
