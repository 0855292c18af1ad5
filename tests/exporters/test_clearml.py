"""ClearMLExporter: a real offline ClearML session, read back from its stored offline data."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from backendkit import events, isolated_clearml_env, row, two_ranks
from readback import clearml as clearml_points
from reference import Point

from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.vocab.rows import HistogramRow, LogRow, MetricRow, series_tag
from otel_train.vocab.run_identity import RunInfo, config_hash

HPARAMS = {"lr": 0.2, "model": {"depth": 4}}
RUN_ID = "cml-run-1"


def _built_in_rows(r0: RunInfo, r1: RunInfo) -> list[MetricRow]:
    """Built-in series under their dotted names: two ranks' step durations, two exporters' error counts."""
    def built_in(run: RunInfo, step: int, name: str, value: float, **attrs: Any) -> MetricRow:
        tag = series_tag(name, attrs)
        return MetricRow(run, step, name, tag, value, "gauge", 0, attrs)

    return [built_in(r, s, "train.step.duration_s", 0.25 * (s + 1) + r.rank) for s in (0, 1) for r in (r0, r1)] + [
        built_in(r0, 0, "otel_train.backend_errors", 1.0, exporter="jsonl"),
        built_in(r0, 0, "otel_train.backend_errors", 2.0, exporter="wandb"),
    ]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from otel_train.exporters.clearml import ClearMLExporter

    root = tmp_path_factory.mktemp("clearml")
    with pytest.MonkeyPatch.context() as mp:
        isolated_clearml_env(mp, root)
        options = ExporterOptions(directory=root / "runs", project="otel-clearml-test", hparams=HPARAMS,
                                  ranks="all")
        r0, r1 = two_ranks(RUN_ID, "cml", HPARAMS)
        exporter = ClearMLExporter(options)
        results: list[bool] = []

        def export() -> None:  # the reader calls exporters from its own thread
            results.append(exporter.export_window(Window(metrics=[
                row(r0, 1, "train/loss", 0.5), row(r0, 0, "train/loss", 1.0), row(r0, 2, "train/loss", 0.25),
                row(r0, 1, "eval/acc{split=val}", 0.75, split="val"), row(r0, 0, "lr", 0.01),
                row(r0, 0, "optim/lr/group0", 0.02), row(r1, 0, "train/loss", 1.5),
                row(RunInfo("other-run", "x"), 0, "train/loss", 9.0),
                *_built_in_rows(r0, r1),
            ], histograms=[HistogramRow(r0, 1, "grad", "grad", 4, 6.0, 0.5, 3.0, (1.0, 2.0), (1, 2, 1), 0)], logs=[
                LogRow(r0, 2, 0, 13, "WARNING", "loss spiked", "job"),
                LogRow(r1, 1, 0, 17, "ERROR", "bad batch", "job", {"exception.stacktrace": "Traceback (x)"}),
            ])))
            results.append(exporter.force_flush())

        worker = threading.Thread(target=export)
        worker.start()
        worker.join(120)
        task = exporter.task
        exporter.shutdown()
        exporter.shutdown()
        folder = Path(task.get_offline_mode_folder())
        yield {"results": results, "folder": folder, "task_id": task.id, "exporter": exporter}


def test_offline_session_stored_locally(session: dict[str, Any]) -> None:
    assert session["results"] == [True, True]
    assert session["task_id"].startswith("offline-")
    assert session["folder"].is_dir() and session["folder"].with_suffix(".zip").is_file()
    assert "/cache/offline/" in session["folder"].as_posix()  # under CLEARML_CACHE_DIR, not ~/.clearml


def test_scalars_with_title_series_mapping(session: dict[str, Any]) -> None:
    scalars: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for ev in events(session["folder"]):
        if ev["type"] == "training_stats_scalar":
            scalars.setdefault((ev["metric"], ev["variant"]), []).append((ev["iter"], ev["value"]))
    assert scalars[("train", "loss")] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert scalars[("eval", "acc{split=val}")] == [(1, 0.75)]
    assert scalars[("lr", "lr")] == [(0, 0.01)]
    assert scalars[("optim/lr", "group0")] == [(0, 0.02)]
    assert scalars[("train", "loss{rank=1}")] == [(0, 1.5)]
    assert len(scalars) == 9  # the other run's row was dropped
    assert session["exporter"].rows_dropped == 1


def test_rank_and_attribute_suffixes_make_distinct_series(session: dict[str, Any]) -> None:
    """Built-in (dotted) names keep their rank and attribute suffixes: no two series share one ClearML series."""
    points = [p for p in clearml_points(session["folder"]) if "step_duration" in p.name or "backend_errors" in p.name]
    assert sorted(points) == sorted([
        Point("train/step_duration_s", 0, 0.25), Point("train/step_duration_s", 1, 0.5),
        Point("train/step_duration_s{rank=1}", 0, 1.25), Point("train/step_duration_s{rank=1}", 1, 1.5),
        Point("otel_train/backend_errors{exporter=jsonl}", 0, 1.0),
        Point("otel_train/backend_errors{exporter=wandb}", 0, 2.0),
    ])


def test_log_records_in_the_console_log_with_step_and_rank(session: dict[str, Any]) -> None:
    console = [json.loads(line) for line in (session["folder"] / "log.jsonl").read_text().splitlines() if line.strip()]
    messages = [(ev["level"], ev["msg"]) for batch in console for ev in batch]  # ClearML joins nearby lines
    text = "\n".join(msg for _, msg in messages)
    assert text.index("[step 2 rank 0] WARNING job: loss spiked") < text.index(
        "[step 1 rank 1] ERROR job: bad batch\nTraceback (x)")
    assert any(level == "error" and "bad batch" in msg for level, msg in messages)


def test_histogram_reported(session: dict[str, Any]) -> None:
    (plot,) = [ev for ev in events(session["folder"]) if ev["type"] == "plot"]
    assert (plot["metric"], plot["variant"], plot["iter"]) == ("grad", "grad", 1)
    data = json.loads(plot["plot_str"])["data"][0]
    assert data["y"] == [1, 2, 1] and data["x"] == ["(-inf, 1]", "(1, 2]", "(2, +inf)"]


def test_task_name_tags_and_hparams(session: dict[str, Any]) -> None:
    task = json.loads((session["folder"] / "task.json").read_text())
    assert task["name"] == "cml"
    assert f"train.run.id:{RUN_ID}" in task["tags"]
    assert f"train.config.hash:{config_hash(HPARAMS)}" in task["tags"]
    general = {k: v["value"] for k, v in task["hyperparams"]["General"].items()}
    assert general == {"lr": "0.2", "model/depth": "4", "train.config.hash": config_hash(HPARAMS),
                       "train.run.id": RUN_ID}


def test_missing_clearml_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.clearml import ClearMLExporter

    monkeypatch.setitem(sys.modules, "clearml", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'otel-train\[clearml\]'"):
        ClearMLExporter(ExporterOptions())


class _FakeLogger:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, str, float, int]] = []

    def report_scalar(self, title: str, series: str, value: float, iteration: int) -> None:
        self.scalars.append((title, series, value, iteration))

    def flush(self, wait: bool = False) -> bool:
        return True


class _FakeTask:
    current: ClassVar[_FakeTask | None] = None
    offline_calls: ClassVar[list[bool]] = []
    inits: ClassVar[list[dict[str, Any]]] = []
    _report_subprocess_enabled = True

    def __init__(self) -> None:
        self.logger = _FakeLogger()
        self.tags: list[str] = []
        self.connected: list[dict[str, Any]] = []
        self.closed = 0

    @classmethod
    def current_task(cls) -> _FakeTask | None:
        return cls.current

    @classmethod
    def set_offline(cls, offline_mode: bool = False) -> None:
        cls.offline_calls.append(offline_mode)

    @classmethod
    def init(cls, **kwargs: Any) -> _FakeTask:
        cls.inits.append(kwargs)
        return cls()

    def get_logger(self) -> _FakeLogger:
        return self.logger

    def add_tags(self, tags: list[str]) -> None:
        self.tags.extend(tags)

    def connect(self, params: dict[str, Any]) -> None:
        self.connected.append(params)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def fake_clearml(monkeypatch: pytest.MonkeyPatch) -> type[_FakeTask]:
    import types

    class Task(_FakeTask):
        current = None
        offline_calls: ClassVar[list[bool]] = []
        inits: ClassVar[list[dict[str, Any]]] = []

    monkeypatch.setitem(sys.modules, "clearml", types.SimpleNamespace(Task=Task))
    monkeypatch.setitem(sys.modules, "clearml.config", None)  # no config file to consult
    for key in [k for k in os.environ if k.startswith(("CLEARML_", "TRAINS_"))]:
        monkeypatch.delenv(key)
    return Task


def test_users_own_task_is_reused_and_left_open(fake_clearml: type[_FakeTask], tmp_path: Path) -> None:
    from otel_train.exporters.clearml import ClearMLExporter

    mine = fake_clearml()
    fake_clearml.current = mine
    with ClearMLExporter(ExporterOptions(directory=tmp_path)) as exp:
        exp.export_window(Window(metrics=[row(RunInfo("r", "n"), 3, "train/loss", 0.5)]))
    assert fake_clearml.inits == [] and mine.closed == 0  # not ours to close
    assert mine.logger.scalars == [("train", "loss", 0.5, 3)]
    assert "train.run.id:r" in mine.tags and mine.connected == [{"train.run.id": "r"}]


def test_configured_server_means_online(fake_clearml: type[_FakeTask], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.clearml import ClearMLExporter

    monkeypatch.setenv("CLEARML_API_HOST", "http://clearml.invalid:8008")
    monkeypatch.setenv("CLEARML_PROJECT", "from-env")
    with ClearMLExporter(ExporterOptions(directory=tmp_path, project="proj")) as exp:
        exp.export_window(Window(metrics=[row(RunInfo("r", "n"), 0, "a", 1.0)]))
    assert fake_clearml.offline_calls == []
    assert fake_clearml.inits[0]["project_name"] == "from-env" and fake_clearml.inits[0]["task_name"] == "n"
    assert fake_clearml._report_subprocess_enabled is False


def test_no_server_means_offline(fake_clearml: type[_FakeTask], tmp_path: Path) -> None:
    from otel_train.exporters.clearml import ClearMLExporter

    with ClearMLExporter(ExporterOptions(directory=tmp_path)) as exp:
        exp.export_window(Window(metrics=[row(RunInfo("r", "n"), 0, "a", 1.0)]))
    assert fake_clearml.offline_calls == [True]


RESTART = """
import json, sys
from pathlib import Path
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.exporters.clearml import ClearMLExporter
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo

