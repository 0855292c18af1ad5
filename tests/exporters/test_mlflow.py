"""MLflowExporter: a real local MLflow store read back with `MlflowClient`; resume in a second process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import backendkit
import pytest
from backendkit import history, isolated_mlflow_env, two_ranks

from otel_train.collect.sdk_rows import MetricsConverter
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow
from otel_train.vocab.run_identity import RunInfo, config_hash

HPARAMS = {"lr": 0.01, "optim": {"name": "adam", "betas": [0.9, 0.99]}}
RUN_ID = "mlf-run-1"


def row(run: RunInfo, step: int, tag: str, value: float, **attrs: Any) -> MetricRow:
    return backendkit.row(run, step, tag, value, 1_700_000_000_000_000_000 + step, **attrs)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from otel_train.exporters.mlflow import MLflowExporter

    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        isolated_mlflow_env(mp, root)
        # ranks "all" with one instance seeing two ranks: the sink's situation.
        options = ExporterOptions(directory=root / "runs", project="otel-mlflow-test", hparams=HPARAMS, ranks="all")
        r0, r1 = two_ranks(RUN_ID, "mlf", HPARAMS)
        exporter = MLflowExporter(options)
        assert exporter.export_window(Window(metrics=[
            row(r0, 1, "train/loss", 0.5), row(r0, 0, "train/loss", 1.0), row(r0, 2, "train/loss", 0.25),
            row(r0, 1, "eval/acc{split=val}", 0.75, split="val"),
            row(r1, 0, "train/loss", 1.5), row(r1, 1, "train/loss", 1.25),
        ], histograms=[HistogramRow(r0, 1, "grad", "grad", 2, 3.0, 1.0, 2.0, (1.5,), (1, 1), 0)]))
        assert exporter.export_window(Window(metrics=[row(r0, 3, "train/loss", 0.125)], logs=[
            LogRow(r0, 3, 1_700_000_000_000_000_003, 13, "WARNING", "loss spiked", "job"),
            LogRow(r0, 3, 1_700_000_000_000_000_004, 17, "ERROR", "bad batch", "job",
                   {"exception.stacktrace": "Traceback (x)\nValueError: bad batch\n"}),
            LogRow(r1, 2, 1_700_000_000_000_000_005, 13, "WARNING", "rank 1 warns", "job"),
        ]))
        mlflow_id = exporter.run_ids[RUN_ID]
        uri = exporter.tracking_uri
        exporter.shutdown()
        exporter.shutdown()
        yield {"root": root, "uri": uri, "id": mlflow_id, "env": dict(os.environ)}


def test_default_store_is_local_sqlite_under_the_directory(store: dict[str, Any]) -> None:
    assert store["uri"] == f"sqlite:///{(store['root'] / 'runs' / 'mlruns' / 'mlflow.db').resolve()}"
    assert (store["root"] / "runs" / "mlruns" / "mlflow.db").is_file()


def test_every_step_and_value(store: dict[str, Any]) -> None:
    uri, rid = store["uri"], store["id"]
    assert history(uri, rid, "train/loss") == [(0, 1.0), (1, 0.5), (2, 0.25), (3, 0.125)]
    assert history(uri, rid, "eval/acc__split-val") == [(1, 0.75)]
    assert history(uri, rid, "train/loss__rank-1") == [(0, 1.5), (1, 1.25)]  # rank 1: same run, suffixed


def test_log_records_are_text_artifacts_per_window_and_rank(store: dict[str, Any]) -> None:
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as mp:
        for key, value in store["env"].items():
            mp.setenv(key, value)
        client = MlflowClient(store["uri"])
        texts = {}
        for rank in (0, 1):
            (artifact,) = client.list_artifacts(store["id"], f"otel-train-logs/rank{rank}")
            path = download_artifacts(run_id=store["id"], artifact_path=artifact.path, tracking_uri=store["uri"])
            texts[artifact.path] = Path(path).read_text()
    assert texts == {
        "otel-train-logs/rank0/step000000003-1700000000000000003.log":
            "[step 3] WARNING job: loss spiked\n[step 3] ERROR job: bad batch\nTraceback (x)\nValueError: bad batch\n",
        "otel-train-logs/rank1/step000000002-1700000000000000005.log": "[step 2] WARNING job: rank 1 warns\n",
    }


def test_run_identity_params_and_tags(store: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store["uri"])
    run = client.get_run(store["id"])
    assert run.info.run_name == "mlf" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "otel-mlflow-test"
    assert run.data.tags["train.run.id"] == RUN_ID
    assert run.data.tags["train.config.hash"] == config_hash(HPARAMS)
    assert run.data.tags["otel_train.last_step"] == "3" and run.data.tags["otel_train.last_step.rank1"] == "1"
    assert run.data.params == {"lr": "0.01", "optim/name": "adam", "optim/betas": "[0.9, 0.99]",
                               "train.config.hash": config_hash(HPARAMS), "train.run.id": RUN_ID}


RESUME_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from otel_train.exporters.base import Window
    from otel_train.exporters.mlflow import MLflowExporter
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    run = RunInfo(sys.argv[2], "mlf")
    exp = MLflowExporter(ExporterOptions(directory=Path(sys.argv[1]), project="otel-mlflow-test",
                                         hparams={"lr": 0.01}))
    rows = [MetricRow(run, s, "train/loss", "train/loss", 10.0 + s, "gauge", 0) for s in range(2, 6)]
    assert exp.export_window(Window(metrics=rows))
    exp.shutdown()
    print("held", exp.steps_held, "dropped", exp.steps_dropped, "run", exp.run_ids[sys.argv[2]])
""")


