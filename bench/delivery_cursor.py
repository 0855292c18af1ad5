"""What recording a backend's written cursor after every window costs (`Spool.advance`, one 12-byte
`pwrite`), against the flush-time cursor (`Spool.acknowledge`: JSON + rename) and against writing the
window itself to JSONL. Prints µs per window and the ratios.

    python bench/delivery_cursor.py [--windows 5000]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.exporters.jsonl import JsonlExporter
from otel_train.ship.spool import Spool
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("bench", "bench")
WINDOW = Window(metrics=[MetricRow(RUN, 0, f"m{i}", f"m{i}", float(i), "gauge", 1) for i in range(20)])


def _time(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for i in range(1, n + 1):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    n = parser.parse_args().windows
    rounds = parser.parse_args().rounds
    results: dict[str, list[float]] = {"advance (pwrite)": [], "acknowledge (json + rename)": [],
                                       "jsonl window of 20 values": []}
    for _ in range(rounds):  # interleaved rounds, medians
        with tempfile.TemporaryDirectory() as d:
            spool = Spool(Path(d) / "spool")
            results["advance (pwrite)"].append(_time(functools.partial(spool.advance, "jsonl"), n))
            results["acknowledge (json + rename)"].append(_time(functools.partial(spool.acknowledge, "jsonl"), n))
            spool.close()
            exp = JsonlExporter(ExporterOptions(directory=d))
            results["jsonl window of 20 values"].append(_time(lambda _i, e=exp: e.export_window(WINDOW), n))
            exp.shutdown()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"{n} windows x {rounds} rounds, median µs per window")
    for k, v in med.items():
        print(f"  {k:32s} {v:8.2f}")
    print(f"advance / acknowledge: {med['advance (pwrite)'] / med['acknowledge (json + rename)']:.3f}x; "
          f"advance / the jsonl write itself: {med['advance (pwrite)'] / med['jsonl window of 20 values']:.3f}x")


if __name__ == "__main__":
    main()
