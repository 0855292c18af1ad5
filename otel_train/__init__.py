"""otel-train: instrument a training loop once with OpenTelemetry, see it in every backend.

Example:
    >>> import otel_train as ot
    >>> session = ot.init(exporters=[], disabled=True)
    >>> for step in ot.steps(range(2)):
    ...     with ot.span("forward"):
    ...         ot.log({"train/loss": 0.5})
    >>> ot.shutdown()
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from otel_train._internal.session_type import RunIdentity, Session
from otel_train.capture.instrument import NO_SPAN
from otel_train.capture.step import STEP_ATTRIBUTE, current_step, step, steps
from otel_train.config.settings import Route
from otel_train.errors import ConfigError, OtelTrainError, StepOrderError

if TYPE_CHECKING:
    from pathlib import Path

    from opentelemetry.metrics import Meter
    from opentelemetry.trace import Tracer


__all__ = [
    "STEP_ATTRIBUTE",
    "ConfigError",
    "OtelTrainError",
    "Route",
    "RunIdentity",
    "Session",
    "StepOrderError",
    "current_session",
    "current_step",
    "flush",
    "get_meter",
    "get_tracer",
    "init",
    "log",
    "resume",
    "set_placement",
    "shutdown",
    "span",
    "step",
    "step_ended",
    "steps",
    "traced",
]

__version__ = "0.1.0"

_F = TypeVar("_F", bound=Callable[..., Any])
_logger = logging.getLogger(__name__)
_session: Any = None
_init_lock = threading.Lock()
_warned_closed = False


def init(
    *,
    exporters: str | Sequence[str | Any] | None = None,
    dir: str | Path | None = None,
    run_name: str | None = None,
    run_id: str | None = None,
    project: str | None = None,
    export_every: int | None = None,
    export_interval_s: float | None = None,
    ranks: str | None = None,
    disabled: bool | None = None,
    shutdown_timeout_s: float | None = None,
    queue_size: int | None = None,
    buffer_size: int | None = None,
    strict_sync: bool | None = None,
    config: Mapping[str, Any] | None = None,
    trace_counters: bool | None = None,
    service_name: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    routes: Mapping[str, Route | Mapping[str, Any]] | None = None,
    step_order: str | None = None,
    resume_step: int | None = None,
) -> Session:
    """Start otel-train for this process. Settings come from `OTEL_TRAIN_*` variables; keywords override.

    Safe to call twice: the second call warns and returns the running session.

    Args:
        exporters: Exporter names (``"tensorboard"``) and/or exporter instances (any OTel
            `MetricExporter`/`SpanExporter` or otel-train `RowExporter`); default
            `OTEL_TRAIN_EXPORTERS`. Every other keyword overrides its `OTEL_TRAIN_*` variable.
        rank, local_rank, world_size: The process's place in the job, for frameworks that know it
            better than the launcher's `RANK`/`LOCAL_RANK`/`WORLD_SIZE` variables (which they override).
        routes: Per-backend routing, exporter name -> `Route` (or a dict with the same keys), e.g.
            ``{"wandb": Route(include=["train/*"], every=10)}``; each given field overrides its
            `OTEL_TRAIN_<BACKEND>_*` variable.
        step_order: What a step going backwards does: ``warn``, ``drop`` or ``raise`` (`OTEL_TRAIN_STEP_ORDER`).
        resume_step: The run restarts at this step, from a checkpoint (`OTEL_TRAIN_RESUME_STEP`): every
            backend is told, so no series shows two values for one step.

    Returns:
        The running `Session` (the one already running when called twice).

    Raises:
        ConfigError: a setting is invalid (one line: the setting, the value, what is allowed), an
            exporter is unknown or its package is missing, `OTEL_TRAIN_DIR` is not writable, or the
            installed opentelemetry-sdk is outside the supported range (checked before anything starts).
    """
    global _session
    from otel_train._internal import sdk
    from otel_train.capture.step import new_step_sequence
    from otel_train.config import settings as cfg
    from otel_train.session import runtime
    from otel_train.session.exit_hooks import forget_preemption

    with _init_lock:
        if _session is not None and not _session.closed:
            _logger.warning("otel_train.init() called again; returning the running session (call "
                            "otel_train.shutdown() first to start a new one)")
            running: Session = _session
            return running
        instances: list[Any] = []
        if exporters is not None and not isinstance(exporters, str):
            instances = [e for e in exporters if not isinstance(e, str)]
            exporters = [e for e in exporters if isinstance(e, str)]
        settings = cfg.load_settings(
            exporters=exporters, dir=dir, run_name=run_name, run_id=run_id, project=project,
            export_every=export_every, export_interval_s=export_interval_s, ranks=ranks, disabled=disabled,
            shutdown_timeout_s=shutdown_timeout_s, queue_size=queue_size, buffer_size=buffer_size,
            strict_sync=strict_sync, config=config, trace_counters=trace_counters, service_name=service_name,
            routes=routes, step_order=step_order, resume_step=resume_step,
        )
        if not settings.disabled:
            sdk.check_supported()  # before anything starts: an unsupported SDK leaves no process or thread behind
        env = None
        placement = {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world_size}
        if any(v is not None for v in placement.values()):
            env = dict(os.environ)
            env.update({k: str(_place(k.lower(), v)) for k, v in placement.items() if v is not None})
        previous = getattr(_session, "run", None)
        if previous is not None and previous.pid == os.getpid():
            # A new run after `shutdown()` in this process (a notebook, an in-process sweep): steps from 0.
            # Not in a forked child, whose `init()` continues its parent's run.
            new_step_sequence()
            forget_preemption()
        session: Session = runtime.start(settings, env=env, instances=instances)
        _session = session
        return session


def _place(keyword: str, value: Any) -> int:
    """`rank=`, `local_rank=`, `world_size=` as an integer >= 0 (one line naming the keyword otherwise)."""
    import operator

    try:
        number = operator.index(value)
    except TypeError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise ConfigError(f"{keyword}: {value!r} is not allowed; expected an integer >= 0")
    return number


def log(mapping: Mapping[str, Any], step: int | None = None, attributes: Mapping[str, Any] | None = None) -> None:
    """Record each value of `mapping` as a gauge named by its key, at `step` (default: the current step).

    Outside any step the latest step entered is used (0 before the first). Numbers, NumPy
    scalars/0-d arrays and tensors are accepted; tensors are converted on the export thread.

    Args:
        mapping: Key -> value; the key is the series name in every backend.
        step: The step (default: the current one), coerced as every step is.
        attributes: Extra OTel attributes for every value of this call (e.g. ``{"trial_id": "a1"}``): each
            makes a distinct series, ``name{trial_id=a1}`` (the Names contract), exactly as a gauge set with
            those attributes. Checked as OTel checks attributes (str keys; str, bool, int, float or a sequence
            of one of those); one that breaks the rule, or is ``train.step`` / ``train.rank``, is left out,
            counted and warned about once, and the values are still logged. NaN and infinities are kept.
            Pass it by keyword. (It is not keyword-only because CPython does not specialise calls to functions
            with keyword-only parameters: that would cost every `log` call about 40 ns.)

    Example:
        >>> import otel_train as ot
        >>> _ = ot.init(exporters=[], disabled=True)
        >>> ot.log({"trial/loss": 0.5}, step=3, attributes={"trial_id": "a1"})
        >>> ot.shutdown()

    Raises:
        StepOrderError: only under ``OTEL_TRAIN_STEP_ORDER=raise``, for an explicit `step` below the
            latest step (API misuse; nothing else raises here after `init`).
    """
    s = _session
    if s is None:
        child = _child_client()
        if child is not None:  # a spawned child of a run (DataLoader worker): to the run's exporter process
            child.log(mapping, step, attributes)
            return
        raise OtelTrainError(
            "otel_train.log() was called before otel_train.init(); call init() first "
            "(or set OTEL_TRAIN_DISABLED=1 and still call init() to turn logging off)"
        )
    if s.closed:
        worker = getattr(s, "worker", None)
        if worker is not None:  # a forked child: its own connection to the run's exporter process
            worker.log(mapping, step, attributes)
            return
        _warn_closed(getattr(s, "forked", False))
        return
    s.log(mapping, step, attributes)


def step_ended(step: int) -> None:
    """Declare that training step `step` ended, where the loop never enters `otel_train.step`.

    For code that logs at a framework's steps (a tracker, monitor or callback): collection follows the
    declared steps as it follows `otel_train.step` (`OTEL_TRAIN_EXPORT_EVERY`), so what was logged is
    exported and spooled within moments, not only every `OTEL_TRAIN_EXPORT_INTERVAL_S`. Records no step
    timing (the framework timed the step, not otel-train). A no-op before `init()` and after `shutdown()`.

    Example:
        >>> import otel_train as ot
        >>> ot.step_ended(3)  # nothing runs: no session
    """
    s = _session
    if s is None or s.closed:
        return
    declare = getattr(s, "step_ended", None)
    if declare is not None:
        declare(step)


def _child_client() -> Any:
    """The run's connection in a spawned child process (`otel_train.ship.workers`), else None."""
    import os

    if not os.environ.get("OTEL_TRAIN_WORKER_ADDRESS"):  # config.OTEL_TRAIN_WORKER_ADDRESS; keeps import light
        return None
    from otel_train.ship.workers import client_from_env

    return client_from_env()


