"""The sink's cost per point without the network: CPU µs per point of decoding + routing (the receivers'
thread) and of the whole path to TensorBoard files (spool, backend threads included), in one process.

Pre-encoded OTLP/protobuf metric requests (`--ranks` ranks of one run, each `--steps-per-request` steps of
`--metrics` gauges, as `bench/sink.py` sends them) go through `SinkCore.ingest`, the entry point both
receivers call, with the tensorboard backend and the default spool; the clock stops when every point is
written. CPU time, not wall time: other load on the machine does not count.

    python bench/sink_path.py [--steps-per-request 10] [--profile]
    python bench/sink_path.py --compare OTHER_PYTHON     # another checkout's sink, interleaved, medians

`--profile` prints cProfile's top functions of the ingest thread (decode + router + spool append); the
backend threads' share shows in `total` minus `ingest`.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _requests(ranks: int, steps: int, metrics: int, per_request: int) -> list[bytes]:
    from otel_train.testing import OtlpPoint, metrics_request

    t = time.time_ns()
    out = []
    for first in range(0, steps, per_request):
        for rank in range(ranks):
            out.append(metrics_request({"train.run.id": "bench", "train.rank": rank, "train.world_size": ranks}, [
                OtlpPoint(f"train/metric_{m}", rank + step * 0.001 + m, step=step, time_unix_nano=t)
                for m in range(metrics) for step in range(first, min(steps, first + per_request))]))
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.sink.receive.ingest import SinkCore
    from otel_train.sink.service import exporter_factory
    from otel_train.sink.settings import SinkSettings

    requests = _requests(args.ranks, args.steps, args.metrics, args.steps_per_request)
    points = args.ranks * args.steps * args.metrics
    with tempfile.TemporaryDirectory(prefix="otel-train-sink-path-") as tmp:
        options = ExporterOptions(directory=Path(tmp) / "runs", ranks="all")
        settings = SinkSettings(spool_dir=Path(tmp) / "spool", max_body_bytes=64 << 20)
        core = SinkCore(settings, exporter_factory(["tensorboard"], options), options.directory)
        gc.collect()
        gc.freeze()
        gc.set_threshold(10_000, 20, 20)  # as `otel-train sink` runs (otel_train.sink.cli)
        profile = cProfile.Profile() if args.profile else None
        cpu0, wall0 = time.process_time(), time.perf_counter()
        thread0 = time.thread_time()
        if profile is not None:
            profile.enable()
        for body in requests:
            core.ingest("metrics", body, "application/x-protobuf", None)
        if profile is not None:
            profile.disable()
        ingest_cpu = time.thread_time() - thread0
        deadline = time.monotonic() + 300
        while sum(r["written"] for r in core.runs()["runs"]) < points and time.monotonic() < deadline:
            time.sleep(0.002)
        total_cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        written = sum(r["written"] for r in core.runs()["runs"])
        core.router.close(30.0)
    if profile is not None:
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.top)
    return {"points": points, "written": written, "requests": len(requests),
            "ingest_us_per_point": round(ingest_cpu / points * 1e6, 3),
            "total_us_per_point": round(total_cpu / points * 1e6, 3),
            "points_per_cpu_s": round(points / total_cpu), "wall_s": round(wall, 2),
            "threads": threading.active_count()}


def _compare(args: argparse.Namespace) -> int:
    """This run's measure with the other interpreter's sink and with this one's, interleaved; medians."""
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--compare")
    del argv[i:i + 2]
    got: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for _ in range(args.repeat):
        for label, python in (("before", args.compare), ("after", sys.executable)):
            # Started outside this checkout, so each interpreter imports its own otel_train.
            out = subprocess.run([python, str(Path(__file__).resolve()), *argv, "--json"], capture_output=True,
                                 text=True, check=True, cwd=tempfile.gettempdir()).stdout
            got[label].append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps({"sink": label, **got[label][-1]}))
    print(f"{args.ranks} ranks x {args.steps_per_request} step(s) x {args.metrics} gauges per request, "
          f"median of {args.repeat}")
    for key in ("ingest_us_per_point", "total_us_per_point", "points_per_cpu_s"):
        b = statistics.median(r[key] for r in got["before"])
        a = statistics.median(r[key] for r in got["after"])
        print(f"  {key:20s} before {b:12,.3f}   after {a:12,.3f}   after/before {a / b:.2f}x")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--metrics", type=int, default=100)
    parser.add_argument("--steps-per-request", type=int, default=10, dest="steps_per_request")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--compare", default="", metavar="PYTHON")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OTEL_TRAIN_LOG_LEVEL", "WARNING")
    if args.compare:
        return _compare(args)
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
