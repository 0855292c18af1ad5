"""Training semantic conventions: every attribute and metric name otel-train defines, in one place.

Users who query the same data in Prometheus/Grafana behind the collector rely on these names, so
they are constants here and rows of the table in docs/semantic-conventions.md (a test checks that
the two agree).

Naming rule: on the wire (OTLP, the sink's input, JSONL, Chrome trace) every name otel-train
defines is an OTel-style dotted name (``train.step.duration_s``). Dashboards group series by the
part before the first ``/``, so the backends that do (TensorBoard, W&B, ClearML, MLflow, Trackio)
show the built-in series under their `display_name` (``train/step_duration_s``), in the same
``train`` section as the user's ``train/loss``. User names are never rewritten, except where a backend requires
it (MLflow's character set, the OTel instrument-name rule on the wire: `otel_train.vocab.names`).
Every rank shows a series under the same name (a rank N > 0 sharing a run adds only its ``{rank=N}`` suffix).

This module imports nothing of ours: it sits at the bottom of the dependency order.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CONVENTIONS", "Convention", "display_name"]

# -- attributes (Resource, data points, spans) ---------------------------------------------------
TRAIN_STEP = "train.step"
TRAIN_RUN_ID = "train.run.id"
TRAIN_RUN_NAME = "train.run.name"
TRAIN_RANK = "train.rank"
TRAIN_LOCAL_RANK = "train.local_rank"
TRAIN_WORLD_SIZE = "train.world_size"
TRAIN_CONFIG_HASH = "train.config.hash"
SERVICE_NAME = "service.name"
HOST_NAME = "host.name"
PROCESS_PID = "process.pid"
THREAD_ID = "thread.id"
THREAD_NAME = "thread.name"
LOG_UNCAUGHT = "otel_train.uncaught"
"""Log record scope (logger name) of uncaught exceptions."""
EVENT_NAME = "event.name"
SPAN_TRUNCATED = "otel_train.truncated"
"""Span attribute: the span was still open when a signal ended the process (closed at the hand-off)."""
RUN_PREEMPTED = "otel_train.preempted"
"""Backend run mark (W&B summary field, MLflow tag, ClearML tag ``name:value``): the preemption signal's name."""

# -- the hang watchdog's log record (`otel_train.hangs`): event name and attributes -----------------
TRAIN_HANG = "train.hang"
HANG_STATE = "train.hang.state"
HANG_PHASE = "train.hang.phase"
HANG_SPANS = "train.hang.spans"
HANG_WAITED = "train.hang.waited_s"
HANG_LIMIT = "train.hang.limit_s"
HANG_USUAL = "train.hang.usual_s"
HANG_FRAME = "train.hang.frame"
HANG_USER_FRAME = "train.hang.user_frame"
HANG_NATIVE = "train.hang.native"
HANG_THREADS = "train.hang.threads"
HANG_FILE = "train.hang.file"

# -- metrics recorded at every step end ------------------------------------------------------------
TRAIN_STEP_DURATION = "train.step.duration_s"
TRAIN_TIME_TOTAL = "train.time_total_s"
TRAIN_ITERATIONS = "train.iterations"
TRAIN_THROUGHPUT = "train.throughput"

# -- self-telemetry: what otel-train itself dropped (recorded only when non-zero) -----------------
DROPPED_RECORDS = "otel_train.dropped_records"
DROPPED_SPANS = "otel_train.dropped_spans"
DROPPED_BATCHES = "otel_train.dropped_batches"

# -- self-telemetry from the exporter process (`otel_train.ship.self_metrics`, every window) ---------------
SELF_POINTS = "otel_train.points"
SELF_WINDOWS = "otel_train.windows"
SELF_BACKLOG = "otel_train.backlog_windows"
SELF_ROWS_WRITTEN = "otel_train.rows_written"
SELF_EXPORT_LATENCY = "otel_train.export_latency_s"
SELF_BACKEND_ERRORS = "otel_train.backend_errors"
SELF_DROPPED_WINDOWS = "otel_train.dropped_windows"
# ... recorded only once non-zero (a count that stays: the series appears when the trouble starts)
SELF_SPOOL_FAILED_APPENDS = "otel_train.spool_failed_appends"
SELF_STEPS_BACKWARDS = "otel_train.steps_backwards"
SELF_STEPS_ORDER_DROPPED = "otel_train.steps_order_dropped"


@dataclasses.dataclass(frozen=True)
class Convention:
    """One name otel-train defines.

    Attributes:
        name: The name on the wire (a glob such as ``phase/*`` for a family of names).
        kind: ``resource``, ``point``, ``span`` (where an attribute appears) or ``metric``.
        type: Value type (``int``, ``str``, ``float``).
        unit: UCUM-style unit, ``1`` for counts and ratios, empty for identifiers.
        set_by: Who sets it.
        otel: The OTel semantic convention it follows, or empty where none exists.
        display: The name dashboards show, where it differs from `name`.
    """

    name: str
    kind: str
    type: str
    unit: str
    set_by: str
    otel: str = ""
    display: str = ""