def _warn_closed(forked: bool) -> None:
    global _warned_closed
    if not _warned_closed:
        _warned_closed = True
        if forked:
            _logger.warning("otel_train.log() in a forked child process: dropped, because the run's session was "
                            "already shut down when it forked (warned once)")
        else:
            _logger.warning("otel_train.log()/span() after shutdown(): dropped (warned once)")


def span(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A context manager timing a block as a span (with `train.step` and the thread).

    Before `init()` (or when disabled) it does nothing. An exception marks the span as error and
    propagates unchanged.
    """
    s = _session  # `_scope`'s body, one call fewer a span
    if s is None or s.closed:
        return _span_without_session(s, name, attributes)
    return s.span(name, attributes, True)


def _scope(name: str, attributes: Mapping[str, Any] | None, record_context: bool) -> Any:
    s = _session
    if s is None or s.closed:
        return _span_without_session(s, name, attributes)
    return s.span(name, attributes, record_context)


def _span_without_session(s: Any, name: str, attributes: Mapping[str, Any] | None) -> Any:
    """Before `init()` or after `shutdown()`: the span of a child process's connection to its run, else none."""
    child = _child_client() if s is None else getattr(s, "worker", None)
    return NO_SPAN if child is None else child.span(name, attributes)


def _span_for_decorator(name: str, record_context: bool) -> Any:
    return _scope(name, None, record_context)


def traced(name: str | Callable[..., Any] | None = None) -> Any:
    """Decorate a function (plain, async, generator or async generator) to run in a span.

    Usable as ``@traced``, ``@traced()`` or ``@traced("name")``; the default name is the
    function's qualified name.
    """
    from otel_train.capture.instrument import traced_with

    if callable(name):
        return traced_with(_span_for_decorator, None, name)

    def decorate(fn: _F) -> _F:
        return traced_with(_span_for_decorator, name, fn)

    return decorate


def flush(timeout_s: float | None = None) -> bool:
    """Collect now and wait until every exporter has written it (bounded by the shutdown timeout).

    In a child process (DataLoader worker) it sends what the child buffered to the run's exporter process.
    """
    s = _session
    child = _child_client() if s is None else getattr(s, "worker", None) if s.closed else None
    if child is not None:
        child.send_now()
        return True
    return True if s is None else bool(s.flush(timeout_s))


def resume(step: int) -> None:
    """Declare that the run restarts at `step` (from a checkpoint), once the session is running.

    What `init(resume_step=step)` does, for when the step is known only after `init()` (the framework
    integrations call it once they have loaded a checkpoint): everything logged before is delivered first,
    then every backend supersedes the earlier attempt's steps >= `step` (TensorBoard purge, JSONL resume
    record, ...; see docs/guarantees.md#preemption-and-resume), and steps may start again from `step`. Windows
    an earlier, killed attempt left undelivered lose their rows at steps >= `step`.

    Args:
        step: The first step of the new attempt (an integer >= 0).

    Raises:
        ConfigError: before `init()`, `step` is not an integer >= 0 (see `otel_train.capture.step.coerce_step`); after
            it, such a step is warned about once and ignored.
        OtelTrainError: called before `init()`.

    Example:
        >>> import otel_train as ot
        >>> _ = ot.init(exporters=[], disabled=True)
        >>> ot.resume(100)
        >>> ot.shutdown()
    """
    from otel_train.capture.step import coerce_step

    s = _session
    try:
        index = coerce_step(step, "otel_train.resume()")
    except ValueError as err:
        if s is None or s.closed or not hasattr(s, "refuse_step"):
            raise ConfigError(str(err)) from None
        s.refuse_step(err)  # after init(): warned once, counted, never raised into the training loop
        return
    if s is None:
        raise OtelTrainError("otel_train.resume() was called before otel_train.init(); call init() first "
                             "(or pass resume_step= to init())")
    if not s.closed:
        s.resume(index)


def shutdown() -> None:
    """Flush and close every exporter. Also runs at interpreter exit and on SIGTERM. Idempotent."""
    s = _session
    if s is not None:
        s.shutdown()


def current_session() -> Session | None:
    """The session `init()` started in this process, or None before `init()`, after `shutdown()` and in a forked
    child. For code that builds on a running session (framework integrations): its ``run`` (run id, name, rank)
    and ``add_config``.

    Example:
        >>> import otel_train as ot
        >>> ot.current_session() is None
        True
    """
    s = _session
    return None if s is None or s.closed else s


def set_placement(*, rank: int | None = None, local_rank: int | None = None,
                  world_size: int | None = None) -> Session | None:
    """Tell the running session where this process runs in the job, once a framework's launcher knows it.

    An `init()` that ran before the launcher set the rank (Lightning's DDP launcher re-runs the script for
    ranks 1..n-1 without ``RANK``; rank 0's own `init()` ran before there was a job) labels the data with
    the wrong rank and run. If the places differ and nothing was exported yet, the session restarts at the
    given place, with the same settings, in the job's run (the empty run folder of the first one is
    removed); if data went out already, one loud error says so and the session stays as it is. Never raises.

    Returns:
        The session now running (`current_session()`).
    """
    global _session
    from otel_train.session import adopt, runtime

    with _init_lock:
        current = _session
        if isinstance(current, runtime.Session) and not current.closed:
            try:
                moved = adopt.adopt_placement(current, rank, local_rank, world_size)
            except Exception:  # after init(): never into the training loop
                _logger.warning("otel-train: could not move the session to rank %s (local rank %s, world size %s)",
                                rank, local_rank, world_size, exc_info=True)
                moved = None
            if moved is not None:
                _session = moved
    return current_session()


def get_meter(name: str = "otel_train") -> Meter:
    """The SDK meter of the running session, for raw OTel instruments (gauges, counters, histograms)."""
    from opentelemetry import metrics

    s = _session
    if s is None or not getattr(s, "enabled", False):
        return metrics.get_meter(name)
    return s.meter_provider.get_meter(name)  # type: ignore[no-any-return]


def get_tracer(name: str = "otel_train") -> Tracer:
    """The SDK tracer of the running session, for raw OTel spans."""
    from opentelemetry import trace

    s = _session
    if s is None or not getattr(s, "enabled", False):
        return trace.get_tracer(name)
    return s.tracer_provider.get_tracer(name)  # type: ignore[no-any-return]
