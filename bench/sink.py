"""Benchmark of `otel-train sink`: OTLP points/s decoded and written to TensorBoard, sink CPU and RSS.

N client processes send pre-encoded OTLP/gRPC metric requests (each `--steps-per-request` steps of
`--metrics` gauges, like the step-aligned reader with export_every > 1) for `--steps` steps, either
straight to the sink or through the rotel collector. The sink runs as its own process
(`python -m otel_train.sink`) with the tensorboard backend.

    python bench/sink.py --quick           # < 1 minute
    python bench/sink.py --clients 4 --steps 2000 --metrics 100 --via both

Before/after in one run: `--compare OTHER_PYTHON` runs every case with the sink of another checkout's
interpreter (its virtual environment's python: the sink process starts outside this checkout, so it imports
that one's package) and with this one, interleaved, `--repeat` times, and prints medians and ratios;
`--compare env --compare-env NAME=VALUE ...` compares this sink with itself under other settings
(`OTEL_TRAIN_SINK_*`). `--ceiling` also sends the same requests to a gRPC server that does nothing
(grpcio's asyncio server, as the sink's receiver): what this machine's transport and senders allow at that
request size, and the sink's share of it. `--py-spy FILE` records the sink with py-spy (collapsed stacks, every thread) and prints
its top functions.

    python bench/sink.py --via direct --steps 1000 --compare ../main/.venv/bin/python
    python bench/sink.py --via direct --steps 1000 --compare env --compare-env OTEL_TRAIN_SINK_SPOOL_RUN_MB=0
    python bench/sink.py --via direct --steps 1000 --steps-per-request 1 --ceiling
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _encode(rank: int, world: int, steps: range, metrics: int) -> bytes:
    from otel_train.testing import OtlpPoint, metrics_request

    t = time.time_ns()
    return metrics_request({"train.run.id": "bench", "train.rank": rank, "train.world_size": world}, [
        OtlpPoint(f"train/metric_{m}", rank + step * 0.001 + m, step=step, time_unix_nano=t)
        for m in range(metrics) for step in steps])


def _requests(rank: int, world: int, steps: int, metrics: int, per_request: int) -> list[bytes]:
    return [_encode(rank, world, range(first, min(steps, first + per_request)), metrics)
            for first in range(0, steps, per_request)]


def _endless(rank: int, world: int, metrics: int, per_request: int, until: float, sent: Any) -> Iterator[bytes]:
    """Requests encoded as they are sent, until `until` (time.monotonic); counts points in `sent`."""
    first = 0
    while time.monotonic() < until:
        yield _encode(rank, world, range(first, first + per_request), metrics)
        sent.value += per_request * metrics
        first += per_request


def _http_client(port: int, payloads: Iterable[bytes]) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/x-protobuf"}
    for body in payloads:
        for _ in range(50):
            conn.request("POST", "/v1/metrics", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                break
            if resp.status != 503:
                raise RuntimeError(f"HTTP {resp.status}")
            time.sleep(0.1)
    conn.close()


def _client(port: int, rank: int, world: int, args: argparse.Namespace, ready: Any, go: Any, sent: Any) -> None:
    import grpc

    payloads: Iterable[bytes]
    if args.duration_s:
        ready.release()
        go.wait()
        payloads = _endless(rank, world, args.metrics, args.steps_per_request, time.monotonic() + args.duration_s,
                            sent)
    else:
        payloads = _requests(rank, world, args.steps, args.metrics, args.steps_per_request)
        sent.value = len(payloads) and args.steps * args.metrics
        ready.release()
        go.wait()
    if args.protocol == "http":
        _http_client(port, payloads)
        return
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(_METHOD)
        for body in payloads:
            for _ in range(50):
                try:
                    call(body, timeout=30)
                    break
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    time.sleep(0.1)


def _start_clients(port: int, args: argparse.Namespace) -> tuple[list[Any], Any, list[Any]]:
    """`args.clients` sender processes, started and ready (requests encoded); they send once `go` is set.
    Returns them, `go`, and each one's count of points sent."""
    ready, go = mp.Semaphore(0), mp.Event()
    sent = [mp.Value("q", 0) for _ in range(args.clients)]
    clients = [mp.Process(target=_client, args=(port, r, args.clients, args, ready, go, sent[r]))
               for r in range(args.clients)]
    for c in clients:
        c.start()
    for _ in clients:
        ready.acquire()
    return clients, go, sent


