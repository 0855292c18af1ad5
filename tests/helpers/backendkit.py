"""Test scaffolding shared by every backend's tests: isolated offline environments, rows, read-back.

Each backend writes into a temporary folder only (never the user's home config or a server), and
each has one reader that returns what a user would see: TensorBoard scalars, a W&B offline run's
history, ClearML's offline metrics, MLflow's metric history. `tests/conftest.py` puts this folder on
`sys.path` (the suite runs in importlib mode), and its `backend_home` fixture isolates them all.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from otel_train.verify.readers import wandb_records  # the package's reader, re-exported for the tests
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo, config_hash


def row(run: RunInfo, step: int, tag: str, value: float, time_ns: int = 0, **attrs: Any) -> MetricRow:
    """A gauge row; `tag` may carry the series suffix (``eval/acc{split=val}``), `attrs` its attributes."""
    return MetricRow(run, step, tag.split("{")[0], tag, value, "gauge", time_ns, attrs)


def two_ranks(run_id: str, name: str, hparams: dict[str, Any]) -> tuple[RunInfo, RunInfo]:
    """Ranks 0 and 1 of one run: the sink's situation, one exporter instance seeing both."""
    h = config_hash(hparams)
    return RunInfo(run_id, name, rank=0, world_size=2, config_hash=h), RunInfo(run_id, name, rank=1, world_size=2,
                                                                               config_hash=h)


def isolated_backends_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    """W&B, ClearML and MLflow all offline/local under `root`."""
    isolated_wandb_env(mp, root / "wandb")
    isolated_clearml_env(mp, root / "clearml")
    isolated_mlflow_env(mp, root / "mlflow")
    mp.setenv("HOME", str(root / "home"))


# -- TensorBoard ----------------------------------------------------------------------------------
def tb_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard log folder, read with TensorBoard's own event-file loader: tag -> every
    point as (step, value), in file order (a step written twice shows twice; `readback.tensorboard`)."""
    import readback

    out: dict[str, list[tuple[int, float]]] = {}
    for p in readback.tensorboard(logdir):
        out.setdefault(p.name, []).append((p.step, p.value))
    return out


def by_step(points: list[tuple[int, float]]) -> dict[int, float]:
    """Step -> value of (step, value) points, for looking a step up; a step written twice fails loudly."""
    out: dict[int, float] = {}
    for step, value in points:
        assert step not in out, f"step {step} written twice ({out[step]!r}, then {value!r})"
        out[step] = value
    return out


def approx_points(points: list[tuple[int, float]]) -> list[tuple[int, Any]]:
    """(step, value) points with each value compared approximately, the steps and the count exactly: compare a
    list read back with ``==`` against this, so a point written twice (or missing) fails."""
    return [(step, pytest.approx(value)) for step, value in points]


# -- Weights & Biases ---------------------------------------------------------------------------------
def isolated_wandb_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    """Offline W&B with every file it writes under `root` (never the user's home config)."""
    for key in list(os.environ):
        if key.startswith("WANDB_"):
            mp.delenv(key)
    mp.setenv("HOME", str(root / "home"))
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_ARTIFACT_DIR", "artifacts")):
        mp.setenv(var, str(root / sub))


def read_run(path: Path) -> dict[str, Any]:
    """run id, name, group, config and history (step -> {key: value}) of one `.wandb` file."""
    out: dict[str, Any] = {"history": {}, "config": {}}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.update(id=rec.run.run_id, name=rec.run.display_name, group=rec.run.run_group,
                       project=rec.run.project)
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            step = items["_step"]
            assert step not in out["history"], f"step {step} written twice"
            out["history"][step] = {k: v for k, v in items.items() if not k.startswith("_")}
            if "grad/_type" in items:
                assert items["grad/_type"] == "histogram"
    return out


def wandb_files(directory: Path, run_name: str, wandb_id: str) -> list[Path]:
    """The offline run files of `wandb_id`, oldest process first (W&B's own naming, `offline_run_files`)."""
    from otel_train.exporters.wandb import offline_run_files

    return offline_run_files(directory / run_name / "wandb", wandb_id)


# -- ClearML ------------------------------------------------------------------------------------------
def isolated_clearml_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    """No server, no user config: ClearML goes offline and keeps everything under `root`."""
    for key in list(os.environ):
        if key.startswith(("CLEARML_", "TRAINS_")):
            mp.delenv(key)
    # ClearML writes these itself (offline mode, process master id): record them, so they are undone after.
    for key in ("CLEARML_OFFLINE_MODE", "TRAINS_OFFLINE_MODE", "CLEARML_PROC_MASTER_ID", "TRAINS_PROC_MASTER_ID"):
        mp.setenv(key, "")
        mp.delenv(key)
    mp.setenv("HOME", str(root / "home"))
    mp.setenv("CLEARML_CONFIG_FILE", str(root / "clearml.conf"))  # absent: defaults only
    mp.setenv("CLEARML_CACHE_DIR", str(root / "cache"))


def events(folder: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            out.extend(json.loads(line))
    return out


# -- MLflow -------------------------------------------------------------------------------------------
def isolated_mlflow_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    for key in list(os.environ):
        if key.startswith("MLFLOW_"):
            mp.delenv(key)
    mp.setenv("HOME", str(root / "home"))
    mp.delenv("XDG_CACHE_HOME", raising=False)  # MLflow's store template too (`otel_train.exporters._mlflow_store`)


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def wait_for_delivery(stderr: str, timeout_s: float = 300.0) -> None:
    """Where a job's shutdown ran out of time (a loaded machine: a heavy backend's client still starting), wait until
    the exporter process its last lines name ("the exporter process (pid N) keeps delivering") has delivered the
    rest and exited, so that a test reads every backend's store whole. Give the job a long
    `OTEL_TRAIN_DRAIN_TIMEOUT_S`."""
    behind = re.search(r"the exporter process \(pid (\d+)\) keeps delivering", stderr)
    if behind is not None:
        wait_exited(int(behind.group(1)), timeout_s)


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (one that ended but is not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_exited(pid: int, timeout_s: float = 300.0) -> None:
    """Wait until the exporter process `pid` has delivered what it holds and exited (ended, reaped or not)."""
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"the exporter process {pid} still delivers after {timeout_s} s")
        time.sleep(0.1)
