"""A run ended by SIGTERM or SIGUSR1 is marked preempted in every backend that has the notion; SIGINT and a
normal exit are not. A real training script (`preempt_driver.py`) is signalled after a few steps, and each
backend is read back with its own reader: W&B's offline run file, MLflow's SQLite store through
`MlflowClient`, ClearML's offline session, Trackio's `Api`, the JSONL file and the Chrome trace.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from backendkit import isolated_backends_env, wait_for_delivery, wandb_files, wandb_records
from selected import selected

# Real processes, each under a 300 s limit of its own: twice the suite's default per test.
pytestmark = pytest.mark.timeout(600)
DRIVER = Path(__file__).with_name("preempt_driver.py")
ALL = "jsonl,chrome_trace,tensorboard,wandb,mlflow,clearml,trackio"
RUN = "pre"


@dataclass(frozen=True)
class Case:
    """One run of the script: its backends, the signal sent after step 2 (None: it runs to its end), the mode
    (`preempt_driver.py`) and where the backends run (`OTEL_TRAIN_EXPORT_PROCESS`; None: the default)."""

    exporters: str
    sig: str | None
    mode: str = "default"
    export_process: str | None = None


CASES = {
    "SIGTERM-on": Case(ALL, "SIGTERM", export_process="on"),  # marked by the exporter process ...
    "SIGUSR1-off": Case(ALL, "SIGUSR1", export_process="off"),  # ... and in-process
    "SIGINT-on": Case(ALL, "SIGINT", export_process="on"),  # Ctrl-C: the user stopped it, no preemption
    "normal-off": Case(ALL, None, export_process="off"),  # a normal end
    "requeue": Case("jsonl,mlflow", "SIGUSR1", mode="chained"),
}


@dataclass(frozen=True)
class Ran:
    out: Path  # OTEL_TRAIN_DIR
    home: Path  # the backends' offline stores
    env: dict[str, str]
    code: int  # the script's exit status
    log: str  # the end of its standard error, for failure messages


def backends_env(home: Path) -> dict[str, str]:
    """This environment with W&B, ClearML, MLflow and Trackio offline under `home`, and no otel-train setting."""
    with pytest.MonkeyPatch.context() as mp:
        isolated_backends_env(mp, home)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACKIO_", "HF_"))}
    env["TRACKIO_DIR"] = str(home / "trackio")  # Trackio reads it at import: the script's, not ours
    return env


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory, mlflow_store_template: Path,
        request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Ran]]]:
    """The cases this session runs, started together, each in folders of its own: a run is mostly one process
    importing and starting backends, which leaves the second core of a 2-core machine idle. Each test then
    waits for its own case and asserts on it alone."""
    prepared: dict[str, tuple[Case, Path, Path, dict[str, str]]] = {}
    for name in selected(request, "case", CASES):  # folders and environments here: `os.environ` is not for threads
        case, root = CASES[name], tmp_path_factory.mktemp(name)
        out, home = root / "runs", root / "home"
        (out / "mlruns").mkdir(parents=True)  # MLflow's store, created once per session (tests/conftest.py)
        shutil.copyfile(mlflow_store_template, out / "mlruns" / "mlflow.db")
        env = backends_env(home)
        # Seven backends' clients start in one process while four other cases run: on a loaded 2-core machine
        # that can outlast the default 10 s hand-off at the signal. The marks, not that deadline, are tested here.
        env["OTEL_TRAIN_SHUTDOWN_TIMEOUT_S"] = "120"
        env["OTEL_TRAIN_DRAIN_TIMEOUT_S"] = "300"  # and, past it, the exporter process delivers the rest on its own
        if case.export_process:
            env["OTEL_TRAIN_EXPORT_PROCESS"] = case.export_process
        prepared[name] = (case, out, home, env)

    def run(case: Case, out: Path, home: Path, env: dict[str, str]) -> Ran:
        return Ran(out, home, env, *run_driver(out, case.exporters, case.sig, case.mode, env))

    with ThreadPoolExecutor(max_workers=len(CASES)) as pool:
        yield {name: pool.submit(run, *args) for name, args in prepared.items()}


def run_driver(out: Path, exporters: str, sig: str | None, mode: str, env: dict[str, str]) -> tuple[int, str]:
    """Start the script, signal it once it has finished step 2 (unless `sig` is None); its exit status and the
    end of its standard error (a file: a pipe read only at the end could fill and stall the script)."""
    err_path = out.parent / "driver.stderr"
    with err_path.open("w") as err_file:
        proc = subprocess.Popen([sys.executable, str(DRIVER), str(out), exporters, mode if sig else "finish"],
                                stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
    assert proc.stdout is not None
    sent = False
    for line in proc.stdout:  # backends print their own lines there too (Trackio, ClearML): steps are bare numbers
        if sig and not sent and line.strip().isdigit() and int(line) >= 2:
            proc.send_signal(getattr(signal, sig))
            sent = True
    code = proc.wait(timeout=300)
    assert sig is None or sent, "the script ended before the signal"
    stderr = err_path.read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    # Shutdown's time can run out on a loaded machine (seven backends' clients start in each of five cases at
    # once): the exporter process then delivers the rest on its own, marks included. Read the backends once it is done.
    wait_for_delivery(stderr)
    return code, stderr[-3000:]


def marks(ran: Ran) -> dict[str, Any]:
    """What each backend says about preemption, read back with its own reader."""
    from mlflow.tracking import MlflowClient

    from otel_train.exporters.chrome_trace import trace_path
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    out, home = ran.out, ran.home
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
    alerts = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ran.env,
                            check=False)
    assert alerts.returncode == 0, (alerts.stderr[-3000:], ran.log)
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


@pytest.mark.parametrize(("case", "status"), [("SIGTERM-on", -signal.SIGTERM), ("SIGUSR1-off", -signal.SIGUSR1)])
def test_sigterm_and_sigusr1_mark_the_run_preempted_in_every_backend(
        ran: dict[str, Future[Ran]], case: str, status: int) -> None:
    run = ran[case].result()
    assert run.code == status  # still ended by the signal, as without otel-train
    assert marks(run) == preempted_by(str(CASES[case].sig)), run.log


@pytest.mark.parametrize(("case", "status"), [("SIGINT-on", 130), ("normal-off", 0)])
def test_sigint_and_a_normal_exit_do_not_mark_the_run(ran: dict[str, Future[Ran]], case: str, status: int) -> None:
    run = ran[case].result()
    assert run.code == status
    assert marks(run) == NOT_PREEMPTED, run.log


@pytest.mark.parametrize("case", ["requeue"])
def test_sigusr1_with_a_requeue_handler_marks_the_run_when_it_ends(ran: dict[str, Future[Ran]], case: str) -> None:
    """SLURM's warning caught by a requeue handler installed before `init`: the loop stops by itself and the
    process exits normally, and the run is still marked (it is ending because of the preemption)."""
    run = ran[case].result()
    assert run.code == 0
    out = run.out
    from mlflow.tracking import MlflowClient

    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    records = list(read_jsonl(jsonl_path(out, RUN, 0)))
    assert records[-1]["type"] == "preempted" and records[-1]["signal"] == "SIGUSR1"
    assert sum(r["type"] == "preempted" for r in records) == 1
    client = MlflowClient(f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("preempt").experiment_id])
    assert (mlflow_run.info.status, mlflow_run.data.tags["otel_train.preempted"]) == ("KILLED", "SIGUSR1")
