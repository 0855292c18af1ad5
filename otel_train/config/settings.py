"""Every setting of a training process, parsed and validated in one place (the sink's: `otel_train.sink.settings`).

Precedence: explicit keyword to `init()` > environment variable > default. The library never
writes to `os.environ`. Each `OTEL_TRAIN_*` name is a module constant with a docstring giving its
type, unit and default; the table in docs/configuration.md lists the same.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from otel_train.config.values import (
    choice,
    parse_bool,
    parse_config_json,
    parse_cpus,
    parse_exporters,
    parse_int,
    parse_nice,
    parse_non_negative_float,
    parse_path,
    parse_positive_float,
    parse_text,
)
from otel_train.errors import ConfigError
from otel_train.vocab.step_order import POLICIES

__all__ = ["Route", "Settings", "StepSelection", "load_settings"]

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
"""Collect and export after every N steps (int >= 1). A step in which an OTel instrument recorded
ends with a collection (points without `train.step` get that step); steps with only `ot.log` values
and spans, which carry their step, are collected every 0.1 s, or sooner once ~400 of them wait, so most
step ends wake no thread. Default 1."""
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
OTEL_TRAIN_TRACE_STEPS = "OTEL_TRAIN_TRACE_STEPS"
"""Which steps' spans and counters the Chrome trace keeps: a comma list of ``A-B`` (steps A to B,
inclusive), ``A`` (one step) and ``every:N`` / ``every:N:K`` (K steps from every multiple of N; K
defaults to 1), e.g. ``100-120`` or ``0-9,every:1000:5``. Spans outside any step are left out too.
Default: every step."""
OTEL_TRAIN_TRACE_GZIP = "OTEL_TRAIN_TRACE_GZIP"
"""Boolean; write the Chrome trace gzip-compressed (``rank<N>.trace.json.gz``, which Perfetto opens).
Default false."""
OTEL_TRAIN_PHASES = "OTEL_TRAIN_PHASES"
"""Boolean; record per-step ``phase/<span name>_s`` and ``phase/other_s`` from the top-level spans of
each step (computed on the export thread). Default true."""
OTEL_TRAIN_SYSTEM_METRICS = "OTEL_TRAIN_SYSTEM_METRICS"
"""Boolean; sample process CPU and memory, host memory and (with NVML) every GPU on a background
thread and record each step's mean and max (``system/cpu_percent/mean`` ...). Default false."""
OTEL_TRAIN_SYSTEM_INTERVAL_S = "OTEL_TRAIN_SYSTEM_INTERVAL_S"
"""Seconds between two system samples (float > 0). Default 1."""
OTEL_TRAIN_PROFILER_BRIDGE = "OTEL_TRAIN_PROFILER_BRIDGE"
"""Boolean; while a torch profiler records, every `ot.span` also opens a
`torch.profiler.record_function` of the same name (torch is never imported by otel-train). Default false."""
OTEL_TRAIN_QUIET = "OTEL_TRAIN_QUIET"
"""Boolean; no summary line on stderr at shutdown (rank 0). Default false."""
OTEL_TRAIN_SELF_METRICS = "OTEL_TRAIN_SELF_METRICS"
"""Boolean; the exporter process adds otel-train's own health to every window (``otel_train/points``,
``otel_train/backlog_windows{exporter=X}``, ``otel_train/export_latency_s{exporter=X}``,
``otel_train/backend_errors{exporter=X}`` ...). Default true."""
OTEL_TRAIN_WORKER_ADDRESS = "OTEL_TRAIN_WORKER_ADDRESS"
"""Set by otel-train, not by users: the Unix socket where the run's exporter process takes the data of
child processes (DataLoader workers, `multiprocessing` children); ``none`` when there is none (their
data is dropped with one warning), ``disabled`` for a disabled run (their calls are no-ops). Spawned
children find the run through it."""

