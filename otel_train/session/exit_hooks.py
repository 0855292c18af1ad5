"""Process exit and signals: every open session hands off (flushes, closes its backends) at interpreter exit
and on SIGTERM, SIGINT, SIGUSR1 and SIGHUP, then the process ends as it would have without us.

`otel_train.session.runtime.start` registers each session in `_active` and calls `_install_hooks`; the last session's
`shutdown()` gives the signal handlers back (`_restore_signal_handlers`).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Protocol

from otel_train._internal import sdk
from otel_train.capture.instrument import SpanBuffer, open_span_scopes
from otel_train.config.settings import Settings
from otel_train.vocab import semconv

__all__ = ["TRUNCATED_ATTRIBUTE", "HandsOff", "release_signal"]

#: Span attribute set on spans that were still open when a signal ended the process.
TRUNCATED_ATTRIBUTE = semconv.SPAN_TRUNCATED

_logger = logging.getLogger("otel_train")


class HandsOff(Protocol):
    """What the hooks need of a session (`otel_train.session.runtime.Session` is one): its deadline, its state, where
    a span cut short by a signal goes, and the hand-off itself."""

    settings: Settings
    span_buffer: SpanBuffer

    @property
    def closed(self) -> bool: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def shutdown(self, deadline: float | None = None) -> None: ...


# -- process hooks --------------------------------------------------------------------------------
#: Signals handed off like interpreter exit. SIGUSR1 is SLURM's `--signal` warning before preemption; SIGHUP
#: a closed terminal or SSH session.
_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP")
#: Of those, the ones that end the run from outside (a scheduler's preemption, a lost terminal), not a user's
#: Ctrl-C: the backends mark the run preempted.
_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGHUP")
#: The preemption signal this process received (its name), once one has: the backends mark their runs at shutdown.
_preempted_by: str | None = None
_hooks_installed = False
#: Per signal whose handler is ours (or was, until a handler installed over ours): the handler before ours.
_previous_handlers: dict[int, Any] = {}
_active: list[HandsOff] = []
_handoff: threading.Thread | None = None


def forget_preemption() -> None:
    """A new run in this process (an `init()` after `shutdown()`): a preemption the last run ended on is not its."""
    global _preempted_by
    _preempted_by = None


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
        for session in [s for s in _active if not s.closed]:  # a session still starting (a short script) first
            wait = getattr(session, "wait_started", None)
            if wait is not None:
                wait()
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


#: The same signal again within this long of the first is the first one twice, not a second one (which ends the
#: process at once): a launcher that forwards SIGTERM to the rank and signals its process group sends two.
_DUPLICATE_S = 1.0
_ending = False  # the hand-off is done: the next delivery of the signal is ours, and ends the process


def _ends_at_once_after(first_at: float) -> Any:
    """The handler of a signal whose hand-off is under way: a repeat within `_DUPLICATE_S` is ignored; anything
    later (a user pressing again), or the hand-off's own ending, gets the default action at once."""
    def repeat(signum: int, frame: Any) -> None:
        if not _ending and time.monotonic() - first_at < _DUPLICATE_S:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return repeat


def _end_process(signum: int, scopes: list[Any]) -> None:
    """Hand off (open spans recorded as truncated, every session shut down) and end the process by `signum`,
    whose disposition is the default again (the main thread sets it, as the signal arrives): same exit status as
    without us."""
    global _ending
    try:
        _record_truncated(scopes)
        _shutdown_active()
    except Exception:
        _logger.warning("otel-train: hand-off on signal %d failed", signum, exc_info=True)
    _ending = True
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # the signal is blocked in this thread (e.g. by the user's `pthread_sigmask`): end anyway
    os._exit(128 + signum)


def _flush_active() -> None:
    deadline = time.monotonic() + _shutdown_budget_s()
    for session in [s for s in _active if not s.closed]:
        session.flush(max(0.0, deadline - time.monotonic()))


_PACKAGE_DIR = os.path.abspath(__file__)
for _ in range(__name__.count(".")):  # otel-train's own code: the package folder, wherever this module sits in it
    _PACKAGE_DIR = os.path.dirname(_PACKAGE_DIR)
_LOCKING_CODE = (_PACKAGE_DIR, os.path.dirname(threading.__file__) + os.sep + "threading",
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
        # The default action ends the process: a second signal meanwhile ends it at once, but the same signal again
        # within `_DUPLICATE_S` is the first one twice (a launcher that signals the rank and its process group).
        # Open spans are recorded as truncated; the process ends by the same signal: no step runs after it.
        signal.signal(signum, _ends_at_once_after(time.monotonic()))
        budget_s = _shutdown_budget_s()  # before the hand-off closes the sessions it is computed from
        _handoff = threading.Thread(target=_end_process, args=(signum, open_span_scopes()), name="otel-train-signal",
                                    daemon=True)
        _handoff.start()
        _handoff.join(budget_s + 1.0)
        signal.signal(signum, signal.SIG_DFL)
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
            if previous is signal.SIG_IGN:  # ignored on purpose (`nohup`'s SIGHUP): it stays a no-op
                continue
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
