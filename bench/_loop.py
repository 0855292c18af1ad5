"""The one training-loop shape every benchmark row runs, and the measurements taken around it.

Per step: 4 timing regions (``data``, ``forward``, ``backward``, ``optimizer``) and one call that
logs 20 scalars. Tools with spans (otel-train, raw OTel) time the regions as spans; the others
time them with `perf_counter` and log the 4 durations with the 20 scalars (24 values per call).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

KEYS = tuple(f"train/m{k:02d}" for k in range(20))
REGIONS = ("data", "forward", "backward", "optimizer")
TIME_KEYS = tuple(f"time/{r}" for r in REGIONS)


def _make_values_source() -> str:
    items = ", ".join(f"{k!r}: b + {j / 32!r}" for j, k in enumerate(KEYS))
    return f"def make_values(i):\n    b = float(i % 1000)\n    return {{{items}}}\n"


_ns: dict[str, Any] = {}
exec(_make_values_source(), _ns)  # noqa: S102 - a dict literal, as user code writes it
make_values: Callable[[int], dict[str, float]] = _ns["make_values"]


_OFFSET = {k: j / 32 for j, k in enumerate(KEYS)}


def expected(step: int, key: str) -> float:
    """The value of `key` at `step` (exact in float32, so every backend can be checked exactly)."""
    return float(step % 1000) + _OFFSET[key]


class NoStep:
    """The step context for tools that have none (the step goes into the log call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NO_STEP = NoStep()


class Timer:
    """A timing region for tools without spans: the duration lands in `timings` (logged with the step)."""

    __slots__ = ("_key", "_t0", "timings")

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings = timings
        self._key = ""
        self._t0 = 0.0

    def __call__(self, name: str) -> Timer:
        self._key = "time/" + name
        return self

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timings[self._key] = time.perf_counter() - self._t0


class Tool:
    """What a benchmark row plugs into the loop. Override what the tool has."""

    name = "tool"
    expected_per_step = len(KEYS)

    def step(self, i: int) -> AbstractContextManager[Any]:
        return NO_STEP

    def region(self, name: str) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def log(self, i: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and close (timed)."""

    def landed(self, steps: int) -> int | None:
        """How many of the `steps * 20` scalars can be read back with the right value (None: not checked)."""
        return None


def children_cpu_s() -> float:
    """CPU of child processes (W&B's service, ClearML's reporter), live and reaped."""
    total = 0.0
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except ImportError:
        pass
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + r.ru_utime + r.ru_stime


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_loop(tool: Tool, steps: int, gap_s: float, warmup: int = 200) -> dict[str, Any]:
    """Run the loop; per-step wall times (ns) of the whole step, the regions and the log call."""
    step, region, log = tool.step, tool.region, tool.log
    pc = time.perf_counter_ns
    sleep = time.sleep
    for i in range(warmup):  # first calls open files / runs; not what a step costs
        with step(i):
            for r in REGIONS:
                with region(r):
                    pass
            log(i, make_values(i))
    gc.collect()
    total = [0] * steps
    spans = [0] * steps
    logs = [0] * steps
    children0 = children_cpu_s()
    cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    for k in range(steps):
        i = warmup + k
        t0 = pc()
        with step(i):
            for r in REGIONS:
                with region(r):
                    pass
            t1 = pc()
            log(i, make_values(i))
            t2 = pc()
        t3 = pc()
        total[k] = t3 - t0
        spans[k] = t1 - t0
        logs[k] = t2 - t1
        if gap_s:
            sleep(gap_s)  # the device's share of a step: the GIL is free for background threads
    wall1, thread1 = time.perf_counter(), time.thread_time()
    children_loop = children_cpu_s()
    srt = sorted(total)
    loop = {"steps": steps, "total_steps": warmup + steps, "mean_us": sum(total) / steps / 1e3,
            "p50_us": srt[steps // 2] / 1e3, "p99_us": srt[min(steps - 1, int(steps * 0.99))] / 1e3,
            "span_us": sum(spans) / steps / 1e3, "log_us": sum(logs) / steps / 1e3,
            "train_cpu_us": (thread1 - thread0) / steps * 1e6, "peak_rss_mb": peak_rss_mb()}
    sys.stdout.write("LOOP " + json.dumps(loop) + "\n")  # what survives a close that never returns
    sys.stdout.flush()
    tc = time.perf_counter()
    tool.close()
    close_s = time.perf_counter() - tc
    cpu1, thread2 = time.process_time(), time.thread_time()
    children1 = max(children_cpu_s(), children_loop)
    train_cpu = thread1 - thread0
    # Everything not on the training thread from loop start to closed: export threads, the writer
    # threads of the backends, their service processes.
    bg_cpu = (cpu1 - cpu0) - (thread2 - thread0) + (children1 - children0)
    total.sort()
    n = steps
    return {
        "steps": n,
        "total_steps": warmup + n,
        "mean_us": sum(total) / n / 1e3,
        "p50_us": total[n // 2] / 1e3,
        "p99_us": total[min(n - 1, int(n * 0.99))] / 1e3,
        "span_us": sum(spans) / n / 1e3,
        "log_us": sum(logs) / n / 1e3,
        "train_cpu_us": train_cpu / n * 1e6,
        "bg_cpu_us": bg_cpu / n * 1e6,
        "loop_wall_s": wall1 - wall0,
        "close_s": close_s,
        "peak_rss_mb": peak_rss_mb(),
    }


def chunks(seq: list[Any], size: int) -> Iterator[list[Any]]:
    for k in range(0, len(seq), size):
        yield seq[k:k + size]
