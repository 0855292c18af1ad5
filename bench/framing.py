"""The hand-off cost of one window between the training process and the exporter process: the msgpack
encoding (`otel_train.ship.framing`: written by ormsgpack, read by msgpack-python) against the pickle of tuples
it replaced, side by side in one run. Encoding runs on the training process's collector thread, decoding in
the exporter process.

A window as a run sends it: `--keys` `ot.log` keys x `--steps` steps (the reader's point tuples), 5 SDK
gauges per step (rows), a histogram per step, and `--spans` spans per step with the attributes `ot.span`
gives them. Prints µs per window (encode, decode, both), bytes, and new / old ratios.

    python bench/framing.py [--keys 20 --steps 100 --spans 4 --rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from otel_train.exporters.base import Window
from otel_train.ship.framing import decode_window, encode_window
from otel_train.vocab.rows import HistogramRow, MetricRow, SpanRow
from otel_train.vocab.run_identity import RunInfo

RUN = RunInfo("bench-run", "bench-run", 0, 0, 8, "otel-train", "host-1", 4242, "abcd1234")

# The pickle encoding as it was (protocol 5, rows as tuples of their fields, the run as a tuple).
_RUN = attrgetter(*(f.name for f in dataclasses.fields(RunInfo)))
_METRIC = attrgetter(*(f.name for f in dataclasses.fields(MetricRow)))
_HIST = attrgetter(*(f.name for f in dataclasses.fields(HistogramRow)))
_SPAN = attrgetter(*(f.name for f in dataclasses.fields(SpanRow)))


def pickle_encode(run: RunInfo, points: Any, metrics: Any, hists: Any, spans: Any) -> tuple[bytes, int]:
    max_step = max(p[1] for p in points) if points else -1
    if metrics:
        max_step = max(max_step, max(r.step for r in metrics))
    return pickle.dumps((2, _RUN(run), points, list(map(_METRIC, metrics)), list(map(_HIST, hists)),
                         list(map(_SPAN, spans))), protocol=5), max_step


def pickle_decode(payload: bytes) -> Window:
    _, run_fields, points, metrics, hists, spans = pickle.loads(payload)
    run = RunInfo(*run_fields)
    rows = [MetricRow(run, s, key, key, v, "gauge", t) for key, s, v, t in points]
    rows.extend(MetricRow(*t) for t in metrics)
    return Window(rows, [HistogramRow(*t) for t in hists], [SpanRow(*t) for t in spans])


def window(keys: int, steps: int, spans_per_step: int) -> tuple[Any, ...]:
    t0 = 1_765_000_000_000_000_000
    tags = [f"train/metric_{k}" for k in range(keys)]  # one str per key, as the user's dict keys are
    points = [(tags[k], s, 1.0 / (k + s + 1), t0 + s * 1_000_000) for s in range(steps) for k in range(keys)]
    metrics = [MetricRow(RUN, s, f"sys/gauge_{g}", f"sys/gauge_{g}", 0.5 * g + s, "gauge", t0 + s, {}, None, "By",
                         "a gauge") for s in range(steps) for g in range(5)]
    hists = [HistogramRow(RUN, s, "grad/norm", "grad/norm", 10, 5.0, 0.1, 2.0, (0.0, 0.5, 1.0, 2.5), (1, 3, 4, 2, 0),
                          t0 + s, {}, "1", "") for s in range(steps)]
    names = ("data", "forward", "backward", "optimizer")
    spans = [SpanRow(RUN, names[i % 4], (s << 64) | 0xABCDEF0123456789ABCDEF, s * 16 + i + 1, s * 16, t0 + s * 1000 + i,
                     t0 + s * 1000 + i + 500, 140_000_000 + i, "MainThread", s,
                     {"train.step": s, "thread.id": 140_000_000 + i, "thread.name": "MainThread"})
             for s in range(steps) for i in range(spans_per_step)]
    return RUN, points, metrics, hists, spans


def _time(fn: Callable[[], Any], n: int) -> float:
    start = time.process_time()  # CPU time: another process's load on the machine does not count
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--spans", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=0, help="windows per timing (default: about 0.3 s worth)")
    a = parser.parse_args()
    args = window(a.keys, a.steps, a.spans)
    old, _ = pickle_encode(*args)
    new, _ = encode_window(*args)
    assert len(decode_window(new).metrics) == len(pickle_decode(old).metrics)
    n = a.n or max(20, int(0.3e6 / max(1.0, _time(lambda: pickle_decode(pickle_encode(*args)[0]), 5))))
    cases: dict[str, Callable[[], Any]] = {
        "pickle encode": lambda: pickle_encode(*args),
        "msgpack encode": lambda: encode_window(*args),
        "pickle decode": lambda: pickle_decode(old),
        "msgpack decode": lambda: decode_window(new),
    }
    results: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.rounds):  # interleaved rounds; the best of each
        for name, fn in cases.items():
            results[name].append(_time(fn, n))
    med = {k: min(v) for k, v in results.items()}
    rows = len(args[1]) + len(args[2]) + len(args[3]) + len(args[4])
    print(f"window: {a.keys} keys x {a.steps} steps + {5 * a.steps} SDK gauges + {a.steps} histograms + "
          f"{a.spans * a.steps} spans = {rows} rows; {n} windows x {a.rounds} rounds, best CPU µs per window")
    for kind in ("encode", "decode"):
        o, w = med[f"pickle {kind}"], med[f"msgpack {kind}"]
        print(f"  {kind:8s} pickle {o:9.1f}   msgpack {w:9.1f}   msgpack/pickle {w / o:.2f}x")
    o = med["pickle encode"] + med["pickle decode"]
    w = med["msgpack encode"] + med["msgpack decode"]
    print(f"  both     pickle {o:9.1f}   msgpack {w:9.1f}   msgpack/pickle {w / o:.2f}x")
    print(f"  bytes    pickle {len(old):9d}   msgpack {len(new):9d}   msgpack/pickle {len(new) / len(old):.2f}x")


if __name__ == "__main__":
    main()
