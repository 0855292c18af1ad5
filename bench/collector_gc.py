"""What the buffered records cost the training process's cycle collector, by how many the collector thread lets
wait before it drains them, at a ~0.6 ms step.

`ot.log` records and finished spans wait in the training process's buffers until the collector thread drains them.
Objects that are still buffered when Python's cycle collector runs survive into its older generations, and those
that reach the oldest one bring the full collections (every object of the process walked: ~0.1-0.2 s with torch
imported) that the same loop without otel-train never has. The collector wakes every 0.1 s, or sooner once
`_WAKE_RECORDS` records and spans wait (400; before, a quarter of the buffer: 25,000, so at this step only the
0.1 s applied); each setting here is a value of that count. The loop is that of `real_loop.py --step 1ms` (default
backends, in the exporter process), run in a fresh process per setting, settings interleaved, medians over the
repetitions. Per setting: the collections of each generation and their time per step (`gc.callbacks`, on the
training thread), the collector thread's CPU in its collections, and the training thread's CPU and wall time per
step.

    python bench/collector_gc.py          # 25,000 (before) against 400 (now), 20,000 steps, 3 repetitions (~2 min)
    python bench/collector_gc.py --wake-records 25000,1000,400,200

Each process runs under `taskset -c 0` with `OTEL_TRAIN_EXPORT_CPUS=1` where `taskset` exists. A full collection's
arrival also depends on what the process held before the loop, so compare the settings over several repetitions.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _child(wake_records: int, steps: int) -> dict[str, Any]:
    """One run: the loop with the collector woken at `wake_records` (the module's constant, set before `init()`)."""
    os.environ.setdefault("OTEL_TRAIN_QUIET", "1")
    from _mlp_loop import MlpLoop, add_thread_time

    import otel_train as ot
    from otel_train.collect import reader

    reader._WAKE_RECORDS = wake_records
    spent: collections.Counter[str] = collections.Counter()
    add_thread_time(reader.StepAlignedMetricReader, "_collect_window", "collecting", spent)
    loop = MlpLoop()
    per_gen = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            entry = per_gen[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - started[0]

    with tempfile.TemporaryDirectory() as tmp:
        session = ot.init(dir=tmp, run_name="collector-gc")
        ot.flush(timeout_s=60)  # the session's start done: the timed steps hold what every step pays
        for step in range(20):
            with ot.step(step):
                loop.body(step, ot.span, ot.log)
        spent.clear()
        exporter = session.export_process.pid if session.export_process is not None else None
        exporter_cpu = _process_cpu(exporter)
        gc.callbacks.append(on_gc)
        wall, cpu = time.perf_counter(), time.thread_time()
        for step in range(20, 20 + steps):
            with ot.step(step):
                loop.body(step, ot.span, ot.log)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        gc.callbacks.remove(on_gc)
        ot.flush(timeout_s=120)  # what the exporter process does with these steps, done
        exporter_cpu = _process_cpu(exporter) - exporter_cpu
        ot.shutdown()
    per_step = 1e6 / steps
    return {"step_us": wall * per_step, "thread_us": cpu * per_step, "collector_us": spent["collecting"] * per_step,
            "exporter_us": exporter_cpu * per_step, "windows": session.reader.windows,
            **{f"gen{g}": n for g, (n, _) in per_gen.items()},
            **{f"gen{g}_us": s * per_step for g, (_, s) in per_gen.items()},
            "gc_us": sum(s for _, s in per_gen.values()) * per_step}


def _process_cpu(pid: int | None) -> float:
    """CPU seconds of process `pid` so far, its threads included (0 where there is none)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wake-records", default="25000,400",
                        help="the counts of buffered records and spans that wake the collector, to compare")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT" + json.dumps(_child(args.child, args.steps)))
        return 0
    wakes = [int(w) for w in args.wake_records.split(",")]
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    env = {**os.environ, "OTEL_TRAIN_EXPORT_CPUS": "1"} if pin else dict(os.environ)
    env = {k: v for k, v in env.items() if k != "OTEL_TRAIN_EXPORTERS"}  # the default backends
    results: dict[int, list[dict[str, Any]]] = {w: [] for w in wakes}
    for _ in range(args.reps):
        for wake in wakes:
            cmd = [*pin, sys.executable, __file__, "--child", str(wake), "--steps", str(args.steps)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False,
                                  cwd=os.path.dirname(os.path.abspath(__file__)))
            if done.returncode != 0:
                raise SystemExit(f"run failed ({done.returncode}): {done.stderr[-2000:]}")
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
            results[wake].append(json.loads(line[len("RESULT"):]))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.steps} steps, default backends, "
          f"median of {args.reps}{' (pinned)' if pin else ''}\n")
    print("| collector woken at (records) | windows | collections gen 0 / 1 / 2 | cycle collector µs/step "
          "(full ones) | collector thread µs/step | training thread µs/step | wall µs/step | "
          "exporter process µs/step |")
    print("|---|---|---|---|---|---|---|---|")
    for wake, rs in results.items():
        def med(key: str, rows: list[dict[str, Any]] = rs) -> float:
            return statistics.median(r[key] for r in rows)

        full = ", ".join(str(r["gen2"]) for r in rs)
        print(f"| {wake} | {med('windows'):.0f} | {med('gen0'):.0f} / {med('gen1'):.0f} / {med('gen2'):.0f} "
              f"(full, each run: {full}) | {med('gc_us'):.1f} ({med('gen2_us'):.1f}) | "
              f"{med('collector_us'):.1f} | {med('thread_us'):.0f} | "
              f"{med('step_us'):.0f} | {med('exporter_us'):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