OTEL_TRAIN_HANG_AFTER_S = "OTEL_TRAIN_HANG_AFTER_S"
"""The hang watchdog's floor in seconds (float >= 0): a step (or a span, against spans of its name) counts as
stuck once it has run more than max(`OTEL_TRAIN_HANG_FACTOR` × its usual duration, this); a kind of work never
seen to finish (the first step, the first validation) waits `OTEL_TRAIN_HANG_FACTOR` × this. ``0`` turns the
watchdog off. Default 60."""
OTEL_TRAIN_HANG_FACTOR = "OTEL_TRAIN_HANG_FACTOR"
"""The hang watchdog's multiple of the median duration of the same kind of work (float >= 1). Default 10."""

OTEL_TRAIN_BACKEND_INCLUDE = "OTEL_TRAIN_<BACKEND>_INCLUDE"
"""Comma list of globs on metric names; that backend gets only matching metrics (its wire name or its
dashboard name, e.g. ``train/*``). ``<BACKEND>`` is the exporter name in capitals (``WANDB``,
``CHROME_TRACE``). Default: every metric."""
OTEL_TRAIN_BACKEND_EXCLUDE = "OTEL_TRAIN_<BACKEND>_EXCLUDE"
"""Comma list of globs on metric names that backend does not get (applied after ``_INCLUDE``). Default none."""
OTEL_TRAIN_BACKEND_EVERY = "OTEL_TRAIN_<BACKEND>_EVERY"
"""That backend gets only steps that are a multiple of N (int >= 1; spans too). Default 1."""
OTEL_TRAIN_BACKEND_LOGS = "OTEL_TRAIN_<BACKEND>_LOGS"
"""Which log records that backend gets, by logger name: a comma list of globs (``job*``), a pattern that begins
with ``!`` leaves matching loggers out (``*,!transformers*``), ``off`` none. Default: every record. Log records
are not picked by ``_INCLUDE``/``_EXCLUDE`` (metric names) nor thinned out by ``_EVERY``."""
OTEL_TRAIN_BACKEND_RANKS = "OTEL_TRAIN_<BACKEND>_RANKS"
"""``0`` or ``all``: overrides `OTEL_TRAIN_RANKS` for that backend. Default: `OTEL_TRAIN_RANKS`."""

