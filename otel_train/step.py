"""The step context: which training step the current code belongs to.

The step lives in a `ContextVar`, so asyncio tasks see the step of the code that created them.
Threads started by the user do not inherit context variables; there `current_step()` falls back
to the latest step entered in the process, which is what a data-loader or logging thread wants.
The step context never calls the reader: the runtime registers a step-end listener.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from otel_train import semconv
from otel_train.errors import StepOrderError

__all__ = [
    "RANK_ATTRIBUTE",
    "STEP_ATTRIBUTE",
    "StepEnd",
    "add_step_end_listener",
    "check_log_step",
    "current_step",
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

_current: contextvars.ContextVar[int | None] = contextvars.ContextVar("otel_train_step", default=None)
_clock = time.perf_counter_ns  # bound once: a step boundary is on the training thread's hot path


class _ProcessState:
    """Process-wide step facts: the latest step entered and the run's start time."""

    __slots__ = ("iterations", "last_logged", "latest", "order", "started_ns", "warned_backwards")

    def __init__(self) -> None:
        self.latest: int | None = None
        self.started_ns = _clock()
        self.iterations = 0
        self.warned_backwards = False
        self.order = "warn"  # OTEL_TRAIN_STEP_ORDER of the running session
        self.last_logged: int | None = None  # highest explicit `ot.log(step=)` under `raise`


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
        out = [(semconv.TRAIN_STEP_DURATION, self.duration_s), (semconv.TRAIN_TIME_TOTAL, self.time_total_s),
               (semconv.TRAIN_ITERATIONS, float(self.iterations))]
        if self.samples is not None and self.duration_s > 0:
            out.append((semconv.TRAIN_THROUGHPUT, self.samples / self.duration_s))
        return out


    @classmethod
    def from_times(cls, step: int, times: tuple[int, int, int, int | None]) -> StepEnd:
        """The StepEnd of a step-end hook's ``(start_ns, end_ns, iterations, samples)`` (off the training thread)."""
        start_ns, end_ns, iterations, samples = times
        return cls(step, (end_ns - start_ns) / 1e9, (end_ns - _state.started_ns) / 1e9, iterations, samples)


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


def set_step_order(policy: str, resume: bool = False) -> None:
    """Set the step-order policy the training thread enforces (the runtime calls it at init).

    `resume`: the run restarts (`resume_step`), so steps entered before do not count as "later".
    """
    _state.order = policy
    _state.last_logged = None
    if resume:
        _state.latest = None


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


def _reset_for_tests() -> None:
    global _state
    _state = _ProcessState()


class step:
    """Mark a block of code as one training step.

    Args:
        i: The step number; ``None`` means the previous step + 1 (0 for the first).
        samples: Samples processed in this step; when given, `train.throughput` is recorded.

    Raises:
        StepOrderError: on entering, under ``OTEL_TRAIN_STEP_ORDER=raise``, when `i` is below the latest
            step entered (a resumed run declares its restart with `init(resume_step=)`).

    Example:
        >>> import otel_train as ot
        >>> with ot.step(5):
        ...     ot.current_step()
        5
    """

    __slots__ = ("_samples", "_start_ns", "_step", "_token")

    def __init__(self, i: int | None = None, *, samples: int | None = None) -> None:
        if i is None:
            i = 0 if _state.latest is None else _state.latest + 1
        elif not isinstance(i, int):
            i = int(i)
        self._step = i
        self._samples = samples
        self._token: contextvars.Token[int | None] | None = None
        self._start_ns = 0

    @property
    def index(self) -> int:
        return self._step

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
        self._token = _current.set(self._step)
        self._start_ns = _clock()
        return self._step

    def __exit__(self, *exc: object) -> None:
        # Kept to a few attribute stores and one call: the runtime's hook appends the step's numbers to a
        # buffer and wakes no thread unless a collection is due; a `StepEnd` is built only for listeners.
        end_ns = _clock()
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


def steps(iterable: Iterable[_T], start: int = 0) -> Iterator[_T]:
    """Iterate `iterable`, running the body of each iteration inside `step(start + k)`.

    Example:
        >>> import otel_train as ot
        >>> [ot.current_step() for _ in ot.steps("ab", start=3)]
        [3, 4]
    """
    i = start
    for item in iterable:
        with step(i):
            yield item
        i += 1
