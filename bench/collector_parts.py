"""Where the collector thread's time goes at a ~0.6 ms step: its CPU per step, by part, in the real loop.

The loop of `real_loop.py --step 1ms` (a 256-96-96-10 MLP on the CPU, one thread, batch 128; per step 4 `ot.span`
and one `ot.log` of 20 values in an `ot.step`) with the default backends (in the exporter process). The collector
thread shares the training core (pinned as below), so its CPU is the training core's. Each part is timed by the
collector's own CPU (`time.thread_time` around the call; a collection runs a few dozen times a second at most, so
the clock reads cost nothing that shows): the whole collection, the window's build, its encoding, the span records' packing,
the hand-off to the exporter process, the buffers' drain, the SDK's collection and the hang watchdog's span samples.

    taskset -c 0 env OTEL_TRAIN_EXPORT_CPUS=1 python bench/collector_parts.py            # 5,000 steps (~10 s)

To compare two versions, run it against each in alternating processes (e.g. a `git worktree` of the earlier one
first on `PYTHONPATH`): within one process the parts are exact; between processes this VM's step varies.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

from _mlp_loop import MlpLoop, add_thread_time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    os.environ.setdefault("OTEL_TRAIN_QUIET", "1")

    import otel_train as ot
    from otel_train.capture.instrument import SpanBuffer
    from otel_train.collect import reader, window_builder
    from otel_train.hangs.watchdog import HangWatchdog
    from otel_train.ship import export_process

    spent: collections.Counter[str] = collections.Counter()
    add_thread_time(reader.StepAlignedMetricReader, "_collect_window", "collection, in all", spent)
    add_thread_time(reader.sdk, "collect", "the SDK's collection", spent)
    add_thread_time(window_builder.WindowBuilder, "build", "building the window", spent)
    add_thread_time(export_process, "encode_window", "encoding it", spent)
    add_thread_time(export_process, "pack_span_records", "packing the span records", spent)
    add_thread_time(export_process.ExportProcess, "_send_encoded", "handing it to the exporter process", spent)
    add_thread_time(SpanBuffer, "drain", "draining the span buffer", spent)
    add_thread_time(HangWatchdog, "take_spans", "the hang watchdog's span samples", spent)

    loop = MlpLoop()
    with tempfile.TemporaryDirectory() as tmp:
        ot.init(dir=tmp, run_name="collector-parts")
        for step in range(args.steps):
            with ot.step(step):
                loop.body(step, ot.span, ot.log)
        ot.shutdown()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.steps} steps, default backends; "
          "the collector thread's CPU\n")
    print("| part | µs/step |")
    print("|---|---|")
    for label, seconds in spent.most_common():
        print(f"| {label} | {seconds / args.steps * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