OTEL_TRAIN_EXPORT_PROCESS = "OTEL_TRAIN_EXPORT_PROCESS"
"""Where named backends run: ``auto`` (default: in an exporter process started at `init()` when a named
exporter is configured), ``on`` (same) or ``off`` (threads in the training process). Exporter objects
passed to `init(exporters=[...])` always stay in the training process."""
OTEL_TRAIN_BACKEND_PROCESSES = "OTEL_TRAIN_BACKEND_PROCESSES"
"""``auto`` (default) or ``off``. ``auto``: in the exporter process, where two or more backends with a heavy
client are configured (``wandb``, ``mlflow``, ``clearml``, ``trackio``), each of those runs in a process of its
own, so that their clients' imports and starts run side by side (about 0.1 s of CPU each, and memory: all four
take ~280 MB more resident than one exporter process). ``off``: every backend on a thread of the exporter process."""
OTEL_TRAIN_DRAIN_TIMEOUT_S = "OTEL_TRAIN_DRAIN_TIMEOUT_S"
"""Seconds the exporter process keeps delivering after the training process has handed off or died,
before it exits (float > 0). Default 120. What it could not deliver waits in the spool for `otel-train replay`."""
OTEL_TRAIN_EXPORT_CPUS = "OTEL_TRAIN_EXPORT_CPUS"
"""CPU list the exporter process pins itself to, e.g. ``1`` or ``8-9,12``. Default: the training
process's affinity."""
OTEL_TRAIN_EXPORT_NICE = "OTEL_TRAIN_EXPORT_NICE"
"""Niceness added to the exporter process (int 0-19). Default 0."""
OTEL_TRAIN_STEP_ORDER = "OTEL_TRAIN_STEP_ORDER"
"""What happens to a row whose step is lower than the last one of its series: ``warn`` (written as
given, counted, warned), ``drop`` (kept from every backend, counted) or ``raise`` (`ot.step`/`ot.log`
below the latest step raise `StepOrderError` on the training thread). Default ``warn``."""
OTEL_TRAIN_RESUME_STEP = "OTEL_TRAIN_RESUME_STEP"
"""The step a resumed run restarts at (int >= 0): every backend is told, so curves do not zig-zag.
Default none (a fresh run)."""
OTEL_TRAIN_VERIFY = "OTEL_TRAIN_VERIFY"
"""``off``, ``record`` or ``on`` (a boolean also: true is ``on``). ``record`` keeps the run's record of what was
logged (``<run folder>/verify/``) for `otel-train verify`; ``on`` also runs verify at the end of the job, each
rank on its own part after its backends closed, and puts the verdict in the summary line. ``off`` keeps no
record. Default ``record`` (about 8 bytes per point on disk, capped by `OTEL_TRAIN_VERIFY_RECORD_MB`: see
docs/performance.md)."""
OTEL_TRAIN_LOG_LEVEL = "OTEL_TRAIN_LOG_LEVEL"
"""The lowest `logging` level captured as OTel log records: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``,
``CRITICAL``, a number, or ``off`` (no `logging` records; uncaught exceptions are still captured). A logger's own
level still applies (a record it does not emit is never seen). Default ``WARNING``."""
OTEL_TRAIN_LOG_RATE = "OTEL_TRAIN_LOG_RATE"
"""Log records captured per second on average, in bursts of as many (float > 0); past it records are dropped
and counted (the shutdown summary's "log records over the rate limit"). Events (a record with an ``event.name``,
such as ``train.hang``) and uncaught exceptions are never dropped by it. Default 500."""
OTEL_TRAIN_CAPTURE_OUTPUT = "OTEL_TRAIN_CAPTURE_OUTPUT"
"""Boolean; also capture each line the process writes to stdout (severity INFO) and stderr (WARN) as a log
record (the text still reaches the terminal). Default false."""
OTEL_TRAIN_VERIFY_RECORD_MB = "OTEL_TRAIN_VERIFY_RECORD_MB"
"""The cap, in MiB per delivering process, of the run's record of what was logged (``<run folder>/verify/``),
which `otel-train verify` compares the backends with (number >= 0; 0: no record). Past it recording stops and
verify says "not checked past step S". Only used when `OTEL_TRAIN_VERIFY` records. Default 256."""

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"

RANKS_ALLOWED = ("0", "all")
EXPORT_PROCESS_ALLOWED = ("auto", "on", "off")
BACKEND_PROCESSES_ALLOWED = ("auto", "off")
STEP_ORDER_ALLOWED = POLICIES
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

T = TypeVar("T")

ROUTE_FIELDS = ("include", "exclude", "every", "ranks", "logs")


@dataclasses.dataclass(frozen=True)
class Route:
    """Which rows one backend gets: the `init(routes=...)` value for one exporter name.

    ``None`` means "not given": the ``OTEL_TRAIN_<BACKEND>_*`` variable applies, else everything.
    Patterns are globs (`fnmatch`, ``*`` also crosses ``/``) on metric names; a metric passes when
    its wire name or its dashboard name matches (``train/*`` also takes ``train.step.duration_s``,
    shown as ``train/step_duration_s``). Spans are routed by `every` only; log records by `logs` only.

    Args:
        include: Only metrics matching one of these globs (a comma string or a sequence).
        exclude: Minus metrics matching one of these (applied after `include`).
        every: Only steps that are a multiple of this (>= 1).
        ranks: ``"0"`` or ``"all"``: overrides `OTEL_TRAIN_RANKS` for this backend.
        logs: Which log records, by logger name: globs, ``!glob`` to leave some out, ``"off"`` (or ``()``) none.

    Example:
        >>> Route(include="train/*, eval/*", every=10).include
        ('train/*', 'eval/*')
        >>> Route(logs="*, !transformers*").logs, Route(logs="off").logs
        (('*', '!transformers*'), ())
    """

    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    every: int | None = None
    ranks: str | None = None
    logs: tuple[str, ...] | None = None
    #: The setting each pattern list came from, named in messages (``OTEL_TRAIN_WANDB_INCLUDE``).
    include_setting: str = "include"
    exclude_setting: str = "exclude"

    def __post_init__(self) -> None:
        for field in ("include", "exclude"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, _patterns(getattr(self, f"{field}_setting"), value))
        if self.every is not None:
            object.__setattr__(self, "every", parse_int("every", str(self.every), 1))
        if self.ranks is not None:
            object.__setattr__(self, "ranks", _parse_ranks("ranks", str(self.ranks)))
        if self.logs is not None:
            object.__setattr__(self, "logs", _log_patterns("logs", self.logs))

    def merged_over(self, base: Route) -> Route:
        """This route's given fields over `base`'s (keyword over env var)."""
        out = base
        for field in ROUTE_FIELDS:
            value = getattr(self, field)
            if value is not None:
                extra = {f"{field}_setting": getattr(self, f"{field}_setting")} if field in ("include", "exclude") else {}
                out = dataclasses.replace(out, **{field: value}, **extra)
        return out


