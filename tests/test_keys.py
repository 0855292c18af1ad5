"""Keys users really write (`val/mAP@0.5`, `Loss (val)`, unicode, spaces) reach every backend.

One real run logs them into TensorBoard, JSONL, MLflow's SQLite store and an offline W&B run, each read back
with its own reader; the `otlp` backend sends them to a real `otel-train sink`, whose JSONL shows the keys as
logged. Where a backend has a rule (MLflow's character set, OTel's instrument-name rule on the wire) the
mapping is a pure function of the key: the same in another process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
sys.path.insert(0, str(Path(__file__).parent / "sink"))

from backendkit import isolated_backends_env, read_run, row, wait_for_delivery

from otel_train.exporters.jsonl import jsonl_path, read_jsonl
from otel_train.vocab.names import KEY_DESCRIPTION_PREFIX, key_from_description, otlp_name

# Real processes, each under a 300 s limit of its own: twice the suite's default per test.
pytestmark = pytest.mark.timeout(600)
KEYS = ["val/mAP@0.5", "Loss (val)", "épochs/loss", "train/loss", "lr group 0:head", "val/mAP#0.5", "损失"]
CHILD_KEY = "data/wait (ms)@child"
STEPS = 4
OTEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_./\-]{0,254}\Z")


def value(i: int, step: int) -> float:
    return step * 10 + i + 0.5  # exact in float32 (TensorBoard)


SCRIPT = textwrap.dedent("""
    import os, sys
    import otel_train as ot
    keys = {keys!r}
    ot.init(exporters=["tensorboard", "jsonl", "mlflow", "wandb"], dir=sys.argv[1], run_id="keys",
            run_name="keys", export_every=2)
    for s in ot.steps(range({steps})):
        ot.log({{k: s * 10 + i + 0.5 for i, k in enumerate(keys)}})
    ot.flush()  # every step out first: a child's value arriving before an older step is the case under test
    pid = os.fork()
    if pid == 0:  # a child process: values go through the worker path
        ot.log({{{child!r}: 7.0}}, step={steps} - 1)
        ot.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    ot.shutdown()
""")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, mlflow_store_template: Path) -> Path:
    root = tmp_path_factory.mktemp("keys")
    (root / "runs" / "mlruns").mkdir(parents=True)  # MLflow's store created once per session (tests/conftest.py)
    shutil.copyfile(mlflow_store_template, root / "runs" / "mlruns" / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        isolated_backends_env(mp, root)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_TRAIN_DRAIN_TIMEOUT_S"] = "300"  # a shutdown that runs out of time on a loaded machine: below
    script = root / "log_keys.py"
    script.write_text(SCRIPT.format(keys=KEYS, steps=STEPS, child=CHILD_KEY))
    done = subprocess.run([sys.executable, str(script), str(root / "runs")], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped" not in done.stderr and "not a valid" not in done.stderr, done.stderr[-3000:]
    wait_for_delivery(done.stderr)  # MLflow's client can still be starting when shutdown's time runs out
    return root / "runs"


def want(i: int) -> list[tuple[int, float]]:
    return [(s, value(i, s)) for s in range(STEPS)]


def test_jsonl_keeps_every_key_as_logged(run_dir: Path) -> None:
    records = [r for r in read_jsonl(jsonl_path(run_dir, "keys", 0)) if r["type"] == "metric"]
    for i, key in enumerate(KEYS):
        assert [(r["step"], r["value"]) for r in records if r["tag"] == key] == want(i), key
    child = [(r["step"], r["value"]) for r in records if r["tag"].startswith(CHILD_KEY + "{worker=")]
    assert child == [(STEPS - 1, 7.0)]


def test_tensorboard_tags_are_the_keys(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "keys"), size_guidance={"scalars": 0})
    acc.Reload()
    for i, key in enumerate(KEYS):
        assert [(e.step, e.value) for e in acc.Scalars(key)] == want(i), key


def test_wandb_keys_are_the_keys(run_dir: Path) -> None:
    (path,) = sorted((run_dir / "keys" / "wandb").glob("offline-run-*/run-*.wandb"))
    history = read_run(path)["history"]  # asserts no step is written twice
    for i, key in enumerate(KEYS):
        assert [(s, items[key]) for s, items in sorted(history.items()) if key in items] == want(i), key


def test_mlflow_keys_as_mlflow_allows(run_dir: Path) -> None:
    from mlflow.tracking import MlflowClient

    from otel_train.exporters.mlflow import mlflow_name

    client = MlflowClient(f"sqlite:///{(run_dir / 'mlruns' / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    names = [mlflow_name(k) for k in KEYS]
    assert names[2:5] == ["épochs/loss", "train/loss", "lr group 0:head"] or os.name == "nt"  # allowed: as is
    assert len(set(names)) == len(KEYS)  # `@` and `#` map to distinct names
    for i, name in enumerate(names):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        assert sorted(history) == want(i), name


def test_mappings_are_pure_functions_of_the_key() -> None:
    """The same names in another process (another rank, a restarted job, the sink)."""
    from otel_train.exporters.mlflow import mlflow_name

    code = ("import sys, json; from otel_train.vocab.names import otlp_name;"
            "from otel_train.exporters.mlflow import mlflow_name;"
            "keys = json.loads(sys.argv[1]); print(json.dumps([[otlp_name(k), mlflow_name(k)] for k in keys]))")
    import json

    done = subprocess.run([sys.executable, "-c", code, json.dumps(KEYS)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout) == [[otlp_name(k), mlflow_name(k)] for k in KEYS]
    wire = [otlp_name(k) for k in KEYS]
    assert all(OTEL_NAME.match(n) for n in wire) and len(set(wire)) == len(KEYS)
    assert otlp_name("train/loss") == "train/loss"
    assert otlp_name("épochs/loss").startswith("epochs/loss_")
    assert key_from_description(otlp_name("Loss (val)"), KEY_DESCRIPTION_PREFIX + "Loss (val)") == "Loss (val)"
    assert key_from_description("train/loss", "a user's description") == "train/loss"


def test_otlp_sends_instrument_names_and_the_sink_restores_the_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sinkkit import make_sink

    from otel_train.exporters.base import Window
    from otel_train.exporters.otlp import OTLPExporter
    from otel_train.ship.rows_to_sdk import RowsToSDK
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo("otlp-keys", "otlp-keys")
    rows = [row(run, s, key, value(i, s), 1_700_000_000_000_000_000 + s) for s in range(STEPS)
            for i, key in enumerate(KEYS)]
    # On the wire: valid OTel instrument names, the key in the description where it was mapped.
    (request,) = list(RowsToSDK().metrics(rows, ()))
    sent = {(m.name, m.description) for rm in request.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics}
    assert sent == {(otlp_name(k), None if otlp_name(k) == k else KEY_DESCRIPTION_PREFIX + k) for k in KEYS}

    sink = make_sink(tmp_path, ("jsonl",))
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.grpc_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        exp = OTLPExporter()
        assert exp.export_window(Window(metrics=rows))
        exp.shutdown()
        assert sink.flush(10)
    finally:
        sink.stop()
    records: list[dict[str, Any]] = [r for r in read_jsonl(jsonl_path(tmp_path / "runs", "otlp-keys", 0))
                                     if r["type"] == "metric"]
    assert sorted({r["tag"] for r in records}) == sorted(KEYS)  # as logged: no wire name, no description
    for i, key in enumerate(KEYS):
        assert [(r["step"], r["value"]) for r in records if r["tag"] == key] == want(i), key
