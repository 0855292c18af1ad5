"""A run ended by SIGTERM or SIGUSR1 is marked preempted in every backend that has the notion; SIGINT and a
normal exit are not. A real training script (`preempt_driver.py`) is signalled after a few steps, and each
backend is read back with its own reader: W&B's offline run file, MLflow's SQLite store through
`MlflowClient`, ClearML's offline session, Trackio's `Api`, the JSONL file and the Chrome trace.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from backendkit import isolated_backends_env, wandb_files, wandb_records

# Real processes, each under a 300 s limit of its own: twice the suite's default per test.
pytestmark = pytest.mark.timeout(600)
DRIVER = Path(__file__).with_name("preempt_driver.py")
ALL = "jsonl,chrome_trace,tensorboard,wandb,mlflow,clearml,trackio"
RUN = "pre"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed_mlflow_store: Callable[[Path], None]) -> Path:
    seed_mlflow_store(tmp_path / "runs")  # every test's `out`
    root = tmp_path / "home"
    isolated_backends_env(monkeypatch, root)
    for key in list(os.environ):
        if key.startswith(("TRACKIO_", "HF_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TRACKIO_DIR", str(root / "trackio"))  # Trackio reads it at import: the script's, not ours
    return root


def run_driver(out: Path, exporters: str, sig: str | None, mode: str = "default") -> int:
    """Start the script, signal it once it has finished step 2 (unless `sig` is None), return its exit status."""
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(out), exporters, mode if sig else "finish"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    sent = False
    for line in proc.stdout:  # backends print their own lines there too (Trackio, ClearML): steps are bare numbers
        if sig and not sent and line.strip().isdigit() and int(line) >= 2:
            proc.send_signal(getattr(signal, sig))
            sent = True
    code = proc.wait(timeout=300)
    assert sig is None or sent, "the script ended before the signal"
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr[-3000:]
    return code


def marks(out: Path, home: Path) -> dict[str, Any]:
    """What each backend says about preemption, read back with its own reader."""
    from mlflow.tracking import MlflowClient

    from otel_train.exporters.chrome_trace import trace_path
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    found: dict[str, Any] = {}
    found["jsonl"] = [r["signal"] for r in read_jsonl(jsonl_path(out, RUN, 0)) if r["type"] == "preempted"]
    trace = json.loads(trace_path(out, RUN, 0).read_text())  # a closed trace is valid JSON
    found["chrome_trace"] = [e["args"]["signal"] for e in trace if e.get("ph") == "i"]
    # W&B: the offline run file; its service writes the last records after the process ends.
    (path,) = wandb_files(out, RUN, RUN)
    for _ in range(300):
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    found["wandb"] = {
        "preempting": sum(r.WhichOneof("record_type") == "preempting" for r in records),
        "summary": [json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary"
                    for i in r.summary.update if i.key == "otel_train.preempted"],
    }
    client = MlflowClient(f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("preempt").experiment_id])
    found["mlflow"] = {"status": run.info.status, "tag": run.data.tags.get("otel_train.preempted")}
    (folder,) = [p for p in (home / "clearml" / "cache" / "offline").glob("offline-*") if p.is_dir()]
    task = json.loads((folder / "task.json").read_text())
    found["clearml"] = {"tags": [t for t in task["tags"] if t.startswith("otel_train.preempted")],
                        "comment": task.get("comment", "")}
    script = "import json, trackio; print(json.dumps(trackio.Api().alerts('preempt')))"
    alerts = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    found["trackio"] = [(a["title"], a["text"], a["level"]) for a in json.loads(alerts.stdout.splitlines()[-1])]
    return found


def preempted_by(sig: str) -> dict[str, Any]:
    return {
        "jsonl": [sig], "chrome_trace": [sig],
        "wandb": {"preempting": 1, "summary": [sig]},
        "mlflow": {"status": "KILLED", "tag": sig},
        "clearml": {"tags": [f"otel_train.preempted:{sig}"], "comment": f"otel-train: preempted by {sig}"},
        "trackio": [("preempted", f"otel-train: the training process ended on {sig}", "warn")],
    }


NOT_PREEMPTED = {
    "jsonl": [], "chrome_trace": [], "wandb": {"preempting": 0, "summary": []},
    "mlflow": {"status": "FINISHED", "tag": None}, "clearml": {"tags": [], "comment": ""}, "trackio": [],
}


@pytest.mark.parametrize(("sig", "export_process", "status"), [
    ("SIGTERM", "on", -signal.SIGTERM),
    ("SIGUSR1", "off", -signal.SIGUSR1),
])
def test_sigterm_and_sigusr1_mark_the_run_preempted_in_every_backend(
        tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch, sig: str, export_process: str,
        status: int) -> None:
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", export_process)  # marked by the exporter process and in-process
    out = tmp_path / "runs"
    assert run_driver(out, ALL, sig) == status  # still ended by the signal, as without otel-train
    assert marks(out, home) == preempted_by(sig)


@pytest.mark.parametrize(("sig", "export_process", "status"), [
    ("SIGINT", "on", 130),  # Ctrl-C: the user stopped it, no preemption
    (None, "off", 0),  # a normal end
])
def test_sigint_and_a_normal_exit_do_not_mark_the_run(tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch,
                                                      sig: str | None, export_process: str, status: int) -> None:
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_PROCESS", export_process)
    out = tmp_path / "runs"
    assert run_driver(out, ALL, sig) == status
    assert marks(out, home) == NOT_PREEMPTED


def test_sigusr1_with_a_requeue_handler_marks_the_run_when_it_ends(tmp_path: Path, home: Path) -> None:
    """SLURM's warning caught by a requeue handler installed before `init`: the loop stops by itself and the
    process exits normally, and the run is still marked (it is ending because of the preemption)."""
    out = tmp_path / "runs"
    assert run_driver(out, "jsonl,mlflow", "SIGUSR1", mode="chained") == 0
    from mlflow.tracking import MlflowClient

    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    records = list(read_jsonl(jsonl_path(out, RUN, 0)))
    assert records[-1]["type"] == "preempted" and records[-1]["signal"] == "SIGUSR1"
    assert sum(r["type"] == "preempted" for r in records) == 1
    client = MlflowClient(f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("preempt").experiment_id])
    assert (run.info.status, run.data.tags["otel_train.preempted"]) == ("KILLED", "SIGUSR1")

