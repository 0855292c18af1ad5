"""Wiring: settings -> Resource, providers, the one reader, exporters; atexit and signals.

Nothing imports this module but the public face (`otel_train/__init__.py`) and the CLI.
"""

from __future__ import annotations

import atexit
import contextlib
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train import config as cfg
from otel_train import semconv
from otel_train._internal import sdk
from otel_train._internal.at_fork import after_fork_in_child
from otel_train.capture.instrument import (
    NO_SPAN,
    LogBuffer,
    ProfiledSpanScope,
    SpanBuffer,
    SpanScope,
    open_span_scopes,
)
from otel_train.capture.step import (
    StepEnd,
    _current,
    check_log_step,
    coerce_step,
    current_step,
    set_refused_step_hook,
    set_step_end_hook,
    set_step_order,
    step_end_hook,
)
from otel_train.errors import ConfigError
from otel_train.exporter_options import ExporterOptions
from otel_train.registry import check_available, get_spec, load_class
from otel_train.run_identity import RunInfo, config_hash

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


def _env_rank(env: Mapping[str, str]) -> int:
    """The global rank: ``RANK``; without it, local rank i of the first node is rank i (Lightning's DDP launcher
    re-runs the script for ranks 1..n-1 with ``LOCAL_RANK``, ``NODE_RANK`` and ``WORLD_SIZE`` but no ``RANK``:
    an `init()` at the top must not take rank 0's place); else 0."""
    if env.get("RANK", "").strip():
        return _env_int(env, "RANK", 0)
    local = _env_int(env, "LOCAL_RANK", 0)
    first_node = _env_int(env, "NODE_RANK", _env_int(env, "GROUP_RANK", 0)) == 0
    return local if first_node and 0 < local < _env_int(env, "WORLD_SIZE", 1) else 0


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
    session.settings = dataclasses.replace(settings, quiet=True)  # no summary naming a run that never was
    session.shutdown()
    if not session.reader.windows:  # nothing went out at shutdown either: no folder of a run that never was
        _remove_unused_run_folder(session.run_claim.path)
    else:  # what was logged before the framework said where this process runs went out at the shutdown
        _logger.warning("otel-train: values logged before the framework set the rank are in run %r (rank %d), "
                        "not in the job's run", session.run.run_id, session.run.rank)
    env = dict(os.environ)
    env.update({k.upper(): str(int(v)) for k, v in wanted.items() if v is not None})
    return start(settings, env=env)


#: What a session that exported nothing leaves in its rank's spool folder (written at `init()`).
_UNUSED_SPOOL_FILES = frozenset({"writer.lock", "exporters.json", "exporter.log"})