def _log_patterns(name: str, value: Any) -> tuple[str, ...]:
    """Logger-name globs (``!glob``: left out); ``off`` or an empty sequence: no log records."""
    if isinstance(value, str) and value.strip().lower() == "off":
        return ()
    if not isinstance(value, str) and not list(value):
        return ()
    out = _patterns(name, value)
    if any(p.lstrip("!") == "" for p in out):
        raise ConfigError(f"{name}: {value!r} has a `!` without a pattern; give globs such as `job*,!job.noisy`")
    return out


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    parts = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(str(p).strip() for p in parts if str(p).strip())
    if not out:
        raise ConfigError(f"{name}: {value!r} holds no pattern; give globs such as `train/*` or unset it")
    return out


@dataclasses.dataclass(frozen=True)
class StepSelection:
    """A set of steps (`OTEL_TRAIN_TRACE_STEPS`): inclusive ranges plus periodic runs.

    Example:
        >>> sel = parse_step_selection("OTEL_TRAIN_TRACE_STEPS", "100-102,every:1000:2")
        >>> [s for s in (0, 1, 2, 100, 102, 103, 1001, 1002) if s in sel]
        [0, 1, 100, 102, 1001]
    """

    ranges: tuple[tuple[int, int], ...] = ()
    periodic: tuple[tuple[int, int], ...] = ()  # (every N, first K steps of each)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        return any(a <= step <= b for a, b in self.ranges) or any(step % n < k for n, k in self.periodic)


def parse_step_selection(name: str, raw: str) -> StepSelection:
    """Parse `OTEL_TRAIN_TRACE_STEPS` (see its docstring); raise `ConfigError` naming the bad item."""
    allowed = "use `A-B`, `A`, `every:N` or `every:N:K` separated by commas, e.g. `100-120` or `every:1000:5`"
    ranges: list[tuple[int, int]] = []
    periodic: list[tuple[int, int]] = []
    for item in (part.strip() for part in raw.split(",")):
        try:
            if item.startswith("every:"):
                n, _, k = item[6:].partition(":")
                every, count = int(n), int(k) if k else 1
                if every < 1 or not 1 <= count <= every:
                    raise ValueError
                periodic.append((every, count))
            elif "-" in item[1:]:
                a, b = item.split("-", 1)
                lo, hi = int(a), int(b)
                if lo < 0 or hi < lo:
                    raise ValueError
                ranges.append((lo, hi))
            else:
                one = int(item)
                if one < 0:
                    raise ValueError
                ranges.append((one, one))
        except ValueError:
            raise ConfigError(f"{name}: {item!r} in {raw!r} is not a step selection; {allowed}") from None
    return StepSelection(tuple(ranges), tuple(periodic))


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
    export_process: str = "auto"
    backend_processes: str = "auto"
    drain_timeout_s: float = 120.0
    export_cpus: tuple[int, ...] = ()
    export_nice: int = 0
    routes: Mapping[str, Route] = dataclasses.field(default_factory=dict)
    trace_steps: StepSelection | None = None
    trace_gzip: bool = False
    phases: bool = True
    system_metrics: bool = False
    system_interval_s: float = 1.0
    profiler_bridge: bool = False
    quiet: bool = False
    self_metrics: bool = True
    step_order: str = "warn"
    resume_step: int | None = None
    verify: str = "record"
    verify_record_mb: float = 256.0
    log_level: int | None = 30
    log_rate: float = 500.0
    capture_output: bool = False
    hang_after_s: float = 60.0
    hang_factor: float = 10.0

    @property
    def record_bytes(self) -> int:
        """The cap of the record of what was logged (0: no record): `verify_record_mb` when `verify` records."""
        return int(self.verify_record_mb * 2**20) if self.verify != "off" else 0