def _noop_server(port: int) -> None:
    """A gRPC server as the sink's receiver is (grpcio's asyncio server) that answers every OTLP export at once,
    decoding nothing (`--ceiling`)."""
    import asyncio

    import grpc

    async def export(body: bytes, context: Any) -> bytes:
        return b""

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            _METHOD.split("/")[1], {"Export": grpc.unary_unary_rpc_method_handler(export)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def ceiling(args: argparse.Namespace) -> dict[str, Any]:
    """The same senders against `_noop_server`: points/s and server CPU per request with no work done."""
    import psutil

    port = _free_port()
    server = mp.Process(target=_noop_server, args=(port,), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the no-op gRPC server did not start") from None
                time.sleep(0.1)
        proc = psutil.Process(server.pid)
        clients, go, sent = _start_clients(port, args)
        cpu0 = sum(proc.cpu_times()[:2])
        t0 = time.perf_counter()
        go.set()
        for c in clients:
            c.join(args.timeout_s)
        seconds = time.perf_counter() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        total = sum(v.value for v in sent)
        requests = total / (args.steps_per_request * args.metrics)
        return {"via": "no-op gRPC server", "clients": args.clients, "points": total,
                "points_per_s": round(total / seconds), "requests_per_s": round(requests / seconds),
                "server_cpu_us_per_request": round(cpu / max(requests, 1) * 1e6)}
    finally:
        server.kill()
        server.join(10)


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def _run_counts(http_port: int) -> tuple[int, int]:
    for run in _get(http_port, "/runs")["runs"]:
        if run["run_id"] == "bench":
            return int(run["points"]), int(run["written"])
    return 0, 0


def bench(args: argparse.Namespace, via: str, python: str = sys.executable, py_spy: str = "") -> dict[str, Any]:
    import psutil

    workdir = Path(tempfile.mkdtemp(prefix="otel-train-bench-"))
    grpc_port, http_port = _free_port(), _free_port()
    if py_spy and shutil.which("py-spy") is None:
        raise SystemExit("--py-spy: the py-spy command is not installed (pip install py-spy)")
    wrap = ["py-spy", "record", "--format", "raw", "--output", py_spy, "--rate", "200", "--threads", "--function",
                                 "--"] if py_spy else []
    sink = subprocess.Popen(
        [*wrap, python, "-m", "otel_train.sink", "--grpc", f"127.0.0.1:{grpc_port}", "--http",
         f"127.0.0.1:{http_port}", "--exporters", "tensorboard", "--dir", str(workdir / "runs"),
         "--log-level", "WARNING", "--max-body-bytes", str(64 << 20)],
        stdout=subprocess.DEVNULL, stderr=(workdir / "sink.log").open("wb"), cwd=workdir)
    rotel = None
    target = http_port if args.protocol == "http" else grpc_port
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _get(http_port, "/health")
                break
            except OSError:
                if time.monotonic() > deadline or sink.poll() is not None:
                    raise RuntimeError((workdir / "sink.log").read_text()[-2000:]) from None
                time.sleep(0.1)
        if via == "rotel":
            import rotel as rotel_pkg

            target = _free_port()
            rotel = subprocess.Popen(
                [str(Path(rotel_pkg.__file__).parent / "rotel-agent"), "start",
                 "--otlp-grpc-endpoint", f"127.0.0.1:{target}", "--otlp-http-endpoint", f"127.0.0.1:{_free_port()}",
                 "--exporter", "otlp", "--otlp-exporter-endpoint", f"http://127.0.0.1:{grpc_port}",
                 # rotel (0.0.1a15) drops the Resource of a batch part split off at --batch-max-size
                 # (default 8192 points); a large maximum avoids the split (the 200 ms timeout flushes).
                 "--batch-max-size", "1000000",
                 "--pid-file", str(workdir / "rotel.pid"), "--log-file", str(workdir / "rotel.log")],
                stdout=(workdir / "rotel.out").open("wb"), stderr=subprocess.STDOUT)
            time.sleep(1.0)
            if rotel.poll() is not None:
                raise RuntimeError("rotel exited at start")
        proc = psutil.Process(sink.pid)
        if py_spy:  # the sink is py-spy's child
            proc = next(c for c in proc.children() if "otel_train.sink" in " ".join(c.cmdline()))
        machine0 = psutil.cpu_times()
        cpu0 = sum(proc.cpu_times()[:2])
        clients, go, sent = _start_clients(target, args)
        rss = proc.memory_info().rss
        samples: list[tuple[float, float, int]] = []  # (seconds, RSS MiB, points written)
        t0 = time.perf_counter()
        go.set()
        t_in = t_out = None
        total = 0
        _last = [0, 0]
        deadline = time.monotonic() + args.timeout_s + (args.duration_s or 0.0)
        while time.monotonic() < deadline:
            points, written = _last[:] = _run_counts(http_port)
            now = time.perf_counter()
            rss_now = proc.memory_info().rss
            rss = max(rss, rss_now)
            if not samples or now - t0 - samples[-1][0] >= args.sample_s:
                samples.append((round(now - t0, 1), round(rss_now / 2**20, 1), written))
            if not any(c.is_alive() for c in clients) or not args.duration_s:
                total = sum(v.value for v in sent)
                if t_in is None and total and points >= total:
                    t_in = now - t0
                if total and written >= total:
                    t_out = now - t0
                    break
            time.sleep(0.05)
        for c in clients:
            c.join(30)
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        machine1 = psutil.cpu_times()
        busy = sum(getattr(machine1, f) - getattr(machine0, f) for f in ("user", "system", "nice", "irq", "softirq"))
        idle = (machine1.idle - machine0.idle) + (getattr(machine1, "iowait", 0) - getattr(machine0, "iowait", 0))
        proc.send_signal(signal.SIGTERM)
        sink.wait(60)
        return {
            "via": via, "protocol": "grpc" if via == "rotel" else args.protocol, "clients": args.clients,
            "points": total,
            "ingested_points_per_s": round(total / t_in) if t_in else None,
            "written_points_per_s": round(total / t_out) if t_out else None,
            "seconds_to_written": round(t_out, 2) if t_out else None,
            "sink_cpu_s": round(cpu, 2), "machine_busy": f"{busy / max(busy + idle, 1e-9):.0%}",
            "sink_peak_rss_mib": round(rss / 2**20, 1),
            **({"rss_mib_over_time": [[t, r] for t, r, _ in samples]} if args.duration_s else {}),
            "sink_exit_code": sink.returncode, "received": _last[0], "written": _last[1],
        }
    finally:
        for p in (rotel, sink):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--metrics", type=int, default=100, help="gauges per step per client")
    parser.add_argument("--steps-per-request", type=int, default=10, dest="steps_per_request")
    parser.add_argument("--via", choices=("direct", "rotel", "both"), default="both")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                        help="how clients send to the sink directly (through rotel: always gRPC)")
    parser.add_argument("--timeout-s", type=float, default=300.0, dest="timeout_s",
                        help="give up this long after the clients are done (or after the start, without --duration-s)")
    parser.add_argument("--duration-s", type=float, default=0.0, dest="duration_s",
                        help="soak: clients encode and send for this long (--steps is then ignored)")
    parser.add_argument("--sample-s", type=float, default=30.0, dest="sample_s",
                        help="with --duration-s: how often the sink's RSS is recorded")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run directory (logs, events)")
    parser.add_argument("--quick", action="store_true", help="2 clients x 500 steps x 50 metrics, both paths")
    parser.add_argument("--compare", default="", metavar="PYTHON",
                        help="also run each case with this interpreter's sink (another checkout), interleaved")
    parser.add_argument("--repeat", type=int, default=3, help="with --compare: runs per case (median)")
    parser.add_argument("--compare-env", nargs="*", default=[], dest="compare_env", metavar="NAME=VALUE",
                        help="with --compare env: the environment of the 'after' sink")
    parser.add_argument("--ceiling", action="store_true",
                        help="also send the same requests to a gRPC server that does nothing (direct, gRPC)")
    parser.add_argument("--py-spy", default="", dest="py_spy", metavar="FILE",
                        help="record the sink with py-spy into FILE and print its top functions")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.steps, args.metrics, args.timeout_s = 2, 500, 50, 25.0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    vias = ("direct", "rotel") if args.via == "both" else (args.via,)
    if args.compare:
        return _compare(args, vias)
    for via in vias:
        result = bench(args, via, py_spy=args.py_spy)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        if args.py_spy:
            _top(args.py_spy)
        if args.ceiling and via == "direct" and args.protocol == "grpc":
            top = ceiling(args)
            sys.stdout.write(json.dumps(top) + "\n")
            print(f"sink / no-op server: {(result['written_points_per_s'] or 0) / top['points_per_s']:.2f}x "
                  f"({args.steps_per_request} step(s) x {args.metrics} gauges per request)")
    return 0


def _compare(args: argparse.Namespace, vias: tuple[str, ...]) -> int:
    """Each case with the other interpreter's sink ("before") and this one's ("after"), interleaved."""
    sinks = {"before": args.compare, "after": sys.executable}
    if args.compare == "env":  # the same sink, before: as it is; after: with --compare-env
        sinks = {"before": sys.executable, "after": sys.executable}
    for via in vias:
        got: dict[str, list[dict[str, Any]]] = {k: [] for k in sinks}
        for _ in range(args.repeat):
            for label, python in sinks.items():
                env_before = dict(os.environ)
                if args.compare == "env" and label == "after":
                    os.environ.update(dict(kv.split("=", 1) for kv in args.compare_env))
                try:
                    got[label].append(bench(args, via, python))
                finally:
                    os.environ.clear()
                    os.environ.update(env_before)
                sys.stdout.write(json.dumps({"sink": label, **got[label][-1]}) + "\n")
                sys.stdout.flush()
        med = {label: {
            "written_points_per_s": statistics.median(r["written_points_per_s"] or 0 for r in runs),
            "points_per_sink_cpu_s": statistics.median(r["points"] / max(r["sink_cpu_s"], 1e-9) for r in runs),
        } for label, runs in got.items()}
        print(f"{via}: {args.clients} clients x {args.steps_per_request} step(s) x {args.metrics} gauges per request, "
              f"median of {args.repeat}")
        for key in ("written_points_per_s", "points_per_sink_cpu_s"):
            b, a = med["before"][key], med["after"][key]
            print(f"  {key:24s} before {b:10,.0f}   after {a:10,.0f}   after/before {a / max(b, 1e-9):.2f}x")
    return 0


def _top(raw: str, n: int = 25) -> None:
    """The functions the sink's threads were sampled in (py-spy's collapsed stacks): own and total share."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in Path(raw).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";")[1:] if f]  # [0] is the thread
        if not frames or not count.isdigit():
            continue
        samples += int(count)
        own[frames[-1]] += int(count)
        for f in set(frames):
            total[f] += int(count)
    print(f"py-spy: {samples} samples; top functions by own samples (own%, total%)")
    for frame, c in own.most_common(n):
        print(f"  {100 * c / samples:5.1f}% {100 * total[frame] / samples:5.1f}%  {frame}")


if __name__ == "__main__":
    sys.exit(main())
