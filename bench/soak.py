"""No leaks: threads, open fds, RSS, child processes and live sessions, flat over repeated init/shutdown and
over a long run.

    python bench/soak.py                                   # 50 init/shutdown cycles, then 1,000,000 steps (~8 min)
    python bench/soak.py --cycles 50 --steps 0             # the cycles only (~1 min)
    python bench/soak.py --cycles 0 --steps 200000 --exporters jsonl,tensorboard --spans --gap-us 0

Cycles: each one `init()` with the named backends (in the exporter process), 20 steps logging a few values,
`shutdown()`. Start is measured after the first cycle (imports and lazy singletons loaded), end after the
last, once the exporter processes have exited (each drains on its own after `shutdown()`). `sessions` counts
every `Session` object still reachable, the closed one `otel_train` keeps for a second `shutdown()` included.
Steps: one session, a loop logging a few values per step (`--spans`: and 4 spans), then `--gap-us` of sleep
(the device's share of a step: with 0 the loop records faster than a backend converts, and the backlog, bounded
by `OTEL_TRAIN_BUFFER_SIZE`, shows as RSS), sampled every `--every` steps with the records waiting in the
buffer (`backlog`); start is the first sample (buffers and queues at their working size), end after the last
step.
Prints start, end and growth of each figure, then ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _loop import REGIONS, rss_mb
from worker import _counting_exporter


def sessions_alive() -> int:
    """`Session` objects the garbage collector can still reach (after a collection)."""
    from otel_train.session.runtime import Session

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Session)


def children() -> list[Any]:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


def probe(wait_children_s: float = 0.0) -> dict[str, float]:
    """The process's figures now; `wait_children_s`: first wait that long for child processes to exit."""
    import psutil

    if wait_children_s:
        psutil.wait_procs(children(), timeout=wait_children_s)
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "rss_mb": round(rss_mb(), 1), "children": len(children()), "sessions": sessions_alive()}


def report(name: str, start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
    growth = {k: round(end[k] - start[k], 1) for k in start}
    print(f"{name}: " + "; ".join(f"{k} {start[k]:g} -> {end[k]:g} ({growth[k]:+g})" for k in start))
    return {"start": start, "end": end, "growth": growth}


def cycles(n: int, exporters: list[str], directory: Path) -> dict[str, Any]:
    import otel_train as ot

    samples: list[dict[str, float]] = [probe()]
    for c in range(n):
        ot.init(exporters=exporters, dir=directory, run_name=f"cycle-{c}", run_id=f"cycle-{c}")
        for s in ot.steps(range(20)):
            ot.log({"loss": 1.0 / (s + 1), "lr": 0.1, "acc": s / 20})
        ot.shutdown()
        if c == 0 or c == n - 1:
            samples.append(probe(wait_children_s=30.0))
        if (c + 1) % 10 == 0:
            sys.stderr.write(f"cycle {c + 1:>4}  {probe()}\n")
    end = probe(wait_children_s=30.0)
    out = report(f"{n} init/shutdown cycles", samples[1], end)
    out["before_first"] = samples[0]
    return out


def steps(n: int, every: int, exporters: list[str], spans: bool, gap_us: float, directory: Path) -> dict[str, Any]:
    import otel_train as ot

    exp: list[Any] = [_counting_exporter()] if exporters == ["count"] else exporters
    session = ot.init(exporters=exp, dir=directory, run_name="soak", run_id="soak")
    log, span, sleep, gap = ot.log, ot.span, time.sleep, gap_us / 1e6
    samples: list[tuple[int, dict[str, float]]] = []
    t0 = time.perf_counter()
    for i in ot.steps(range(n)):
        if spans:
            for r in REGIONS:
                with span(r):
                    pass
        log({"loss": 1.0 / (i + 1), "lr": 0.1, "acc": (i % 100) / 100})
        if gap:
            sleep(gap)
        if (i + 1) % every == 0:
            samples.append((i + 1, {**probe(), "backlog": len(session.log_buffer)}))
            sys.stderr.write(f"step {i + 1:>9,}  {samples[-1][1]}  "
                             f"({(time.perf_counter() - t0) / (i + 1) * 1e6:.1f} µs/step)\n")
    ot.flush()
    end = {**probe(), "backlog": len(session.log_buffer)}
    dropped = {"records": session.log_buffer.dropped, "spans": session.span_buffer.dropped,
               "windows": session.reader.dropped_windows}
    ot.shutdown()
    first_step, first = samples[0] if samples else (0, end)
    out = report(f"{n:,} steps (from step {first_step:,})", first, end)
    out["dropped"] = dropped
    out["samples"] = samples
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--cycle-exporters", default="jsonl,tensorboard")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--every", type=int, default=100_000)
    p.add_argument("--exporters", default="count", help="`count` (a backend here that keeps nothing) or names")
    p.add_argument("--spans", action="store_true", help="4 spans per step as well")
    p.add_argument("--gap-us", type=float, default=300.0, help="sleep per step (the device's share)")
    p.add_argument("--dir", type=Path, default=None)
    a = p.parse_args()
    os.environ["OTEL_TRAIN_QUIET"] = "1"  # no summary line per shutdown
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="otel-train-soak-") as tmp:
        root = a.dir or Path(tmp)
        if a.cycles:
            result["cycles"] = cycles(a.cycles, a.cycle_exporters.split(","), root / "cycles")
        if a.steps:
            result["steps"] = steps(a.steps, min(a.every, a.steps), a.exporters.split(","), a.spans, a.gap_us, root / "steps")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
