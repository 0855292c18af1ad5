"""Figures for the "What the fault suite proves" table (docs/guarantees.md).

Runs the fault suite's signal driver (a tiny loop forked per repetition, JSONL + TensorBoard) for each
signal and reports the time from the signal to the process's end and the share of the steps logged
before the signal that landed; the same after `kill -9` followed by `otel-train replay` (and how long
the orphaned exporter process takes to drain and exit, polled every 10 ms); `kill -9` of the exporter
process twice per run (restart, then in-process export) and how many points landed twice; then the time
`ot.shutdown()` takes with a backend that never returns; and a real `rotel` collector between `otlp`
and the sink, killed for `--collector-down-s` seconds mid-run: step wall time while down vs up, and
the points that landed in the sink after recovery.

    python bench/faults.py --reps 20 [--only child_kill] [--collector-down-s 60]
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
        # Steps the loop finished after the parent saw step `reported_at_signal` and signalled (pipe latency only,
        # when the loop stops at the signal), and of all steps it finished, those that did not land.
        ran_on = sum(r["last_reported"] - r["reported_at_signal"] for r in results)
        lost = sum(max(0, r["last_reported"] + 1 - len({p[1] for p in r["jsonl"]})) for r in results)
        print(f"{sig}: {reps} reps, exit after signal median {statistics.median(exits) * 1000:.0f} ms, "
              f"max {max(exits) * 1000:.0f} ms; steps logged before the signal that landed: "
              f"JSONL {100 * landed / before:.1f} %, TensorBoard {100 * landed_tb / before:.1f} % ({before} steps); "
              f"steps finished after it: {ran_on}, finished steps missing from JSONL: {lost}")


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


def child_kill(reps: int) -> None:
    """`kill -9` of the exporter process at two random steps of each run (JSONL, TensorBoard, Chrome trace)."""
    import os
    import random
    import signal

    import otel_train as ot
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl
    from otel_train.trace_merge import load_trace

    points = twice = spans = spans_twice = kills = 0
    for rep in range(reps):
        rng = random.Random(rep)
        at = set(rng.sample(range(5, 55), 2))
        with tempfile.TemporaryDirectory() as out:
            session = ot.init(exporters=["jsonl", "tensorboard", "chrome_trace"], dir=out, run_name="k")
            proc = session.export_process
            assert proc is not None
            for step in range(60):
                with ot.step(step), ot.span("work"):
                    ot.log({"loss": 1.0 / (step + 1), "acc": step * 0.5})
                time.sleep(rng.uniform(0.0, 0.03))
                if step in at:
                    time.sleep(rng.uniform(0.0, 0.15))
                    old = proc.pid
                    os.kill(old, signal.SIGKILL)
                    kills += 1
                    deadline = time.monotonic() + 30
                    while proc.pid == old and proc.fallback is None and time.monotonic() < deadline:
                        time.sleep(0.01)
            ot.shutdown()
            got = [(r["tag"], r["step"]) for r in read_jsonl(jsonl_path(out, "k", 0))
                   if r["type"] == "metric" and r["tag"] in ("loss", "acc")]
            points += len(got)
            twice += len(got) - len(set(got))
            steps = [e["args"]["train.step"] for t in sorted(Path(out, "k", "trace").glob("rank0*.trace.json"))
                     for e in load_trace(t) if e.get("name") == "work"]
            spans += len(steps)
            spans_twice += len(steps) - len(set(steps))
    print(f"kill -9 of the exporter process: {kills} kills in {reps} runs; JSONL {twice} of {points} points twice, "
          f"Chrome trace {spans_twice} of {spans} spans twice")


def collector_down(down_s: float) -> None:
    """`otlp` (in the exporter process) -> rotel -> `otel-train sink`; rotel killed for `down_s` seconds."""
    import os

    import otel_train as ot
    from otel_train.exporters.jsonl import read_jsonl

    tests = Path(__file__).parents[1] / "tests"
    sys.path[:0] = [str(tests / "faults"), str(tests / "sink")]
    from rotel_proc import Rotel
    from test_collector_sink import _Sink

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs"
        sink = _Sink(Path(tmp) / "sink", out).start()
        rotel = Rotel(Path(tmp) / "rotel", sink.grpc).start()
        os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{rotel.grpc_port}",
                          OTEL_EXPORTER_OTLP_INSECURE="true")
        try:
            ot.init(exporters=["otlp"], dir=Path(tmp) / "local", run_id="down", run_name="down")
            phases: dict[str, list[float]] = {"up before": [], "down": [], "up after": []}
            phase, step, t_kill = "up before", 0, 0.0
            start = time.monotonic()
            while True:
                now = time.monotonic()
                if phase == "up before" and now - start >= 10:
                    rotel.kill()
                    phase, t_kill = "down", now
                elif phase == "down" and now - t_kill >= down_s:
                    rotel.start()
                    phase = "up after"
                elif phase == "up after" and now - t_kill >= down_s + 20:
                    break
                t0 = time.perf_counter()
                with ot.step(step):
                    ot.log({"loss": 1.0 / (step + 1), "acc": step * 0.5})
                    time.sleep(0.02)  # the step's work
                phases[phase].append(time.perf_counter() - t0)
                step += 1
            t0 = time.monotonic()
            ot.shutdown()
            shutdown_s = time.monotonic() - t0
            deadline = time.monotonic() + 120
            landed: set[tuple[str, int]] = set()
            while time.monotonic() < deadline:
                rows = [r for f in sorted(out.rglob("*.jsonl")) for r in read_jsonl(f)]
                got = [(r["tag"], r["step"]) for r in rows if r.get("type") == "metric" and r["tag"] in ("loss", "acc")]
                landed = set(got)
                if len(landed) == 2 * step:
                    break
                time.sleep(0.5)
        finally:
            rotel.stop()
            sink.stop()
    med = {k: statistics.median(v) * 1000 for k, v in phases.items() if v}
    print(f"collector down {down_s:g} s: step wall time median {med['down']:.2f} ms while down vs "
          f"{med['up before']:.2f} ms before / {med['up after']:.2f} ms after (20 ms of it the loop's sleep; "
          f"ratio {med['down'] / med['up before']:.3f}); {len(landed)}/{2 * step} points in the sink's JSONL, "
          f"{len(got) - len(landed)} twice; shutdown {shutdown_s:.2f} s")


def hanging_backend(deadline_s: float) -> None:
    import otel_train as ot
    from otel_train.testing import InMemoryRowExporter
    from otel_train.vocab.rows import HistogramRow, MetricRow

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
    parser.add_argument("--collector-down-s", type=float, default=60.0)
    parser.add_argument("--only", choices=["signals", "kill9", "kill9_whole_job", "child_kill", "hanging_backend",
                                           "collector_down"])
    args = parser.parse_args()
    parts = {"signals": lambda: signals(args.reps), "kill9": lambda: kill9(args.reps),
             "kill9_whole_job": lambda: kill9_whole_job(args.reps), "child_kill": lambda: child_kill(args.reps),
             "hanging_backend": lambda: hanging_backend(args.deadline_s),
             "collector_down": lambda: collector_down(args.collector_down_s)}
    for name, part in parts.items():
        if args.only in (None, name):
            part()


if __name__ == "__main__":
    main()
