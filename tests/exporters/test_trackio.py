"""TrackioExporter: a real local Trackio store (under TRACKIO_DIR), read back with Trackio's storage;
resume in a second process; the user's own Trackio run is left alone.

Trackio reads TRACKIO_DIR when it is imported, so the real runs happen in subprocesses with their own
environment (the pytest process may have imported trackio already).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from otel_train.config.exporter_options import ExporterOptions
from otel_train.vocab.run_identity import config_hash

HPARAMS = {"lr": 0.3, "data": {"bs": 8}}

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import trackio
    from trackio.sqlite_storage import SQLiteStorage
    from otel_train.exporters.base import Window
    from otel_train.exporters.trackio import TrackioExporter
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.rows import HistogramRow, MetricRow
    from otel_train.vocab.run_identity import RunInfo, config_hash

    phase, directory = sys.argv[1], Path(sys.argv[2])
    hp = json.loads(sys.argv[3])
    r0 = RunInfo("trk-run-1", "trk", rank=0, world_size=2, config_hash=config_hash(hp))
    r1 = RunInfo("trk-run-1", "trk", rank=1, world_size=2, config_hash=config_hash(hp))

    def row(run, step, tag, value, **attrs):
        return MetricRow(run, step, tag.split("{")[0], tag, value, "gauge", 0, attrs)

    # The user's own Trackio run, current in this thread: the exporter must not finish or replace it.
    user = trackio.init(project="user-project", name="mine", embed=False, auto_log_gpu=False, auto_log_cpu=False)
    exp = TrackioExporter(ExporterOptions(directory=directory, project="otel-trackio-test", hparams=hp,
                                          ranks="all"))
    if phase == "first":
        ok = exp.export_window(Window(metrics=[
            row(r0, 1, "train/loss", 0.5), row(r0, 0, "train/loss", 1.0), row(r0, 2, "train/loss", 0.25),
            row(r0, 1, "eval/acc{split=val}", 0.75, split="val"), row(r1, 0, "train/loss", 1.5),
            row(r0, 1, "train/twice", 1.0), row(r0, 1, "train/twice", 2.0),  # two `ot.log` calls in one step
        ], histograms=[HistogramRow(r0, 2, "grad", "grad", 4, 6.0, 0.5, 3.0, (1.0, 2.0), (1, 2, 1), 0)]))
    else:  # a restarted job: steps 1 and 2 are already stored
        ok = exp.export_window(Window(metrics=[row(r0, s, "train/loss", 10.0 + s) for s in range(1, 5)]))
        # Another training run with the same name must not continue this one.
        with TrackioExporter(ExporterOptions(directory=directory, project="otel-trackio-test")) as other:
            other.export_window(Window(metrics=[row(RunInfo("trk-run-2", "trk"), 0, "train/loss", 5.0)]))
        print("OTHER" + json.dumps(SQLiteStorage.get_logs("otel-trackio-test", "trk-trk-run-2"), default=str))
    exp.shutdown()
    user_alive = trackio.context_vars.current_run.get() is user
    trackio.log({"mine": 1.0}, step=0)
    user.finish()
    logs = SQLiteStorage.get_logs("otel-trackio-test", "trk")
    config = SQLiteStorage.get_run_config("otel-trackio-test", "trk")
    print("RESULT" + json.dumps({"ok": ok, "dropped": exp.steps_dropped, "held": exp.steps_held, "user_alive": user_alive,
                                 "logs": logs, "config": config, "runs": SQLiteStorage.get_runs("otel-trackio-test"),
                                 "files": sorted(p.name for p in Path(sys.argv[4]).iterdir())}, default=str))
""")


