"""The configs in `collector-config/`: consistent with themselves, with the sink, and with rotel.

The OpenTelemetry Collector YAML is checked structurally (no collector binary here); the rotel
settings are checked against the real `rotel-agent` binary of the `rotel` test dependency.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from otel_train.sink.settings import SinkSettings

CONFIG_DIR = Path(__file__).resolve().parent.parent / "collector-config"
COLLECTOR_FILES = ("agent.yaml", "gateway.yaml")
ROTEL_ENV = CONFIG_DIR / "rotel-agent.env"
KINDS = ("receivers", "processors", "exporters", "connectors")
SINK_GRPC_PORT = int(SinkSettings().grpc.rpartition(":")[2])


def load(name: str) -> dict[str, Any]:
    config = yaml.safe_load((CONFIG_DIR / name).read_text(encoding="utf-8"))
    assert isinstance(config, dict), name
    return config


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def pipelines(config: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    result = config["service"]["pipelines"]
    assert isinstance(result, dict) and result
    return result


def exporter_of_type(config: dict[str, Any], type_: str) -> tuple[str, dict[str, Any]]:
    found = [(cid, body) for cid, body in config["exporters"].items() if component_type(cid) == type_]
    assert len(found) == 1, f"expected one `{type_}` exporter, got {[cid for cid, _ in found]}"
    return found[0]


def port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"ROTEL_[A-Z0-9_]+", key), f"{path.name}:{number}: {line!r}"
        assert value == value.strip() and not value.startswith(("'", '"')), f"{path.name}:{number}"
        assert key not in values, f"{path.name}:{number}: {key} set twice"
        values[key] = value
    return values


# -- OpenTelemetry Collector YAML -----------------------------------------------------------------


@pytest.mark.parametrize("name", COLLECTOR_FILES)
def test_pipelines_name_only_defined_components(name: str) -> None:
    config = load(name)
    for pipeline_id, pipeline in pipelines(config).items():
        assert component_type(pipeline_id) in ("traces", "metrics", "logs"), pipeline_id
        assert pipeline["receivers"] and pipeline["exporters"], pipeline_id
        for kind in ("receivers", "processors", "exporters"):
            for component_id in pipeline.get(kind, []):
                assert component_id in (config.get(kind) or {}), (
                    f"{name}: {pipeline_id} names undefined {component_id}"
                )
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"], f"{name}: undefined extension {extension}"


@pytest.mark.parametrize("name", COLLECTOR_FILES)
def test_every_defined_component_is_used(name: str) -> None:
    config = load(name)
    used = {kind: set() for kind in KINDS}
    for pipeline in pipelines(config).values():
        for kind in KINDS:
            used[kind].update(pipeline.get(kind, []))
    for kind in KINDS:
        assert set(config.get(kind) or {}) == used[kind], f"{name}: unused {kind}"
    assert set(config.get("extensions") or {}) == set(config["service"].get("extensions", []))


@pytest.mark.parametrize("name", COLLECTOR_FILES)
def test_memory_limiter_comes_first_in_every_pipeline(name: str) -> None:
    for pipeline_id, pipeline in pipelines(load(name)).items():
        processors = pipeline.get("processors", [])
        assert processors and component_type(processors[0]) == "memory_limiter", f"{name}: {pipeline_id}"


@pytest.mark.parametrize("name", COLLECTOR_FILES)
def test_metrics_traces_and_logs_all_flow(name: str) -> None:
    signals = {component_type(pipeline_id) for pipeline_id in pipelines(load(name))}
    assert signals == {"metrics", "traces", "logs"}


def test_agent_exports_to_the_gateway_with_queue_and_retry() -> None:
    agent, gateway = load("agent.yaml"), load("gateway.yaml")
    exporter_id, exporter = exporter_of_type(agent, "otlp_grpc")
    assert exporter["endpoint"] == "${env:OTEL_GATEWAY_ENDPOINT}"
    for pipeline in pipelines(agent).values():
        assert pipeline["exporters"] == [exporter_id]
    queue, retry = exporter["sending_queue"], exporter["retry_on_failure"]
    assert queue["enabled"] is True and queue["queue_size"] > 0 and queue["block_on_overflow"] is False
    assert queue["batch"]["min_size"] <= queue["batch"]["max_size"]
    assert retry["enabled"] is True
    # The README's example gateway address uses the port the gateway really listens on.
    gateway_port = port_of(gateway["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    readme = (CONFIG_DIR / "README.md").read_text(encoding="utf-8")
    examples = re.findall(r"OTEL_GATEWAY_ENDPOINT=\S+:(\d+)", readme)
    assert examples and {int(port) for port in examples} == {gateway_port}


def test_gateway_routes_every_run_to_one_sink_on_the_sink_port() -> None:
    gateway = load("gateway.yaml")
    exporter_id, exporter = exporter_of_type(gateway, "load_balancing")
    assert exporter["routing_key"] == "attributes"
    assert exporter["routing_attributes"] == ["train.run.id"]
    hostnames = exporter["resolver"]["static"]["hostnames"]
    assert hostnames and {port_of(host) for host in hostnames} == {SINK_GRPC_PORT}
    assert "endpoint" not in exporter["protocol"]["otlp"]  # the resolver supplies it
    for signal_ in ("metrics", "traces"):
        assert exporter_id in pipelines(gateway)[signal_]["exporters"], signal_


def test_gateway_keeps_delta_for_the_sinks_and_feeds_prometheus_cumulative() -> None:
    gateway = load("gateway.yaml")
    lb_id, _ = exporter_of_type(gateway, "load_balancing")
    prometheus_id, _ = exporter_of_type(gateway, "prometheus")
    file_id, file_exporter = exporter_of_type(gateway, "file")
    for pipeline_id, pipeline in pipelines(gateway).items():
        processors = [component_type(p) for p in pipeline.get("processors", [])]
        if prometheus_id in pipeline["exporters"]:
            assert pipeline["exporters"] == [prometheus_id] and pipeline_id.startswith("metrics")
            assert processors.index("attributes") < processors.index("deltatocumulative")
        else:
            assert "deltatocumulative" not in processors and "attributes" not in processors
            assert {lb_id, file_id} <= set(pipeline["exporters"]), pipeline_id
    step_deletes = [
        action
        for pid, body in gateway["processors"].items()
        if component_type(pid) == "attributes"
        for action in body["actions"]
    ]
    assert step_deletes == [{"key": "train.step", "action": "delete"}]
    rotation = file_exporter["rotation"]
    assert all(
        isinstance(rotation[k], int) and rotation[k] > 0 for k in ("max_megabytes", "max_days", "max_backups")
    )


# -- rotel ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rotel_binary() -> Path:
    import rotel  # a test dependency: a missing `rotel` fails here, it does not skip

    binary = Path(rotel.__file__).resolve().parent / "rotel-agent"
    assert binary.is_file() and os.access(binary, os.X_OK), binary
    return binary


@pytest.fixture(scope="module")
def rotel_help(rotel_binary: Path) -> str:
    done = subprocess.run(
        [rotel_binary, "start", "--help"], check=False, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_rotel_env_names_are_real_rotel_settings(rotel_help: str) -> None:
    known = set(re.findall(r"\[env: (ROTEL_[A-Z0-9_]+)=", rotel_help))
    assert len(known) > 50  # the help really lists its variables
    unknown = set(read_env_file(ROTEL_ENV)) - known
    assert not unknown, f"not in `rotel-agent start --help`: {sorted(unknown)}"


def test_rotel_env_sends_to_the_sink_and_leaves_its_ports_free() -> None:
    env = read_env_file(ROTEL_ENV)
    url = urlsplit(env["ROTEL_OTLP_EXPORTER_ENDPOINT"])
    assert url.scheme == "http" and url.hostname == "127.0.0.1" and url.port == SINK_GRPC_PORT
    assert env["ROTEL_EXPORTER"] == "otlp" and env["ROTEL_OTLP_EXPORTER_PROTOCOL"] == "grpc"
    sink = SinkSettings()
    receivers = {env["ROTEL_OTLP_GRPC_ENDPOINT"], env["ROTEL_OTLP_HTTP_ENDPOINT"]}
    assert all(r.startswith("127.0.0.1:") for r in receivers)
    assert {port_of(r) for r in receivers}.isdisjoint({port_of(sink.grpc), port_of(sink.http)})
    assert int(env["ROTEL_OTLP_GRPC_MAX_RECV_MSG_SIZE_MIB"]) * 1024 * 1024 <= sink.max_body_bytes
    # The daemon changes to / before writing its pid file: only absolute paths are safe, and those
    # are per machine, so the launcher sets them (as `rotel_environment` below does).
    for key in ("ROTEL_PID_FILE", "ROTEL_LOG_FILE"):
        assert key not in env or os.path.isabs(env[key]), key
    assert int(env["ROTEL_BATCH_MAX_SIZE"]) > 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rotel_environment(tmp_path: Path, **overrides: str) -> dict[str, str]:
    """The env file on free loopback ports, pid/log files under `tmp_path`, no inherited ROTEL_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTEL_")}
    env.update(read_env_file(ROTEL_ENV))
    env.update(
        ROTEL_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{free_port()}",
        ROTEL_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{free_port()}",
        ROTEL_PID_FILE=str(tmp_path / "rotel.pid"),
        ROTEL_LOG_FILE=str(tmp_path / "rotel.log"),
    )
    env.update(overrides)
    return env


