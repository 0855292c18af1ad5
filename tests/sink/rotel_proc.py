"""Start and stop real processes for the end-to-end tests: the rotel collector and the sink CLI.

rotel opens its ports before it validates its config, so "port open" is not "ready": we also
check the process is still alive. It writes pid/log files to /tmp unless told otherwise, so both
are passed under the test's tmp_path. Its queue is memory-only (dropped ~3 s after SIGTERM): wait
for the sink to have the data before stopping it. Its batch splitting loses the Resource of the
split-off part, so batches are bounded by time here, not size.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


def post_otlp(port: int, path: str, body: bytes, content_type: str = "application/x-protobuf",
              statuses: list[int] | None = None, tries: int = 600) -> int:
    """POST one OTLP/HTTP request to `path` as an OTel sender does: a 503 (a run closing, or still replayed after a
    restart) is retried after its Retry-After (at most 1 s; 0.05 s without one), any other answer is final. Returns
    the last status; every answer is appended to `statuses`."""
    status = 503
    for _ in range(tries):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": content_type})
        wait = 0.05
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status = int(resp.status)
        except urllib.error.HTTPError as err:
            status = int(err.code)
            wait = min(1.0, float(err.headers.get("Retry-After") or wait))
        if statuses is not None:
            statuses.append(status)
        if status != 503:
            return status
        time.sleep(wait)
    return status


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def rotel_binary() -> Path:
    import rotel

    return Path(rotel.__file__).parent / "rotel-agent"


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
    """Whether `condition` holds within `timeout_s` (checked once more at the end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class Rotel:
    """rotel on loopback: OTLP in on `grpc_port`/`http_port`, OTLP/gRPC out to `target_grpc_port`."""

    def __init__(self, workdir: Path, target_grpc_port: int, *extra_args: str) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.target = target_grpc_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.extra_args = extra_args

    def start(self, timeout_s: float = 20.0) -> Rotel:
        self.starts += 1
        log = self.workdir / f"rotel-{self.starts}.out"
        cmd = [
            str(rotel_binary()), "start",
            "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}",
            "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
            "--exporter", "otlp",
            "--otlp-exporter-endpoint", f"http://127.0.0.1:{self.target}",  # rotel needs the scheme
            "--otlp-exporter-protocol", "grpc",
            "--batch-timeout", "50ms",
            # rotel 0.0.1a15 drops the Resource of the part of a batch it splits off at
            # --batch-max-size (measured: those points arrive without train.run.id); a maximum this
            # large means batches are cut by the timeout only.
            "--batch-max-size", "1000000",
            "--pid-file", str(self.workdir / "rotel.pid"),
            "--log-file", str(self.workdir / "rotel.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rotel exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
            if _port_open(self.grpc_port) and _port_open(self.http_port):
                time.sleep(0.3)  # rotel binds before validating its config: still alive after that?
                if self.proc.poll() is None:
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"rotel did not open its ports in {timeout_s} s: {log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None:
            _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


class SinkProcess:
    """`python -m otel_train.sink` as a subprocess on free loopback ports."""

    def __init__(self, workdir: Path, *args: str, env: dict[str, str] | None = None,
                 fd_limit: int | None = None) -> None:
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.log = workdir / "sink.log"
        workdir.mkdir(parents=True, exist_ok=True)
        # `fd_limit`: the sink's process starts under that file-descriptor limit (soft and hard), as under
        # `ulimit -n`; set by the interpreter before the sink's module runs (no preexec_fn in a threaded parent).
        launch = ["-m", "otel_train.sink"] if fd_limit is None else [
            "-c", (f"import resource, runpy; resource.setrlimit(resource.RLIMIT_NOFILE, ({fd_limit}, {fd_limit})); "
                   "runpy.run_module('otel_train.sink', run_name='__main__', alter_sys=True)")]
        cmd = [sys.executable, *launch, "--grpc", f"127.0.0.1:{self.grpc_port}",
               "--http", f"127.0.0.1:{self.http_port}", "--status-interval-s", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout_s: float = 30.0) -> SinkProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sink exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                self.get("/health")
                return self
            except OSError:
                time.sleep(0.1)
        _stop(self.proc, signal.SIGKILL)
        raise RuntimeError(f"sink not ready in {timeout_s} s: {self.log.read_text()[-2000:]}")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as resp:
            return json.loads(resp.read())

    def post_metrics(self, body: bytes, tries: int = 100) -> None:
        """One OTLP/HTTP metrics request, retried on 503 as a collector does (`post_otlp`): a run that is closing
        just then, e.g. as the replay of its spool ends, refuses with a short hint."""
        status = post_otlp(self.http_port, "/v1/metrics", body, tries=tries)
        if status == 503:
            raise AssertionError(f"the sink refused the request {tries} times")
        assert status == 200, status

    def settled_health(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """`/health` once nothing is held for reordering and the spools found at start are delivered."""
        def settled() -> bool:
            health = self.get("/health")
            return bool(health["reorder_held"] == 0 and health["spool_replay"]["done"])

        assert wait_until(settled, timeout_s), self.get("/health")
        return dict(self.get("/health"))

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, and the exit code once the sink has written everything and exited."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def points(self, run_id: str) -> int:
        for run in self.get("/runs")["runs"]:
            if run["run_id"] == run_id:
                return int(run["points"])
        return 0

    def wait_points(self, run_id: str, expected: int, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        got = 0
        while time.monotonic() < deadline:
            got = self.points(run_id)
            if got >= expected:
                return got
            time.sleep(0.1)
        return got

    def stop(self) -> int:
        """SIGTERM (the sink flushes every run) and return the exit code."""
        _stop(self.proc, timeout_s=30.0)
        return int(self.proc.returncode)