def _parse_ranks(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value not in RANKS_ALLOWED:
        raise ConfigError(f"{name}: {raw!r} is not allowed; use `0` (rank 0 exports metrics) or `all`")
    return value


_parse_step_order = choice(STEP_ORDER_ALLOWED)
VERIFY_ALLOWED = ("off", "record", "on")


def _parse_verify(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value in VERIFY_ALLOWED:
        return value
    try:
        return "on" if parse_bool(name, value) else "off"
    except ConfigError:
        raise ConfigError(f"{name}: {raw!r} is not allowed; use off, record or on (or a boolean)") from None
_parse_export_process = choice(EXPORT_PROCESS_ALLOWED)
_parse_backend_processes = choice(BACKEND_PROCESSES_ALLOWED)


def _parse_hang_factor(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a number; expected a multiple >= 1 (e.g. 10)") from None
    if not value >= 1 or math.isinf(value):
        raise ConfigError(f"{name}: {raw!r} is not allowed; expected a finite multiple >= 1 (e.g. 10)")
    return value


# field name -> (env variable, parser)
_ENV: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "exporters": (OTEL_TRAIN_EXPORTERS, parse_exporters),
    "dir": (OTEL_TRAIN_DIR, parse_path),
    "run_name": (OTEL_TRAIN_RUN_NAME, parse_text),
    "run_id": (OTEL_TRAIN_RUN_ID, parse_text),
    "project": (OTEL_TRAIN_PROJECT, parse_text),
    "export_every": (OTEL_TRAIN_EXPORT_EVERY, lambda n, r: parse_int(n, r, 1)),
    "export_interval_s": (OTEL_TRAIN_EXPORT_INTERVAL_S, parse_positive_float),
    "ranks": (OTEL_TRAIN_RANKS, _parse_ranks),
    "shutdown_timeout_s": (OTEL_TRAIN_SHUTDOWN_TIMEOUT_S, parse_positive_float),
    "queue_size": (OTEL_TRAIN_QUEUE_SIZE, lambda n, r: parse_int(n, r, 1)),
    "buffer_size": (OTEL_TRAIN_BUFFER_SIZE, lambda n, r: parse_int(n, r, 1)),
    "strict_sync": (OTEL_TRAIN_STRICT_SYNC, parse_bool),
    "config": (OTEL_TRAIN_CONFIG_JSON, parse_config_json),
    "trace_counters": (OTEL_TRAIN_TRACE_COUNTERS, parse_bool),
    "service_name": (OTEL_SERVICE_NAME, parse_text),
    "export_process": (OTEL_TRAIN_EXPORT_PROCESS, _parse_export_process),
    "backend_processes": (OTEL_TRAIN_BACKEND_PROCESSES, _parse_backend_processes),
    "drain_timeout_s": (OTEL_TRAIN_DRAIN_TIMEOUT_S, parse_positive_float),
    "export_cpus": (OTEL_TRAIN_EXPORT_CPUS, parse_cpus),
    "export_nice": (OTEL_TRAIN_EXPORT_NICE, parse_nice),
    "trace_steps": (OTEL_TRAIN_TRACE_STEPS, parse_step_selection),
    "trace_gzip": (OTEL_TRAIN_TRACE_GZIP, parse_bool),
    "phases": (OTEL_TRAIN_PHASES, parse_bool),
    "system_metrics": (OTEL_TRAIN_SYSTEM_METRICS, parse_bool),
    "system_interval_s": (OTEL_TRAIN_SYSTEM_INTERVAL_S, parse_positive_float),
    "profiler_bridge": (OTEL_TRAIN_PROFILER_BRIDGE, parse_bool),
    "quiet": (OTEL_TRAIN_QUIET, parse_bool),
    "self_metrics": (OTEL_TRAIN_SELF_METRICS, parse_bool),
    "step_order": (OTEL_TRAIN_STEP_ORDER, _parse_step_order),
    "resume_step": (OTEL_TRAIN_RESUME_STEP, lambda n, r: parse_int(n, r, 0, 2**63 - 1)),  # a step: int64
    "verify": (OTEL_TRAIN_VERIFY, lambda n, r: _parse_verify(n, r)),
    "verify_record_mb": (OTEL_TRAIN_VERIFY_RECORD_MB, parse_non_negative_float),
    "log_level": (OTEL_TRAIN_LOG_LEVEL, lambda n, r: parse_log_level(n, r)),
    "log_rate": (OTEL_TRAIN_LOG_RATE, lambda n, r: parse_positive_float(n, r, "log records per second")),
    "capture_output": (OTEL_TRAIN_CAPTURE_OUTPUT, parse_bool),
    "hang_after_s": (OTEL_TRAIN_HANG_AFTER_S, parse_non_negative_float),
    "hang_factor": (OTEL_TRAIN_HANG_FACTOR, _parse_hang_factor),
}


_LOG_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50, "FATAL": 50}


def parse_log_level(name: str, raw: str) -> int | None:
    """A `logging` level by name or number; None for ``off``."""
    value = raw.strip().upper()
    if value in ("OFF", "NONE", "FALSE", "0"):
        return None
    if value in _LOG_LEVELS:
        return _LOG_LEVELS[value]
    try:
        return max(1, int(value))
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not allowed; use DEBUG, INFO, WARNING, ERROR, CRITICAL, a level "
                          "number, or off") from None