first, last = int(sys.argv[1]), int(sys.argv[2])
run = RunInfo("cml-restart", "restart")
exporter = ClearMLExporter(ExporterOptions(directory=Path(sys.argv[3]), project="otel-clearml-restart"))
ok = exporter.export_window(Window(metrics=[MetricRow(run, s, "train/loss", "train/loss", float(s), "gauge", 0)
                                            for s in range(first, last + 1)]))
ok = ok and exporter.force_flush()
exporter.shutdown()
print("RESULT" + json.dumps({"ok": ok, "held": exporter.steps_held}))
"""


def test_a_restarted_exporter_writes_no_step_an_earlier_session_holds(tmp_path: Path) -> None:
    """Each process opens a new offline Task; the restarted exporter process is handed again the windows after its
    cursor, which lags what the previous session wrote: those steps were written twice (every restart). Now a
    series' rows at or below its last iteration in the run's earlier sessions are skipped, counted."""
    import subprocess

    from readback import clearml_folders

    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    with pytest.MonkeyPatch.context() as mp:
        isolated_clearml_env(mp, tmp_path)
        env = dict(os.environ)
    results = []
    for first, last in ((0, 5), (3, 8)):  # the second process is handed steps 3..5 again
        done = subprocess.run([sys.executable, str(script), str(first), str(last), str(tmp_path / "runs")], env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.split("RESULT", 1)[1]))
    assert [r["ok"] for r in results] == [True, True]
    assert [r["held"] for r in results] == [0, 3]
    sessions = clearml_folders(tmp_path / "cache")
    assert len(sessions) == 2
    steps = sorted(p.step for f in sessions for p in clearml_points(f) if p.name == "train/loss")
    assert steps == list(range(9))


UNWRITABLE = """
import json, shutil, sys
from pathlib import Path
from otel_train.config.exporter_options import ExporterOptions
from otel_train.exporters.base import Window
from otel_train.exporters.clearml import ClearMLExporter
from otel_train.vocab.rows import MetricRow
from otel_train.vocab.run_identity import RunInfo

