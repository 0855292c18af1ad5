"""Every setting of otel-train, parsed and validated in one place.

Precedence: explicit keyword to `init()` > environment variable > default. The library never
writes to `os.environ`. Each `OTEL_TRAIN_*` name is a module constant with a docstring giving its
type, unit and default; the README's table lists the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from otel_train.errors import ConfigError

__all__ = ["Settings", "SinkSettings", "load_settings", "load_sink_settings", "parse_bool"]

OTEL_TRAIN_EXPORTERS = "OTEL_TRAIN_EXPORTERS"
"""Comma list of exporter names. Default ``tensorboard,chrome_trace``."""
OTEL_TRAIN_DIR = "OTEL_TRAIN_DIR"
"""Directory every local backend writes under. Default ``./otel-train-runs``."""
OTEL_TRAIN_RUN_NAME = "OTEL_TRAIN_RUN_NAME"
"""Human-readable run name (TensorBoard folder, W&B name). Default: the run id."""
OTEL_TRAIN_RUN_ID = "OTEL_TRAIN_RUN_ID"
"""Run id shared by every rank of one job. Default: the launcher's job id, else generated."""
OTEL_TRAIN_PROJECT = "OTEL_TRAIN_PROJECT"
"""Project name for backends that group runs (W&B, ClearML, MLflow, Trackio). Default ``otel-train``."""
OTEL_TRAIN_EXPORT_EVERY = "OTEL_TRAIN_EXPORT_EVERY"
"""Collect and export after every N steps (int >= 1). Default 1."""
OTEL_TRAIN_EXPORT_INTERVAL_S = "OTEL_TRAIN_EXPORT_INTERVAL_S"
"""Collect at the latest every this many seconds (float > 0). Default 30."""
OTEL_TRAIN_RANKS = "OTEL_TRAIN_RANKS"
"""Which ranks export metrics: ``0`` (global rank 0 only) or ``all``. Spans come from every rank. Default ``0``."""
OTEL_TRAIN_DISABLED = "OTEL_TRAIN_DISABLED"
"""Boolean; when true every otel-train call is a cheap no-op. Default false."""
OTEL_TRAIN_SHUTDOWN_TIMEOUT_S = "OTEL_TRAIN_SHUTDOWN_TIMEOUT_S"
"""Upper bound in seconds for the flush at shutdown (float > 0). Default 10."""
OTEL_TRAIN_QUEUE_SIZE = "OTEL_TRAIN_QUEUE_SIZE"
"""Export windows queued per exporter before the oldest is dropped (int >= 1). While an exporter is
busy, new windows merge into the queued one (up to 50,000 rows), so this bounds a slow backend's
memory, not its steps. Default 16."""
OTEL_TRAIN_BUFFER_SIZE = "OTEL_TRAIN_BUFFER_SIZE"
"""Logged records (one per `ot.log` call) and spans buffered between two collections before the
oldest is dropped (int >= 1). Default 100,000 (about 0.5 GB at 20 scalars per record)."""
OTEL_TRAIN_STRICT_SYNC = "OTEL_TRAIN_STRICT_SYNC"
"""Boolean; warn once per key when a logged value would force a device sync on the training
thread. Default false."""
OTEL_TRAIN_CONFIG_JSON = "OTEL_TRAIN_CONFIG_JSON"
"""JSON object of hyperparameters sent once to every backend that has the notion. Default none."""
OTEL_TRAIN_TRACE_COUNTERS = "OTEL_TRAIN_TRACE_COUNTERS"
"""Boolean; write logged metrics as counter events under the Chrome trace timeline. Default true."""
OTEL_TRAIN_STEP_ORDER = "OTEL_TRAIN_STEP_ORDER"
"""What happens to a row whose step is lower than the last one of its series: ``warn`` (written as
given, counted, warned), ``drop`` (kept from every backend, counted) or ``raise`` (`ot.step`/`ot.log`
below the latest step raise `StepOrderError` on the training thread). Default ``warn``."""
OTEL_TRAIN_RESUME_STEP = "OTEL_TRAIN_RESUME_STEP"
"""The step a resumed run restarts at (int >= 0): every backend is told, so curves do not zig-zag.
Default none (a fresh run)."""

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"

