"""Ray Tune: a real two-trial experiment on the CPU; read back from TensorBoard and the Chrome trace."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

tune = pytest.importorskip("ray.tune", reason="Ray Tune is not installed: pip install 'otel-train[ray]'")

import ray
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import otel_train as ot
from otel_train.exporters.chrome_trace import trace_path
from otel_train.integrations.ray_tune import OtelTrainCallback
from otel_train.trace_merge import load_trace


def _tags(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def _points(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    """Every point of `tag` as (step, value), in file order: a step written twice shows twice."""
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _trainable(config: dict[str, Any]) -> None:
    for i in range(3):
        if config["lr"] < 0 and i == 1:
            raise ValueError("negative learning rate")
        tune.report({"loss": config["lr"] * (10 - i), "nested": {"acc": i / 10}, "name": "not a number"})


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    # `Tuner.fit` leaves its own SIGINT/SIGUSR1 handlers in the process: tests run after these get theirs back.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGUSR1)}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_two_trials_write_their_series_and_spans(ray_local: None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "tune-run")
    callback = OtelTrainCallback()
    tuner = tune.Tuner(
        _trainable,
        param_space={"lr": tune.grid_search([1.0, 2.0, -1.0])},
        tune_config=tune.TuneConfig(reuse_actors=True),  # one worker for the trials that succeed: faster
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray"), callbacks=[callback], verbose=0),
    )
    results = tuner.fit()
    assert len(results.errors) == 1
    assert ot._session is None or ot._session.closed  # the callback shut down what it started

    from backendkit import approx_points  # here: Ray's workers import this file without the test helpers

    trials = {r.config["lr"]: r.metrics["trial_id"] for r in results if r.error is None}
    (failed,) = [r.metrics["trial_id"] for r in results if r.error is not None]
    acc = _tags(tmp_path / "runs" / "tune-run")
    scalars = set(acc.Tags()["scalars"])
    for lr, trial_id in trials.items():
        loss = _points(acc, f"tune/loss{{trial_id={trial_id}}}")
        assert loss == approx_points([(1, lr * 10), (2, lr * 9), (3, lr * 8)])  # at Tune's training_iteration
        acc_values = _points(acc, f"tune/nested/acc{{trial_id={trial_id}}}")
        assert acc_values == approx_points([(1, 0.0), (2, 0.1), (3, 0.2)])
        for auto in ("training_iteration", "time_this_iter_s", "time_total_s", "iterations_since_restore"):
            assert f"tune/{auto}{{trial_id={trial_id}}}" in scalars
        iters = _points(acc, f"tune/training_iteration{{trial_id={trial_id}}}")
        assert iters == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert not any("name" in t or "pid" in t or "timestamp" in t for t in scalars)

    events = load_trace(trace_path(tmp_path / "runs", "tune-run", 0))
    spans = {e["args"]["trial_id"]: e for e in events if e.get("ph") == "X" and e["name"] == "tune/trial"}
    assert sorted(spans) == sorted([*trials.values(), failed])
    assert sorted(s["args"]["config/lr"] for s in spans.values()) == [-1.0, 1.0, 2.0]
    assert all(spans[t]["args"]["tune/last_iteration"] == 3 and "error" not in spans[t]["args"]
               for t in trials.values())
    assert spans[failed]["args"]["error"] == "ValueError: negative learning rate"
    assert spans[failed]["args"]["tune/last_iteration"] == 1
    assert _points(acc, f"tune/loss{{trial_id={failed}}}") == [(1, -10.0)]


def test_state_survives_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What Tune checkpoints (`get_state`) brings a fresh callback back to the same run and steps."""
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    first = OtelTrainCallback()
    first.setup()
    state = first.get_state()
    first.on_experiment_end([])
    resumed = OtelTrainCallback()
    resumed.set_state(state)
    resumed.setup()
    assert ot._session.run.run_id == state["run_id"]
    assert resumed.get_state()["run_name"] == state["run_name"]
    resumed.on_experiment_end([])


def _fails_once(config: dict[str, Any]) -> None:
    marker = Path(config["marker"])
    for i in range(3):
        if i == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError("first attempt fails")
        tune.report({"loss": 10.0 - i})


