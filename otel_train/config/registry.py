"""Exporters by name: built-ins in a lazy table, third parties through entry points.

The registry never imports a backend library; it imports a backend module only when that
backend is built. A missing optional package is reported at `init` with the exact install line.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any

from otel_train.errors import ConfigError

__all__ = ["ExporterSpec", "check_available", "get_spec", "known_exporters", "load_class"]

ENTRY_POINT_GROUP = "otel_train.exporters"


@dataclasses.dataclass(frozen=True)
class ExporterSpec:
    """How to build the exporter registered under `name`."""

    name: str
    target: str  # "module:Class"
    requires: tuple[str, ...] = ()  # importable modules the backend needs
    extra: str | None = None  # the `otel-train[...]` extra that installs them


_BUILTIN: dict[str, ExporterSpec] = {
    spec.name: spec
    for spec in (
        ExporterSpec("tensorboard", "otel_train.exporters.tensorboard:TensorBoardExporter", ("tensorboard",)),
        ExporterSpec("chrome_trace", "otel_train.exporters.chrome_trace:ChromeTraceExporter"),
        ExporterSpec("jsonl", "otel_train.exporters.jsonl:JsonlExporter"),
        ExporterSpec("console", "otel_train.exporters.console:ConsoleExporter"),
        ExporterSpec("otlp", "otel_train.exporters.otlp:OTLPExporter", ("opentelemetry.exporter.otlp",)),
        ExporterSpec("wandb", "otel_train.exporters.wandb:WandbExporter", ("wandb",), "wandb"),
        ExporterSpec("clearml", "otel_train.exporters.clearml:ClearMLExporter", ("clearml",), "clearml"),
        ExporterSpec("trackio", "otel_train.exporters.trackio:TrackioExporter", ("trackio",), "trackio"),
        ExporterSpec("mlflow", "otel_train.exporters.mlflow:MLflowExporter", ("mlflow",), "mlflow"),
    )
}


def _third_party() -> dict[str, ExporterSpec]:
    from importlib.metadata import entry_points  # here: ~14 ms of imports that built-in names never need

    found: dict[str, ExporterSpec] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _BUILTIN:
            found[ep.name] = ExporterSpec(ep.name, ep.value)
    return found


def known_exporters() -> dict[str, ExporterSpec]:
    """Every exporter name that can be configured, built-ins first."""
    return {**_BUILTIN, **_third_party()}


def get_spec(name: str, setting: str = "OTEL_TRAIN_EXPORTERS") -> ExporterSpec:
    """The spec for `name`, or a `ConfigError` listing the known names."""
    spec = _BUILTIN.get(name)
    if spec is not None:  # built-ins win over entry points: no need to scan every installed distribution
        return spec
    known = known_exporters()
    spec = known.get(name)
    if spec is None:
        raise ConfigError(f"{setting}: unknown exporter {name!r}; known: {', '.join(sorted(known))}")
    return spec


def check_available(spec: ExporterSpec, setting: str = "OTEL_TRAIN_EXPORTERS") -> None:
    """Raise `ConfigError` with the exact `pip install` when a module the backend needs is missing."""
    for module in spec.requires:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            hint = f"pip install 'otel-train[{spec.extra}]'" if spec.extra else "pip install --force-reinstall otel-train"
            raise ConfigError(
                f"{setting}: exporter {spec.name!r} needs the `{module.split('.')[0]}` package, "
                f"which is not installed; run: {hint}"
            )


def load_class(spec: ExporterSpec) -> Any:
    """Import the backend module and return its exporter class."""
    module_name, _, attr = spec.target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)
