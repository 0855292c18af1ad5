"""Benchmark: what an open run costs `otel-train sink`, ramping the number of runs.

The sink runs as its own process (`python -m otel_train.sink`, JSONL backend unless `--exporters`, runs never
idle-closed unless `--close-all`, default `--max-open-runs` and `--backend-threads`); one gRPC client opens runs
by sending each a one-point request (retrying a refusal, as a collector does: a request may meet the LRU closing
runs), and at every level of the ramp measures the latency of requests to random runs (p50, p99; a run the LRU
closed is reopened by it), then, with no traffic for `--idle-sample-s`, the sink's CPU use, and its threads, file
descriptors and RSS, per run. The last lines set the levels side by side (ratios to the first level).

    python bench/sink_runs.py                      # 1,000 and 10,000 runs
    python bench/sink_runs.py --levels 10,100,1000,2000,10000
    python bench/sink_runs.py --levels 10000 --close-all   # then every run closed: what memory comes back

`--close-all` starts the sink with `--idle-s 20`: runs then also close while the ramp is under way (as they do
in a long-lived sink), and after the last level the bench waits until `/health` shows none open and samples RSS.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(run_id: str, step: int) -> bytes:
    from otel_train.testing import OtlpPoint, metrics_request

    return metrics_request({"train.run.id": run_id}, [OtlpPoint("train/loss", step * 0.5, step=step)])


def _proc(pid: int) -> tuple[int, int, float, float]:
    """Threads, open file descriptors, RSS MiB and CPU seconds of process `pid` (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
    rss_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return threads, fds, rss_kib / 1024, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1000,10000", help="run counts of the ramp")
    parser.add_argument("--max-open-runs", default=None, dest="max_open_runs", help="the sink's --max-open-runs")
    parser.add_argument("--probes", type=int, default=200, help="requests timed at each level")
    parser.add_argument("--idle-sample-s", type=float, default=3.0, dest="idle_sample_s")
    parser.add_argument("--exporters", default="jsonl", help="the sink's backends (default jsonl)")
    parser.add_argument("--close-all", action="store_true", dest="close_all",
                        help="after the last level, wait until every run is closed (idle) and sample RSS")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    import grpc

    workdir = Path(tempfile.mkdtemp(prefix="otel-train-sink-runs-"))
    grpc_port, http_port = _free_port(), _free_port()
    log = (workdir / "sink.log").open("wb")
    sink = subprocess.Popen([sys.executable, "-m", "otel_train.sink", "--grpc", f"127.0.0.1:{grpc_port}", "--http",
                             f"127.0.0.1:{http_port}", "--exporters", args.exporters, "--dir", str(workdir / "runs"),
                             "--idle-s", "20" if args.close_all else "86400", "--status-interval-s", "3600",
                             *(["--max-open-runs", args.max_open_runs] if args.max_open_runs else [])],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        call = channel.unary_unary(_METHOD)
        refused = 0

        def export(body: bytes, timeout: float) -> None:
            nonlocal refused
            while True:
                try:
                    call(body, timeout=timeout)
                    return
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    refused += 1
                    time.sleep(0.01)

        base = _proc(sink.pid)
        print(f"idle sink: {base[0]} threads, {base[1]} fds, {base[2]:.1f} MiB")
        print("| runs | open s | p50 ms | p99 ms | idle CPU % | threads | fds | RSS MiB | KiB/run | threads/run "
              "| fds/run | refused |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        rows: list[dict[str, float]] = []
        opened = 0
        rng = random.Random(0)
        for level in levels:
            t0 = time.perf_counter()
            while opened < level:
                export(_request(f"run-{opened}", 0), timeout=60)
                opened += 1
            open_s = time.perf_counter() - t0
            lat = []
            for i in range(args.probes):
                body = _request(f"run-{rng.randrange(opened)}", i + 1)
                t = time.perf_counter()
                export(body, timeout=60)
                lat.append((time.perf_counter() - t) * 1000)
            lat.sort()
            before = _proc(sink.pid)
            time.sleep(args.idle_sample_s)
            threads, fds, rss, cpu = _proc(sink.pid)
            idle_cpu = (cpu - before[3]) / args.idle_sample_s * 100
            per_run_kib = (rss - base[2]) * 1024 / opened
            row = {"runs": opened, "p50 ms": lat[len(lat) // 2], "p99 ms": lat[int(len(lat) * 0.99)],
                   "threads": threads, "fds": fds, "RSS MiB": rss, "KiB/run": per_run_kib,
                   "threads/run": (threads - base[0]) / opened, "fds/run": (fds - base[1]) / opened}
            rows.append(row)
            print(f"| {opened:,} | {open_s:.1f} | {row['p50 ms']:.2f} | {row['p99 ms']:.2f} | "
                  f"{idle_cpu:.0f} | {threads} | {fds} | {rss:.0f} | {per_run_kib:.1f} | "
                  f"{row['threads/run']:.4f} | {row['fds/run']:.3f} | {refused} |", flush=True)
        if args.close_all:
            import json
            import urllib.request

            def runs_open() -> int:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as resp:
                    return int(json.loads(resp.read())["runs_open"])

            t0 = time.perf_counter()
            while runs_open() and time.perf_counter() - t0 < 600:
                time.sleep(1.0)
            time.sleep(args.idle_sample_s)
            threads, fds, rss, _ = _proc(sink.pid)
            print(f"\nevery run closed after {time.perf_counter() - t0:.0f} s: {threads} threads, {fds} fds, "
                  f"RSS {rss:.0f} MiB ({(rss - base[2]) * 1024 / opened:.1f} KiB per run opened)", flush=True)
        if len(rows) > 1:
            first = rows[0]
            print(f"\nside by side, ratio of each level to {first['runs']:,.0f} runs:")
            for key in ("runs", "threads", "fds", "RSS MiB", "KiB/run", "p50 ms", "p99 ms"):
                cells = ", ".join(f"{r[key]:,.1f} ({r[key] / first[key]:.2f}x)" if first[key] else f"{r[key]:,.1f}"
                                  for r in rows)
                print(f"  {key:>8}: {cells}")
    finally:
        sink.terminate()
        try:
            sink.wait(300)
        except subprocess.TimeoutExpired:
            sink.kill()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