RANKS_ALLOWED = ("0", "all")
STEP_ORDER_ALLOWED = ("warn", "drop", "raise")
DEFAULT_EXPORTERS = ("tensorboard", "chrome_trace")

#: Launcher variables holding an id shared by every rank of one job, most specific first.
JOB_ID_VARIABLES = (
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",
    "JOB_ID",
    "AZUREML_RUN_ID",
    "SKYPILOT_TASK_ID",
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The validated settings of one `init()`."""

    exporters: tuple[str, ...] = DEFAULT_EXPORTERS
    dir: Path = Path("otel-train-runs")
    run_name: str | None = None
    run_id: str | None = None
    project: str = "otel-train"
    export_every: int = 1
    export_interval_s: float = 30.0
    ranks: str = "0"
    disabled: bool = False
    shutdown_timeout_s: float = 10.0
    queue_size: int = 16
    buffer_size: int = 100_000
    strict_sync: bool = False
    config: Mapping[str, Any] | None = None
    trace_counters: bool = True
    service_name: str = "otel-train"
    step_order: str = "warn"
    resume_step: int | None = None


def parse_bool(name: str, raw: str) -> bool:
    """Parse a boolean setting; raise `ConfigError` naming the variable on anything else."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}: {raw!r} is not a boolean; use one of 1, true, yes, on, 0, false, no, off")


def _parse_int(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not an integer; expected an integer >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}: {value} is too small; expected an integer >= {minimum}")
    return value


def _parse_positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a number; expected seconds > 0") from None
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"{name}: {raw!r} is not allowed; expected a finite number of seconds > 0")
    return value


def _parse_exporters(name: str, raw: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in raw.split(",") if part.strip())
    seen: list[str] = []
    for part in names:
        if part not in seen:
            seen.append(part)
    return tuple(seen)


