"""The bad-input table: every odd input a user can hand `ot.log` is either exact in every backend or counted, by
cause, in `Session.refusals` and the shutdown summary line ("refused at the call: ...") — never lost silently.

One real job (tests/inputs/bad_inputs_job.py) logs every input to TensorBoard, JSONL, the Chrome trace, MLflow
(SQLite), W&B (offline), Trackio and ClearML (offline) at once, a forked child too; each backend is read back with
its own reader as lists of points, so a value held twice, at a wrong step or under a merged name fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import readback
from reference import Point

from otel_train._internal.values import REFUSAL_CAUSES
from otel_train.exporters.clearml import title_series
from otel_train.exporters.mlflow import mlflow_key
from otel_train.exporters.wandb import wandb_key
from otel_train.vocab.rows import series_tag

# One real job with seven backends (about a minute on 2 shared cores), under a 300 s limit of its own.
pytestmark = pytest.mark.timeout(600)
JOB = Path(__file__).with_name("bad_inputs_job.py")
RUN = "bad-inputs"
PROJECT = "otel-bad-inputs"
BACKENDS = ("tensorboard", "jsonl", "chrome_trace", "mlflow", "wandb", "trackio", "clearml")
MAX_STEP = 2**63 - 1


@dataclass(frozen=True)
class Exact:
    """An input every backend holds once, at its step, with its value, under its mapped name."""

    name: str
    attributes: dict[str, str]
    step: int
    value: float


@dataclass(frozen=True)
class Counted:
    """An input no backend holds: refused at the call, counted under `cause`."""

    key: str | None  # the key it was logged under (None: no usable key)
    step: float
    cause: str


EXACT = {
    "Decimal('1.1')": Exact("in/decimal", {}, 13, 1.1),
    "Fraction(1, 4)": Exact("in/fraction", {}, 14, 0.25),
    "key _step": Exact("_step", {}, 12, 7.0),
    "an attribute that is no attribute (the value is kept)": Exact("in/bad_attribute", {}, 15, 3.0),
    "attribute value '1,b=2'": Exact("in/acc", {"a": "1,b=2"}, 20, 1.0),
    "attributes a=1, b=2": Exact("in/acc", {"a": "1", "b": "2"}, 20, 2.0),
    "key 'acc{a=1,b=2}'": Exact("in/acc{a=1,b=2}", {}, 20, 3.0),
    "step 2**63-1": Exact("in/max_step", {}, MAX_STEP, 9.0),
}
COUNTED = {
    "complex": Counted("in/complex", 1, "not_a_number"),
    "str": Counted("in/str", 2, "not_a_number"),
    "None": Counted("in/none", 3, "not_a_number"),
    "bytes": Counted("in/bytes", 4, "not_a_number"),
    "object()": Counted("in/object", 5, "not_a_number"),
    "tensor of 3": Counted("in/tensor", 6, "not_a_scalar"),
    "2x2 array": Counted("in/array", 7, "not_a_scalar"),
    "list of 2": Counted("in/list", 8, "not_a_scalar"),
    "ot.log(None)": Counted(None, 9, "not_a_mapping"),
    "key ''": Counted(None, 10, "bad_key"),
    "key 5": Counted(None, 11, "bad_key"),
    "step 2**63": Counted("in/big_step", 2**63, "step_out_of_range"),
    "step -1": Counted("in/negative_step", -1, "step_out_of_range"),
    "step 2.5": Counted("in/half_step", 2.5, "bad_step"),
    "child: str": Counted("in/child_str", 40, "not_a_number"),
    "child: step 2**63": Counted("in/child_big", 2**63, "step_out_of_range"),
}
#: What the job refuses in all, by cause: the table's counted rows, plus the attribute left out of one call.
REFUSALS = {"not_a_number": 6, "not_a_scalar": 3, "bad_key": 2, "not_a_mapping": 1, "bad_step": 1,
            "step_out_of_range": 3, "bad_attribute": 1}


def _float32(v: float) -> float:
    return float(np.float32(v))


def _clearml_name(name: str, attributes: dict[str, str]) -> str:
    title, series = title_series(name, series_tag(name, attributes))
    return f"{title}/{series}"


#: Each backend's documented name and value mapping (README "Keys"; a TensorBoard scalar is a float32).
NAMES: dict[str, Callable[[str, dict[str, str]], str]] = {
    "mlflow": lambda n, a: mlflow_key(n, a or None), "clearml": _clearml_name,
    "wandb": lambda n, a: wandb_key(series_tag(n, a))}  # W&B's reserved keys (`_step`) get one more `_`
VALUES: dict[str, Callable[[float], float]] = {"tensorboard": _float32}
NO_STEP = {"chrome_trace"}  # counter events carry a time, not a step


@dataclass(frozen=True)
class Job:
    points: dict[str, list[Point]]
    summary: str
    refusals: dict[str, int]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, mlflow_store_template: Path) -> Job:
    import shutil

    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "runs" / "mlruns").mkdir(parents=True)
    shutil.copyfile(mlflow_store_template, root / "runs" / "mlruns" / "mlflow.db")  # MLflow's store, made once
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "WANDB_", "CLEARML_", "TRAINS_", "TRACKIO_", "MLFLOW_", "HF_"))}
    env.update(HOME=str(root / "home"), HF_HOME=str(root / "hf"), TRACKIO_DIR=str(root / "trackio"),
               WANDB_MODE="offline", WANDB_SILENT="true", CLEARML_CONFIG_FILE=str(root / "clearml.conf"),
               CLEARML_CACHE_DIR=str(root / "clearml"), OTEL_TRAIN_EXPORTERS=",".join(BACKENDS),
               OTEL_TRAIN_DIR=str(root / "runs"), OTEL_TRAIN_RUN_ID=RUN, OTEL_TRAIN_RUN_NAME=RUN,
               OTEL_TRAIN_PROJECT=PROJECT, OTEL_TRAIN_SHUTDOWN_TIMEOUT_S="90")
    out = subprocess.run([sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    (summary,) = [line for line in out.stderr.splitlines() if line.startswith("otel-train: ") and " points in " in line]
    folder = root / "runs" / RUN
    wandb_files = sorted(folder.rglob(f"run-{RUN}.wandb"))
    assert len(wandb_files) == 1, wandb_files
    points = {
        "tensorboard": readback.tensorboard(folder),
        "jsonl": readback.jsonl(folder / "rank0.jsonl"),
        "chrome_trace": readback.chrome_counters(folder / "trace" / "rank0.trace.json"),
        "mlflow": readback.mlflow(f"sqlite:///{root / 'runs' / 'mlruns' / 'mlflow.db'}", RUN),
        "wandb": readback.wandb(wandb_files[0]),
        "trackio": readback.trackio(root / "trackio", PROJECT, RUN),
        "clearml": [p for f in readback.clearml_folders(root / "clearml") for p in readback.clearml(f)],
    }
    return Job(points, summary, json.loads(out.stdout.strip().splitlines()[-1]))


def _user(points: list[Point]) -> list[Point]:
    """The job's own points (otel-train's self-telemetry and step timing left out)."""
    return [p for p in points if not p.name.startswith(("otel_train", "train", "phase", "system"))]


_EXACT_CASES = [pytest.param(case, backend, id=f"{case} -> {backend}") for case in EXACT for backend in BACKENDS]


@pytest.mark.parametrize(("case", "backend"), _EXACT_CASES)
def test_an_input_that_is_a_value_is_exact_in_every_backend(job: Job, case: str, backend: str) -> None:
    want = EXACT[case]
    name = NAMES.get(backend, lambda n, a: series_tag(n, a))(want.name, want.attributes)
    value = VALUES.get(backend, lambda v: v)(want.value)
    step = None if backend in NO_STEP else want.step
    held = [p for p in job.points[backend] if p.name == name]
    assert held == [Point(name, step, value)], f"{backend} holds {held} under {name!r}"


def test_colliding_attribute_series_stay_three_series_in_every_backend(job: Job) -> None:
    """`{"a": "1,b=2"}`, `{"a": "1", "b": "2"}` and the key `acc{a=1,b=2}`: three names, one value each."""
    for backend, points in job.points.items():
        at = sorted((p.name, p.value) for p in _user(points) if p.name.split("/")[0] == "in" and "acc" in p.name)
        assert len({name for name, _ in at}) == 3 and sorted(v for _, v in at) == [1.0, 2.0, 3.0], (backend, at)


@pytest.mark.parametrize("case", list(COUNTED))
def test_an_input_that_is_refused_is_in_no_backend_and_counted(job: Job, case: str) -> None:
    want = COUNTED[case]
    for backend, points in job.points.items():
        if want.key is not None:
            assert not [p for p in points if want.key in p.name], backend
        else:  # no usable key: nothing of the job's own at its step
            assert not [p for p in _user(points) if p.step == want.step and not p.name.startswith("_step")], backend
    assert job.refusals.get(want.cause, 0) == REFUSALS[want.cause]
    assert _summary_counts(job.summary).get(want.cause) == REFUSALS[want.cause], job.summary


def _summary_counts(line: str) -> dict[str, int]:
    """The summary line's "refused at the call: N <words>, ..." clause, as cause -> N."""
    if "refused at the call: " not in line:
        return {}
    clause = line.split("refused at the call: ", 1)[1].split(";", 1)[0]
    by_words = {words.split(" ", 1)[1]: cause for cause, words in REFUSAL_CAUSES.items()}  # after the unit
    out: dict[str, int] = {}
    for part in clause.split(", "):
        n, _unit, words = part.split(" ", 2)
        out[by_words[words]] = int(n.replace(",", ""))
    return out


def test_the_refusals_are_counted_once_by_cause(job: Job) -> None:
    assert job.refusals == REFUSALS
    assert _summary_counts(job.summary) == REFUSALS, job.summary
    assert "; 0 dropped;" in job.summary, job.summary
