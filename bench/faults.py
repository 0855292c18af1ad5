"""Figures for the README's "What the fault suite proves" table.

Runs the fault suite's signal driver (a tiny loop forked per repetition, JSONL + TensorBoard) for each
signal and reports the time from the signal to the process's end and the share of the steps logged
before the signal that landed; the same after `kill -9` followed by `otel-train replay` (and how long
the orphaned exporter process takes to drain and exit, polled every 10 ms); then the time
`ot.shutdown()` takes with a backend that never returns.

    python bench/faults.py --reps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

DRIVER = Path(__file__).parents[1] / "tests" / "faults" / "signal_driver.py"
KILL9_DRIVER = DRIVER.with_name("kill9_driver.py")


def signals(reps: int) -> None:
    for sig in ("SIGTERM", "SIGINT", "SIGUSR1"):
        with tempfile.TemporaryDirectory() as out:
            proc = subprocess.run([sys.executable, str(DRIVER), out, sig, str(reps), "1"], capture_output=True,
                                  text=True, check=True)
        results = json.loads(proc.stdout)
        exits = [r["exit_s"] for r in results]
        before = sum(r["reported_at_signal"] + 1 for r in results)
        landed = sum(min(len({p[1] for p in r["jsonl"]}), r["reported_at_signal"] + 1) for r in results)
        landed_tb = sum(min(len({p[1] for p in r["tb"]}), r["reported_at_signal"] + 1) for r in results)
        print(f"{sig}: {reps} reps, exit after signal median {statistics.median(exits) * 1000:.0f} ms, "
              f"max {max(exits) * 1000:.0f} ms; steps logged before the signal that landed: "
              f"JSONL {100 * landed / before:.1f} %, TensorBoard {100 * landed_tb / before:.1f} % ({before} steps)")


def kill9(reps: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, str(KILL9_DRIVER), out, str(reps), "1"], capture_output=True,
                              text=True, check=True)
    results = json.loads(proc.stdout)
    drains = [r["drained_s"] for r in results]
    reached = sum(r["cursors"].get("jsonl", 0) for r in results)  # windows spooled and made durable
    spooled = sum(r["spooled_seq"] for r in results)
    steps = sum(len({p[1] for p in r["jsonl"]}) for r in results)
    once = sum(len(r["jsonl"]) == len({tuple(p) for p in r["jsonl"]}) == len(r["tb"]) for r in results)
    print(f"kill -9: {reps} reps, {steps} steps landed, {reached}/{spooled} spooled windows durable in JSONL, "
          f"{once}/{reps} reps with every point once in JSONL and TensorBoard; exporter process drained and "
          f"exited {statistics.median(drains) * 1000:.0f} ms median, {max(drains) * 1000:.0f} ms max after the kill")


def kill9_whole_job(reps: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, str(KILL9_DRIVER), out, str(reps), "2", "both"], capture_output=True,
                              text=True, check=True)
    results = json.loads(proc.stdout)
    spooled = sum(r["spooled_step"] + 1 for r in results)
    landed = sum(len({p[1] for p in r["jsonl"]}) for r in results)
    points = sum(len(r["jsonl"]) for r in results)
    repeated = points - sum(len({tuple(p) for p in r["jsonl"]}) for r in results)
    print(f"kill -9 of both processes: {reps} reps, after replay {landed}/{spooled} spooled steps in JSONL, "
          f"{repeated} of {points} points written twice (not yet acknowledged at the kill)")


def hanging_backend(deadline_s: float) -> None:
    import otel_train as ot
    from otel_train.records import HistogramRow, MetricRow
    from otel_train.testing import InMemoryRowExporter

    class Hanging(InMemoryRowExporter):
        def write_metrics(self, rows: Sequence[MetricRow], histograms: Sequence[HistogramRow]) -> None:
            threading.Event().wait()

    with tempfile.TemporaryDirectory() as out:
        ot.init(exporters=["jsonl", Hanging()], dir=out, run_id="h", shutdown_timeout_s=deadline_s)
        for s in ot.steps(range(20)):
            ot.log({"loss": 1.0 / (s + 1)})
        t0 = time.monotonic()
        ot.shutdown()
        print(f"hanging backend: shutdown returned after {time.monotonic() - t0:.2f} s "
              f"(OTEL_TRAIN_SHUTDOWN_TIMEOUT_S={deadline_s:g})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--deadline-s", type=float, default=2.0)
    args = parser.parse_args()
    signals(args.reps)
    kill9(args.reps)
    kill9_whole_job(args.reps)
    hanging_backend(args.deadline_s)


if __name__ == "__main__":
    main()