def _parse_ranks(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in RANKS_ALLOWED:
        raise ConfigError(f"{name}: {raw!r} is not allowed; use `0` (rank 0 exports metrics) or `all`")
    return value


def _parse_step_order(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in STEP_ORDER_ALLOWED:
        raise ConfigError(f"{name}: {raw!r} is not allowed; use one of {', '.join(STEP_ORDER_ALLOWED)}")
    return value


def _parse_config_json(name: str, raw: str) -> Mapping[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{name}: not valid JSON ({err.msg} at char {err.pos}); expected a JSON object") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: {raw[:60]!r} is not allowed; expected a JSON object")
    return value


def _parse_text(name: str, raw: str) -> str:
    value = raw.strip()
    if not value:
        raise ConfigError(f"{name}: empty value is not allowed; unset it or give a non-empty string")
    return value


# field name -> (env variable, parser)
_ENV: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "exporters": (OTEL_TRAIN_EXPORTERS, _parse_exporters),
    "dir": (OTEL_TRAIN_DIR, lambda n, r: Path(_parse_text(n, r)).expanduser()),
    "run_name": (OTEL_TRAIN_RUN_NAME, _parse_text),
    "run_id": (OTEL_TRAIN_RUN_ID, _parse_text),
    "project": (OTEL_TRAIN_PROJECT, _parse_text),
    "export_every": (OTEL_TRAIN_EXPORT_EVERY, lambda n, r: _parse_int(n, r, 1)),
    "export_interval_s": (OTEL_TRAIN_EXPORT_INTERVAL_S, _parse_positive_float),
    "ranks": (OTEL_TRAIN_RANKS, _parse_ranks),
    "shutdown_timeout_s": (OTEL_TRAIN_SHUTDOWN_TIMEOUT_S, _parse_positive_float),
    "queue_size": (OTEL_TRAIN_QUEUE_SIZE, lambda n, r: _parse_int(n, r, 1)),
    "buffer_size": (OTEL_TRAIN_BUFFER_SIZE, lambda n, r: _parse_int(n, r, 1)),
    "strict_sync": (OTEL_TRAIN_STRICT_SYNC, parse_bool),
    "config": (OTEL_TRAIN_CONFIG_JSON, _parse_config_json),
    "trace_counters": (OTEL_TRAIN_TRACE_COUNTERS, parse_bool),
    "service_name": (OTEL_SERVICE_NAME, _parse_text),
    "step_order": (OTEL_TRAIN_STEP_ORDER, _parse_step_order),
    "resume_step": (OTEL_TRAIN_RESUME_STEP, lambda n, r: _parse_int(n, r, 0)),
}


def _validate_kwarg(field: str, value: Any) -> Any:
    """Validate an explicit `init()` keyword with the same rules as its variable."""
    var = _ENV[field][0] if field in _ENV else field
    if field == "exporters":
        if isinstance(value, str):
            return _parse_exporters(var, value)
        return _parse_exporters(var, ",".join(value))
    if field == "config":
        if not isinstance(value, Mapping):
            raise ConfigError(f"config: {type(value).__name__} is not allowed; expected a mapping of hyperparameters")
        return dict(value)
    if field == "dir":
        return Path(value).expanduser()
    if field == "disabled":
        return value if isinstance(value, bool) else parse_bool(field, str(value))
    if isinstance(value, str):
        return _ENV[field][1](field, value)
    if field in ("export_every", "queue_size", "buffer_size"):
        return _parse_int(field, str(value), 1)
    if field == "resume_step":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"resume_step: {value!r} is not allowed; expected an integer step >= 0")
        return _parse_int(field, str(value), 0)
    if field in ("export_interval_s", "shutdown_timeout_s"):
        return _parse_positive_float(field, str(value))
    return value


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build `Settings` from the environment, then apply explicit keyword overrides.

    Args:
        environ: The environment to read; defaults to `os.environ`.
        **overrides: `Settings` field names with explicit values (``None`` means "not given").

    Raises:
        ConfigError: one line naming the setting, the bad value and what is allowed.
    """
    env = os.environ if environ is None else environ
    fields = {f.name for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for field, (var, parser) in _ENV.items():
        raw = env.get(var)
        if raw is not None and (raw.strip() or field == "exporters"):
            values[field] = parser(var, raw)
    disabled = False
    for var in (OTEL_TRAIN_DISABLED, OTEL_SDK_DISABLED):
        raw = env.get(var)
        if raw is not None:
            disabled = disabled or parse_bool(var, raw)
    values["disabled"] = disabled
    for key, value in overrides.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"init(): unknown keyword `{key}`; allowed: {allowed}")
        if value is not None:
            values[key] = _validate_kwarg(key, value)
    return Settings(**values)


# -- the sink (`otel-train sink`) ---------------------------------------------------------------
OTEL_TRAIN_SINK_GRPC = "OTEL_TRAIN_SINK_GRPC"
"""HOST:PORT the sink's OTLP/gRPC receiver binds. Default ``127.0.0.1:4317``."""
OTEL_TRAIN_SINK_HTTP = "OTEL_TRAIN_SINK_HTTP"
"""HOST:PORT the sink's OTLP/HTTP (+ JSON, health, runs, compat API) server binds. Default ``127.0.0.1:4318``."""
OTEL_TRAIN_SINK_TOKEN = "OTEL_TRAIN_SINK_TOKEN"
"""Bearer token required on both protocols when set. Default none (no auth; loopback only by default)."""
OTEL_TRAIN_SINK_AGGREGATE = "OTEL_TRAIN_SINK_AGGREGATE"
"""Comma list of cross-rank aggregates from ``mean,min,max``. Default none."""
OTEL_TRAIN_SINK_IDLE_S = "OTEL_TRAIN_SINK_IDLE_S"
"""Seconds without data after which the sink closes a run's backends (float > 0). Default 300."""
OTEL_TRAIN_SINK_AGGREGATE_TIMEOUT_S = "OTEL_TRAIN_SINK_AGGREGATE_TIMEOUT_S"
"""Seconds to wait for every rank of a step before writing its aggregate anyway (float > 0). Default 30."""
OTEL_TRAIN_SINK_MAX_BODY_BYTES = "OTEL_TRAIN_SINK_MAX_BODY_BYTES"
"""Largest request body / gRPC message accepted, in bytes (int >= 1024). Default 16 MiB."""
OTEL_TRAIN_SINK_STATUS_INTERVAL_S = "OTEL_TRAIN_SINK_STATUS_INTERVAL_S"
"""Seconds between the sink's status log lines (float > 0). Default 10."""

