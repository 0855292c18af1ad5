"""Wiring: settings -> Resource, providers, the one reader, exporters; atexit and signals.

Nothing imports this module but the public face (`otel_train/__init__.py`) and the CLI.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train import config as cfg
from otel_train import semconv
from otel_train.errors import ConfigError
from otel_train.instrument import (
    NO_SPAN,
    LogBuffer,
    ProfiledSpanScope,
    SpanBuffer,
    SpanScope,
    open_span_scopes,
)
from otel_train.records import ExporterOptions, RunInfo, config_hash
from otel_train.registry import check_available, get_spec, load_class
from otel_train.step import (
    StepEnd,
    _current,
    check_log_step,
    current_step,
    set_step_end_hook,
    set_step_order,
    step_end_hook,
)

__all__ = ["TRUNCATED_ATTRIBUTE", "Session", "resolve_run_id", "start"]

#: Span attribute set on spans that were still open when a signal ended the process.
TRUNCATED_ATTRIBUTE = semconv.SPAN_TRUNCATED

_logger = logging.getLogger("otel_train")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not an integer; the launcher should set a whole number") from None


def resolve_run_id(settings: cfg.Settings, env: Mapping[str, str]) -> str:
    """The run id, equal on every rank of one job without communication.

    Explicit `OTEL_TRAIN_RUN_ID`, else the launcher's job id, else (several ranks) a hash of the
    rendezvous address, else (one process) a fresh time-based id.
    """
    if settings.run_id:
        return settings.run_id
    for var in cfg.JOB_ID_VARIABLES:
        value = env.get(var, "").strip()
        if value and value.lower() != "none":
            return value
    world = _env_int(env, "WORLD_SIZE", 1)
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if world > 1 and addr and port:
        launcher = _launcher_identity(env, world)
        if launcher is None:
            _logger.warning("no OTEL_TRAIN_RUN_ID or launcher job id, and the ranks span hosts: deriving the run id "
                            "from MASTER_ADDR:MASTER_PORT; set OTEL_TRAIN_RUN_ID to keep runs of reused ports apart")
            launcher = ""
        return "job-" + hashlib.sha256(f"{addr}:{port}:{world}:{launcher}".encode()).hexdigest()[:12]
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def _launcher_identity(env: Mapping[str, str], world: int) -> str | None:
    """``pid:start time`` of the process that started this job's ranks, when they all run on this host: equal
    on every rank of one job, different for the next job even on the same rendezvous port (`accelerate
    launch` always uses 29500). None when the ranks may span hosts or the start time cannot be read.

    The launcher is the `multiprocessing` parent (``mp.spawn``), else the parent process when the launcher
    put the rank in this process's initial environment (torchrun and `accelerate launch` start every rank,
    Lightning's DDP launcher starts ranks 1..n-1 from rank 0), else this process (Lightning's rank 0, which
    starts the others itself).
    """
    import multiprocessing

    parent = multiprocessing.parent_process()
    local_world = env.get("LOCAL_WORLD_SIZE", "").strip()
    one_host = (parent is not None or local_world == str(world)
                or env.get("MASTER_ADDR", "").strip().lower() in _LOOPBACK)
    if not one_host:
        return None
    if parent is not None and parent.pid:
        pid = parent.pid
    elif _in_initial_environment(("RANK", "LOCAL_RANK")):
        pid = os.getppid()
    else:
        pid = os.getpid()
    start = _process_start(pid)
    return None if start is None else f"{pid}:{start}"


def _in_initial_environment(names: tuple[str, ...]) -> bool:
    """Whether one of `names` was in the environment this process was started with (Linux ``/proc``)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            keys = {entry.split(b"=", 1)[0] for entry in f.read().split(b"\0")}
    except OSError:
        return False
    return any(name.encode() in keys for name in names)


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux ``/proc``): with the pid, a process
    identity that a reused pid does not repeat. None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[19].decode()  # field 22, counted after "pid (comm)"
    except (OSError, ValueError, IndexError):
        return None


