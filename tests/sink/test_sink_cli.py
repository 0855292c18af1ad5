"""`python -m otel_train.sink`: help, fail-fast settings, env configuration, SIGTERM flush."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from rotel_proc import SinkProcess, free_port
from sinkkit import scalars


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_train.sink", *args], capture_output=True, text=True, check=False,
                          timeout=60, env={**os.environ, **(env or {})})


def test_help_lists_every_flag() -> None:
    out = _run("--help")
    assert out.returncode == 0
    for flag in ("--grpc", "--http", "--exporters", "--dir", "--token", "--aggregate", "--idle-s", "--tls-cert",
                 "--tls-key", "--max-body-bytes", "--reorder-s", "OTEL_TRAIN_SINK_GRPC", "OTEL_TRAIN_SINK_TOKEN"):
        assert flag in out.stdout


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--grpc", "nope"], {}, "--grpc: 'nope' is not allowed; expected HOST:PORT"),
    (["--idle-s", "-1"], {}, "--idle-s: '-1' is not allowed"),
    (["--reorder-s", "-1"], {}, "--reorder-s: '-1' is not allowed; expected a finite number of seconds >= 0"),
    ([], {"OTEL_TRAIN_SINK_AGGREGATE": "avg"}, "OTEL_TRAIN_SINK_AGGREGATE: unknown aggregate 'avg'"),
    (["--exporters", "tensorboard,nosuch"], {}, "unknown exporter 'nosuch'; known:"),
    (["--exporters", "otlp"], {}, "`otlp` is not allowed in the sink"),
    (["--tls-cert", "cert.pem"], {}, "--tls-cert/--tls-key: give both"),
])
def test_bad_values_fail_fast_with_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    out = _run(*args, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_env_configured_sink_flushes_on_sigterm(tmp_path: Path) -> None:
    http_port = free_port()
    env = {"OTEL_TRAIN_SINK_GRPC": f"127.0.0.1:{free_port()}", "OTEL_TRAIN_SINK_HTTP": f"127.0.0.1:{http_port}",
           "OTEL_TRAIN_EXPORTERS": "tensorboard", "OTEL_TRAIN_DIR": str(tmp_path / "runs"),
           "OTEL_TRAIN_SINK_TOKEN": "tok", "OTEL_TRAIN_SINK_IDLE_S": "3600"}
    sink = SinkProcess.__new__(SinkProcess)  # same helper, but configured only through the environment
    sink.grpc_port, sink.http_port, sink.log = 0, http_port, tmp_path / "sink.log"
    sink.proc = subprocess.Popen([sys.executable, "-m", "otel_train.sink"], env={**os.environ, **env},
                                 stdout=sink.log.open("wb"), stderr=subprocess.STDOUT)
    sink.wait_ready()
    doc = {"resourceMetrics": [{"resource": {"attributes": [
        {"key": "train.run.id", "value": {"stringValue": "envrun"}}]}, "scopeMetrics": [{"metrics": [
            {"name": "loss", "gauge": {"dataPoints": [{"asDouble": 0.25, "attributes": [
                {"key": "train.step", "value": {"intValue": "5"}}]}]}}]}]}]}
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/metrics", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer tok"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
    assert sink.stop() == 0  # SIGTERM: flushes the open run although it is not idle
    assert scalars(tmp_path / "runs" / "envrun") == {"loss": [(5, 0.25)]}
    assert "stopped" in sink.log.read_text()
