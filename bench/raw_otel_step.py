"""What stamping raw OTel measurements with their step costs the training thread.

    python bench/raw_otel_step.py                  # 2,000 steps x 20 records per variant, 5 interleaved rounds
    python bench/raw_otel_step.py --steps 500 --rounds 3

One process, one session (a backend that only counts rows), one loop: per step 10 `Counter.add` and 10
`Histogram.record` through `ot.get_meter()`, timed on the training thread with `perf_counter_ns` around the
records only (collection runs on the collector thread after every step, as in a real run). Variants, rounds
interleaved, median per variant:

- ``before``: the reader's measurement hook as it was (flags the record, the point gets the collection's step);
- ``stamped``: the hook now (adds ``train.step`` = the current step to each measurement without one);
- ``explicit``: the user passes ``{"train.step": k}`` themselves (what the README used to recommend);
- ``sdk``: the SDK's own storage, no hook at all (the floor).

Prints ns per record and each variant against ``before``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from typing import Any

import otel_train as ot
from otel_train.testing import InMemoryRowExporter

RECORDS = 10  # per instrument per step


class _Counting(InMemoryRowExporter):
    def write_metrics(self, rows: Any, histograms: Any) -> None:  # keep memory flat: count only
        self.count = getattr(self, "count", 0) + len(rows) + len(histograms)


def _hooks(session: Any) -> dict[str, Any]:
    reader = session.reader
    storage = reader._sdk_storage
    stamped = storage.consume_measurement
    sdk = type(storage).consume_measurement.__get__(storage)

    def before(*args: Any, **kwargs: Any) -> None:  # the hook before the fix, verbatim
        if threading.get_ident() != reader._collector_ident:
            reader._sdk_recorded = True
        sdk(*args, **kwargs)

    return {"before": before, "stamped": stamped, "explicit": stamped, "sdk": sdk}


def _round(variant: str, hook: Any, session: Any, steps: int, first: int, counter: Any, hist: Any) -> float:
    session.reader._sdk_storage.consume_measurement = hook
    clock = time.perf_counter_ns
    spent = 0
    for k in ot.steps(range(first, first + steps), start=first):
        attrs = {"train.step": k} if variant == "explicit" else None
        t0 = clock()
        for _ in range(RECORDS):
            counter.add(1, attrs)
            hist.record(0.5, attrs)
        spent += clock() - t0
    ot.flush(timeout_s=60)
    return spent / (steps * 2 * RECORDS)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        session = ot.init(exporters=[_Counting()], dir=tmp, run_id="bench", export_interval_s=3600)
        meter = ot.get_meter("bench")
        counter, hist = meter.create_counter("samples"), meter.create_histogram("batch_time")
        hooks = _hooks(session)
        results: dict[str, list[float]] = {v: [] for v in hooks}
        first = 0
        _round("sdk", hooks["sdk"], session, 200, first, counter, hist)  # warm-up
        first += 200
        for _ in range(args.rounds):
            for variant, hook in hooks.items():
                results[variant].append(_round(variant, hook, session, args.steps, first, counter, hist))
                first += args.steps
        ot.shutdown()
    base = statistics.median(results["before"])
    print(f"{args.steps:,} steps x {2 * RECORDS} records per variant, {args.rounds} rounds (median)\n")
    print("| variant | ns per record | × before |")
    print("|---|---:|---:|")
    for variant, values in results.items():
        med = statistics.median(values)
        print(f"| {variant} | {med:.0f} | {med / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
