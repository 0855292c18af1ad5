"""The step context: which training step the current code belongs to.

The step lives in a `ContextVar`, so asyncio tasks see the step of the code that created them.
Threads started by the user do not inherit context variables; there `current_step()` falls back
to the latest step entered in the process, which is what a data-loader or logging thread wants.
The step context never calls the reader: the runtime registers a step-end listener.
"""

from __future__ import annotations

import contextvars
import logging
import math
import operator
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from otel_train.errors import StepOrderError
from otel_train.vocab import semconv

__all__ = [
    "MAX_STEP",
    "RANK_ATTRIBUTE",
    "STEP_ATTRIBUTE",
    "StepEnd",
    "StepOutOfRange",
    "add_step_end_listener",
    "check_log_step",
    "coerce_step",
    "current_step",
    "open_step",
    "remove_step_end_listener",
    "set_step_end_hook",
    "set_step_order",
    "step",
    "step_end_hook",
    "steps",
]

STEP_ATTRIBUTE = semconv.TRAIN_STEP
"""The data-point / span attribute that carries the step (int)."""
RANK_ATTRIBUTE = semconv.TRAIN_RANK

_logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The highest step: steps are 64-bit signed integers in TensorBoard, MLflow, Trackio, W&B, OTLP and the window
#: format, so a step is an integer from 0 to this.
MAX_STEP = 2**63 - 1


class StepOutOfRange(ValueError):
    """An integer step below 0 or above `MAX_STEP` (a `ValueError`, as every refused step)."""


_current: contextvars.ContextVar[int | None] = contextvars.ContextVar("otel_train_step", default=None)
_clock = time.perf_counter_ns  # bound once: a step boundary is on the training thread's hot path


def coerce_step(value: Any, where: str) -> int:
    """`value` as a step: what every entry point that takes a step accepts (`ot.step`, `ot.steps(start=)`,
    `ot.log(step=)`, `ot.resume`, `init(resume_step=)`, child processes, the integrations).

    Accepted, from 0 to `MAX_STEP` (2**63 - 1): anything `operator.index` takes (`int`, NumPy integers, integer
    0-d tensors and arrays) and numbers with an integral value (``61.0``, a float tensor holding 3.0). Refused:
    ``True``/``False`` (a step is never a flag), fractions (2.5), NaN, ±inf, strings and everything else; and,
    as `StepOutOfRange`, integers outside that range: a negative step (W&B and Trackio refuse one, and -1 means
    "no step" in spools and child processes) and one beyond 64 bits (no backend stores it).

    Args:
        value: The step given.
        where: The call it was given to, for the message (e.g. ``"otel_train.log(step=)"``).

    Raises:
        ValueError: `value` is not a step; the one-line message names it and what is allowed
            (`StepOutOfRange` for an integer outside 0..2**63-1).

    Example:
        >>> import numpy as np
        >>> coerce_step(np.int64(3), "ot.step"), coerce_step(61.0, "ot.step")
        (3, 61)
        >>> coerce_step(2.5, "ot.step")
        Traceback (most recent call last):
        ...
        ValueError: ot.step: 2.5 is not a step; expected an integer >= 0 (or a number with an integral value, e.g. 3.0)
        >>> coerce_step(-1, "ot.step")
        Traceback (most recent call last):
        ...
        otel_train.capture.step.StepOutOfRange: ot.step: -1 is not a step; expected an integer from 0 to 2**63-1
    """
    if type(value) is int and 0 <= value <= MAX_STEP:  # the common case first
        return value
    if not isinstance(value, (bool, str, bytes)):
        step: int | None = None
        try:
            step = operator.index(value)
        except TypeError:
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                number = math.nan
            if math.isfinite(number) and number.is_integer():
                step = int(number)
        if step is not None:
            if 0 <= step <= MAX_STEP:
                return step
            raise StepOutOfRange(f"{where}: {step} is not a step; expected an integer from 0 to 2**63-1")
    shown = repr(value)
    raise ValueError(f"{where}: {shown[:80]} is not a step; expected an integer >= 0 (or a number with an "
                     "integral value, e.g. 3.0)")