run = RunInfo("cml-unwritable", "unwritable")
exporter = ClearMLExporter(ExporterOptions(directory=Path(sys.argv[1]), project="otel-clearml-unwritable"))

def window(steps):
    return Window(metrics=[MetricRow(run, s, "train/loss", "train/loss", float(s), "gauge", 0) for s in steps])

out = {"ok": [exporter.export_window(window(range(3))) and exporter.force_flush()]}
out["durable"] = [exporter.durable_step()]
metrics = exporter._folder / "metrics.jsonl"
shutil.move(metrics, metrics.with_suffix(".kept"))
metrics.mkdir()  # ClearML's reporter cannot append: it logs the error and goes on
out["ok"].append(exporter.export_window(window(range(3, 6))) and exporter.force_flush())
out["durable"].append(exporter.durable_step())
exporter.shutdown()
print("RESULT" + json.dumps(out))
"""


def test_writes_clearml_could_not_make_are_not_claimed(tmp_path: Path) -> None:
    """ClearML's offline reporter logs a write it cannot make (a full disk, a read-only file) and goes on: the rows
    were marked written and their windows left the spool, lost for good with "0 dropped". Now a step is claimed only
    once the session's `metrics.jsonl` holds it (`durable_step`): delivery keeps the rest in the spool."""
    import subprocess

    script = tmp_path / "unwritable.py"
    script.write_text(UNWRITABLE)
    with pytest.MonkeyPatch.context() as mp:
        isolated_clearml_env(mp, tmp_path)
        env = dict(os.environ)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    assert result["ok"] == [True, True]  # ClearML said nothing
    assert result["durable"] == [None, 2]  # steps 3..5 are not in its store: not claimed
