"""Wiring: settings -> Resource, providers, the one reader, exporters; `start` registers each session with the
exit and signal hooks (`otel_train.session.exit_hooks`).

Nothing imports this module but the public face (`otel_train/__init__.py`), the CLI and, lazily,
`otel_train.session.placement` (which restarts a session in the framework's place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_train._internal.at_fork import after_fork_in_child
from otel_train._internal.values import REFUSED_PREFIX, RefusalCounts
from otel_train.capture.attributes import clean_attributes, refused_reason
from otel_train.capture.instrument import (
    NO_SPAN,
    LogBuffer,
    ProfiledSpanScope,
    SpanBuffer,
    SpanScope,
)
from otel_train.capture.log_capture import LogCapture
from otel_train.capture.step import (
    StepEnd,
    StepOutOfRange,
    _current,
    check_log_step,
    coerce_step,
    current_step,
    set_refused_step_hook,
    set_step_end_hook,
    set_step_order,
    step_end_hook,
)
from otel_train.config import settings as cfg
from otel_train.config.exporter_options import ExporterOptions
from otel_train.errors import ConfigError
from otel_train.session import exit_hooks
from otel_train.session.backend_setup import build_backends, split_backends
from otel_train.session.child_handoff import hand_off_disabled
from otel_train.session.placement import _env_int, _env_rank, resolve_run_id
from otel_train.vocab.run_identity import RunInfo, config_hash

__all__ = ["DisabledSession", "Session", "start"]

_logger = logging.getLogger("otel_train")


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


#: How long a call that needs the session's background start (a raw OTel instrument, `flush`, `shutdown`) waits
#: for it at most; it takes tens of milliseconds.
_START_WAIT_S = 60.0


class Session:
    """One `init()`: the providers, the reader and the exporters of this process.

    `init()` returns once the settings are checked, the run folder claimed, the buffers and hooks of the training
    thread in place and the backends that run here built: what fails on bad configuration fails there. The rest
    (the OTel SDK's providers, the reader and its collector thread, the exporter process, the watchdog) is built on
    a thread of its own meanwhile (`_start_rest`); until it is up, `ot.log` values, spans and step ends wait in the
    buffers, a raw OTel measurement or span waits for the SDK (`global_providers.PendingProviders`), and whatever
    needs the rest (`flush`, `shutdown`, `resume`) waits for it. A child forked meanwhile needs none of it: it
    logs through its own connection to the exporter process, whose address is bound before `init()` returns.
    """

    enabled = True

    def __init__(self, settings: cfg.Settings, env: Mapping[str, str], instances: Sequence[Any] = ()) -> None:
        # The start may still run when the interpreter exits (a short script): a module that registers a threading
        # exit hook (the SDK's `Resource.create` uses a thread pool) must be imported before that begins.
        import concurrent.futures.thread  # noqa: F401

        from otel_train._internal.global_providers import PendingProviders
        from otel_train.session.child_handoff import ChildHandOff

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
        local, remote = split_backends(settings)
        self.run_claim = _claim(directory, self.run, settings.drain_timeout_s)
        self.run = dataclasses.replace(self.run, run_id=self.run_claim.run_id, run_name=self.run_claim.run_name)
        #: Values refused at the call, by cause (`otel_train._internal.values.REFUSAL_CAUSES`: a type that is no
        #: number, a bad key, a step out of range, ...): never in any window; the summary line and `otel-train
        #: verify` report them. The collector counts here what it refuses as it converts values; at shutdown the
        #: child processes' join.
        self.refusals = RefusalCounts()
        # What is built before `init()` returns. A failed `init()` leaves nothing behind: each part built registers
        # its undoing, run (last first) only when a later part fails.
        with contextlib.ExitStack() as undo:
            undo.callback(_undo, self.run_claim.release)
            self.exporters = build_backends(local, options) + list(instances)
            for ex in self.exporters:  # the caller's instances too: `init()` took them, as `shutdown()` does
                undo.callback(_undo, ex.shutdown)
            listener = None
            self._listener_sock: Any = None
            if remote:  # bound now: a child process started before the exporter process is up still reaches it
                from otel_train.ship.spool import spool_dir
                from otel_train.ship.workers import worker_listener

                listener = worker_listener(spool_dir(directory, self.run.run_name, self.run.rank))
                self._listener_sock = listener[1]
                if listener[1] is not None:
                    undo.callback(_undo, listener[1].close)
            self.log_buffer = LogBuffer(settings.buffer_size, strict=settings.strict_sync)
            self.span_buffer = SpanBuffer(settings.buffer_size)
            self._pending = PendingProviders(_START_WAIT_S)
            self._install_globals(self._pending.meter_provider, self._pending.tracer_provider)
            undo.callback(_undo, self._release_globals, self._pending.meter_provider, self._pending.tracer_provider)
            #: `logging` records, uncaught exceptions (and stdout/stderr lines) as log records, into the buffer.
            self.log_capture = LogCapture(self.log_buffer.append_log, settings.log_level, settings.log_rate,
                                          settings.capture_output)
            self.log_capture.install()
            undo.pop_all()
        self._closed = False
        self._lock = threading.Lock()
        self._append = self.log_buffer.append
        set_step_order(settings.step_order, resume=False if settings.resume_step is None else settings.resume_step)
        self._check_step = settings.step_order == "raise"
        self._warned_step = False
        self._warned_attributes = False
        self._warned_mapping = False
        #: `OTEL_TRAIN_VERIFY`: this rank's verdict at shutdown (`otel_train.verify`), for the summary line.
        self.verify_verdict: str | None = None
        set_refused_step_hook(self.refuse_step)
        self._scope_class = ProfiledSpanScope if settings.profiler_bridge else SpanScope
        # Built by `_start_rest` (read through the properties below, which wait for it).
        self._reader: Any = None
        self._export_process: Any = None
        self._meter_provider: Any = None
        self._tracer_provider: Any = None
        self._resource: Any = None
        self._sampler: Any = None
        self._hang_watchdog: Any = None
        self._early_step: int | None = None  # the latest step ended before the reader was up
        self._early_steps = 0  # `ot.step` ends before the reader was up (its step-end hook counts them on)
        self._early_logged_steps = 0  # `step_ended` calls before the reader was up (its `on_step_end` counts on)
        self._start_failed = False
        #: At shutdown, where the start failed: what was logged and never exported, "records" (values, step ends,
        #: log records) and "spans" (`_count_unexported`).
        self.unexported: dict[str, int] = {}
        self._step_hook = self._early_step_end_hook()
        set_step_end_hook(self._step_hook)
        self.forked = False
        self.worker: Any = None
        self._children = ChildHandOff(listener[0] if listener is not None else None)
        after_fork_in_child(self._after_fork_in_child)  # held weakly: a shut-down session is freed
        _write_running_hang_file(settings, self.run, directory)  # the watchdog itself starts on the start thread
        self._started = threading.Event()
        self._start_thread = threading.Thread(target=self._start_rest, args=(remote, options, directory, listener),
                                              name="otel-train-start", daemon=True)  # an exit waits for it
        self._start_thread.start()

    def _early_step_end_hook(self) -> Callable[[int, int, int, int, int | None], None]:
        """The step-end hook until the reader is up: the step's numbers go into the buffer as the reader's hook
        puts them there (`StepAlignedMetricReader.step_end_hook`); the reader collects them when it starts, and
        goes on counting toward `export_every` from them (`StepAlignedMetricReader.take_over`)."""
        append = self.log_buffer._items.append
        seq = self.log_buffer._seq

        def on_step_end(step: int, start_ns: int, end_ns: int, iterations: int, samples: int | None) -> None:
            with self._lock:  # the start hands the count over under this lock (`_build_rest`)
                if self._reader is None:
                    append((next(seq), step, (start_ns, end_ns, iterations, samples), 0))
                    self._early_step = step
                    self._early_steps += 1
                    return
            self._step_hook(step, start_ns, end_ns, iterations, samples)  # handed over meanwhile: the reader's

        return on_step_end

    def _start_rest(self, remote: tuple[str, ...], options: ExporterOptions, directory: Path,
                    listener: tuple[str, Any] | None) -> None:
        """Build what `init()` did not wait for (on the thread "otel-train-start"): the hang watchdog first (it
        watches the training thread from `init()` on, whatever else fails), then the rest (`_build_rest`). Never
        raises: a failure is logged once; what is logged meanwhile waits in the bounded buffers, and `shutdown()`
        counts it as not exported and closes what `init()` built (the backends here, the run folder's claim)."""
        try:
            watchdog = _start_hang_watchdog(self.settings, self.run, directory)
            with self._lock:
                if not self._closed:
                    self._hang_watchdog, watchdog = watchdog, None
            if watchdog is not None:  # shut down meanwhile (a shutdown that gave up waiting)
                watchdog.stop()
            self._build_rest(remote, options, directory, listener)
        except Exception:
            self._start_failed = True
            _logger.exception("otel-train: starting the reader and the exporter process failed; training goes on, "
                              "and what it logs is counted as not exported at shutdown")
            if listener is not None and listener[1] is not None:
                _undo(listener[1].close)
        finally:
            if self._reader is None:  # failed, or shut down meanwhile: raw OTel calls stop waiting
                self._pending.finish(None)
            self._started.set()

    def _build_rest(self, remote: tuple[str, ...], options: ExporterOptions, directory: Path,
                    listener: tuple[str, Any] | None) -> None:
        settings = self.settings
        with contextlib.ExitStack() as undo:
            export_process = None
            if remote:
                # First, from a module of few imports: the exporter process's interpreter starts and imports while
                # the SDK and the rest are imported and built here.
                from otel_train.ship.child_boot import boot_child
                from otel_train.ship.spool import spool_dir

                booted = boot_child(spool_dir(directory, self.run.run_name, self.run.rank), self.run_claim.fd,
                                    listener[1] if listener is not None else None, settings.export_cpus,
                                    settings.export_nice)
                undo.callback(_end_unconfigured, booted)

                from otel_train.ship.export_process import ExportProcess

                export_process = ExportProcess(
                    remote, options, self.run, drain_timeout_s=settings.drain_timeout_s, cpus=settings.export_cpus,
                    nice=settings.export_nice, self_metrics=settings.self_metrics,
                    backend_processes=settings.backend_processes != "off", lock_fd=self.run_claim.fd,
                    record_bytes=settings.record_bytes, listener=listener, booted=booted)
                undo.pop_all()  # the exporter process has its configuration: ending it is `end`'s
                undo.callback(_undo, export_process.end, 1.0)
            from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider

            from otel_train.collect.reader import StepAlignedMetricReader, ThreadSpanProcessor
            from otel_train.ship.logged_record import open_record

            # Resource.create merges OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME under ours.
            resource = Resource.create(self.run.resource_attributes())
            reader = StepAlignedMetricReader(
                self.exporters,
                export_every=settings.export_every,
                export_interval_s=settings.export_interval_s,
                queue_size=settings.queue_size,
                log_buffer=self.log_buffer,
                span_buffer=self.span_buffer,
                export_metrics=self.export_metrics,
                resource=resource,
                channel=export_process,
                phases=settings.phases,
                record=functools.partial(open_record, run=self.run, directory=directory,
                                         cap_bytes=settings.record_bytes,
                                         resume_step=settings.resume_step),
                refusals=self.refusals,
            )
            undo.pop_all()  # the reader's shutdown closes the exporters and the exporter process from here on
            if export_process is not None:  # after the reader's shutdown has closed it: its child ends now
                undo.callback(_undo, export_process.end, 1.0)
            undo.callback(_undo, reader.shutdown, 1000)
            meter_provider = MeterProvider(
                metric_readers=[reader], resource=resource,
                exemplar_filter=AlwaysOffExemplarFilter(), shutdown_on_exit=False,
            )
            undo.callback(_undo, meter_provider.shutdown, timeout_millis=1000)
            tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            undo.callback(_undo, tracer_provider.shutdown)
            tracer_provider.add_span_processor(ThreadSpanProcessor(self.span_buffer))
            sampler = None
            if settings.system_metrics and self.export_metrics:
                from otel_train.collect.system_metrics import SystemSampler

                sampler = SystemSampler(self.log_buffer.append, settings.system_interval_s)
                sampler.start()
                undo.callback(_undo, sampler.stop)
            reader.export_in_forked_child = False  # a forked child logs through `workers`, never through these
            if self._hang_watchdog is not None:  # it learns each span name's usual duration from the collected spans
                reader.span_listener = self._hang_watchdog.take_spans
            with self._lock:
                if self._closed:  # a shutdown that gave up waiting for this start: undo it all
                    return
                self._export_process, self._resource, self._reader = export_process, resource, reader
                self._meter_provider, self._tracer_provider = meter_provider, tracer_provider
                self._sampler = sampler
                hook = reader.take_over(self._early_step, self._early_steps, self._early_logged_steps)
                if step_end_hook() is self._step_hook:
                    set_step_end_hook(hook)
                self._step_hook = hook
            undo.pop_all()
        # Raw OTel instruments and tracers now reach the SDK's (those that waited for it first).
        self._install_globals(meter_provider, tracer_provider)
        self._pending.finish((meter_provider, tracer_provider))

    def wait_started(self) -> bool:
        """Wait for the background start (at most `_START_WAIT_S`); False if it is not done by then."""
        return self._wait_started()

    def _wait_started(self, timeout_s: float | None = None) -> bool:
        """Wait for the background start (`_start_rest`), at most `timeout_s` (None: `_START_WAIT_S`); False if
        it is not done by then."""
        if self._started.is_set() or threading.current_thread() is self._start_thread:
            return True
        return self._started.wait(_START_WAIT_S if timeout_s is None else max(0.0, min(timeout_s, _START_WAIT_S)))

    @property
    def reader(self) -> Any:
        """The step-aligned reader (`otel_train.collect.reader`); None if the start failed."""
        self._wait_started()
        return self._reader

    @property
    def export_process(self) -> Any:
        """The exporter process's handle (`otel_train.ship.export_process`); None when every backend runs here."""
        self._wait_started()
        return self._export_process

    @property
    def meter_provider(self) -> Any:
        self._wait_started()
        return self._meter_provider

    @property
    def tracer_provider(self) -> Any:
        self._wait_started()
        return self._tracer_provider

    @property
    def resource(self) -> Any:
        self._wait_started()
        return self._resource

    @property
    def sampler(self) -> Any:
        self._wait_started()
        return self._sampler

    @property
    def hang_watchdog(self) -> Any:
        self._wait_started()
        return self._hang_watchdog

    def _after_fork_in_child(self) -> None:
        # A forked child (e.g. a DataLoader worker) shares the parent's open files, backend runs and
        # exporter-process socket: it must use none of them. Its `ot.log`/`ot.span` go through a
        # connection of its own to the exporter process (`otel_train.ship.workers`), opened on first use.
        if not self._closed:
            self.worker = self._children.forked_child_client()
            # Its records, and its count of those over the rate limit, go where its `ot.log` values go.
            self.log_capture.retarget(self.worker.add_log, self.worker.count_rate_limited)
        if not self._started.is_set():  # forked while starting: the start goes on in the parent only
            if self._listener_sock is not None:
                self._listener_sock.close()  # the parent's exporter process listens there, not this child
            self._started.set()
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
    def _install_globals(meter_provider: Any, tracer_provider: Any) -> None:
        from otel_train._internal import global_providers

        # OTel's globals are set once per process: ours are set once and follow each session (`point_to`).
        global_providers.install(meter_provider, tracer_provider)

    def _release_globals(self, meter_provider: Any, tracer_provider: Any) -> None:
        from otel_train._internal import global_providers

        global_providers.release(meter_provider, tracer_provider)

    # -- hot path ---------------------------------------------------------------------------
    def log(self, mapping: Mapping[str, Any], step: int | None = None,
            attributes: Mapping[str, Any] | None = None) -> None:
        if step is None:
            step = _current.get()
            if step is None:
                step = current_step() or 0
        else:
            if type(step) is not int or step >> 63:  # not 0..MAX_STEP (2**63-1): one shift, no lookup
                try:
                    step = coerce_step(step, "otel_train.log(step=)")
                except ValueError as err:  # never into the loop: counted, warned once, the values go nowhere
                    if isinstance(mapping, Mapping):
                        self.refuse_step(err, len(mapping))
                    else:
                        self.refusals.add("not_a_mapping")
                    return
            if self._check_step and attributes is None:  # attributed values: other series, checked per series
                check_log_step(step)  # OTEL_TRAIN_STEP_ORDER=raise: API misuse, raised where it happens
        try:
            if attributes is None:
                self._append(step, dict(mapping))
            else:  # the rare path: checked as OTel checks attributes; what it leaves out is counted, never raised
                clean, refused = clean_attributes(attributes)
                if refused:
                    self.refuse_attributes(attributes, refused)
                if clean:
                    self.log_buffer.append_attributed(step, dict(mapping), clean)
                else:
                    self._append(step, dict(mapping))
        except (TypeError, ValueError):
            self.refusals.add("not_a_mapping")
            if not self._warned_mapping:
                self._warned_mapping = True
                _logger.warning("otel_train.log expects a mapping of name -> number, got %s; skipped (warned once; "
                                "counted in the shutdown summary)", type(mapping).__name__)

    @property
    def refused_step_values(self) -> int:
        """Values of `ot.log` calls whose step was refused (2.5, NaN, "3", -1, 2**63): never written."""
        return self.refusals.get("bad_step", 0) + self.refusals.get("step_out_of_range", 0)

    @property
    def refused_attributes(self) -> int:
        """Attributes of `ot.log(..., attributes=)` calls left out by OTel's rule (the values were still logged)."""
        return self.refusals.get("bad_attribute", 0)

    def refuse_attributes(self, attributes: Any, refused: list[Any]) -> None:
        """Attributes of an `ot.log` call that OTel's rule leaves out (`clean_attributes`): counted and warned
        once; the values are logged with the attributes that remain."""
        self.refusals.add("bad_attribute", len(refused))
        if not self._warned_attributes:
            self._warned_attributes = True
            _logger.warning("otel_train.log: %s; left out, the values are logged without it (warned once; "
                            "counted in the shutdown summary)", refused_reason(attributes, refused[0]))

    def refuse_step(self, err: ValueError, values: int | None = None) -> None:
        """A step that is no step, given after `init()`: counted (the `values` of an `ot.log` call, which go
        nowhere; else, `values` None, the `ot.step`/`ot.steps` call, whose block takes the next step) and warned
        once; never raised into the training loop."""
        if values is not None:
            self.refusals.add("step_out_of_range" if isinstance(err, StepOutOfRange) else "bad_step", values)
        else:
            self.refusals.add("bad_step_entered")
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
        reader = self.reader  # waits for the start: the resume follows what was logged before it
        if reader is None:
            return
        try:
            reader.resume(step)
        except Exception:
            _logger.warning("otel-train: declaring the resume at step %d failed", step, exc_info=True)

    def step_ended(self, step: int) -> None:
        """`otel_train.step_ended`: a framework's logged step is a step boundary for collection (the reader
        wakes the collector as at an `otel_train.step` end, every `export_every` steps, at most every 0.1 s).
        Never raises."""
        if self._closed:
            return
        reader = self._reader
        if reader is None:
            with self._lock:  # the start hands the count over under this lock: no step is counted twice or lost
                reader = self._reader
                if reader is None:  # not up yet: counted toward `export_every`, collected when it starts
                    with contextlib.suppress(TypeError, ValueError):
                        self._early_step = int(step)
                        self._early_logged_steps += 1
                    return
        try:  # the reader collects what a pause leaves pending on its own (its collector loop)
            now = time.perf_counter_ns()
            reader.on_step_end(StepEnd.from_times(int(step), (now, now, 0, None)))
        except Exception:
            _logger.warning("otel-train: declaring the end of step %r failed", step, exc_info=True)

    # -- lifecycle ----------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        if self._closed:
            return True
        timeout = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        reader = self.reader
        if reader is None:
            return False
        try:
            return bool(reader.force_flush(timeout * 1000))
        except Exception:
            _logger.warning("flush failed", exc_info=True)
            return False

    def shutdown(self, deadline: float | None = None) -> None:
        """Flush and close everything by `deadline` (`time.monotonic()`; default: the shutdown timeout).

        A start still under way is waited for first (until `deadline`, else at most `_START_WAIT_S`): what was
        logged meanwhile goes out with the last window. One that gives up waiting closes what `init()` built;
        the start, once it gets there, closes the rest (its reader collects and delivers what waits first)."""
        self._wait_started(None if deadline is None else deadline - time.monotonic())
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(ValueError):  # nothing of the process keeps a closed session alive
            exit_hooks._active.remove(self)
        if step_end_hook() is self._step_hook:
            set_step_end_hook(None)
        set_refused_step_hook(None)
        self._children.release()
        set_step_order("warn")
        if self._hang_watchdog is not None:  # first: a long final flush is no hang
            self._hang_watchdog.stop()
        preempted = exit_hooks._preempted_by
        if preempted is not None:  # backends that have the notion mark the run as preempted before closing it
            for exporter in self.exporters:
                if hasattr(exporter, "preempt_at_close"):
                    exporter.preempt_at_close(preempted)
            if self._export_process is not None:
                self._export_process.preempted = preempted
        self.log_capture.remove()  # what was captured until now goes out with the last window
        if self.log_capture.rate_limited:
            self.refusals.add("log_rate_limited", self.log_capture.rate_limited)
        timeout_s = self.settings.shutdown_timeout_s
        if deadline is not None:
            timeout_s = max(0.05, min(timeout_s, deadline - time.monotonic()))
        try:
            if self._sampler is not None:
                self._sampler.stop()  # its last step goes out with the final flush
            self._release_globals(self._pending.meter_provider, self._pending.tracer_provider)
            if self._reader is not None:
                self._reader.shutdown(timeout_s * 1000)
                self._release_globals(self._meter_provider, self._tracer_provider)
                self._tracer_provider.shutdown()
                self._meter_provider.shutdown(timeout_millis=1000)
            else:  # the start failed (or is not done): the backends built here were never handed to a reader
                for exporter in self.exporters:
                    _undo(exporter.shutdown)
                if self._listener_sock is not None:
                    _undo(self._listener_sock.close)
        except Exception:
            _logger.warning("shutdown did not complete cleanly", exc_info=True)
        self.run_claim.release()  # an exporter process still draining keeps the run folder's lock until it is done
        self._add_children_refusals()  # before the record of this session is written for verify
        self._verify_own_part()
        if self._reader is None:
            self._count_unexported()
        if self.run.rank == 0 and not self.settings.quiet:
            from otel_train.session.summary import write_session_summary

            write_session_summary(self)
        if not any(not s.closed for s in exit_hooks._active):  # after the hand-off: a signal during it still hands off
            exit_hooks._restore_signal_handlers()

    def _count_unexported(self) -> None:
        """What a session whose start failed (or was not done by shutdown) holds at shutdown: never exported,
        counted as such for the summary line, and said once where the summary line is silenced."""
        for what, buffer in (("records", self.log_buffer), ("spans", self.span_buffer)):
            left = buffer.drain()
            self.unexported[what] = len(left) + buffer.dropped
        if any(self.unexported.values()) and (self.run.rank != 0 or self.settings.quiet):
            _logger.warning("otel-train: %d records (values, step ends, log records) and %d spans logged in this "
                            "session were not exported: its start %s", self.unexported["records"],
                            self.unexported["spans"],
                            "failed (logged above)" if self._start_failed else "was not done by shutdown")

    def _add_children_refusals(self) -> None:
        """What child processes refused (they tell the exporter process, whose last progress report has it)."""
        progress = self._export_process.last_progress if self._export_process is not None else None
        for cause, n in (getattr(progress, "children_lost", None) or {}).items():
            if cause.startswith(REFUSED_PREFIX):
                self.refusals.add(cause[len(REFUSED_PREFIX):], n)

    @property
    def closed(self) -> bool:
        return self._closed

    def _verify_own_part(self) -> None:
        """Record the values refused at the call; under `OTEL_TRAIN_VERIFY`, check this rank's part of the run
        (its backends are closed now) and keep the verdict for the summary line. Never raises."""
        from otel_train.vocab.run_paths import run_folder

        run_dir = run_folder(self.settings.dir, self.run.run_name)
        if self.settings.record_bytes:
            from otel_train.ship.logged_record import write_session_record

            write_session_record(run_dir, self.run.rank, self.refusals)
        if self.settings.verify != "on":
            return
        if exit_hooks._handoff is not None:  # a signal's hand-off has a deadline to keep: verify by hand later
            self.verify_verdict = f"verify: skipped on a signal (`otel-train verify {run_dir}`)"
            return
        try:
            from otel_train.verify import check

            report = check(run_dir, ranks=[self.run.rank])
            self.verify_verdict = report.verdict()
        except Exception as err:
            self.verify_verdict = f"verify: could not run ({type(err).__name__}: {err})"
        if self.run.rank != 0 and not self.verify_verdict.startswith("verify: pass"):
            _logger.warning("otel-train rank %d: %s", self.run.rank, self.verify_verdict)

    release_signal = staticmethod(exit_hooks.release_signal)

    def step_order_counts(self) -> dict[str, dict[str, int]]:
        """Per exporter name: rows whose step went backwards, and of those dropped (`OTEL_TRAIN_STEP_ORDER`)."""
        return {ex.name: ex.step_order.counts() for ex in self.exporters if hasattr(ex, "step_order")}


def _undo(part: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Undo one part of a failed `init()`, never raising over the error that made it fail."""
    try:
        part(*args, **kwargs)
    except Exception:
        _logger.debug("otel-train: undoing a failed init(): %r failed", part, exc_info=True)


def _end_unconfigured(booted: Any) -> None:
    """End an exporter process that was started but never sent its configuration (it waits for it)."""
    conn, proc = booted
    _undo(conn.close)  # it reads end-of-file and exits
    _undo(proc.wait, 5.0)


def _start_hang_watchdog(settings: cfg.Settings, run: RunInfo, directory: Path) -> Any:
    """This rank's hang watchdog (`otel_train.hangs.watchdog`), started; None under `OTEL_TRAIN_HANG_AFTER_S=0`.
    Never raises: a watchdog that cannot start is logged, and training goes on without it."""
    if not settings.hang_after_s:
        return None
    from otel_train.hangs.watchdog import HangWatchdog

    try:
        watchdog = HangWatchdog(settings.hang_after_s, settings.hang_factor, _hang_file(run, directory),
                                _hang_identity(run))
        watchdog.start()
    except Exception:
        _logger.warning("otel-train: the hang watchdog could not start; training goes on without it", exc_info=True)
        return None
    return watchdog


def _write_running_hang_file(settings: cfg.Settings, run: RunInfo, directory: Path) -> None:
    """This rank's hang file as `init()` leaves it (``running``, `otel_train.hangs.hang_file`): a roll call sees
    the rank from `init()` on, before the watchdog is up on the start thread (it rewrites the file from then on).
    Never raises: where it cannot be written, the watchdog says so once."""
    if not settings.hang_after_s:
        return
    from otel_train.hangs.hang_file import file_content, heartbeat_every_s, write_hang_file

    identity = {**_hang_identity(run), "main_ident": threading.main_thread().ident}  # as the watchdog writes it
    try:
        write_hang_file(_hang_file(run, directory), file_content(
            identity, "running", None, heartbeat_every_s(settings.hang_after_s), [], time.time()))
    except OSError:
        _logger.debug("otel-train: the hang file could not be written at init()", exc_info=True)


def _hang_identity(run: RunInfo) -> dict[str, Any]:
    """What a rank's hang file says of it: rank, world size, run id and name, host, pid."""
    return {"rank": run.rank, "world_size": run.world_size, "run_id": run.run_id, "run_name": run.run_name,
            "host": run.host, "pid": run.pid}


def _hang_file(run: RunInfo, directory: Path) -> Path:
    from otel_train.hangs.hang_file import hang_path
    from otel_train.vocab.run_paths import run_folder

    return hang_path(run_folder(directory, run.run_name), run.rank)


def _claim(directory: Path, run: RunInfo, drain_timeout_s: float) -> Any:
    """Become the one writer of this rank's run folder, or of a distinct run (`otel_train.ship.spool.claim_run`)."""
    from otel_train.ship.spool import claim_run

    # An earlier attempt's exporter process drains for at most its drain timeout (+ its watchdog's grace).
    return claim_run(directory, run.run_id, run.run_name, run.rank, wait_s=drain_timeout_s + 5.0)


class DisabledSession:
    """What `init()` returns under `OTEL_TRAIN_DISABLED` / `OTEL_SDK_DISABLED`: every call is a no-op."""

    enabled = False
    closed = False
    run = None  # no run is recorded

    def __init__(self, settings: cfg.Settings) -> None:
        self.settings = settings
        self.refusals = RefusalCounts()  # nothing is checked, so nothing is refused
        # A step the enabled session would refuse without raising (`ot.step("3")`) must not raise here either: a
        # job that runs with telemetry on must not crash when a launcher turns it off.
        set_refused_step_hook(self.refuse_step)

    def refuse_step(self, err: ValueError) -> None:
        return None

    def export_progress(self, timeout_s: float = 5.0) -> None:
        return None

    def log(self, mapping: Mapping[str, Any], step: int | None = None,
            attributes: Mapping[str, Any] | None = None) -> None:
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
        if not self.closed:
            set_refused_step_hook(None)
        self.closed = True


def start(settings: cfg.Settings, env: Mapping[str, str] | None = None,
          instances: Sequence[Any] = ()) -> Session | DisabledSession:
    """Build the session for `settings` (plus ready-made exporter `instances`).

    Raises:
        ConfigError: anything misconfigured.
    """
    if settings.disabled:
        hand_off_disabled()
        return DisabledSession(settings)
    session = Session(settings, os.environ if env is None else env, instances)
    exit_hooks._active[:] = [s for s in exit_hooks._active if not s.closed]
    exit_hooks._active.append(session)
    exit_hooks._install_hooks()
    return session
