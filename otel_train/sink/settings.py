"""The settings of `otel-train sink`: `SinkSettings` from the ``OTEL_TRAIN_SINK_*`` variables and the CLI's flags
(`load_sink_settings`), validated before the sink starts."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from otel_train.config.values import parse_int, parse_path, parse_positive_float, parse_text
from otel_train.errors import ConfigError

__all__ = ["SinkSettings", "load_sink_settings"]

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
OTEL_TRAIN_SINK_TOKEN_FILE = "OTEL_TRAIN_SINK_TOKEN_FILE"
"""A file holding the bearer token (`OTEL_TRAIN_SINK_TOKEN` from a file; surrounding whitespace ignored)."""
OTEL_TRAIN_SINK_BODY_TIMEOUT_S = "OTEL_TRAIN_SINK_BODY_TIMEOUT_S"
"""Seconds an HTTP request body may take to arrive; a slower one is answered 408 and closed (float > 0). Default 30."""
OTEL_TRAIN_SINK_MAX_CONNECTIONS = "OTEL_TRAIN_SINK_MAX_CONNECTIONS"
"""Open HTTP connections at most (int >= 1). At the cap a new connection closes the oldest one that has not sent
a whole request (nor an authorized one, with a token) or is idle between requests; with none such, the new one is
closed. Default: a quarter of the file-descriptor limit, at most 1024."""
OTEL_TRAIN_SINK_SPOOL_DIR = "OTEL_TRAIN_SINK_SPOOL_DIR"
"""Where the sink holds each run's windows while its backends are behind. Default ``<OTEL_TRAIN_DIR>/.sink-spool``."""
OTEL_TRAIN_SINK_SPOOL_RUN_MB = "OTEL_TRAIN_SINK_SPOOL_RUN_MB"
"""MiB one run may hold for its backends before the sink refuses its requests (int >= 0; 0: no spool). Default 1024."""
OTEL_TRAIN_SINK_SPOOL_TOTAL_MB = "OTEL_TRAIN_SINK_SPOOL_TOTAL_MB"
"""MiB all runs together may hold before the sink refuses requests of runs that hold any (int >= 1). Default 8192."""
OTEL_TRAIN_SINK_QUEUE_WINDOWS = "OTEL_TRAIN_SINK_QUEUE_WINDOWS"
"""Requests held in memory per run and backend (int >= 1); without a spool, more are refused. Default 256."""
OTEL_TRAIN_SINK_RETRY_AFTER_S = "OTEL_TRAIN_SINK_RETRY_AFTER_S"
"""Seconds a refused sender is told to wait (HTTP Retry-After, gRPC RetryInfo; float > 0). Default 1."""
OTEL_TRAIN_SINK_BACKEND_THREADS = "OTEL_TRAIN_SINK_BACKEND_THREADS"
"""Threads per backend kind that every run's backends share (int >= 1). Default 4."""
OTEL_TRAIN_SINK_MAX_OPEN_RUNS = "OTEL_TRAIN_SINK_MAX_OPEN_RUNS"
"""Runs whose backends (and files) are open at once; one more closes the least recently used idle run, which
reopens on its next request with its totals (int >= 1). Default: what the file-descriptor limit allows after a
reserve and the connections, at 6 descriptors per run, at most 1000 (106 under ``ulimit -n 1024``)."""
OTEL_TRAIN_SINK_REORDER_S = "OTEL_TRAIN_SINK_REORDER_S"
"""Seconds the sink holds a run's points for TensorBoard and W&B, so that a point a collector delivers late (by
less than this) is written in step order instead of skipped (float >= 0; 0: no hold). Default 5."""
OTEL_TRAIN_SINK_HEADER_TIMEOUT_S = "OTEL_TRAIN_SINK_HEADER_TIMEOUT_S"
"""Seconds a new HTTP connection may take to send its first request's headers; a slower one is closed
(float > 0). Default 10."""
OTEL_TRAIN_SINK_SHUTDOWN_TIMEOUT_S = "OTEL_TRAIN_SINK_SHUTDOWN_TIMEOUT_S"
"""Seconds the sink spends writing what it holds on SIGTERM before it exits anyway; what is not written then
stays in the runs' spools and is written by the next start (float > 0). Default 10."""

