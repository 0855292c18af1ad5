"""The official OpenTelemetry JavaScript SDK as a sender (its OTLP exporters over gRPC, HTTP/JSON and
HTTP/protobuf, default CUMULATIVE and DELTA temporality), run with `node` against a real sink.

The npm packages pinned in `js/package.json` are installed once into a cache folder outside the
repository (`~/.cache/otel-train-tests/js-<hash of package.json>`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sinkkit import make_sink, scalars

_JS = Path(__file__).parent / "js"
_CASES = [(p, t) for p in ("grpc", "http/json", "http/protobuf") for t in ("cumulative", "delta")]


def _run_id(protocol: str, temporality: str) -> str:
    return f"js-{protocol.replace('/', '-')}-{temporality}"


def _installed() -> Path:
    """The folder with `sender.mjs` and its node_modules (installed by npm on first use)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("the JavaScript sender test needs `node` and `npm` on PATH")
    package = (_JS / "package.json").read_bytes()
    digest = hashlib.sha256(package + (_JS / "sender.mjs").read_bytes()).hexdigest()[:12]
    folder = Path.home() / ".cache" / "otel-train-tests" / f"js-{digest}"
    if not (folder / "node_modules" / ".installed").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))
        shutil.copy(_JS / "package.json", staging)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--no-package-lock", "--loglevel=error"],
                       cwd=staging, check=True, timeout=300)
        shutil.copy(_JS / "sender.mjs", staging)
        (staging / "node_modules" / ".installed").write_text("ok")
        try:
            staging.rename(folder)
        except OSError:  # another session installed it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    return folder


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every (protocol, temporality) sender run at once against one sink; (runs folder, /runs by id)."""
    folder = _installed()
    tmp = tmp_path_factory.mktemp("js")
    sink = make_sink(tmp, exporters=("tensorboard", "chrome_trace"))
    try:
        procs = []
        for protocol, temporality in _CASES:
            endpoint = f"http://127.0.0.1:{sink.grpc_port if protocol == 'grpc' else sink.http_port}"
            procs.append(subprocess.Popen(
                ["node", "sender.mjs", protocol, temporality, endpoint, _run_id(protocol, temporality)],
                cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "NODE_NO_WARNINGS": "1"}))
        for proc, case in zip(procs, _CASES, strict=True):
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{case}: {out.decode()[-2000:]}"
        assert sink.flush(30)
        runs = {r["run_id"]: r for r in sink.runs()["runs"]}
        health = sink.health()
    finally:
        sink.stop()
    assert health["rejected"] == {} and health["unsupported"] == {}
    yield tmp / "runs", runs


@pytest.mark.parametrize(("protocol", "temporality"), _CASES)
def test_js_sdk_exact_values_per_step(sent: tuple[Path, dict[str, Any]], protocol: str, temporality: str) -> None:
    runs_dir, runs = sent
    run = _run_id(protocol, temporality)
    tb = scalars(runs_dir / run)
    assert tb["train/loss"] == [(s, 0.25 * s) for s in range(50)]  # once per step, however often re-sent
    assert tb["train/tokens"] == [(s, 100.0 * (s + 1)) for s in range(50)]  # running total 100 .. 5000
    assert tb["train/grad/count"] == [(s, 3.0) for s in range(50)]
    assert tb["train/grad/sum"] == [(s, 11.5) for s in range(50)]
    assert runs[run]["spans"] == 50
    trace = [p for p in (runs_dir / run).rglob("*.json") if "trace" in p.name]
    events = [e for p in trace for e in json.loads(p.read_text()) if isinstance(e, dict) and e.get("ph") == "X"]
    assert sorted(e["args"]["train.step"] for e in events if e["name"] == "train_step") == list(range(50))