def adopt_placement(session: Session, rank: int | None, local_rank: int | None,
                    world_size: int | None) -> Session | DisabledSession | None:
    """A new session in the framework's place (rank, local rank, world size), when `session` (started by the
    user's `init()` before the framework said where this process runs) disagrees and has exported nothing.

    Lightning's DDP launcher re-runs the script without ``RANK``: an `init()` at the top makes rank 1 believe
    it is rank 0 of a run of its own. Adopting shuts that session down and starts one with the same settings
    at the framework's rank (so the run id is the job's, see `resolve_run_id`). Returns None (and warns once,
    loudly) when it cannot: data was already exported, or the session has exporter instances, which cannot
    be rebuilt. Returns `session` itself when the places agree.
    """
    run = session.run
    wanted = {"rank": rank, "local_rank": local_rank, "world_size": world_size}
    differs = {k: v for k, v in wanted.items() if v is not None and int(v) != getattr(run, k)}
    if not differs:
        return session
    have = ", ".join(f"{k}={getattr(run, k)}" for k in differs)
    want = ", ".join(f"{k}={v}" for k, v in differs.items())
    instances = len(session.exporters) > len(_placement(session.settings)[0])
    if session.reader.windows or instances:
        _logger.error("otel-train: the framework says this process is %s, but the running session (started by "
                      "init() before the framework's launcher set the rank) is %s and %s; its data is labelled "
                      "with the wrong rank and run. Call otel_train.init() after the framework has started its "
                      "processes (e.g. in the LightningModule's setup), or let the integration start it",
                      want, have, "has exported data already" if session.reader.windows else
                      "has exporter instances that cannot be rebuilt")
        return None
    _logger.info("otel-train: adopting the framework's place (%s instead of %s): the session started by "
                 "init() restarts before anything was exported", want, have)
    settings = session.settings
    session.shutdown()
    env = dict(os.environ)
    env.update({k.upper(): str(int(v)) for k, v in wanted.items() if v is not None})
    return start(settings, env=env)


def _check_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".otel-train-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"OTEL_TRAIN_DIR: cannot write to {str(path)!r} ({err.strerror or err}); "
            "give a directory this process can create and write"
        ) from None
    return path