def _remove_unused_run_folder(spool: Path, wait_s: float = 5.0) -> None:
    """Remove the rank's spool folder of a session that exported nothing, and its run folder if nothing else
    is in it. Only once this process holds the folder's claim (the session's exporter process has exited) and
    only when it holds nothing but what `init()` wrote (an empty exporter log: a non-empty one is kept)."""
    from otel_train.ship.spool import LOCK_FILE, try_lock

    deadline = time.monotonic() + wait_s
    try:
        fd = try_lock(spool)
        while fd is None and time.monotonic() < deadline:
            time.sleep(0.05)
            fd = try_lock(spool)
    except OSError:
        return
    if fd is None:
        _logger.debug("otel-train: %s is still held; the unused run folder stays", spool)
        return
    try:
        files = {p.name: p for p in spool.iterdir()}
        log = files.get("exporter.log")
        if not set(files) <= _UNUSED_SPOOL_FILES or (log is not None and log.stat().st_size):
            return
        for name, path in files.items():
            if name != LOCK_FILE:
                path.unlink()
        files[LOCK_FILE].unlink()  # last, still locked: a contender that opened it first retries on a new file
    except OSError:
        return
    finally:
        os.close(fd)
    for folder in (spool, spool.parent, spool.parent.parent):  # rank<N>/, spool/, the run folder: if empty
        try:
            folder.rmdir()
        except OSError:
            return


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
        from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        from otel_train.collect.reader import StepAlignedMetricReader, ThreadSpanProcessor

        self.settings = settings
        rank = _env_rank(env)
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
        self.run_claim = _claim(directory, self.run, settings.drain_timeout_s)
        self.run = dataclasses.replace(self.run, run_id=self.run_claim.run_id, run_name=self.run_claim.run_name)
        # A failed `init()` leaves nothing behind: each part built registers its undoing, run (last first)
        # only when a later part fails (no exporter process, thread, open backend or run-folder claim).
        with contextlib.ExitStack() as undo:
            undo.callback(_undo, self.run_claim.release)
            self.export_process = None
            if remote:
                from otel_train.ship.export_process import ExportProcess

                self.export_process = ExportProcess(
                    remote, options, self.run, drain_timeout_s=settings.drain_timeout_s, cpus=settings.export_cpus,
                    nice=settings.export_nice, self_metrics=settings.self_metrics, lock_fd=self.run_claim.fd)
                undo.callback(_undo, self.export_process.end, 1.0)
            self.exporters = self._build_exporters(local, options) + list(instances)
            for ex in self.exporters:  # the caller's instances too: `init()` took them, as `shutdown()` does
                undo.callback(_undo, ex.shutdown)
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
            undo.pop_all()  # the reader's shutdown closes the exporters and the exporter process from here on
            undo.callback(_undo, self.run_claim.release)
            if self.export_process is not None:  # after the reader's shutdown has closed it: its child ends now
                undo.callback(_undo, self.export_process.end, 1.0)
            undo.callback(_undo, self.reader.shutdown, 1000)
            self.meter_provider = MeterProvider(
                metric_readers=[self.reader], resource=self.resource,
                exemplar_filter=AlwaysOffExemplarFilter(), shutdown_on_exit=False,
            )
            undo.callback(_undo, self.meter_provider.shutdown, timeout_millis=1000)
            self.tracer_provider = TracerProvider(resource=self.resource, shutdown_on_exit=False)
            undo.callback(_undo, self.tracer_provider.shutdown)
            self.tracer_provider.add_span_processor(ThreadSpanProcessor(self.span_buffer))
            self.sampler = None
            if settings.system_metrics and self.export_metrics:
                from otel_train.collect.system_metrics import SystemSampler

                self.sampler = SystemSampler(self.log_buffer.append, settings.system_interval_s)
                self.sampler.start()
                undo.callback(_undo, self.sampler.stop)
            self._install_globals()
            undo.callback(_undo, self._release_globals)
            undo.pop_all()
        self._closed = False
        self._lock = threading.Lock()
        self._append = self.log_buffer.append
        set_step_order(settings.step_order, resume=False if settings.resume_step is None else settings.resume_step)
        self._check_step = settings.step_order == "raise"
        #: Values of `ot.log` calls whose step was refused (2.5, NaN, "3"): never written, counted here.
        self.refused_step_values = 0
        self._warned_step = False
        set_refused_step_hook(self.refuse_step)
        self._scope_class = ProfiledSpanScope if settings.profiler_bridge else SpanScope
        self._step_hook = self.reader.step_end_hook()
        set_step_end_hook(self._step_hook)
        self.reader.export_in_forked_child = False  # a forked child logs through `workers`, never through these
        self.forked = False
        self.worker: Any = None
        self._worker_address = self.export_process.worker_address if self.export_process is not None else None
        # Spawned children (DataLoader workers, multiprocessing) find the run here: the one variable
        # otel-train sets, because a spawned child has nothing else of ours. Removed at shutdown.
        os.environ[cfg.OTEL_TRAIN_WORKER_ADDRESS] = self._worker_address or "none"
        from otel_train.ship.workers import WorkerClient

        self._worker_class = WorkerClient
        after_fork_in_child(self._after_fork_in_child)  # held weakly: a shut-down session is freed

    def _after_fork_in_child(self) -> None:
        # A forked child (e.g. a DataLoader worker) shares the parent's open files, backend runs and
        # exporter-process socket: it must use none of them. Its `ot.log`/`ot.span` go through a
        # connection of its own to the exporter process (`otel_train.ship.workers`), opened on first use.
        if not self._closed:
            self.worker = self._worker_class(self._worker_address)
        self._closed = True
        self.forked = True
        if step_end_hook() is self._step_hook:  # the reader exports nothing here: nothing to buffer for it
            set_step_end_hook(None)
        self._lock = threading.Lock()

    def export_progress(self, timeout_s: float = 5.0) -> Any:
        """The exporter process's progress (`otel_train.ship.delivery.Progress`: windows spooled, per backend
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
        from otel_train._internal import global_providers

        # OTel's globals are set once per process: ours are set once and follow each session (`point_to`).
        global_providers.install(self.meter_provider, self.tracer_provider)

    def _release_globals(self) -> None:
        from otel_train._internal import global_providers

        global_providers.release(self.meter_provider, self.tracer_provider)

    # -- hot path ---------------------------------------------------------------------------
    def log(self, mapping: Mapping[str, Any], step: int | None = None) -> None:
        if step is None:
            step = _current.get()
            if step is None:
                step = current_step() or 0
        else:
            if type(step) is not int:
                try:
                    step = coerce_step(step, "otel_train.log(step=)")
                except ValueError as err:  # never into the loop: counted, warned once, the values go nowhere
                    self.refuse_step(err, len(mapping) if isinstance(mapping, Mapping) else 0)
                    return
            if self._check_step:
                check_log_step(step)  # OTEL_TRAIN_STEP_ORDER=raise: API misuse, raised where it happens
        try:
            self._append(step, dict(mapping))
        except (TypeError, ValueError):
            _logger.warning("otel_train.log expects a mapping of name -> number, got %s; skipped",
                            type(mapping).__name__)

    def refuse_step(self, err: ValueError, values: int = 0) -> None:
        """A step that is no step, given after `init()`: counted (with the `values` of its call, which go
        nowhere) and warned once; never raised into the training loop."""
        self.refused_step_values += values
        if not self._warned_step:
            self._warned_step = True
            _logger.warning("%s (warned once; an `ot.log` with such a step is not written, an `ot.step` or "
                            "`ot.steps` with one continues after the latest step)", err)

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
        set_step_order(self.settings.step_order, resume=step)
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
        try:  # the reader collects what a pause leaves pending on its own (its collector loop)
            now = time.perf_counter_ns()
            self.reader.on_step_end(StepEnd.from_times(int(step), (now, now, 0, None)))
        except Exception:
            _logger.warning("otel-train: declaring the end of step %r failed", step, exc_info=True)

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
        with contextlib.suppress(ValueError):  # nothing of the process keeps a closed session alive
            _active.remove(self)
        if step_end_hook() is self._step_hook:
            set_step_end_hook(None)
        set_refused_step_hook(None)
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
            self._release_globals()
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown(timeout_millis=1000)
        except Exception:
            _logger.warning("shutdown did not complete cleanly", exc_info=True)
        self.run_claim.release()  # an exporter process still draining keeps the run folder's lock until it is done
        if self.run.rank == 0 and not self.settings.quiet:
            self._write_summary()
        if not any(not s.closed for s in _active):  # after the hand-off: a signal during it still hands off
            _restore_signal_handlers()

    def _write_summary(self) -> None:
        from otel_train.run_paths import run_folder
        from otel_train.summary import summary_line, write_summary

        try:
            stats = self.reader.stats()
            names = [str(getattr(ex, "name", type(ex).__name__)) for ex in self.exporters]
            failures, dropped = dict(stats["failures"]), stats["dropped"]
            in_process = [ex for ex in self.exporters if hasattr(ex, "step_order")]
            backwards = {ex.name: ex.step_order.backwards for ex in in_process}
            order_dropped = {ex.name: ex.step_order.dropped + int(getattr(ex, "steps_dropped", 0)) for ex in in_process}
            spool_failed = 0
            reader = self.reader
            dropped_by = {"values over the log buffer": int(getattr(reader.log_buffer, "dropped", 0)),
                          "spans over the span buffer": int(getattr(reader.span_buffer, "dropped", 0)),
                          "windows over an export queue": int(stats["dropped"]) - int(reader.log_buffer.dropped)
                          - int(reader.span_buffer.dropped),
                          "values at a refused step": self.refused_step_values}
            dropped += self.refused_step_values
            lost = {ex.name: {k: v for k, v in ex.rows_lost.items() if v}
                    for ex in in_process if getattr(ex, "rows_lost", None)}
            if self.export_process is not None:  # the exporter process's backends: its last progress report
                names += list(self.export_process.names)
                progress = self.export_process.last_progress
                failures.update(progress.failures)
                dropped += self.export_process.dropped + sum(progress.dropped.values())
                backwards.update(progress.steps_backwards)
                order_dropped.update(progress.steps_order_dropped)
                spool_failed = progress.spool_failed_appends
                lost.update(progress.rows_lost)
                dropped_by["windows the exporter process could not take or its backends dropped"] = (
                    self.export_process.dropped + sum(progress.dropped.values()))
                children = getattr(progress, "children_lost", None) or {}  # child processes' values
                dropped_by.update(children)
                dropped += sum(children.values())
            write_summary(summary_line(stats["points"], stats["windows"], names, dropped,
                                       failures, str(run_folder(self.settings.dir, self.run.run_name)),
                                       steps_backwards=backwards, steps_order_dropped=order_dropped,
                                       spool_failed_appends=spool_failed, dropped_by=dropped_by, rows_lost=lost))
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


def _undo(part: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Undo one part of a failed `init()`, never raising over the error that made it fail."""
    try:
        part(*args, **kwargs)
    except Exception:
        _logger.debug("otel-train: undoing a failed init(): %r failed", part, exc_info=True)


