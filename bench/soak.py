"""Bounded memory: RSS over a long run of 20 scalars + 4 spans per step.

    python bench/soak.py                         # 1,000,000 steps, a counting backend, RSS every 100k
    python bench/soak.py --steps 200000 --exporters tensorboard,chrome_trace --gap-us 0

Prints RSS at intervals and the growth from the first interval to the end. `--gap-us` sleeps each
step (the device's share); with 0 the export threads only get the GIL the interpreter hands them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _loop import REGIONS, make_values, rss_mb
from worker import _counting_exporter


def soak(steps: int, every: int, exporters: str, gap_us: float, directory: Path) -> dict[str, float]:
    import otel_train as ot

    exp = [_counting_exporter()] if exporters == "count" else exporters.split(",")
    session = ot.init(exporters=exp, dir=directory, run_name="soak", run_id="soak")
    log, span, step = ot.log, ot.span, ot.step
    sleep, gap = time.sleep, gap_us / 1e6
    samples: list[tuple[int, float]] = [(0, rss_mb())]
    t0 = time.perf_counter()
    for i in range(steps):
        with step(i):
            for r in REGIONS:
                with span(r):
                    pass
            log(make_values(i))
        if gap:
            sleep(gap)
        if (i + 1) % every == 0:
            samples.append((i + 1, rss_mb()))
            sys.stderr.write(f"step {i + 1:>9,}  RSS {samples[-1][1]:7.1f} MB  "
                             f"({(time.perf_counter() - t0) / (i + 1) * 1e6:.1f} µs/step)\n")
    ot.flush()
    end = rss_mb()
    reader = session.reader
    dropped = (reader.log_buffer.dropped, reader.span_buffer.dropped, reader.dropped_windows)
    ot.shutdown()
    first = samples[1][1] if len(samples) > 1 else samples[0][1]
    return {"steps": steps, "rss_start_mb": samples[0][1], "rss_first_interval_mb": first, "rss_end_mb": end,
            "growth_mb": end - first, "dropped_records": dropped[0], "dropped_spans": dropped[1],
            "dropped_windows": dropped[2], "samples": samples}  # type: ignore[dict-item]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--every", type=int, default=100_000)
    p.add_argument("--exporters", default="count", help="`count` (a backend that keeps nothing) or names")
    p.add_argument("--gap-us", type=float, default=0.0)
    p.add_argument("--dir", type=Path, default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="otel-train-soak-") as tmp:
        out = soak(a.steps, a.every, a.exporters, a.gap_us, a.dir or Path(tmp))
    print("RESULT " + json.dumps(out))
    print(f"RSS {out['rss_first_interval_mb']:.1f} MB at step {a.every:,} -> {out['rss_end_mb']:.1f} MB at step "
          f"{a.steps:,}: growth {out['growth_mb']:+.1f} MB; dropped {out['dropped_records']} records, "
          f"{out['dropped_spans']} spans, {out['dropped_windows']} windows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