class Session:
    """One `init()`: the providers, the reader and the exporters of this process."""

    enabled = True

    def __init__(self, settings: cfg.Settings, env: Mapping[str, str], instances: Sequence[Any] = ()) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics._internal.exemplar import AlwaysOffExemplarFilter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        from otel_train.reader import StepAlignedMetricReader, ThreadSpanProcessor

        self.settings = settings
        rank = _env_int(env, "RANK", 0)
        run_id = resolve_run_id(settings, env)
        self.run = RunInfo(
            run_id=run_id,
            run_name=settings.run_name or run_id,
            rank=rank,
            local_rank=_env_int(env, "LOCAL_RANK", 0),
            world_size=max(1, _env_int(env, "WORLD_SIZE", 1)),
            service_name=settings.service_name,
            host=socket.gethostname(),
            pid=os.getpid(),
            config_hash=config_hash(settings.config),
        )
        # A backend's `OTEL_TRAIN_<BACKEND>_RANKS=all` makes this rank export metrics; routing drops them elsewhere.
        self.export_metrics = rank == 0 or settings.ranks == "all" or any(
            r.ranks == "all" for r in settings.routes.values())
        directory = _check_dir(settings.dir)
        options = ExporterOptions.from_settings(settings, directory=directory)
        local, remote = _placement(settings)
        self.export_process = None
        if remote:
            from otel_train.export_process import ExportProcess

            self.export_process = ExportProcess(remote, options, self.run, drain_timeout_s=settings.drain_timeout_s,
                                                cpus=settings.export_cpus, nice=settings.export_nice,
                                                self_metrics=settings.self_metrics)
        try:
            self.exporters = self._build_exporters(local, options) + list(instances)
        except BaseException:
            if self.export_process is not None:
                self.export_process.close(time.monotonic() + 1.0)
            raise
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME under ours.
        self.resource = Resource.create(self.run.resource_attributes())
        self.log_buffer = LogBuffer(settings.buffer_size, strict=settings.strict_sync)
        self.span_buffer = SpanBuffer(settings.buffer_size)
        self.reader = StepAlignedMetricReader(
            self.exporters,
            export_every=settings.export_every,
            export_interval_s=settings.export_interval_s,
            queue_size=settings.queue_size,
            log_buffer=self.log_buffer,
            span_buffer=self.span_buffer,
            export_metrics=self.export_metrics,
            resource=self.resource,
            channel=self.export_process,
            phases=settings.phases,
        )
        self.meter_provider = MeterProvider(
            metric_readers=[self.reader], resource=self.resource,
            exemplar_filter=AlwaysOffExemplarFilter(), shutdown_on_exit=False,
        )
        self.tracer_provider = TracerProvider(resource=self.resource, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(ThreadSpanProcessor(self.span_buffer))
        self.sampler = None
        if settings.system_metrics and self.export_metrics:
            from otel_train.system_metrics import SystemSampler

            self.sampler = SystemSampler(self.log_buffer.append, settings.system_interval_s)
            self.sampler.start()
        self._install_globals()
        self._closed = False
        self._lock = threading.Lock()
        self._append = self.log_buffer.append
        set_step_order(settings.step_order, resume=settings.resume_step is not None)
        self._check_step = settings.step_order == "raise"
        self._scope_class = ProfiledSpanScope if settings.profiler_bridge else SpanScope
        self._step_hook = self.reader.step_end_hook()
        set_step_end_hook(self._step_hook)
        self.forked = False
        self.worker: Any = None
        self._worker_address = self.export_process.worker_address if self.export_process is not None else None
        # Spawned children (DataLoader workers, multiprocessing) find the run here: the one variable
        # otel-train sets, because a spawned child has nothing else of ours. Removed at shutdown.
        os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS] = self._worker_address or "none"
        from otel_train.workers import WorkerClient

        self._worker_class = WorkerClient
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # A forked child (e.g. a DataLoader worker) shares the parent's open files, backend runs and
        # exporter-process socket: it must use none of them. Its `ot.log`/`ot.span` go through a
        # connection of its own to the exporter process (`otel_train.workers`), opened on first use.
        if not self._closed:
            self.worker = self._worker_class(self._worker_address)
        self._closed = True
        self.forked = True

    def export_progress(self, timeout_s: float = 5.0) -> Any:
        """The exporter process's progress (`otel_train.delivery.Progress`: windows spooled, per backend
        the last durable window and step, `behind()`), or None when every backend runs in this process."""
        if self.export_process is None:
            return None
        return self.export_process.progress(timeout_s)

    @staticmethod
    def _build_exporters(names: tuple[str, ...], options: ExporterOptions) -> list[Any]:
        specs = [get_spec(name) for name in names]  # unknown names fail before anything is built
        for spec in specs:
            check_available(spec)
        built = []
        for spec in specs:
            try:
                built.append(load_class(spec)(options))
            except (ImportError, ConfigError):
                for ex in built:
                    ex.shutdown()
                raise
            except Exception as err:
                for ex in built:
                    ex.shutdown()
                raise ConfigError(f"OTEL_TRAIN_EXPORTERS: exporter {spec.name!r} could not start: "
                                  f"{type(err).__name__}: {err}") from err
        return built

    def _install_globals(self) -> None:
        from opentelemetry import metrics, trace

        # The OTel API allows setting each global once per process; later sessions keep their own.
        if type(metrics.get_meter_provider()).__name__.startswith(("_Proxy", "NoOp")):
            metrics.set_meter_provider(self.meter_provider)
        if type(trace.get_tracer_provider()).__name__.startswith(("Proxy", "NoOp")):
            trace.set_tracer_provider(self.tracer_provider)

    # -- hot path ---------------------------------------------------------------------------
    def log(self, mapping: Mapping[str, Any], step: int | None = None) -> None:
        if step is None:
            step = _current.get()
            if step is None:
                step = current_step() or 0
        elif self._check_step:
            check_log_step(step)  # OTEL_TRAIN_STEP_ORDER=raise: API misuse, raised where it happens
        try:
            self._append(step, dict(mapping))
        except (TypeError, ValueError):
            _logger.warning("otel_train.log expects a mapping of name -> number, got %s; skipped",
                            type(mapping).__name__)

    def span(self, name: str, attributes: Mapping[str, Any] | None = None, record_context: bool = True) -> Any:
        return self._scope_class(self.span_buffer, name, attributes, record_context)

    def add_config(self, config: Mapping[str, Any]) -> None:
        """Merge hyperparameters that a framework reports after `init()` into the run's config.

        Backends read the config when they open their run, at the first metrics they write, so
        config added before the first export reaches every backend (frameworks report it before
        training starts); a backend that has already opened its run keeps the config it had.
        """
        merged = {**(self.settings.config or {}), **config}
        self.settings = dataclasses.replace(self.settings, config=merged)
        for exporter in self.exporters:
            options = getattr(exporter, "options", None)
            if isinstance(options, ExporterOptions):
                exporter.options = dataclasses.replace(options, hparams=merged)
        if self.export_process is not None:
            self.export_process.add_config(merged)

    def resume(self, step: int) -> None:
        """The run restarts at `step` (`otel_train.resume`): steps may start again below the latest, and every
        backend, here and in the exporter process, supersedes the earlier attempt's steps >= `step`, in order
        after what was logged before. Never raises, never waits for a backend."""
        if self._closed:
            return
        set_step_order(self.settings.step_order, resume=True)
        try:
            self.reader.resume(step)
        except Exception:
            _logger.warning("otel-train: declaring the resume at step %d failed", step, exc_info=True)

    def step_ended(self, step: int) -> None:
        """`otel_train.step_ended`: a framework's logged step is a step boundary for collection (the reader
        wakes the collector as at an `otel_train.step` end, every `export_every` steps, at most every 0.1 s).
        Never raises."""
        if self._closed:
            return
        try:
            reader = self.reader
            reader.on_step_end(StepEnd(int(step), 0.0, time.monotonic(), 0, None))
            if reader._steps_since >= reader.export_every:  # due, but within 0.1 s of the last wake-up
                self._wake_later(reader._wake)
        except Exception:
            _logger.warning("otel-train: declaring the end of step %r failed", step, exc_info=True)

    def _wake_later(self, wake: threading.Event) -> None:
        """Wake the collector in 0.1 s (one timer at a time): a framework may log its last steps and then pause
        (evaluation, a hang, a crash), with no later step end to collect them, unlike an `ot.step` loop."""
        timer = getattr(self, "_deferred_wake", None)
        if timer is not None and timer.is_alive():
            return
        timer = threading.Timer(0.1, wake.set)
        timer.daemon = True
        timer.start()
        self._deferred_wake = timer

    # -- lifecycle ----------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        if self._closed:
            return True
        timeout = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        try:
            return self.reader.force_flush(timeout * 1000)
        except Exception:
            _logger.warning("flush failed", exc_info=True)
            return False

    def shutdown(self, deadline: float | None = None) -> None:
        """Flush and close everything by `deadline` (`time.monotonic()`; default: the shutdown timeout)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if step_end_hook() is self._step_hook:
            set_step_end_hook(None)
        if os.environ.get(cfg.OTEL_TRAIN_WORKER_ADDRESS) == (self._worker_address or "none"):
            del os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS]
        set_step_order("warn")
        preempted = _preempted_by
        if preempted is not None:  # backends that have the notion mark the run as preempted before closing it
            for exporter in self.exporters:
                if hasattr(exporter, "preempt_at_close"):
                    exporter.preempt_at_close(preempted)
            if self.export_process is not None:
                self.export_process.preempted = preempted
        timeout_s = self.settings.shutdown_timeout_s
        if deadline is not None:
            timeout_s = max(0.05, min(timeout_s, deadline - time.monotonic()))
        try:
            if self.sampler is not None:
                self.sampler.stop()  # its last step goes out with the final flush
            self.reader.shutdown(timeout_s * 1000)
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown(timeout_millis=1000)
        except Exception:
            _logger.warning("shutdown did not complete cleanly", exc_info=True)
        if self.run.rank == 0 and not self.settings.quiet:
            self._write_summary()

    def _write_summary(self) -> None:
        from otel_train.records import run_folder
        from otel_train.summary import summary_line, write_summary

        try:
            stats = self.reader.stats()
            names = [str(getattr(ex, "name", type(ex).__name__)) for ex in self.exporters]
            failures, dropped = dict(stats["failures"]), stats["dropped"]
            in_process = [ex for ex in self.exporters if hasattr(ex, "step_order")]
            backwards = {ex.name: ex.step_order.backwards for ex in in_process}
            order_dropped = {ex.name: ex.step_order.dropped + int(getattr(ex, "steps_dropped", 0)) for ex in in_process}
            spool_failed = 0
            if self.export_process is not None:  # the exporter process's backends: its last progress report
                names += list(self.export_process.names)
                progress = self.export_process.last_progress
                failures.update(progress.failures)
                dropped += self.export_process.dropped + sum(progress.dropped.values())
                backwards.update(progress.steps_backwards)
                order_dropped.update(progress.steps_order_dropped)
                spool_failed = progress.spool_failed_appends
            write_summary(summary_line(stats["points"], stats["windows"], names, dropped,
                                       failures, str(run_folder(self.settings.dir, self.run.run_name)),
                                       steps_backwards=backwards, steps_order_dropped=order_dropped,
                                       spool_failed_appends=spool_failed))
        except Exception:
            _logger.debug("no shutdown summary", exc_info=True)

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def release_signal(signum: int) -> Any:
        """Give `signum` back to the handler it had before `init()`, for a framework that installs its own
        handler only over the default one (Lightning's SLURM requeue handler).

        Returns:
            otel-train's handler, for the caller to chain in front of the framework's (called from a
            handler composed so, it only flushes); None when otel-train's is not the current handler
            (then nothing changed).
        """
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signum) is not _on_signal:
            return None
        signal.signal(signum, _previous_handlers.get(signum, signal.SIG_DFL))
        return _on_signal

    def step_order_counts(self) -> dict[str, dict[str, int]]:
        """Per exporter name: rows whose step went backwards, and of those dropped (`OTEL_TRAIN_STEP_ORDER`)."""
        return {ex.name: ex.step_order.counts() for ex in self.exporters if hasattr(ex, "step_order")}


def _is_builtin(target: str) -> bool:
    """Whether a registry target (``module:Class``) is one of our own backends."""
    return target.partition(":")[0].split(".")[:2] == ["otel_train", "exporters"]


def _placement(settings: cfg.Settings) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split the named exporters into (built here, built in the exporter process).

    Built-in backends (`otlp` included) go to the exporter process unless `OTEL_TRAIN_EXPORT_PROCESS=off`.
    Staying here: third-party names (entry points; their classes may not expect to run elsewhere).
    Unknown names and missing packages fail here, before anything starts.
    """
    from otel_train.registry import check_available, get_spec

    names = settings.exporters
    for spec in [get_spec(n) for n in names]:
        check_available(spec)
    if settings.export_process == "off" or (settings.export_process == "auto" and (
            os.name != "posix" or not sys.executable)):
        return names, ()  # the exporter process needs Unix sockets, fd passing and an interpreter to start
    remote = tuple(n for n in names if _is_builtin(get_spec(n).target))
    return tuple(n for n in names if n not in remote), remote


class DisabledSession:
    """What `init()` returns under `OTEL_TRAIN_DISABLED` / `OTEL_SDK_DISABLED`: every call is a no-op."""

    enabled = False
    closed = False

    def __init__(self, settings: cfg.Settings) -> None:
        self.settings = settings

    def log(self, mapping: Mapping[str, Any], step: int | None = None) -> None:
        return None

    def span(self, name: str, attributes: Mapping[str, Any] | None = None, record_context: bool = True) -> Any:
        return NO_SPAN

    def add_config(self, config: Mapping[str, Any]) -> None:
        return None

    def resume(self, step: int) -> None:
        return None

    def flush(self, timeout_s: float | None = None) -> bool:
        return True

    def shutdown(self) -> None:
        self.closed = True


# -- process hooks --------------------------------------------------------------------------------
#: Signals handed off like interpreter exit. SIGUSR1 is SLURM's `--signal` warning before preemption.
_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
#: Of those, the ones that mean preemption (a scheduler's), not a user's Ctrl-C.
_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
#: The preemption signal this process received (its name), once one has: the backends mark their runs at shutdown.
_preempted_by: str | None = None
_hooks_installed = False
_previous_handlers: dict[int, Any] = {}
_active: list[Session] = []
_handoff: threading.Thread | None = None


def _shutdown_budget_s() -> float:
    """The one deadline for hand-offs: the longest `OTEL_TRAIN_SHUTDOWN_TIMEOUT_S` of the open sessions."""
    return max((s.settings.shutdown_timeout_s for s in _active if not s.closed), default=0.0)


def _shutdown_active() -> None:
    """Shut every session down under ONE deadline (`_shutdown_budget_s`)."""
    deadline = time.monotonic() + _shutdown_budget_s()
    for session in [s for s in _active if not s.closed]:
        session.shutdown(deadline)


def _at_exit() -> None:
    handoff = _handoff
    if handoff is not None:  # a signal's hand-off is under way: let it finish (it has the deadline)
        handoff.join(_shutdown_budget_s() + 1.0)
    _shutdown_active()


def _record_truncated(scopes: list[Any]) -> None:
    """Record the scopes still open as spans ended now, flagged `otel_train.truncated` (a scope is
    its own span record: it is ended here as its exit would end it)."""
    session = next((s for s in reversed(_active) if not s.closed), None)
    if session is None:
        return
    now = time.time_ns()
    for scope in scopes:
        if hasattr(scope, "end_ns"):  # ended meanwhile: recorded by its own exit
            continue
        if not hasattr(scope, "start_ns"):  # the signal came inside its `__enter__`: it never started
            continue
        scope.end_ns = now
        scope.attributes = {**(scope.attributes or {}), TRUNCATED_ATTRIBUTE: True}
        session.span_buffer.append(scope)


def _end_process(signum: int, scopes: list[Any]) -> None:
    try:
        _record_truncated(scopes)
        _shutdown_active()
    except Exception:
        _logger.warning("otel-train: hand-off on signal %d failed", signum, exc_info=True)
    os.kill(os.getpid(), signum)  # the default action, now restored: same exit status as without us


def _flush_active() -> None:
    deadline = time.monotonic() + _shutdown_budget_s()
    for session in [s for s in _active if not s.closed]:
        session.flush(max(0.0, deadline - time.monotonic()))


_LOCKING_CODE = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(threading.__file__) + os.sep + "threading",
                 os.sep + "opentelemetry" + os.sep)


