"""The training thread's cost in one run: `ot.log`+`ot.span` against raw OTel and the floor, plus RSS growth.

    python bench/overhead.py                 # 20,000 steps per row, then a 200,000-step RSS run
    python bench/overhead.py --steps 5000 --rss-steps 50000
    python bench/overhead.py --boundary-only  # only the step-boundary table (about 20 s)

Each row runs in its own process (same loop as `run.py`: 20 scalars + 4 timing regions per step).
The step-boundary table times, on the training thread with `perf_counter_ns` around each step and
side by side in one process (rounds interleaved, median of 3): the floor (the 20 values built as a
dict literal, as user code does, and 20 `list.append`), an empty `ot.step`, `ot.step` + `ot.log` of
the 20 values, and TensorBoard's own event writer for the same 20 values (each row builds the dict
inside its timed block). The session runs without the hang watchdog; the "logging handler installed + watchdog
on" rows time the same `ot.step` + `ot.log` with a watchdog thread running through that row (default settings:
one look a second; and one look every 0.1 s, as `OTEL_TRAIN_HANG_AFTER_S=1` gives), interleaved with the others.

The logging handler (the `logging.Logger.callHandlers` hook that turns records into log records, at the default
`OTEL_TRAIN_LOG_LEVEL=WARNING`) is installed by `init()` in every row that runs a session: every `ot` row here and
in the per-row table below, the watchdog rows included. The child checks that it is and the table says so; nothing
in the timed loop logs, so the rows measure what having it installed costs a step that emits no record.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from run import HERE, isolated_env, run_row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--gap-us", type=float, default=200.0, help="simulated device time per step (sleep)")
    p.add_argument("--rss-steps", type=int, default=200_000)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--boundary-steps", type=int, default=20_000)
    p.add_argument("--boundary-only", action="store_true")
    p.add_argument("--boundary-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.boundary_child:
        return _boundary_child(args, Path(args.boundary_child))
    tmp = Path(tempfile.mkdtemp(prefix="otel-train-overhead-"))
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, tmp: Path) -> int:
    rc = _boundary(args, tmp)
    if rc or args.boundary_only:
        return rc
    rows = {tool: run_row(tool, args.steps, args, tmp) for tool in ("floor", "ot", "raw-otel")}
    for tool, r in rows.items():
        if "error" in r:
            print(f"{tool}: {r['error']}")
            return 1
    floor, ours, raw = rows["floor"], rows["ot"], rows["raw-otel"]
    print(f"{args.steps:,} steps per row, gap {args.gap_us:g} µs; per step: 20 scalars + 4 regions\n")
    print("| row | µs/step mean | p99 | 4 regions µs | log µs | train CPU µs/step | bg CPU µs/step |")
    print("|---|---|---|---|---|---|---|")
    for r in (floor, ours, raw):
        print(f"| {r['name']} | {r['mean_us']:.1f} | {r['p99_us']:.1f} | {r['span_us']:.1f} | {r['log_us']:.1f} "
              f"| {r['train_cpu_us']:.1f} | {r['bg_cpu_us']:.1f} |")
    log_ratio = raw["log_us"] / ours["log_us"]
    span_ratio = (ours["span_us"] / 4) / (raw["span_us"] / 4)
    print()
    print(f"- ot.log(20 scalars) {ours['log_us']:.1f} µs vs 20 raw gauge.set {raw['log_us']:.1f} µs: "
          f"{log_ratio:.0f}× cheaper (target ≥ 10×: {'met' if log_ratio >= 10 else 'MISSED'})")
    print(f"- a span: ot.span {ours['span_us'] / 4:.1f} µs vs raw OTel {raw['span_us'] / 4:.1f} µs: "
          f"{span_ratio:.2f}× (target ≤ 1.3×: {'met' if span_ratio <= 1.3 else 'MISSED'}; ot includes "
          f"entering ot.step)")
    print(f"- ot.log vs the floor (list.append of the dict): {ours['log_us'] / floor['log_us']:.2f}×; "
          f"whole step vs floor: {ours['mean_us'] / floor['mean_us']:.2f}×")
    cmd = [sys.executable, str(HERE / "soak.py"), "--steps", str(args.rss_steps), "--every",
           str(max(1, args.rss_steps // 10)), "--gap-us", str(args.gap_us), "--dir", str(tmp / "soak")]
    result = _child_result(cmd, "RSS run", args, tmp)
    if result is None:
        return 1
    growth = result["growth_mb"]
    print(f"- RSS over {args.rss_steps:,} steps (ot.log + 4 ot.span per step, counting backend): "
          f"{result['rss_first_interval_mb']:.1f} -> {result['rss_end_mb']:.1f} MB, growth {growth:+.1f} MB "
          f"(target < 20 MB: {'met' if growth < 20 else 'MISSED'}); dropped {result['dropped_records']} records, "
          f"{result['dropped_spans']} spans")
    return 0


def _child_result(cmd: list[str], what: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any] | None:
    """Run a bench child and return its `RESULT {json}` line (None, after saying why, if it has none)."""
    proc = subprocess.run(cmd, env=isolated_env(tmp), capture_output=True, text=True, timeout=args.timeout_s,
                          check=False)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        print(f"- {what} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-3:]}")
    return result


def _boundary(args: argparse.Namespace, tmp: Path) -> int:
    """Run the step-boundary rounds in a fresh process and print their table; non-zero on failure."""
    cmd = [sys.executable, __file__, "--boundary-child", str(tmp / "boundary"), "--boundary-steps",
           str(args.boundary_steps), "--gap-us", str(args.gap_us)]
    result = _child_result(cmd, "step-boundary run", args, tmp)
    if result is None:
        return 1
    floor, empty, logged, tb = (result[k] for k in ("floor", "ot.step empty", "ot.step + ot.log", "tb writer"))
    print(f"Step boundary, training thread, {args.boundary_steps:,} steps x 3 interleaved rounds (median), "
          f"gap {args.gap_us:g} µs, exporters: {result['exporters']}; logging handler installed in every ot row "
          f"(OTEL_TRAIN_LOG_LEVEL={result['log_level']}): {'yes' if result['logging_handler'] else 'NO'}\n")
    print("| row | µs/step median | p99 |")
    print("|---|---|---|")
    for name, r in result.items():
        if isinstance(r, dict):
            print(f"| {name} | {r['median_us']:.2f} | {r['p99_us']:.2f} |")
    lf, lt = logged["median_us"] / floor["median_us"], logged["median_us"] / tb["median_us"]
    print()
    print(f"- empty ot.step {empty['median_us']:.2f} µs (target ≤ 2 µs: "
          f"{'met' if empty['median_us'] <= 2 else 'MISSED'})")
    print(f"- ot.step + ot.log(20) vs the floor of 20 list.append: {lf:.2f}× (target ≤ 3×: "
          f"{'met' if lf <= 3 else 'MISSED'})")
    print(f"- ot.step + ot.log(20) vs TensorBoard's event writer: {lt:.2f}× (target ≤ 0.33×: "
          f"{'met' if lt <= 1 / 3 else 'MISSED'})")
    with_tensors = result.get("ot.step + ot.log, 4 CPU tensors")
    if isinstance(with_tensors, dict):
        print(f"- 4 of the 20 values as CPU tensors (read at the call): +{with_tensors['median_us'] - logged['median_us']:.2f} "
              f"µs per step ({with_tensors['median_us'] / logged['median_us']:.2f}× the all-float call)")
    for name in ("ot.step + ot.log, logging handler installed + watchdog on", "ot.step + ot.log, logging handler installed + watchdog on, 10 looks/s"):
        on = result.get(name)
        if isinstance(on, dict):  # noise: the larger spread of the two rows' round medians
            delta = on["median_us"] - logged["median_us"]
            noise = max(max(r["round_medians_us"]) - min(r["round_medians_us"]) for r in (on, logged))
            print(f"- {name}: {on['median_us']:.2f} µs vs {logged['median_us']:.2f} µs off ({delta:+.2f} µs; "
                  f"rounds spread up to {noise:.2f} µs: {'within' if abs(delta) <= noise else 'BEYOND'} noise)")
    print(f"- every step landed in the log buffer's export: {result['landed']} of {result['expected']}\n")
    return 0


def _boundary_child(args: argparse.Namespace, root: Path) -> int:
    import logging
    import os
    import statistics
    import time

    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    import otel_train as ot
    from otel_train.hangs.watchdog import HangWatchdog

    os.environ["OTEL_TRAIN_HANG_AFTER_S"] = "0"  # the watchdog runs only through the "watchdog on" rows
    session = ot.init(exporters=["jsonl"], dir=str(root / "runs"), run_name="boundary")
    capture = session.log_capture  # the logging handler, installed by `init()` for every row (checked, reported)
    handler_installed = capture.handler.active and logging.Logger.callHandlers is capture.handler._hook
    writer = EventFileWriter(str(root / "tb"))
    from _loop import make_values  # the 20 values as a dict literal, built inside every timed block
    clock, gap = time.perf_counter_ns, args.gap_us / 1e6
    n = args.boundary_steps
    step_no = [0]

    def floor(i: int) -> int:
        out: list[float] = []
        t0 = clock()
        for v in make_values(i).values():
            out.append(v)  # noqa: PERF402 - the floor is 20 appends, as a logger would do
        return clock() - t0

    def empty(i: int) -> int:
        t0 = clock()
        with ot.step(step_no[0]):
            pass
        t = clock() - t0
        step_no[0] += 1
        return t

    def logged(i: int) -> int:
        t0 = clock()
        with ot.step(step_no[0]):
            ot.log(make_values(i))
        t = clock() - t0
        step_no[0] += 1
        return t

    def tb(i: int) -> int:
        V = summary_pb2.Summary.Value
        t0 = clock()
        values = make_values(i)
        summary = summary_pb2.Summary(value=[V(tag=k, simple_value=v) for k, v in values.items()])
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=step_no[0], summary=summary))
        return clock() - t0

    rows = {"floor": floor, "ot.step empty": empty, "ot.step + ot.log": logged, "tb writer": tb,
            "ot.step + ot.log, logging handler installed + watchdog on": logged, "ot.step + ot.log, logging handler installed + watchdog on, 10 looks/s": logged}
    watchdog_floor_s = {"ot.step + ot.log, logging handler installed + watchdog on": 60.0, "ot.step + ot.log, logging handler installed + watchdog on, 10 looks/s": 1.0}
    try:  # 4 of the 20 values as CPU tensors, filled in place after logging (read at the call since the snapshot)
        import torch

        tensors = [torch.zeros(()) for _ in range(4)]

        def logged_tensors(i: int) -> int:
            values: dict[str, Any] = make_values(i)
            for k, (key, t) in enumerate(zip(list(values)[:4], tensors)):
                t.fill_(float(i + k))
                values[key] = t
            t0 = clock()
            with ot.step(step_no[0]):
                ot.log(values)
            t = clock() - t0
            step_no[0] += 1
            return t

        rows["ot.step + ot.log, 4 CPU tensors"] = logged_tensors
    except ImportError:
        pass
    samples: dict[str, list[list[int]]] = {name: [] for name in rows}
    logged_steps = []
    for _ in range(3):
        for name, fn in rows.items():
            dog = None
            if name in watchdog_floor_s:  # as `init()` starts it, fed the collected spans
                dog = HangWatchdog(watchdog_floor_s[name], 10.0, root / "hang" / "rank0.json", {"rank": 0})
                dog.start()
                session.reader.span_listener = dog.take_spans
            times = []
            for i in range(n):
                if name.startswith("ot.step + ot.log"):
                    logged_steps.append(step_no[0])
                times.append(fn(i))
                if gap:
                    time.sleep(gap)
            if dog is not None:
                dog.stop()
                session.reader.span_listener = None
            samples[name].append(sorted(times))
    session.shutdown()
    writer.close()
    landed = set()
    for path in (root / "runs").rglob("rank*.jsonl"):  # not the spool's binary `written.jsonl` cursor
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("name") == "train/m00":
                landed.add(rec.get("step"))
    out: dict[str, object] = {}
    for name, rounds in samples.items():
        out[name] = {"median_us": statistics.median(r[len(r) // 2] for r in rounds) / 1000,
                     "p99_us": statistics.median(r[int(len(r) * 0.99)] for r in rounds) / 1000,
                     "round_medians_us": [r[len(r) // 2] / 1000 for r in rounds]}
    out.update(exporters="jsonl (exporter process)", landed=len(landed & set(logged_steps)),
               expected=len(logged_steps), logging_handler=handler_installed,
               log_level=logging.getLevelName(session.settings.log_level or 0))
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