SINK_AGGREGATES_ALLOWED = ("mean", "min", "max")
#: `OTEL_TRAIN_SINK_REORDER_S`'s default: parallel collector consumers reorder within one export round trip (well
#: under a second); a request the sink refused comes back after its retry-after (1 s) plus the sender's backoff;
#: TensorBoard's data server reloads every 5 s, so a dashboard shows the points at most one reload later.
DEFAULT_REORDER_S = 5.0


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
    body_timeout_s: float = 30.0
    max_connections: int | None = None  # None: derived from the file-descriptor limit (`fd_limits`)
    spool_dir: Path | None = None
    spool_run_mb: int = 1024
    spool_total_mb: int = 8192
    queue_windows: int = 256
    retry_after_s: float = 1.0
    backend_threads: int = 4
    max_open_runs: int | None = None  # None: derived from the file-descriptor limit (`fd_limits`)
    reorder_s: float = DEFAULT_REORDER_S
    header_timeout_s: float = 10.0
    shutdown_timeout_s: float = 10.0


def _parse_reorder_s(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a number; expected seconds >= 0 (0: no hold)") from None
    if not value >= 0 or math.isinf(value):
        raise ConfigError(f"{name}: {raw!r} is not allowed; expected a finite number of seconds >= 0 (0: no hold)")
    return value


def _parse_token_file(name: str, raw: str) -> str:
    try:
        token = Path(raw.strip()).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{name}: cannot read {raw!r} ({getattr(err, 'strerror', None) or err}); give a "
                          "readable file holding the token") from None
    if not token:
        raise ConfigError(f"{name}: {raw!r} is empty; the file must hold the token")
    return token


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
    "token": (OTEL_TRAIN_SINK_TOKEN, parse_text),
    "aggregate": (OTEL_TRAIN_SINK_AGGREGATE, _parse_aggregates),
    "idle_s": (OTEL_TRAIN_SINK_IDLE_S, parse_positive_float),
    "aggregate_timeout_s": (OTEL_TRAIN_SINK_AGGREGATE_TIMEOUT_S, parse_positive_float),
    "max_body_bytes": (OTEL_TRAIN_SINK_MAX_BODY_BYTES, lambda n, r: parse_int(n, r, 1024)),
    "status_interval_s": (OTEL_TRAIN_SINK_STATUS_INTERVAL_S, parse_positive_float),
    "token_file": (OTEL_TRAIN_SINK_TOKEN_FILE, _parse_token_file),
    "body_timeout_s": (OTEL_TRAIN_SINK_BODY_TIMEOUT_S, parse_positive_float),
    "max_connections": (OTEL_TRAIN_SINK_MAX_CONNECTIONS, lambda n, r: parse_int(n, r, 1)),
    "spool_dir": (OTEL_TRAIN_SINK_SPOOL_DIR, parse_path),
    "spool_run_mb": (OTEL_TRAIN_SINK_SPOOL_RUN_MB, lambda n, r: parse_int(n, r, 0)),
    "spool_total_mb": (OTEL_TRAIN_SINK_SPOOL_TOTAL_MB, lambda n, r: parse_int(n, r, 1)),
    "queue_windows": (OTEL_TRAIN_SINK_QUEUE_WINDOWS, lambda n, r: parse_int(n, r, 1)),
    "retry_after_s": (OTEL_TRAIN_SINK_RETRY_AFTER_S, parse_positive_float),
    "backend_threads": (OTEL_TRAIN_SINK_BACKEND_THREADS, lambda n, r: parse_int(n, r, 1)),
    "max_open_runs": (OTEL_TRAIN_SINK_MAX_OPEN_RUNS, lambda n, r: parse_int(n, r, 1)),
    "reorder_s": (OTEL_TRAIN_SINK_REORDER_S, _parse_reorder_s),
    "header_timeout_s": (OTEL_TRAIN_SINK_HEADER_TIMEOUT_S, parse_positive_float),
    "shutdown_timeout_s": (OTEL_TRAIN_SINK_SHUTDOWN_TIMEOUT_S, parse_positive_float),
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
    token_file = values.pop("token_file", None)
    # A token given here wins, then a token file given here, then the variables (the token over the file).
    if token_file is not None and overrides.get("token") is None and (
            overrides.get("token_file") is not None or "token" not in values):
        values["token"] = token_file
    return SinkSettings(**values)
