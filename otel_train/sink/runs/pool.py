"""A bounded set of threads per backend kind, on which every run's backends take turns.

The sink opens one set of backends per training run. A thread per run and backend does not scale (10,000
runs would be 20,000 threads); here each backend kind (``jsonl (sink)``, ``tensorboard (sink)``, ...) has
`threads` workers, and a run's backend is a *unit* scheduled onto them when it has work (`wake`), or when a
timed flush is due. A unit runs on one worker at a time, so a backend still never sees two windows at once.

One run must never hold up another, also when its backend hangs: a unit that has run longer than `stall_s`
no longer counts as a worker of its kind, and a spare worker is started for the others (at most `max_spare`
per kind; `stalled` counts the units stuck now, shown in `/health`). A worker beyond `threads` ends once it
has nothing to do.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["BackendPool"]

_logger = logging.getLogger(__name__)

_IDLE, _QUEUED, _RUNNING, _CLOSED = range(4)


class _Unit:
    """One run's one backend: its work function and where it stands in its kind's queue."""

    __slots__ = ("again", "due", "kind", "started", "state", "work")

    def __init__(self, kind: _Kind, work: Callable[[], float | None]) -> None:
        self.kind = kind
        self.work = work
        self.state = _IDLE
        self.again = False  # woken while running: run once more right after
        self.due = math.inf  # when its timed turn is due (monotonic)
        self.started = 0.0


class _Kind:
    """The workers and the queue of one backend kind."""

    def __init__(self, name: str, threads: int, stall_s: float, max_spare: int) -> None:
        self.name = name
        self.threads = threads
        self.stall_s = stall_s
        self.max_spare = max_spare
        self.cv = threading.Condition()
        self.ready: deque[_Unit] = deque()
        self.timed: list[tuple[float, int, _Unit]] = []
        self.tie = itertools.count()
        self.running: set[_Unit] = set()
        self.workers = 0
        self.idle = 0
        self.stop = False
        self.warned = False

    # -- called with self.cv held ----------------------------------------------------------------
    def stuck(self, now: float) -> int:
        return sum(1 for u in self.running if now - u.started >= self.stall_s)

    def ensure_worker(self, now: float) -> None:
        """Start a worker if work is waiting and too few of the existing ones can take it."""
        if self.idle or self.stop:
            return
        wanted = self.threads + self.stuck(now)
        if self.workers >= wanted:
            return
        if self.workers >= self.threads + self.max_spare:
            if not self.warned:
                self.warned = True
                _logger.warning("sink: %d `%s` writes have hung for over %.0f s; no more spare threads are started "
                                "(other runs of this backend wait for them)", self.stuck(now), self.name,
                                self.stall_s)
            return
        self.workers += 1
        threading.Thread(target=self.serve, name=f"otel-train-sink-{self.name}-{self.workers}", daemon=True).start()

    def push(self, unit: _Unit) -> None:
        unit.state = _QUEUED
        self.ready.append(unit)
        self.cv.notify()
        self.ensure_worker(time.monotonic())

    # -- workers ----------------------------------------------------------------------------------
    def serve(self) -> None:
        unit: _Unit | None = None
        while True:
            with self.cv:
                unit = None  # while it waits, a worker keeps no closed run's backend alive
                unit = self._next()
                if unit is None:
                    self.workers -= 1
                    return
                unit.state = _RUNNING
                unit.started = time.monotonic()
                self.running.add(unit)
            try:
                delay = unit.work()
            except Exception:  # the work isolates its backend; this is a last resort, never a dead worker
                _logger.exception("sink: `%s` work failed", self.name)
                delay = 1.0
            with self.cv:
                self.running.discard(unit)
                if delay is None:
                    unit.state = _CLOSED
                elif unit.again:
                    unit.again = False
                    self.push(unit)
                else:
                    unit.state = _IDLE
                    if delay != math.inf:
                        unit.due = time.monotonic() + delay
                        heapq.heappush(self.timed, (unit.due, next(self.tie), unit))
                        self.cv.notify()
                if self.workers > self.threads + self.stuck(time.monotonic()):
                    self.workers -= 1  # a spare whose stuck unit came back, or one that was stuck itself
                    if self.ready:
                        self.ensure_worker(time.monotonic())
                    return

    def _next(self) -> _Unit | None:
        """The next unit to run (cv held), waiting for one; None: this worker should end."""
        while True:
            now = time.monotonic()
            while self.timed and self.timed[0][0] <= now:
                due, _, unit = heapq.heappop(self.timed)
                if unit.state == _IDLE and unit.due == due:
                    unit.due = math.inf
                    unit.state = _QUEUED
                    self.ready.append(unit)
            if self.ready:
                return self.ready.popleft()
            if self.stop:
                return None
            timeout = self.timed[0][0] - now if self.timed else None
            self.idle += 1
            try:
                self.cv.wait(timeout)
            finally:
                self.idle -= 1


class BackendPool:
    """Bounded threads per backend kind for every run's backends (`otel_train.ship.delivery.BackendPool`).

    Args:
        threads: Workers per backend kind.
        stall_s: A write running longer than this no longer occupies a worker: a spare one is started.
        max_spare: Spare workers per kind at most (hung writes beyond it hold up that kind's other runs).
    """

    def __init__(self, threads: int = 4, stall_s: float = 2.0, max_spare: int = 64) -> None:
        self.threads = max(1, threads)
        self.stall_s = stall_s
        self.max_spare = max_spare
        self._kinds: dict[str, _Kind] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def _watch(self) -> None:
        """Work waiting behind writes that turned into stalls gets a spare worker without another wake."""
        while not self._closed.wait(self.stall_s / 2):
            with self._lock:
                kinds = list(self._kinds.values())
            for k in kinds:
                with k.cv:
                    if k.ready:
                        k.ensure_worker(time.monotonic())

    def register(self, kind: str, work: Callable[[], float | None]) -> Callable[[], None]:
        """Add one backend of kind `kind`; returns its wake function (see the module docstring)."""
        with self._lock:
            k = self._kinds.get(kind)
            if k is None:
                k = self._kinds[kind] = _Kind(kind, self.threads, self.stall_s, self.max_spare)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="otel-train-sink-pool-watchdog",
                                                  daemon=True)
                self._watchdog.start()
        unit = _Unit(k, work)

        def wake() -> None:
            with k.cv:
                if unit.state == _RUNNING:
                    unit.again = True
                elif unit.state == _IDLE:
                    k.push(unit)
                elif unit.state == _QUEUED:
                    k.ensure_worker(time.monotonic())  # a hung worker may be why it still waits

        return wake

    def stats(self) -> dict[str, Any]:
        """Workers, units waiting and units stuck (running over `stall_s`), per kind."""
        now = time.monotonic()
        out: dict[str, Any] = {}
        with self._lock:
            kinds = list(self._kinds.values())
        for k in kinds:
            with k.cv:
                out[k.name] = {"threads": k.workers, "waiting": len(k.ready), "stalled": k.stuck(now)}
        return out

    @property
    def stalled(self) -> int:
        return sum(int(s["stalled"]) for s in self.stats().values())

    def close(self) -> None:
        """Let the workers end once their queues are empty (the backends were closed before)."""
        self._closed.set()
        with self._lock:
            kinds = list(self._kinds.values())
        for k in kinds:
            with k.cv:
                k.stop = True
                k.cv.notify_all()