SINK_AGGREGATES_ALLOWED = ("mean", "min", "max")


@dataclasses.dataclass(frozen=True)
class SinkSettings:
    """The validated settings of one `otel-train sink`."""

    grpc: str = "127.0.0.1:4317"
    http: str = "127.0.0.1:4318"
    token: str | None = None
    aggregate: tuple[str, ...] = ()
    idle_s: float = 300.0
    aggregate_timeout_s: float = 30.0
    max_body_bytes: int = 16 * 1024 * 1024
    status_interval_s: float = 10.0
    tls_cert: Path | None = None
    tls_key: Path | None = None


def _parse_host_port(name: str, raw: str) -> str:
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name}: {raw!r} is not allowed; expected HOST:PORT, e.g. 127.0.0.1:4317")
    return raw.strip()


def _parse_aggregates(name: str, raw: str) -> tuple[str, ...]:
    parts = tuple(p.strip().lower() for p in raw.split(",") if p.strip())
    for part in parts:
        if part not in SINK_AGGREGATES_ALLOWED:
            raise ConfigError(f"{name}: unknown aggregate {part!r}; allowed: {', '.join(SINK_AGGREGATES_ALLOWED)}")
    return parts


_SINK_ENV: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "grpc": (OTEL_TRAIN_SINK_GRPC, _parse_host_port),
    "http": (OTEL_TRAIN_SINK_HTTP, _parse_host_port),
    "token": (OTEL_TRAIN_SINK_TOKEN, _parse_text),
    "aggregate": (OTEL_TRAIN_SINK_AGGREGATE, _parse_aggregates),
    "idle_s": (OTEL_TRAIN_SINK_IDLE_S, _parse_positive_float),
    "aggregate_timeout_s": (OTEL_TRAIN_SINK_AGGREGATE_TIMEOUT_S, _parse_positive_float),
    "max_body_bytes": (OTEL_TRAIN_SINK_MAX_BODY_BYTES, lambda n, r: _parse_int(n, r, 1024)),
    "status_interval_s": (OTEL_TRAIN_SINK_STATUS_INTERVAL_S, _parse_positive_float),
}


def load_sink_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> SinkSettings:
    """Build `SinkSettings` from the environment, then explicit overrides (CLI flags; ``None`` = not given).

    String overrides are validated with the same parser as their variable, named by the flag
    (``--grpc``); `tls_cert` / `tls_key` are paths.

    Raises:
        ConfigError: one line naming the setting, the bad value and what is allowed.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field, (var, parser) in _SINK_ENV.items():
        raw = env.get(var)
        if raw is not None and raw.strip():
            values[field] = parser(var, raw)
    for key, value in overrides.items():
        if value is None:
            continue
        if key in ("tls_cert", "tls_key"):
            values[key] = Path(value)
        elif key in _SINK_ENV:
            values[key] = _SINK_ENV[key][1](f"--{key.replace('_', '-')}", str(value))
        else:
            raise ConfigError(f"sink: unknown setting `{key}`; allowed: {', '.join(sorted(_SINK_ENV))}, tls_cert, tls_key")
    return SinkSettings(**values)