def _claim(directory: Path, run: RunInfo, drain_timeout_s: float) -> Any:
    """Become the one writer of this rank's run folder, or of a distinct run (`otel_train.ship.spool.claim_run`)."""
    from otel_train.ship.spool import claim_run

    # An earlier attempt's exporter process drains for at most its drain timeout (+ its watchdog's grace).
    return claim_run(directory, run.run_id, run.run_name, run.rank, wait_s=drain_timeout_s + 5.0)


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
    run = None  # no run is recorded

    def __init__(self, settings: cfg.Settings) -> None:
        self.settings = settings

    def export_progress(self, timeout_s: float = 5.0) -> None:
        return None

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
#: Per signal whose handler is ours (or was, until a handler installed over ours): the handler before ours.
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


def _before_exit_hooks() -> None:
    """At interpreter exit, before any `atexit` hook (`threading._register_atexit`): a backend client running in
    this process registers its own `atexit` teardown when it starts, after ours, so it would run first (atexit
    is last in, first out) and lose what is still to be written (W&B's service teardown). While a thread of the
    user's still runs (the interpreter waits for it next), only flush: the `atexit` hook shuts down after it."""
    try:
        others = [t for t in threading.enumerate()
                  if t is not threading.current_thread() and not t.daemon and t.is_alive()]
        if others:
            _flush_active()
        else:
            _at_exit()
    except Exception:  # never let the exit fail because of us
        _logger.warning("otel-train: hand-off at exit failed", exc_info=True)


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