def run_phase(phase: str, root: Path, script: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "HF_", "OTEL_TRAIN_"))}
    env.update(HOME=str(root / "home"), TRACKIO_DIR=str(root / "trackio"), HF_HOME=str(root / "hf"))
    done = subprocess.run([sys.executable, str(script), phase, str(root / "runs"), json.dumps(HPARAMS),
                           str(root / "trackio")], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    result = json.loads(line[len("RESULT"):])
    other = [x for x in done.stdout.splitlines() if x.startswith("OTHER")]
    if other:
        result["other"] = json.loads(other[0][len("OTHER"):])
    return result


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("trackio")
    script = root / "phase.py"
    script.write_text(SCRIPT)
    return {"first": run_phase("first", root, script), "resume": run_phase("resume", root, script)}


def series(logs: list[dict[str, Any]], key: str) -> list[tuple[int, Any]]:
    """(step, value) of every stored record with `key`, as a list: a point stored twice shows."""
    return sorted(((entry["step"], entry[key]) for entry in logs if key in entry), key=lambda p: p[0])


def test_every_step_and_value_in_the_local_store(phases: dict[str, dict[str, Any]]) -> None:
    first = phases["first"]
    assert first["ok"] and first["runs"] == ["trk"]
    assert "otel-trackio-test.db" in first["files"]  # under TRACKIO_DIR, no Space, no server
    logs = first["logs"]
    assert series(logs, "train/loss") == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert series(logs, "eval/acc{split=val}") == [(1, 0.75)]
    assert series(logs, "train/loss{rank=1}") == [(0, 1.5)]  # rank 1: same run, suffixed
    assert series(logs, "train/twice") == [(1, 1.0), (1, 2.0)]  # both values, as JSONL holds them
    ((step, hist),) = series(logs, "grad")
    assert step == 2 and hist["_type"] == "trackio.histogram"


def test_config_has_hparams_hash_and_group(phases: dict[str, dict[str, Any]]) -> None:
    config = phases["first"]["config"]
    assert config["lr"] == 0.3 and config["data"] == {"bs": 8}
    assert config["train.config.hash"] == config_hash(HPARAMS) and config["train.run.id"] == "trk-run-1"
    assert config["_Group"] == "trk-run-1"


def test_resume_continues_without_duplicate_steps(phases: dict[str, dict[str, Any]]) -> None:
    resumed = phases["resume"]
    assert resumed["ok"] and (resumed["held"], resumed["dropped"]) == (2, 0)  # held: not a loss
    assert resumed["runs"] == ["trk", "trk-trk-run-2"]  # same name, other run id: a run of its own
    assert [(e["step"], e["train/loss"]) for e in resumed["other"]] == [(0, 5.0)]
    loss = [(e["step"], e["train/loss"]) for e in resumed["logs"] if "train/loss" in e]
    assert loss == [(0, 1.0), (1, 0.5), (2, 0.25), (3, 13.0), (4, 14.0)]


AHEAD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from trackio.sqlite_storage import SQLiteStorage
    from otel_train.exporters.base import Window
    from otel_train.exporters.trackio import TrackioExporter
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.rows import MetricRow
    from otel_train.vocab.run_identity import RunInfo

    phase, directory = sys.argv[1], Path(sys.argv[2])
    run = RunInfo("ahead-run", "ahead")
    steps = range(0, 3) if phase == "first" else range(3, 6)
    exp = TrackioExporter(ExporterOptions(directory=directory, project="otel-trackio-ahead"))
    ok = exp.export_window(Window(metrics=[r for s in steps for r in (
        MetricRow(run, s, "train/loss", "train/loss", float(s), "gauge", 0),
        MetricRow(run, s + 5, "wk/val", "wk/val", 100.0 + s + 5, "gauge", 0))]))
    exp.shutdown()
    print("RESULT" + json.dumps({"ok": ok, "dropped": exp.steps_dropped, "held": exp.steps_held,
                                 "logs": SQLiteStorage.get_logs("otel-trackio-ahead", "ahead")}, default=str))
""")


def test_a_restart_drops_each_series_only_below_its_own_last_step(tmp_path: Path) -> None:
    """A series logged ahead of the loop (`step=i+5`) set the run's last step 5 ahead of the loop's series: after a
    restart, the loop's steps in between were dropped as "already held". Each series now keeps its own last step."""
    script = tmp_path / "ahead.py"
    script.write_text(AHEAD)
    run_phase("first", tmp_path, script)
    resumed = run_phase("resume", tmp_path, script)
    assert resumed["ok"] and (resumed["held"], resumed["dropped"]) == (0, 0)
    assert series(resumed["logs"], "train/loss") == [(s, float(s)) for s in range(6)]
    assert series(resumed["logs"], "wk/val") == [(s, 100.0 + s) for s in range(5, 11)]


def test_the_users_own_trackio_run_is_untouched(phases: dict[str, dict[str, Any]]) -> None:
    assert phases["first"]["user_alive"] and phases["resume"]["user_alive"]


def test_missing_trackio_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.trackio import TrackioExporter

    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'otel-train\[trackio\]'"):
        TrackioExporter(ExporterOptions())



CURSOR_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from trackio.sqlite_storage import SQLiteStorage
    from otel_train.ship.delivery import Delivery
    from otel_train.exporters.trackio import TrackioExporter
    from otel_train.ship.framing import encode_window
    from otel_train.config.exporter_options import ExporterOptions
    from otel_train.vocab.run_identity import RunInfo
    from otel_train.ship.spool import Spool

    run = RunInfo("cur-run", "cur")
    exp = TrackioExporter(ExporterOptions(directory=Path(sys.argv[1]), project="otel-trackio-cursor"))
    d = Delivery({"trackio": exp}, Spool(Path(sys.argv[1]) / "spool"))
    seen = []
    for seq in range(1, 9):
        d.submit(seq, seq - 1, encode_window(run, [("train/loss", seq - 1, float(seq), 1_000 + seq)])[0])
        d.flush(time.monotonic() + 30)
        # Right after the flush: what the cursor claims, then what the store holds (read second, so a write
        # landing in between can only make the store hold more).
        claimed = d.progress().delivered_step["trackio"]
        held = [e["step"] for e in SQLiteStorage.get_logs("otel-trackio-cursor", "cur") if "train/loss" in e]
        seen.append([claimed, held])
    d.close(time.monotonic() + 60)
    held = [e["step"] for e in SQLiteStorage.get_logs("otel-trackio-cursor", "cur") if "train/loss" in e]
    print("RESULT" + json.dumps({"seen": seen, "final": held, "cursor": Spool(Path(sys.argv[1]) / "spool").cursor("trackio")}))
""")


def test_the_delivery_cursor_never_claims_a_step_the_store_lacks(tmp_path: Path) -> None:
    """Trackio writes its queue to SQLite from a thread of its own: the exporter process's cursor (what a replay
    after `kill -9` skips) may claim a window only once Trackio's database holds it."""
    script = tmp_path / "cursor.py"
    script.write_text(CURSOR_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACKIO_", "HF_", "OTEL_TRAIN_"))}
    env.update(HOME=str(tmp_path / "home"), TRACKIO_DIR=str(tmp_path / "trackio"), HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
    for claimed, held in result["seen"]:
        assert all(step in held for step in range(claimed + 1)), (claimed, held)
    assert result["final"] == list(range(8)) and result["cursor"] == 8