#: Set by the runtime while a session runs: reports a refused step (warned once, counted) instead of raising,
#: since after `init()` nothing of ours raises into the training loop.
_refuse_hook: Callable[[ValueError], None] | None = None


def set_refused_step_hook(hook: Callable[[ValueError], None] | None) -> None:
    """Install (or, with ``None``, remove) the running session's handler of refused steps."""
    global _refuse_hook
    _refuse_hook = hook


def _coerce_or_none(value: Any, where: str) -> int | None:
    """`coerce_step`, but after `init()` a refused step is reported to the session and gives None."""
    try:
        return coerce_step(value, where)
    except ValueError as err:
        hook = _refuse_hook
        if hook is None:
            raise
        hook(err)
        return None


def _next_step() -> int:
    """The step `step()` without a number enters: after the latest, else the declared restart, else 0."""
    latest = _state.latest
    if latest is not None:
        return latest + 1
    return _state.resumed_at or 0


class _ProcessState:
    """Process-wide step facts: the latest step entered and the run's start time."""

    __slots__ = ("iterations", "last_logged", "latest", "open", "order", "resumed_at", "started_ns",
                 "warned_backwards")

    def __init__(self) -> None:
        self.latest: int | None = None
        self.started_ns = _clock()
        self.iterations = 0
        self.warned_backwards = False
        self.order = "warn"  # OTEL_TRAIN_STEP_ORDER of the running session
        self.last_logged: int | None = None  # highest explicit `ot.log(step=)` under `raise`
        self.resumed_at: int | None = None  # the declared restart step: where `step()` without a number starts
        self.open: step | None = None  # the step entered last (open until its `ended_ns`): read by the hang watchdog


_state = _ProcessState()


class StepEnd:
    """What a step-end listener receives; also the step's own gauges (`items`), so that the runtime can
    buffer it as is and the collector thread, not the training thread, builds them."""

    __slots__ = ("duration_s", "iterations", "samples", "step", "time_total_s")

    def __init__(self, step: int, duration_s: float, time_total_s: float, iterations: int, samples: int | None):
        self.step = step
        self.duration_s = duration_s
        self.time_total_s = time_total_s
        self.iterations = iterations
        self.samples = samples

    def items(self) -> list[tuple[str, float]]:
        """The step's gauges: duration, time since start, iterations and, with `samples`, throughput.

        Example:
            >>> StepEnd(3, 0.5, 10.0, 4, 64).items()[-1]
            ('train.throughput', 128.0)
        """
        return list(_step_gauges(self.duration_s, self.time_total_s, self.iterations, self.samples).items())

    @staticmethod
    def gauges_from_times(times: tuple[int, int, int, int | None]) -> dict[str, float]:
        """`from_times(..., times).items()` as a dict, without building the `StepEnd` (the collector's usual path)."""
        start_ns, end_ns, iterations, samples = times
        return _step_gauges((end_ns - start_ns) / 1e9, (end_ns - _state.started_ns) / 1e9, iterations, samples)


    @classmethod
    def from_times(cls, step: int, times: tuple[int, int, int, int | None]) -> StepEnd:
        """The StepEnd of a step-end hook's ``(start_ns, end_ns, iterations, samples)`` (off the training thread)."""
        start_ns, end_ns, iterations, samples = times
        return cls(step, (end_ns - start_ns) / 1e9, (end_ns - _state.started_ns) / 1e9, iterations, samples)


def _step_gauges(duration_s: float, time_total_s: float, iterations: int, samples: int | None) -> dict[str, float]:
    out = {semconv.TRAIN_STEP_DURATION: duration_s, semconv.TRAIN_TIME_TOTAL: time_total_s,
           semconv.TRAIN_ITERATIONS: float(iterations)}
    if samples is not None and duration_s > 0:
        out[semconv.TRAIN_THROUGHPUT] = samples / duration_s
    return out