#: How long a signal that interrupted otel-train's own (or OTel's, `threading`'s, `logging`'s) code waits for the
#: loop to reach the next line of its own code; past it, the hand-off runs without holding the loop.
_SAFE_POINT_WAIT_S = 1.0
#: Set once a signal has been acted on from a safe point (the watchdog stands down).
_handled = threading.Event()
_deferred: set[int] = set()  # signals waiting for the loop's next line


def _end_process(signum: int, scopes: list[Any]) -> None:
    """Hand off (open spans recorded as truncated, every session shut down) and end the process by `signum`,
    whose disposition is the default again: same exit status as without us."""
    try:
        _record_truncated(scopes)
        _shutdown_active()
    except Exception:
        _logger.warning("otel-train: hand-off on signal %d failed", signum, exc_info=True)
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # the signal is blocked in this thread (e.g. by the user's `pthread_sigmask`): end anyway
    os._exit(128 + signum)


def _flush_active() -> None:
    deadline = time.monotonic() + _shutdown_budget_s()
    for session in [s for s in _active if not s.closed]:
        session.flush(max(0.0, deadline - time.monotonic()))


_LOCKING_CODE = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(threading.__file__) + os.sep + "threading",
                 os.path.dirname(logging.__file__) + os.sep)


def _interrupted_locking_code(frame: Any) -> bool:
    """Whether the signal interrupted our own code, OTel's, `threading`'s, `logging`'s or an import (which may hold
    a lock the hand-off needs, e.g. inside the reader's wake-up `Event.set`), rather than the user's."""
    code_file = getattr(getattr(frame, "f_code", None), "co_filename", "")
    return (code_file.startswith(_LOCKING_CODE) or os.sep + "opentelemetry" + os.sep in code_file
            or code_file.startswith("<frozen importlib"))


