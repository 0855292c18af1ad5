"""Resume at step N: no backend shows two values for one step of one series.

The first attempt logs steps 0..9; the job restarts from a checkpoint at step 5 and logs 5..7 with
other values. Read back with each backend's own reader: TensorBoard (the earlier attempt's steps
>= 5 purged by the `SessionLog.START` event), JSONL (resume record applied), MLflow's SQLite store and
an offline W&B run (steps the run already holds keep their values: these stores cannot delete).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from backendkit import isolated_wandb_env, read_run, wandb_files
from faultkit import SERIES, expected, f32, jsonl_points, tb_points, value

import otel_train as ot

RUN = "job-resume"


def attempt(directory: Path, steps: range, offset: float, resume_step: int | None) -> None:
    # Four backends' clients start in the exporter process; on a slow host that can outlast the default 10 s
    # hand-off (then the backends are read before the drain ends). What they hold is tested here, not that deadline.
    ot.init(exporters=["tensorboard", "jsonl", "mlflow", "wandb"], dir=directory, run_id=RUN, run_name=RUN,
            project="resume", resume_step=resume_step, shutdown_timeout_s=120.0)
    for s in ot.steps(steps, start=steps.start):
        ot.log({tag: value(tag, s) + offset for tag in SERIES})
    ot.shutdown()


def test_resume_at_n_never_shows_two_values_for_one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          seed_mlflow_store: Callable[[Path], None]) -> None:
    isolated_wandb_env(monkeypatch, tmp_path / "wandb")
    directory = tmp_path / "runs"
    seed_mlflow_store(directory)
    attempt(directory, range(10), 0.0, None)
    attempt(directory, range(5, 8), 100.0, resume_step=5)

    old = expected(range(5))
    new = {(tag, s, value(tag, s) + 100.0) for s in range(5, 8) for tag in SERIES}
    # TensorBoard: the restart replaces steps >= 5 (the earlier attempt's 8 and 9 are purged too).
    tb = tb_points(directory / RUN)
    assert len(tb) == len({(t, s) for t, s, _ in tb})
    assert set(tb) == {(t, s, f32(v)) for t, s, v in old | new}
    # JSONL: the resume record supersedes the earlier attempt's steps >= 5.
    assert sorted(jsonl_points(directory, RUN)) == sorted(old | new)

    # MLflow: points cannot be deleted; the run already holds 0..9, so nothing is written twice.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(directory / 'mlruns' / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    for tag in SERIES:
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)]
        assert sorted(history) == [(s, value(tag, s)) for s in range(10)]
    assert run.data.tags["otel_train.resume_step"] == "5"

    # W&B offline: one file per process; together one value per step (the held steps were dropped).
    files = wandb_files(directory, RUN, RUN)
    assert len(files) == 2
    first, second = (read_run(f) for f in files)
    assert sorted(first["history"]) == list(range(10))
    assert not set(first["history"]) & set(second["history"])


def test_resume_step_is_validated_at_init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ot.ConfigError, match="OTEL_TRAIN_RESUME_STEP: -1 is too small"):
        monkeypatch.setenv("OTEL_TRAIN_RESUME_STEP", "-1")
        ot.init(exporters=[], dir=tmp_path)
    monkeypatch.delenv("OTEL_TRAIN_RESUME_STEP")
    with pytest.raises(ot.ConfigError, match="resume_step: 'x' is not an integer"):
        ot.init(exporters=[], dir=tmp_path, resume_step="x")  # type: ignore[arg-type]


def test_resume_lets_steps_restart_below_the_latest_under_raise(tmp_path: Path) -> None:
    ot.init(exporters=[], dir=tmp_path, step_order="raise")
    with ot.step(9):
        pass
    ot.shutdown()
    ot.init(exporters=[], dir=tmp_path, step_order="raise", resume_step=5)
    with ot.step(5):  # a restart from a checkpoint is not a step going backwards
        pass
    with pytest.raises(ot.StepOrderError), ot.step(4):
        pass