def test_restored_experiment_continues_the_same_run(ray_local: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`Tuner.restore` brings the callback back through Tune's checkpointed state: same run, same folder."""
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))  # no run name or id: a fresh id per init
    config = {"marker": str(tmp_path / "marker")}
    tuner = tune.Tuner(_fails_once, param_space=config, run_config=tune.RunConfig(
        name="exp", storage_path=str(tmp_path / "ray"), callbacks=[OtelTrainCallback()], verbose=0))
    assert len(tuner.fit().errors) == 1
    (first_run,) = (tmp_path / "runs").iterdir()
    restored = tune.Tuner.restore(str(tmp_path / "ray" / "exp"), _fails_once, resume_errored=True)
    results = restored.fit()
    assert not results.errors
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [first_run.name]  # the same run continued
    (trial_id,) = [r.metrics["trial_id"] for r in results]
    acc = _tags(first_run)
    # Every point Tune reported, as reported: the failed attempt's iteration 1, then the retry's 1..3 (with no
    # checkpoint Tune restarts the trial from scratch, so iteration 1 is reported twice; a dict per step hid it).
    assert _points(acc, f"tune/loss{{trial_id={trial_id}}}") == [(1, 10.0), (1, 10.0), (2, 9.0), (3, 8.0)]
    assert _points(acc, f"tune/training_iteration{{trial_id={trial_id}}}") == [(1, 1.0), (1, 1.0), (2, 2.0),
                                                                             (3, 3.0)]


_DIVERGING = [1.0, float("nan"), float("inf"), float("-inf")]


def _diverging(config: dict[str, Any]) -> None:
    for i, loss in enumerate(_DIVERGING, start=1):
        tune.report({"loss": loss, "stable": i < 3, "parts": {"a": i, "b": {"c": 2 * i}},
                     "timesteps_total": 10 * i, "tags": ["not", "a", "number"]})


def _jsonl_series(directory: Path, run_name: str) -> dict[str, list[tuple[int, str]]]:
    """tag -> [(step, repr(value)), ...] in file order (repr: NaN compares equal to itself)."""
    from otel_train.exporters.jsonl import jsonl_path, read_jsonl

    out: dict[str, list[tuple[int, str]]] = {}
    for r in read_jsonl(jsonl_path(directory, run_name, 0)):
        if r["type"] == "metric":
            out.setdefault(r["tag"], []).append((r["step"], repr(float(r["value"]))))
    return out


def test_non_finite_bools_nested_and_left_out_values(ray_local: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A diverged trial keeps NaN/+-inf at their steps, bools are 0/1, nested dicts are joined with `/`, the step
    is `timesteps_total` (as Tune's own loggers use it), and a list is counted and warned about once."""
    monkeypatch.setenv("OTEL_TRAIN_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OTEL_TRAIN_RUN_NAME", "edges")
    monkeypatch.setenv("OTEL_TRAIN_EXPORTERS", "jsonl")
    callback = OtelTrainCallback()
    tuner = tune.Tuner(_diverging, run_config=tune.RunConfig(storage_path=str(tmp_path / "ray"),
                                                               callbacks=[callback], verbose=0))
    with caplog.at_level("WARNING", logger="otel_train.integrations"):
        (result,) = list(tuner.fit())
    series = _jsonl_series(tmp_path / "runs", "edges")
    trial = f"{{trial_id={result.metrics['trial_id']}}}"
    steps = [10, 20, 30, 40]
    assert series[f"tune/loss{trial}"] == list(zip(steps, ["1.0", "nan", "inf", "-inf"]))
    assert series[f"tune/stable{trial}"] == list(zip(steps, ["1.0", "1.0", "0.0", "0.0"]))
    assert series[f"tune/parts/a{trial}"] == list(zip(steps, ["1.0", "2.0", "3.0", "4.0"]))
    assert series[f"tune/parts/b/c{trial}"] == list(zip(steps, ["2.0", "4.0", "6.0", "8.0"]))
    assert series[f"tune/training_iteration{trial}"] == list(zip(steps, ["1.0", "2.0", "3.0", "4.0"]))
    assert not [t for t in series if t.startswith("tune/tags")]
    assert callback.left_out == 4
    assert len([r for r in caplog.records if "'tags'" in r.getMessage()]) == 1


def test_missing_extra_names_the_pip_line() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['ray'] = None; sys.modules['ray.tune'] = None\n"
            "try:\n    import otel_train.integrations.ray_tune\nexcept ModuleNotFoundError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'otel-train[ray]'" in out