def _defer_to_next_line(signum: int, frame: Any) -> None:
    """The signal interrupted locking code: act on it at the next line the main thread runs in the nearest caller
    that is not (the user's loop), through that frame's trace hook; the loop runs no line of its own before. A
    watchdog hands off without the loop if it does not get there within `_SAFE_POINT_WAIT_S` (say, it waits in a
    long `flush()`), then lets the next delivery act at once."""
    if signum in _deferred:
        return
    user = frame
    while user is not None and _interrupted_locking_code(user):
        user = user.f_back
    _deferred.add(signum)
    _handled.clear()
    if user is not None:
        _trace_next_line(user, lambda: _on_signal(signum, user))
    main = threading.main_thread().ident

    def watchdog() -> None:
        if _handled.wait(_SAFE_POINT_WAIT_S):
            return
        ends = _previous_handlers.get(signum, signal.SIG_DFL) in (signal.SIG_DFL, None)
        try:
            _shutdown_active() if ends else _flush_active()
        except Exception:
            _logger.warning("otel-train: hand-off on signal %d failed", signum, exc_info=True)
        _handed_off.add(signum)
        signal.pthread_kill(main, signum)  # type: ignore[arg-type]
        if ends and not _handled.wait(1.0):  # the main thread never runs Python again: end the process anyway
            os._exit(128 + signum)

    threading.Thread(target=watchdog, name="otel-train-signal-watchdog", daemon=True).start()


def _trace_next_line(frame: Any, act: Any) -> None:
    """Call `act` (on the main thread) at the next line or return event of `frame`, through its `f_trace`, chaining
    a tracer already there (a debugger, coverage) and removing ours once it ran."""
    previous_global = sys.gettrace()
    previous_local, previous_lines = frame.f_trace, frame.f_trace_lines

    def local(f: Any, event: Any, arg: Any) -> Any:
        if f is frame and event in ("line", "return"):
            f.f_trace, f.f_trace_lines = previous_local, previous_lines
            if sys.gettrace() is untraced:
                sys.settrace(previous_global)
            act()
        return previous_local(f, event, arg) if previous_local is not None else None

    def untraced(f: Any, event: Any, arg: Any) -> Any:  # tracing on for this thread; new frames are not traced
        return None

    frame.f_trace_lines = True
    frame.f_trace = local
    if previous_global is None:
        sys.settrace(untraced)


#: Signals whose hand-off the watchdog has done: the next delivery acts at once, wherever the loop is.
_handed_off: set[int] = set()


