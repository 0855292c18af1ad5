"""A named backend built on a thread of its own, so that nobody waits for its start.

Importing a backend's client (W&B, MLflow, ClearML, TensorBoard) takes from a tenth of a second to seconds, and
each backend pays it alone: built one after the other, `init()` would cost the sum. A `StartingBackend` stands in
the backend's place in delivery at once (`otel_train.ship.delivery`, in the exporter process and in the training
process) and builds the real one on its own thread, `start()`. Its feed's first write waits for that build, so
windows wait where the feed keeps them meanwhile: in the spool (exporter process; the feed reads them back
from there) or in the feed's bounded queue, merged (training process). Everything else delivery calls is handed
to the real backend once built.

A backend that fails to start is logged once, as an error naming it and the cause, and counted in `failures`;
its windows are never acknowledged, so with a spool they stay there for `otel-train replay`, and without one
their rows are counted lost (``not_started``). Errors that must stop the job (an unknown name, a missing
package) are raised before, where the names are checked.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from otel_train._internal import faults
from otel_train.backend import RowExporter, Window
from otel_train.config import routing
from otel_train.config.exporter_options import ExporterOptions
from otel_train.config.routing import RowFilter
from otel_train.vocab.run_identity import RunInfo
from otel_train.vocab.step_order import StepOrder

__all__ = ["StartFailed", "StartingBackend", "starting_backends"]

_logger = logging.getLogger("otel_train")


class StartFailed(Exception):
    """A build's failure whose message already says the cause (``Type: message``), e.g. from another process."""