def _known_backends() -> list[str]:
    from otel_train.config.registry import known_exporters  # lazy: the registry sits above config

    return sorted(known_exporters())


def _route_variables() -> frozenset[str]:
    """Every fixed `OTEL_TRAIN_*` variable of this module, so that `OTEL_TRAIN_EXPORT_EVERY` is no route."""
    return frozenset(v for k, v in globals().items() if k.startswith("OTEL_TRAIN_") and isinstance(v, str))


def _parse_route_env(env: Mapping[str, str]) -> dict[str, Route]:
    """`OTEL_TRAIN_<BACKEND>_{INCLUDE,EXCLUDE,EVERY,RANKS,LOGS}` -> a `Route` per backend name."""
    fixed = _route_variables()
    known: tuple[str, ...] | None = None  # looked up once, and only if a routing variable is set
    found: dict[str, dict[str, Any]] = {}
    for var, raw in env.items():
        if not var.startswith("OTEL_TRAIN_") or var in fixed or not raw.strip():
            continue
        backend_part, _, suffix = var[len("OTEL_TRAIN_"):].rpartition("_")
        if suffix.lower() not in ROUTE_FIELDS or not backend_part:
            continue
        if known is None:
            known = tuple(_known_backends())
        backend = backend_part.lower()
        if backend not in known:
            upper = ", ".join(f"OTEL_TRAIN_{k.upper()}_{suffix}" for k in known)
            raise ConfigError(f"{var}: unknown backend {backend_part!r} in the variable name; allowed: {upper}")
        field = suffix.lower()
        values = found.setdefault(backend, {})
        if field == "every":
            values[field] = parse_int(var, raw, 1)
        elif field == "ranks":
            values[field] = _parse_ranks(var, raw)
        elif field == "logs":
            values[field] = _log_patterns(var, raw)
        else:
            values[field] = _patterns(var, raw)
            values[f"{field}_setting"] = var
    return {backend: Route(**values) for backend, values in found.items()}