def _on_signal(signum: int, frame: Any) -> None:
    """Hand off on a signal, then behave as the handler before ours would (or the default action).

    The hand-off runs on a thread of its own while the main thread (the training loop) waits in this handler,
    at most `OTEL_TRAIN_SHUTDOWN_TIMEOUT_S`: no step starts after the signal, and nothing of the loop runs
    while the hand-off collects. A handler runs inside whatever the loop was doing: when that is code that may
    hold a lock the hand-off needs (ours, OTel's, `threading`'s), it acts at the loop's next line instead.
    """
    global _handoff, _preempted_by
    name = signal.Signals(signum).name
    if name in _PREEMPTION_SIGNALS and _preempted_by is None:
        _preempted_by = name
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    # Called by a handler installed after ours that chains to it (Lightning composes handlers this way):
    # that handler decides whether the process ends, so we only flush (never delivering it again: the
    # framework's handler would run twice).
    if signal.getsignal(signum) is not _on_signal:
        budget_s = _shutdown_budget_s()
        _handoff = threading.Thread(target=_flush_active, name="otel-train-signal", daemon=True)
        _handoff.start()
        if not _interrupted_locking_code(frame):  # else the flush would wait for the locks the loop holds
            _handoff.join(budget_s)
        return
    if signum in _handed_off:  # the loop never left locking code: the hand-off ran, act now
        _handed_off.discard(signum)
        _deferred.discard(signum)
        _handled.set()
        if previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif callable(previous) and previous is not _on_signal:
            previous(signum, frame)
        return
    if _interrupted_locking_code(frame):
        _defer_to_next_line(signum, frame)
        return
    _deferred.discard(signum)
    _handled.set()
    if previous in (signal.SIG_DFL, None):
        # The default action ends the process: a second signal meanwhile ends it at once. Open spans are
        # recorded as truncated; the process ends by the same signal, from this handler: no step runs after it.
        signal.signal(signum, signal.SIG_DFL)
        budget_s = _shutdown_budget_s()  # before the hand-off closes the sessions it is computed from
        _handoff = threading.Thread(target=_end_process, args=(signum, open_span_scopes()), name="otel-train-signal",
                                    daemon=True)
        _handoff.start()
        _handoff.join(budget_s + 1.0)
        os.kill(os.getpid(), signum)  # the hand-off overran its deadline: end now
        return
    # A handler of the user's (a SLURM requeue handler, a checkpoint hook) or SIGINT's `KeyboardInterrupt`
    # runs next and decides whether the process ends: flush first, waiting at most the deadline.
    budget_s = _shutdown_budget_s()
    _handoff = threading.Thread(target=_flush_active, name="otel-train-signal", daemon=True)
    _handoff.start()
    _handoff.join(budget_s)
    if callable(previous) and previous is not _on_signal:
        previous(signum, frame)


def _install_hooks() -> None:
    """The exit hooks (once per process) and the signal handlers (at each `init()` after they were given back)."""
    global _hooks_installed
    if not _hooks_installed:
        _hooks_installed = True
        atexit.register(_at_exit)
        sdk.register_before_atexit(_before_exit_hooks)  # before every atexit hook (a backend client's own)
    if threading.current_thread() is not threading.main_thread():
        _logger.debug("init() outside the main thread: no signal handlers installed")
        return
    for name in _SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None or sig in _previous_handlers:  # SIGUSR1 does not exist on Windows; ours already
            continue
        try:
            previous = signal.getsignal(sig)
            if previous is _on_signal:  # put back by a framework after ours was given back: what it had is unknown
                previous = signal.SIG_DFL
            signal.signal(sig, _on_signal)
            _previous_handlers[sig] = previous
        except (ValueError, OSError):  # not allowed here (embedded interpreter)
            pass


def _restore_signal_handlers() -> None:
    """The last session has shut down: each signal whose handler is still ours gets the one it had before
    `init()` back. Left alone: a signal whose handler was installed over ours (it may chain to ours, which
    then only flushes, so ours stays on record and is not installed again), and one whose hand-off is
    deferred to the loop's next line (it acts as ours would, later)."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers (a signal's hand-off thread shuts sessions down too)
    for sig in list(_previous_handlers):
        if sig in _deferred or signal.getsignal(sig) is not _on_signal:
            continue
        previous = _previous_handlers[sig]
        try:
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        except (ValueError, OSError, TypeError):
            continue
        del _previous_handlers[sig]


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