class StartingBackend(RowExporter):
    """Stands for the backend `build(options)` returns, built by `start()` on a thread of its own.

    It is a `RowExporter` only on the side delivery calls (`export_window`, `resume`, `force_flush`, `shutdown`
    and the counters, see `RowExporter`): each is the built backend's own, and a write waits for the build.

    Args:
        name: The backend's registry name.
        build: Builds the backend from its options (the registry's class).
        options: What the backend is built with.
        cls: The backend's class, when its module is already imported: its `kill_safe_writes` (delivery reads
            it before the build) and its routing rule (the run's record says it before the backend is up) are
            then known at once.
        spooled: Its windows are kept in a spool: a failed start loses nothing, so no row is counted lost.
    """

    def __init__(self, name: str, build: Callable[[ExporterOptions], RowExporter], options: ExporterOptions,
                 *, cls: type[RowExporter] | None = None, spooled: bool = False) -> None:
        # Not `RowExporter.__init__`: this object writes nothing itself; the built backend has the writer.
        self.name = name
        self.kill_safe_writes = cls is not None and cls.kill_safe_writes
        #: The routing rule the backend will be built with (`routing.bind`), known from its class.
        self._route: RowFilter | None = None
        self._cls = cls
        if cls is not None:
            self._route = routing.bind(cls.name, options, cls.display_names)[1]
        self._build = build
        self._options = options
        self._spooled = spooled
        self._lock = threading.Lock()
        self._started = threading.Event()  # set once the build ended, either way
        self._backend: RowExporter | None = None
        self._error: str | None = None
        self._abandoned = False  # shut down before it was up: the build's result is closed at once
        self._preempted: str | None = None
        self._keep_failed = False
        self._listener: Callable[[Sequence[tuple[str, int]]], None] | None = None
        self._on_started: list[Callable[[RowExporter], None]] = []
        self._failures = 0
        self._unwritten = 0  # windows handed to a backend that did not start
        self._lost: dict[str, int] = {}
        self._order = StepOrder(options.step_order, name)  # its counters until the backend is up

    # -- starting ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Build the backend on a thread of its own (once)."""
        threading.Thread(target=self._start, name=f"otel-train-start-{self.name}", daemon=True).start()

    def _start(self) -> None:
        faults.before_start(self.name)
        options = self._options
        try:
            backend = self._build(options)
        except BaseException as err:
            self._error = str(err) if isinstance(err, StartFailed) else f"{type(err).__name__}: {err}"
            self._failures += 1
            where = ("its windows stay in the spool; `otel-train replay` delivers them once it can start"
                     if self._spooled else "its data is not written")
            _logger.error("otel-train: backend `%s` could not start: %s; %s", self.name, self._error, where)
            self._started.set()
            return
        with self._lock:  # what was set while it was being built
            if self._options is not options:
                backend.options = dataclasses.replace(backend.options, hparams=self._options.hparams,
                                                      resume_step=self._options.resume_step)
            if self._preempted is not None:
                backend.preempt_at_close(self._preempted)
            if self._keep_failed:
                backend.keep_failed_windows()
            if self._listener is not None:
                backend.watch_appends(self._listener)
            abandoned = self._abandoned
            self._backend = backend
            waiting, self._on_started = self._on_started, []
        for callback in waiting:
            _call_safely(callback, backend, self.name)
        self._started.set()
        if abandoned:
            backend.shutdown()

    def when_started(self, callback: Callable[[RowExporter], None]) -> None:
        """Call `callback(backend)` once the backend is up (at once when it already is; never when it fails)."""
        with self._lock:
            backend = self._backend
            if backend is None:
                self._on_started.append(callback)
                return
        _call_safely(callback, backend, self.name)

    def wait_started(self, timeout_s: float | None = None) -> bool:
        """Wait until the build ended (the backend is up, or failed to start); False on timeout."""
        return self._started.wait(timeout_s)

    @property
    def start_error(self) -> str | None:
        """Why the backend did not start (``Type: message``), or None."""
        return self._error

    def _up(self) -> RowExporter | None:
        """The built backend, after waiting for the build (None: it did not start)."""
        self._started.wait()
        return self._backend

    # -- what delivery calls ------------------------------------------------------------------------------
    def export_window(self, window: Window) -> bool:
        backend = self._up()
        if backend is not None:
            return backend.export_window(window)
        self._unwritten += 1
        if not self._spooled:
            lost = len(window.metrics) + len(window.histograms) + len(window.spans) + len(window.logs)
            self._lost["not_started"] = self._lost.get("not_started", 0) + lost
        return False

    def resume(self, run: RunInfo, step: int) -> bool:
        backend = self._up()
        return backend.resume(run, step) if backend is not None else False

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        if not self._started.is_set() and not self._unwritten:
            return True  # nothing was handed to it yet (every write waits for the build)
        backend = self._up()
        return backend.force_flush(timeout_millis) if backend is not None else False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        with self._lock:
            backend = self._backend
            if backend is None:
                self._abandoned = True  # nothing was written (a write waits for the build): close it once built
                return
        backend.shutdown(timeout_millis)

    def durable_step(self) -> int | None:
        backend = self._backend
        return backend.durable_step() if backend is not None else None

    def preempt_at_close(self, cause: str) -> None:
        with self._lock:
            self._preempted = cause
            backend = self._backend
        if backend is not None:
            backend.preempt_at_close(cause)

    def keep_failed_windows(self) -> None:
        with self._lock:
            self._keep_failed = True
            backend = self._backend
        if backend is not None:
            backend.keep_failed_windows()

    def retry_in_s(self) -> float:
        backend = self._backend
        return backend.retry_in_s() if backend is not None else 0.0

    def watch_appends(self, listener: Callable[[Sequence[tuple[str, int]]], None] | None) -> None:
        with self._lock:
            self._listener = listener
            backend = self._backend
        if backend is not None:
            backend.watch_appends(listener)

    def forget_pending_after_fork(self) -> None:
        backend = self._backend
        if backend is not None:
            backend.forget_pending_after_fork()

    def export(self, data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:  # type: ignore[override]
        backend = self._up()
        return backend.export(data, timeout_millis) if backend is not None else None

    @property
    def backend_class(self) -> type[RowExporter] | None:
        """The backend's class, when it was given (its module already imported)."""
        return self._cls

    @property
    def route(self) -> RowFilter | None:
        """The backend's row filter (None: every row unchanged); before the build, the one its class implies
        (None too when the class was not given)."""
        backend = self._backend
        return backend.window_writer.route if backend is not None else self._route

    @property
    def options(self) -> ExporterOptions:
        backend = self._backend
        return backend.options if backend is not None else self._options

    @options.setter
    def options(self, value: ExporterOptions) -> None:
        with self._lock:  # hyperparameters reported after init(), a resume: the build takes them over
            self._options = value
            backend = self._backend
        if backend is not None:
            backend.options = value

    @property
    def unwritten_windows(self) -> int:
        backend = self._backend
        return backend.unwritten_windows if backend is not None else self._unwritten

    def lost_handed(self) -> bool:
        backend = self._backend
        return backend.lost_handed() if backend is not None else False

    @property
    def failures(self) -> int:
        backend = self._backend
        return self._failures + (backend.failures if backend is not None else 0)

    @failures.setter
    def failures(self, value: int) -> None:
        self._failures = value

    @property
    def dropped_windows(self) -> int:
        backend = self._backend
        return backend.dropped_windows if backend is not None else 0

    @dropped_windows.setter
    def dropped_windows(self, value: int) -> None:
        pass

    @property
    def rows_lost(self) -> dict[str, int]:
        backend = self._backend
        return backend.rows_lost if backend is not None else self._lost

    @property
    def step_order(self) -> StepOrder:
        backend = self._backend
        return backend.step_order if backend is not None else self._order

    def __getattr__(self, attr: str) -> Any:
        """A backend's own attributes (W&B's `steps_dropped`, a file path), once it is up."""
        backend = self.__dict__.get("_backend")
        if backend is None or attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(backend, attr)


def _call_safely(callback: Callable[[RowExporter], None], backend: RowExporter, name: str) -> None:
    try:
        callback(backend)
    except Exception:  # a listener's fault never keeps the backend from starting
        _logger.debug("a listener of backend `%s`'s start failed", name, exc_info=True)


def starting_backends(names: Sequence[str], options: ExporterOptions, *, spooled: bool,
                      hosted: Callable[[str, str], Callable[[ExporterOptions], RowExporter]] | None = None,
                      ) -> dict[str, StartingBackend]:
    """A `StartingBackend` per name, not started yet (`start()` each once delivery holds them). With `spooled`
    and `hosted`, where two or more have a heavy client (`RowExporter.heavy_client`), each of those is built by
    ``hosted(name, target)`` (`otel_train.ship.backend_host.hosted`: in a process of its own).

    Raises:
        ConfigError: an unknown name or a missing package (before anything is built).
    """
    from otel_train.config.registry import check_available, get_spec, load_class

    specs = [get_spec(name) for name in names]
    for spec in specs:
        check_available(spec)
    out = {}
    if spooled:  # delivery reads `kill_safe_writes` before the build: the backend's module now, its client later
        classes = {spec.name: load_class(spec) for spec in specs}
        heavy = {name for name, cls in classes.items() if _is_heavy(cls)}
        host = heavy if hosted is not None and len(heavy) >= 2 else set()
        for spec in specs:
            cls = classes[spec.name]
            build = hosted(spec.name, spec.target) if hosted is not None and spec.name in host else cls
            out[spec.name] = StartingBackend(spec.name, build, options, cls=cls, spooled=True)
        return out
    for spec in specs:
        # no spool, nothing kill-safe to know: even the module is imported on the backend's thread
        out[spec.name] = StartingBackend(spec.name, _builder(spec), options)
    return out


def _is_heavy(cls: Any) -> bool:
    """A backend class whose client is heavy to start and whose writes are not kill-safe appends."""
    return (isinstance(cls, type) and issubclass(cls, RowExporter) and cls.heavy_client
            and not cls.kill_safe_writes)


def _builder(spec: Any) -> Callable[[ExporterOptions], RowExporter]:
    from otel_train.config.registry import load_class

    def build(options: ExporterOptions) -> RowExporter:
        backend: RowExporter = load_class(spec)(options)
        return backend

    return build