def accepts(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.fixture
def run_rotel(rotel_binary: Path, tmp_path: Path) -> Iterator[Any]:
    """Start `rotel-agent start` in the foreground; every process started is stopped afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = open(tmp_path / f"rotel-{len(started)}.out", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([rotel_binary, "start"], env=env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def wait_until_listening(
    proc: subprocess.Popen[bytes], env: dict[str, str], deadline_s: float = 10.0
) -> None:
    deadline = time.monotonic() + deadline_s
    endpoints = (env["ROTEL_OTLP_GRPC_ENDPOINT"], env["ROTEL_OTLP_HTTP_ENDPOINT"])
    while not all(accepts(e) for e in endpoints):
        assert proc.poll() is None, f"rotel exited with {proc.returncode} before listening"
        assert time.monotonic() < deadline, "rotel did not open its ports in time"
        time.sleep(0.05)


def test_rotel_starts_with_the_env_file_and_stays_up(run_rotel: Any, tmp_path: Path) -> None:
    env = rotel_environment(tmp_path)
    proc = run_rotel(env)
    wait_until_listening(proc, env)
    # rotel opens its ports before it validates the exporter: only a live process after a
    # while shows the configuration was accepted.
    time.sleep(1.0)
    assert proc.poll() is None, (tmp_path / "rotel-0.out").read_text(encoding="utf-8")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
    assert "Starting Rotel" in (tmp_path / "rotel-0.out").read_text(encoding="utf-8")


def test_rotel_exits_when_the_exporter_endpoint_lacks_its_scheme(run_rotel: Any, tmp_path: Path) -> None:
    """The liveness check above can fail: the same settings without `http://` are refused."""
    env = rotel_environment(tmp_path, ROTEL_OTLP_EXPORTER_ENDPOINT=f"127.0.0.1:{SINK_GRPC_PORT}")
    proc = run_rotel(env)
    assert proc.wait(timeout=10) != 0
    assert "relative URL without a base" in (tmp_path / "rotel-0.out").read_text(encoding="utf-8")


def test_rotel_daemon_writes_pid_and_log_where_told(rotel_binary: Path, tmp_path: Path) -> None:
    env = rotel_environment(tmp_path)
    pid_file, log_file = Path(env["ROTEL_PID_FILE"]), Path(env["ROTEL_LOG_FILE"])
    done = subprocess.run(
        [rotel_binary, "start", "--daemon"], check=False, env=env, capture_output=True, timeout=30
    )
    pid = None
    try:
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 10
        while not (pid_file.is_file() and pid_file.read_text(encoding="utf-8").strip()):
            assert time.monotonic() < deadline, "no pid file"
            time.sleep(0.05)
        pid = int(pid_file.read_text(encoding="utf-8"))
        while not all(accepts(env[k]) for k in ("ROTEL_OTLP_GRPC_ENDPOINT", "ROTEL_OTLP_HTTP_ENDPOINT")):
            assert time.monotonic() < deadline, "daemon did not open its ports in time"
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(pid, 0)  # still alive: raises ProcessLookupError otherwise
        assert "Starting Rotel" in log_file.read_text(encoding="utf-8")
    finally:
        if pid is None:
            pid = _daemon_pid(rotel_binary, pid_file)
        if pid is not None:
            _stop(pid)


def _daemon_pid(binary: Path, pid_file: Path) -> int | None:
    """Find our daemon if its pid file never appeared: same binary, same pid-file setting."""
    import psutil

    for proc in psutil.process_iter(["exe"]):
        try:
            if proc.info["exe"] == str(binary) and proc.environ().get("ROTEL_PID_FILE") == str(pid_file):
                return int(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _stop(pid: int) -> None:
    import psutil

    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout=5)  # also returns for a zombie that our parent has not reaped yet
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        proc.kill()