StepEndListener = Callable[[StepEnd], None]
_listeners: list[StepEndListener] = []
#: ``(step, start_ns, end_ns, iterations, samples)``: the runtime's own step end. Plain numbers, so the
#: training thread builds no `StepEnd` (the collector does, with `StepEnd.from_times`).
StepEndHook = Callable[[int, int, int, int, "int | None"], None]
_hook: StepEndHook | None = None


def set_step_end_hook(hook: StepEndHook | None) -> None:
    """Install the runtime's step-end hook (one per process; ``None`` removes it)."""
    global _hook
    _hook = hook


def step_end_hook() -> StepEndHook | None:
    """The installed step-end hook, if any."""
    return _hook


def add_step_end_listener(listener: StepEndListener) -> None:
    """Call `listener` at the end of every step (on the training thread; keep it cheap)."""
    if listener not in _listeners:
        _listeners.append(listener)


def remove_step_end_listener(listener: StepEndListener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def current_step() -> int | None:
    """The step of the calling context, else the latest step entered, else ``None``."""
    value = _current.get()
    return _state.latest if value is None else value


def set_step_order(policy: str, resume: bool | int = False) -> None:
    """Set the step-order policy the training thread enforces (the runtime calls it at init).

    `resume`: the run restarts (`resume_step`, given as the step), so steps entered before do not count as
    "later", and `step()` / `steps()` without a number start at that step.
    """
    _state.order = policy
    _state.last_logged = None
    if resume is not False:
        _state.latest = None
        _state.resumed_at = None if resume is True else int(resume)


def check_log_step(step: int) -> None:
    """Under ``raise``: refuse an explicit `ot.log(..., step=)` below the latest step (API misuse).

    Raises:
        StepOrderError: `step` is lower than the latest step entered or logged explicitly.
    """
    if _state.order != "raise":
        return
    latest = max((s for s in (_state.latest, _state.last_logged) if s is not None), default=None)
    if latest is not None and step < latest:
        raise StepOrderError(
            f"otel_train.log(step={step}) after step {latest}: steps must not go backwards under "
            "OTEL_TRAIN_STEP_ORDER=raise; pass resume_step= to init() when restarting from a checkpoint, "
            "or set OTEL_TRAIN_STEP_ORDER=warn or drop"
        )
    _state.last_logged = step


#: Where the latest step entered is also written for child processes (an 8-byte shared memory cell of
#: `otel_train.ship.workers.StepCell`, as a ``q`` memoryview), or None: one store per step entered.
_shared_step: Any = None


def share_latest_step(cell: Any) -> None:
    """Also write each step entered into `cell[0]` (a writable ``q`` memoryview; None stops it). Until the
    first step it holds 0, the step the training thread's own `log` uses then."""
    global _shared_step
    _shared_step = cell
    if cell is not None:
        cell[0] = 0 if _state.latest is None else _state.latest


def open_step() -> step | None:
    """The step entered last in this process (still running while its `ended_ns` is 0), or None. Lock-free: the
    hang watchdog calls it from its own thread."""
    return _state.open


def new_step_sequence() -> None:
    """Forget the previous run's steps: a new run in this process starts at step 0, with its own clock,
    iteration count and step-order state (the runtime calls it at an `init()` after a `shutdown()`)."""
    global _state
    _state = _ProcessState()


def _reset_for_tests() -> None:
    new_step_sequence()


class step:
    """Mark a block of code as one training step.

    Args:
        i: The step number (see `coerce_step`: NumPy integers, ``3.0`` and integer tensors are taken);
            ``None`` means the previous step + 1 (0 for the first).
        samples: Samples processed in this step; when given, `train.throughput` is recorded.

    Raises:
        ValueError: before `init()`, `i` is not a step (2.5, NaN, a string). After `init()` such a step is
            warned about once, counted, and the block becomes the next step.
        StepOrderError: on entering, under ``OTEL_TRAIN_STEP_ORDER=raise``, when `i` is below the latest
            step entered (a resumed run declares its restart with `init(resume_step=)`).

    Example:
        >>> import otel_train as ot
        >>> with ot.step(5):
        ...     ot.current_step()
        5
    """

    __slots__ = ("_end_ns", "_samples", "_start_ns", "_step", "_token")

    def __init__(self, i: int | None = None, *, samples: int | None = None) -> None:
        if i is not None and (type(i) is not int or i >> 63):  # i >> 63: i is not in 0..MAX_STEP
            # Not a step (2.5, "3"): raised before init(); after it, warned once and the block is the next step
            i = _coerce_or_none(i, "otel_train.step()")
        if i is None:
            i = _next_step()
        self._step = i
        self._samples = samples
        self._token: contextvars.Token[int | None] | None = None
        self._start_ns = 0
        self._end_ns = 0

    @property
    def index(self) -> int:
        return self._step

    @property
    def started_ns(self) -> int:
        """When the step was entered (`time.perf_counter_ns`); 0 before."""
        return self._start_ns

    @property
    def ended_ns(self) -> int:
        """When the step ended (`time.perf_counter_ns`); 0 while it runs."""
        return self._end_ns

    def __enter__(self) -> int:
        latest = _state.latest
        if latest is not None and self._step < latest:
            if _state.order == "raise":
                raise StepOrderError(
                    f"otel_train.step({self._step}) after step {latest}: steps must not go backwards under "
                    "OTEL_TRAIN_STEP_ORDER=raise; pass resume_step= to init() when restarting from a "
                    "checkpoint, or set OTEL_TRAIN_STEP_ORDER=warn or drop"
                )
            if not _state.warned_backwards:
                _state.warned_backwards = True
                _logger.warning(
                    "step %d follows step %d: rows going backwards are %s (OTEL_TRAIN_STEP_ORDER=%s; "
                    "warned once)",
                    self._step, latest,
                    "dropped from every backend" if _state.order == "drop" else "written as given (W&B drops them)",
                    _state.order,
                )
        _state.latest = self._step
        shared = _shared_step
        if shared is not None:
            shared[0] = self._step
        self._token = _current.set(self._step)
        self._start_ns = _clock()
        _state.open = self  # one store: the hang watchdog reads the running step from another thread
        return self._step

    def __exit__(self, *exc: object) -> None:
        # Kept to a few attribute stores and one call: the runtime's hook appends the step's numbers to a
        # buffer and wakes no thread unless a collection is due; a `StepEnd` is built only for listeners.
        end_ns = self._end_ns = _clock()
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        state = _state
        state.iterations += 1
        hook = _hook
        if hook is not None:
            try:
                hook(self._step, self._start_ns, end_ns, state.iterations, self._samples)
            except Exception:  # never into the training loop
                _logger.exception("step-end hook failed")
        if _listeners:
            info = StepEnd(self._step, (end_ns - self._start_ns) / 1e9, (end_ns - state.started_ns) / 1e9,
                           state.iterations, self._samples)
            for listener in _listeners:
                try:
                    listener(info)
                except Exception:  # a listener must never break the training loop
                    _logger.exception("step-end listener %r failed", listener)


def steps(iterable: Iterable[_T], start: int | None = None) -> Iterator[_T]:
    """Iterate `iterable`, running the body of each iteration inside `step(start + k)`.

    Without `start`, the steps continue after the latest step entered (0 for the first), like `step()`:
    an epoch loop ``for epoch in ...: for batch in ot.steps(loader)`` never goes back to step 0.

    Raises:
        ValueError: before `init()`, `start` is not a step (see `coerce_step`); after it, such a start is
            warned about once, counted, and the steps continue after the latest.

    Example:
        >>> import otel_train as ot
        >>> [ot.current_step() for _ in ot.steps("ab", start=3)]
        [3, 4]
        >>> with ot.step(9):
        ...     pass
        >>> [ot.current_step() for _ in ot.steps("ab")]
        [10, 11]
    """
    i = None if start is None else _coerce_or_none(start, "otel_train.steps(start=)")
    if i is None:
        i = _next_step()
    for item in iterable:
        with step(i):
            yield item
        i += 1