CONVENTIONS: tuple[Convention, ...] = (
    Convention(TRAIN_STEP, "point, span, log record", "int", "1",
               "`ot.step` / `ot.log(step=)`; stamped at collection; a log record: the step it was emitted in"),
    Convention(TRAIN_RUN_ID, "resource", "str", "", "`OTEL_TRAIN_RUN_ID`, else the launcher's job id"),
    Convention(TRAIN_RUN_NAME, "resource", "str", "", "`OTEL_TRAIN_RUN_NAME`, else the run id"),
    Convention(TRAIN_RANK, "resource", "int", "1", "`RANK` / `init(rank=)`"),
    Convention(TRAIN_LOCAL_RANK, "resource", "int", "1", "`LOCAL_RANK` / `init(local_rank=)`"),
    Convention(TRAIN_WORLD_SIZE, "resource", "int", "1", "`WORLD_SIZE` / `init(world_size=)`"),
    Convention(TRAIN_CONFIG_HASH, "resource", "str", "", "hash of `init(config=)` / `OTEL_TRAIN_CONFIG_JSON`"),
    Convention(SERVICE_NAME, "resource", "str", "", "`OTEL_SERVICE_NAME`, default `otel-train`", "service.name"),
    Convention(HOST_NAME, "resource", "str", "", "runtime", "host.name"),
    Convention(PROCESS_PID, "resource", "int", "", "runtime", "process.pid"),
    Convention(THREAD_ID, "span, log record", "int", "", "the thread that started the span / emitted the record",
               "thread.id"),
    Convention(THREAD_NAME, "span, log record", "str", "", "the thread that started the span / emitted the record",
               "thread.name"),
    Convention(EVENT_NAME, "log record", "str", "",
               "a record's `extra={\"event.name\": ...}` (`train.hang`); `exception` for uncaught exceptions",
               "event.name"),
    Convention("exception.{type,message,stacktrace}", "log record", "str", "",
               "a `logging` record with `exc_info`; an uncaught exception", "exception.type"),
    Convention("code.{file.path,function.name,line.number}", "log record", "str", "",
               "the `logging` call that emitted the record", "code.function.name"),
    Convention(LOG_UNCAUGHT, "log record scope", "str", "",
               "the logger name of uncaught exceptions (main thread: FATAL, other threads: ERROR)"),
    Convention(SPAN_TRUNCATED, "span", "bool", "", "a signal ended the process while the span was open"),
    Convention(RUN_PREEMPTED, "backend run", "str", "",
               "a SIGTERM / SIGUSR1 / SIGHUP ended the process: the signal's name (W&B summary, MLflow tag, ClearML tag)"),
    Convention(TRAIN_HANG, "log event", "—", "", "hang watchdog: `event.name` of its WARN log records (logger "
               "`otel_train.hang`) and of the records in `hang/rank<N>.json`"),
    Convention(HANG_STATE, "log", "str", "", "hang watchdog: `stuck` (a record while stuck), `resumed` (the work "
               "ended), `ended` (the rank ended while still stuck)"),
    Convention(HANG_PHASE, "log", "str", "", "hang watchdog: the innermost open span's name, else `step`"),
    Convention(HANG_SPANS, "log", "str[]", "", "hang watchdog: the open spans of the main thread, outermost first"),
    Convention(HANG_WAITED, "log", "float", "s", "hang watchdog: how long the step (or span) has run; when resumed, "
               "how long it ran"),
    Convention(HANG_LIMIT, "log", "float", "s", "hang watchdog: the limit it passed, max(factor × usual, floor)"),
    Convention(HANG_USUAL, "log", "float", "s", "hang watchdog: the median duration of the same kind (absent: none "
               "seen yet)"),
    Convention(HANG_FRAME, "log", "str", "", "hang watchdog: the main thread's innermost Python frame, "
               "`file:line in function`"),
    Convention(HANG_USER_FRAME, "log", "str", "", "hang watchdog: the main thread's innermost frame in the user's "
               "code"),
    Convention(HANG_NATIVE, "log", "bool", "", "hang watchdog: the main thread is in native code (its frame did "
               "not move between two looks)"),
    Convention(HANG_THREADS, "log", "str", "", "hang watchdog: every thread's stack, innermost frame first (text)"),
    Convention(HANG_FILE, "log", "str", "", "hang watchdog: the `hang/rank<N>.json` file with the whole record"),
    Convention(TRAIN_STEP_DURATION, "metric", "float", "s", "every step end", display="train/step_duration_s"),
    Convention(TRAIN_TIME_TOTAL, "metric", "float", "s", "every step end", display="train/time_total_s"),
    Convention(TRAIN_ITERATIONS, "metric", "int", "1", "every step end", display="train/iterations"),
    Convention(TRAIN_THROUGHPUT, "metric", "float", "1/s", "step end with `samples=`", display="train/throughput"),
    Convention(DROPPED_RECORDS, "metric", "int", "1", "reader: logged records dropped (buffer full)",
               display="otel_train/dropped_records"),
    Convention(DROPPED_SPANS, "metric", "int", "1", "reader: spans dropped (buffer full)",
               display="otel_train/dropped_spans"),
    Convention(DROPPED_BATCHES, "metric", "int", "1", "reader: export windows dropped (queue full)",
               display="otel_train/dropped_batches"),
    Convention(SELF_POINTS, "metric", "int", "1", "exporter process: points received so far",
               display="otel_train/points"),
    Convention(SELF_WINDOWS, "metric", "int", "1", "exporter process: windows received so far",
               display="otel_train/windows"),
    Convention(SELF_BACKLOG, "metric", "int", "1", "exporter process, `{exporter=X}`: windows waiting for X, the arriving one included",
               display="otel_train/backlog_windows"),
    Convention(SELF_ROWS_WRITTEN, "metric", "int", "1",
               "exporter process, `{exporter=X}`: rows (points and spans) handed to X so far",
               display="otel_train/rows_written"),
    Convention(SELF_EXPORT_LATENCY, "metric", "float", "s",
               "exporter process, `{exporter=X}`: mean time of X's writes since the last window",
               display="otel_train/export_latency_s"),
    Convention(SELF_BACKEND_ERRORS, "metric", "int", "1",
               "exporter process, `{exporter=X}`: X's failed writes so far (each is retried)",
               display="otel_train/backend_errors"),
    Convention(SELF_DROPPED_WINDOWS, "metric", "int", "1",
               "exporter process, `{exporter=X}`: windows X gave up on (rejected on every retry, or its queue overflowed)",
               display="otel_train/dropped_windows"),
    Convention(SELF_SPOOL_FAILED_APPENDS, "metric", "int", "1",
               "exporter process: windows the spool could not write ahead (disk full), delivered from memory only; "
               "once non-zero", display="otel_train/spool_failed_appends"),
    Convention(SELF_STEPS_BACKWARDS, "metric", "int", "1",
               "exporter process, `{exporter=X}`: rows whose step went backwards in their series, seen by X; "
               "once non-zero", display="otel_train/steps_backwards"),
    Convention(SELF_STEPS_ORDER_DROPPED, "metric", "int", "1",
               "exporter process, `{exporter=X}`: rows X did not write because of their step (backwards in "
               "TensorBoard and W&B, everywhere under `drop`/`raise`; older than W&B's last; held by a resumed "
               "run); once non-zero",
               display="otel_train/steps_order_dropped"),
    Convention("worker", "point, span, log record", "int", "1",
               "DataLoader worker id (pid for other child processes) of child-process data"),
    # Names of the phase and system-metrics feature (defined there; listed here so the table is whole).
    Convention("phase/<name>_s", "metric", "float", "s", "phase timing (per step)"),
    Convention("phase/other_s", "metric", "float", "s", "phase timing: step time outside every phase"),
    Convention("system/cpu_percent/{mean,max}", "metric", "float", "%", "system metrics sampler (100 = one core)",
               "process.cpu.utilization"),
    Convention("system/rss_mb/{mean,max}", "metric", "float", "MiBy", "system metrics sampler", "process.memory.usage"),
    Convention("system/host_memory_percent/{mean,max}", "metric", "float", "%", "system metrics sampler",
               "system.memory.utilization"),
    Convention("system/host_memory_used_mb/{mean,max}", "metric", "float", "MiBy", "system metrics sampler",
               "system.memory.usage"),
    Convention("gpu<N>/util_percent/{mean,max}", "metric", "float", "%", "system metrics sampler (NVML)",
               "hw.gpu.utilization"),
    Convention("gpu<N>/memory_used_mb/{mean,max}", "metric", "float", "MiBy", "system metrics sampler (NVML)",
               "hw.gpu.memory.usage"),
    Convention("gpu<N>/power_w/{mean,max}", "metric", "float", "W", "system metrics sampler (NVML)", "hw.power"),
    Convention("gpu<N>/temperature_c/{mean,max}", "metric", "float", "Cel", "system metrics sampler (NVML)",
               "hw.temperature"),
    Convention("cuda<N>/max_allocated_mb/{mean,max}", "metric", "float", "MiBy",
               "system metrics sampler (torch, when imported)"),
)

#: Wire name -> the name dashboards show (only names that differ).
DISPLAY_NAMES: dict[str, str] = {c.name: c.display for c in CONVENTIONS if c.display}


def display_name(name: str) -> str:
    """The name a dashboard shows for metric `name`: built-ins in their section, others unchanged.

    Example:
        >>> display_name("train.step.duration_s"), display_name("train/loss")
        ('train/step_duration_s', 'train/loss')
    """
    return DISPLAY_NAMES.get(name, name)