def test_resumed_job_continues_the_same_run(store: dict[str, Any], tmp_path: Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(store["root"] / "runs"), RUN_ID],
                          env=store["env"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"held 2 dropped 0 run {store['id']}" in done.stdout  # steps 2, 3 were already there: not a loss
    assert history(store["uri"], store["id"], "train/loss") == [
        (0, 1.0), (1, 0.5), (2, 0.25), (3, 0.125), (4, 14.0), (5, 15.0)]


def test_last_step_tag_never_goes_backwards_and_a_restart_writes_no_step_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A late row (step 4 after step 9) must not lower `otel_train.last_step`: a restarted job reads it as the
    highest step stored and must not write steps 5..9 again."""
    from mlflow.tracking import MlflowClient

    from otel_train.exporters.mlflow import MLflowExporter

    isolated_mlflow_env(monkeypatch, tmp_path)
    options = ExporterOptions(directory=tmp_path / "runs", project="late")
    run = RunInfo("late-run", "late")
    first = MLflowExporter(options)
    assert first.export_window(Window(metrics=[row(run, s, "train/loss", float(s)) for s in (0, 1, 2, 3, 5, 6, 7, 8, 9)]))
    assert first.export_window(Window(metrics=[row(run, 4, "train/loss", 4.0)]))  # late: after step 9
    uri, rid = first.tracking_uri, first.run_ids["late-run"]
    first.shutdown()
    assert MlflowClient(uri).get_run(rid).data.tags["otel_train.last_step"] == "9"

    restarted = MLflowExporter(options)  # the job restarts from a checkpoint at step 4
    assert restarted.export_window(Window(metrics=[row(run, s, "train/loss", 100.0 + s) for s in range(4, 13)]))
    restarted.shutdown()
    assert (restarted.steps_held, restarted.steps_dropped) == (6, 0)  # steps 4..9 are held already
    assert history(uri, rid, "train/loss") == [(s, float(s)) for s in range(10)] + [(s, 100.0 + s) for s in (10, 11, 12)]
    assert MlflowClient(uri).get_run(rid).data.tags["otel_train.last_step"] == "12"


def test_a_restart_drops_each_series_only_below_its_own_last_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A series logged ahead of the loop (`step=i+5`) made the run's last step 5 ahead of the loop's series; after
    the exporter process restarted, the loop's steps in between were dropped as "already held" (and counted as
    such, so verify passed). Each series now keeps its own last step."""
    from otel_train.exporters.mlflow import MLflowExporter

    isolated_mlflow_env(monkeypatch, tmp_path)
    options = ExporterOptions(directory=tmp_path / "runs", project="ahead")
    run = RunInfo("ahead-run", "ahead")

    def window(steps: range) -> Window:
        return Window(metrics=[r for s in steps for r in (row(run, s, "train/loss", float(s)),
                                                          row(run, s + 5, "wk/val", 100.0 + s + 5))])

    first = MLflowExporter(options)
    assert first.export_window(window(range(6)))  # train/loss to step 5, wk/val to step 10
    uri, rid = first.tracking_uri, first.run_ids["ahead-run"]
    first.shutdown()
    restarted = MLflowExporter(options)  # handed again from step 4 (its cursor lagged), then on
    assert restarted.export_window(window(range(4, 9)))
    restarted.shutdown()
    assert history(uri, rid, "train/loss") == [(s, float(s)) for s in range(9)]
    assert history(uri, rid, "wk/val") == [(s, 100.0 + s) for s in range(5, 14)]
    assert (restarted.steps_held, restarted.steps_dropped) == (2 + 2, 0)  # train/loss 4, 5, wk/val 9, 10


def test_otel_sdk_path_with_counter_totals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain OTel: MeterProvider + reader -> `exporter.export(MetricsData)`; counters as running totals."""
    from mlflow.tracking import MlflowClient
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_train.exporters.mlflow import MLflowExporter

    isolated_mlflow_env(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'env.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    from opentelemetry.sdk.metrics import Counter
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    reader = InMemoryMetricReader(preferred_temporality={Counter: AggregationTemporality.DELTA})
    provider = MeterProvider(metric_readers=[reader],
                             resource=Resource.create(RunInfo("sdk-run", "sdk").resource_attributes()))
    counter = provider.get_meter("t").create_counter("data/samples")
    exporter = MLflowExporter(ExporterOptions(directory=tmp_path / "unused"))
    for step in range(3):
        counter.add(10, {"train.step": step, "split": "train"})
        exporter.export(reader.get_metrics_data())
    exporter.shutdown()
    provider.shutdown()
    assert not (tmp_path / "unused").exists()  # MLFLOW_TRACKING_URI wins
    client = MlflowClient(f"sqlite:///{tmp_path / 'env.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("from-env").experiment_id])
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "data/samples__split-train")) \
        == [(0, 10.0), (1, 20.0), (2, 30.0)]


def test_keys_map_deterministically() -> None:
    """Keys MLflow accepts stay; others are mapped plus a hash of the key; the attribute suffix is mapped."""
    from otel_train.exporters.mlflow import mlflow_key, mlflow_name
    from otel_train.vocab.names import key_hash

    assert [mlflow_name(k) for k in ("train/loss", "épochs/loss", "a b:c-d.e_f")] == [
        "train/loss", "épochs/loss", "a b:c-d.e_f"]
    assert mlflow_name("val/mAP@0.5") == f"val/mAP_0.5_{key_hash('val/mAP@0.5')}"
    assert mlflow_name("Loss (val)") == f"Loss _val__{key_hash('Loss (val)')}"
    assert mlflow_name("val/mAP#0.5") != mlflow_name("val/mAP@0.5")  # never one name for two keys
    assert mlflow_name("../x") == f"__/x_{key_hash('../x')}" and mlflow_name("a//b/") == f"a/b_{key_hash('a//b/')}"
    assert mlflow_key("a/b", {"x": 1, "y": "z w"}) == "a/b__x-1__y-z w"
    assert mlflow_key("odd", {"k": "@/.."}) == "odd__k-_/__"
    long = mlflow_name("x" * 300)
    assert len(long) == 250 and long == mlflow_name("x" * 300) != mlflow_name("x" * 301)


def test_every_mapped_key_passes_mlflows_own_validation() -> None:
    from mlflow.utils.validation import _validate_metric_name

    from otel_train.exporters.mlflow import mlflow_key, mlflow_name

    odd = ["..yLμyz/損", "..", ".", "...", "..a", "../x", "a/../b", "/lead", "trail/", "a//b", "val/mAP@0.5", "x" * 300,
           "a b", "(x)", "損"]
    for key in odd:
        for mapped in (mlflow_name(key), mlflow_key(key, {"k": "@/.."})):
            _validate_metric_name(mapped)  # raises for a key MLflow would refuse (its rows would be lost)


def test_missing_mlflow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.mlflow import MLflowExporter

    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'otel-train\[mlflow\]'"):
        MLflowExporter(ExporterOptions())
    assert MetricsConverter  # imported for the SDK path above


def test_a_value_logged_twice_at_a_step_within_one_millisecond_is_held_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow keeps one row per (key, step, value, millisecond); a loop that logs the same value at the same step
    of a series twice (a step revisited) within a millisecond must still find both."""
    from otel_train.exporters.mlflow import MLflowExporter

    isolated_mlflow_env(monkeypatch, tmp_path)
    run = RunInfo("twice", "twice")
    exporter = MLflowExporter(ExporterOptions(directory=tmp_path / "runs", project="twice"))
    same_ms = 1_700_000_000_000_000_000
    assert exporter.export_window(Window(metrics=[
        backendkit.row(run, 5, "loss", 0.0, same_ms), backendkit.row(run, 6, "loss", 1.0, same_ms + 1),
        backendkit.row(run, 5, "loss", 0.0, same_ms + 2)]))
    last = Window(metrics=[backendkit.row(run, 5, "loss", 0.0, same_ms + 3)])
    assert exporter.export_window(last)
    exporter.write_metrics(last.metrics, [])  # the same rows again, as a retried write sends them
    uri, rid = exporter.tracking_uri, exporter.run_ids["twice"]
    exporter.shutdown()
    # A list: the three logged at step 5 are there, the retried one once.
    assert sorted(history(uri, rid, "loss")) == [(5, 0.0), (5, 0.0), (5, 0.0), (6, 1.0)]