def _interrupted_locking_code(frame: Any) -> bool:
    """Whether the signal interrupted our own code, OTel's or `threading` (which may hold a lock the
    flush needs, e.g. inside the reader's wake-up `Event.set`), rather than the user's."""
    code_file = getattr(getattr(frame, "f_code", None), "co_filename", "")
    return code_file.startswith(_LOCKING_CODE[:2]) or _LOCKING_CODE[2] in code_file


def _on_signal(signum: int, frame: Any) -> None:
    """Hand off on a signal. The work runs on a thread of its own: a signal handler runs inside
    whatever the training thread was doing, possibly holding a lock that flushing needs."""
    global _handoff, _preempted_by
    name = signal.Signals(signum).name
    if name in _PREEMPTION_SIGNALS and _preempted_by is None:
        _preempted_by = name
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    # Called by a handler installed after ours that chains to it (Lightning composes handlers this way):
    # that handler decides whether the process ends, so we only flush.
    chained = signal.getsignal(signum) is not _on_signal
    if previous in (signal.SIG_DFL, None) and not chained:
        # The default action ends the process: flush and close everything (open spans recorded as
        # truncated), then end it by the same signal. A second signal meanwhile ends it at once.
        signal.signal(signum, signal.SIG_DFL)
        _handoff = threading.Thread(target=_end_process, args=(signum, open_span_scopes()), name="otel-train-signal",
                                    daemon=True)
        _handoff.start()
        return
    # A handler of the user's or a framework's (Lightning's SLURM requeue, a checkpoint hook) runs next and
    # decides whether the process ends: flush first, waiting at most the deadline (should the interrupted
    # code hold a lock the flush needs, the wait ends at the deadline, never later).
    _handoff = threading.Thread(target=_flush_active, name="otel-train-signal", daemon=True)
    _handoff.start()
    if not _interrupted_locking_code(frame):  # else the flush waits for the locks the loop holds: go on
        _handoff.join(_shutdown_budget_s())
    if callable(previous) and previous is not _on_signal:
        previous(signum, frame)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_at_exit)
    if threading.current_thread() is not threading.main_thread():
        _logger.debug("init() outside the main thread: no signal handlers installed")
        return
    for name in _SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None:  # SIGUSR1 does not exist on Windows
            continue
        try:
            _previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not allowed here (embedded interpreter)
            pass


def start(settings: cfg.Settings, env: Mapping[str, str] | None = None,
          instances: Sequence[Any] = ()) -> Session | DisabledSession:
    """Build the session for `settings` (plus ready-made exporter `instances`).

    Raises:
        ConfigError: anything misconfigured.
    """
    if settings.disabled:
        os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS] = "disabled"  # its spawned children: no-ops too, silently
        return DisabledSession(settings)
    session = Session(settings, os.environ if env is None else env, instances)
    _active[:] = [s for s in _active if not s.closed]
    _active.append(session)
    _install_hooks()
    return session