def _validate_routes(value: Any) -> dict[str, Route]:
    """`init(routes=...)`: exporter name -> `Route` or a mapping with the same keys."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"routes: {type(value).__name__} is not allowed; expected a mapping of exporter name -> "
                          "Route (or a dict with include, exclude, every, ranks, logs)")
    known = _known_backends()
    out: dict[str, Route] = {}
    for backend, spec in value.items():
        name = str(backend).strip().lower()
        where = f"routes[{backend!r}]"
        if name not in known:
            raise ConfigError(f"{where}: unknown exporter {backend!r}; known: {', '.join(known)}")
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - set(ROUTE_FIELDS))
            if unknown:
                raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(ROUTE_FIELDS)}")
            kwargs = {k: spec[k] for k in ROUTE_FIELDS if spec.get(k) is not None}
            for field in ("include", "exclude"):
                kwargs[f"{field}_setting"] = f"{where}.{field}"
            spec = Route(**kwargs)
        elif isinstance(spec, Route):
            spec = dataclasses.replace(spec, include_setting=f"{where}.include", exclude_setting=f"{where}.exclude")
        else:
            raise ConfigError(f"{where}: {type(spec).__name__} is not allowed; expected a Route or a dict")
        out[name] = spec
    return out


def _validate_kwarg(field: str, value: Any) -> Any:
    """Validate an explicit `init()` keyword with the same rules as its variable."""
    var = _ENV[field][0] if field in _ENV else field
    if field == "routes":
        return _validate_routes(value)
    if field == "exporters":
        if isinstance(value, str):
            return parse_exporters(var, value)
        return parse_exporters(var, ",".join(value))
    if field == "config":
        if not isinstance(value, Mapping):
            raise ConfigError(f"config: {type(value).__name__} is not allowed; expected a mapping of hyperparameters")
        return dict(value)
    if field == "dir":
        return parse_path(field, value)
    if field == "disabled":
        return value if isinstance(value, bool) else parse_bool(field, str(value))
    if isinstance(value, str):
        return _ENV[field][1](field, value)
    if field in ("export_every", "queue_size", "buffer_size"):
        return parse_int(field, str(value), 1)
    if field == "log_rate":
        return parse_positive_float(field, str(value), "log records per second")
    if field == "log_level":
        return parse_log_level(field, str(value))
    if field == "capture_output":
        return value if isinstance(value, bool) else parse_bool(field, str(value))
    if field == "verify_record_mb":
        return parse_non_negative_float(field, str(value))
    if field == "verify":
        return _parse_verify(field, ("on" if value else "off") if isinstance(value, bool) else str(value))
    if field == "resume_step":
        from otel_train.capture.step import coerce_step

        try:
            step = coerce_step(value, "resume_step")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        return parse_int(field, str(step), 0)
    if field in ("export_interval_s", "shutdown_timeout_s", "system_interval_s", "drain_timeout_s"):
        return parse_positive_float(field, str(value))
    if field == "export_nice":
        return parse_nice(field, str(value))
    if field == "export_cpus":
        return parse_cpus(field, ",".join(str(c) for c in value))
    parser = _ENV[field][1] if field in _ENV else None
    if parser is parse_bool:  # `strict_sync=5`: a flag is True or False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{field}: {value!r} is not allowed; expected True or False")
    if parser is parse_text:  # `run_name=123`
        raise ConfigError(f"{field}: {value!r} is not allowed; expected a string")
    if field in ("ranks", "step_order", "export_process", "backend_processes"):  # a choice: named by its word
        return parser(field, str(value))  # type: ignore[misc]
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
    routes = _parse_route_env(env)
    for key, value in overrides.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"init(): unknown keyword `{key}`; allowed: {allowed}")
        if value is not None:
            values[key] = _validate_kwarg(key, value)
    for backend, route in values.pop("routes", {}).items():  # keyword fields over the variables'
        routes[backend] = route.merged_over(routes.get(backend, Route()))
    values["routes"] = routes
    return Settings(**values)
