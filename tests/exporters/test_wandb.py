"""WandbExporter: a real offline W&B run read back from its `.wandb` file; resume in a second process;
rank policy and step ordering against a fake `wandb` module."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_train.exporters.base import Window
from otel_train.records import ExporterOptions, HistogramRow, MetricRow, RunInfo, config_hash

HPARAMS = {"lr": 0.1, "optim": {"beta": 0.9}}
RUN_ID = "job/77"  # "/" is reserved in W&B ids: becomes "-"


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


# -- reading a .wandb file back (LevelDB log format of protobuf `Record`s) -----------------------
_BLOCK = 32768
_HEADER = 7


def wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    off, pending = _HEADER, b""
    while off + _HEADER <= len(data):
        left = _BLOCK - off % _BLOCK
        if left < _HEADER:
            off += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[off:off + _HEADER])
        if kind == 0 and length == 0:  # zero padding up to the block end
            off += left
            continue
        chunk = data[off + _HEADER:off + _HEADER + length]
        off += _HEADER + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            pending = b""
            yield record
        elif kind == 2:  # FIRST
            pending = chunk
        else:  # MIDDLE
            pending += chunk


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
    return sorted((directory / run_name / "wandb").glob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb"))


def row(run: RunInfo, step: int, tag: str, value: float, **attrs: Any) -> MetricRow:
    return MetricRow(run, step, tag.split("{")[0], tag, value, "gauge", 1_000 + step, attrs)


# -- the real offline run (one module-scoped session) ----------------------------------------------
@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from otel_train.exporters.wandb import WandbExporter

    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        isolated_wandb_env(mp, root)
        options = ExporterOptions(directory=root / "runs", project="otel-wandb-test", hparams=HPARAMS,
                                  ranks="all")
        r0 = RunInfo(RUN_ID, "wb", rank=0, world_size=2, config_hash=config_hash(HPARAMS))
        r1 = RunInfo(RUN_ID, "wb", rank=1, world_size=2, config_hash=config_hash(HPARAMS))
        hist = HistogramRow(r0, 1, "grad", "grad", 4, 6.0, 0.5, 3.0, (1.0, 2.0), (1, 2, 1), 5_000)
        exporter = WandbExporter(options)
        # Window 1: out of order inside the window, a suffixed series, a histogram, rank 1.
        assert exporter.export_window(Window(metrics=[
            row(r0, 2, "train/loss", 0.2), row(r0, 0, "train/loss", 1.0), row(r0, 1, "train/loss", 0.5),
            row(r0, 1, "eval/acc{split=val}", 0.75, split="val"),
            row(r1, 0, "train/loss", 1.5), row(r1, 1, "train/loss", 1.25),
        ], histograms=[hist]))
        # Window 2: a late value for the step written last (merged), an older step (dropped), new steps.
        assert exporter.export_window(Window(metrics=[
            row(r0, 2, "eval/late", 7.0), row(r0, 1, "train/loss", 99.0),
            row(r0, 3, "train/loss", 0.1), row(r0, 4, "train/loss", 0.05),
        ]))
        dropped = exporter.steps_dropped
        exporter.shutdown()
        exporter.shutdown()  # idempotent
        yield {"root": root, "options": options, "dropped": dropped, "env": dict(os.environ)}


def test_offline_history_every_step_and_value(offline: dict[str, Any]) -> None:
    files = wandb_files(offline["root"] / "runs", "wb", "job-77")
    assert len(files) == 1
    run = read_run(files[0])
    assert (run["id"], run["name"], run["group"], run["project"]) == ("job-77", "wb", RUN_ID, "otel-wandb-test")
    hist = run["history"]
    assert sorted(hist) == [0, 1, 2, 3, 4]
    assert {s: h["train/loss"] for s, h in hist.items()} == {0: 1.0, 1: 0.5, 2: 0.2, 3: 0.1, 4: 0.05}
    assert hist[1]["eval/acc{split=val}"] == 0.75
    assert hist[2]["eval/late"] == 7.0  # same step in a later window: merged into step 2
    assert offline["dropped"] == 1  # the step-1 row that came after step 2
    # A histogram is stored as nested keys under its tag; outer edges are its min and max.
    assert hist[1]["grad/values"] == [1, 2, 1] and hist[1]["grad/bins"] == [0.5, 1.0, 2.0, 3.0]


def test_offline_config_has_hparams_and_hash(offline: dict[str, Any]) -> None:
    run = read_run(wandb_files(offline["root"] / "runs", "wb", "job-77")[0])
    cfg = {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in run["config"].items()}
    assert cfg["lr"] == 0.1 and cfg["optim"] == {"beta": 0.9}
    assert cfg["train.config.hash"] == config_hash(HPARAMS)
    assert cfg["train.run.id"] == RUN_ID


def test_rank1_is_its_own_run_in_the_group(offline: dict[str, Any]) -> None:
    files = wandb_files(offline["root"] / "runs", "wb", "job-77-rank1")
    assert len(files) == 1
    run = read_run(files[0])
    assert (run["id"], run["name"], run["group"]) == ("job-77-rank1", "wb-rank1", RUN_ID)
    assert {s: h["train/loss"] for s, h in run["history"].items()} == {0: 1.5, 1: 1.25}


RESUME_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from otel_train.exporters.base import Window
    from otel_train.exporters.wandb import WandbExporter
    from otel_train.records import ExporterOptions, MetricRow, RunInfo

    run = RunInfo(sys.argv[2], "wb", world_size=2)
    exp = WandbExporter(ExporterOptions(directory=Path(sys.argv[1]), project="otel-wandb-test", ranks="all"))
    rows = [MetricRow(run, s, "train/loss", "train/loss", 10.0 + s, "gauge", s) for s in range(3, 8)]
    assert exp.export_window(Window(metrics=rows))
    exp.shutdown()
    print("dropped", exp.steps_dropped)
""")


def test_resumed_job_continues_without_duplicate_steps(offline: dict[str, Any], tmp_path: Path) -> None:
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(offline["root"] / "runs"), RUN_ID],
                          env=offline["env"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dropped 2" in done.stdout  # steps 3 and 4 were already in the run
    assert "monotonically" not in done.stderr
    files = wandb_files(offline["root"] / "runs", "wb", "job-77")
    assert len(files) == 2  # offline: one file per process, same run id (`wandb sync` joins them)
    first, second = (read_run(f) for f in files)
    assert second["id"] == first["id"] == "job-77"
    assert {s: h["train/loss"] for s, h in second["history"].items()} == {5: 15.0, 6: 16.0, 7: 17.0}
    assert not set(first["history"]) & set(second["history"])


# -- fakes: rank policy, one `log` per step, and the missing package ---------------------------------
class FakeRun:
    def __init__(self, kwargs: dict[str, Any], root: Path) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[int, dict[str, Any]]] = []
        self.finished = 0
        self.starting_step = 0
        self.settings = types.SimpleNamespace(wandb_dir=str(root))

    def log(self, data: dict[str, Any], step: int) -> None:
        self.calls.append((step, dict(data)))

    def finish(self) -> None:
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[FakeRun]:
    runs: list[FakeRun] = []

    def init(settings: Any = None, **kwargs: Any) -> FakeRun:
        runs.append(FakeRun({**kwargs, "settings": settings}, tmp_path))
        return runs[-1]

    module = types.SimpleNamespace(init=init, Settings=lambda **kw: kw, Histogram=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", module)
    for key in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_CONSOLE", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(key, raising=False)
    return runs


def test_rank_zero_policy_and_one_log_per_step(fake_wandb: list[FakeRun], tmp_path: Path) -> None:
    from otel_train.exporters.wandb import WandbExporter

    r0, r1 = RunInfo("r", "n", rank=0, world_size=2), RunInfo("r", "n", rank=1, world_size=2)
    with WandbExporter(ExporterOptions(directory=tmp_path, project="proj")) as exp:
        assert exp.export_window(Window(metrics=[
            row(r0, 1, "a", 1.0), row(r0, 0, "a", 0.0), row(r0, 1, "b", 2.0), row(r1, 0, "a", 9.0)]))
    assert len(fake_wandb) == 1  # rank 1 ignored with ranks "0"
    run = fake_wandb[0]
    assert run.calls == [(0, {"a": 0.0}), (1, {"a": 1.0, "b": 2.0})]
    assert run.finished == 1
    kw = run.kwargs
    assert (kw["id"], kw["name"], kw["project"], kw["resume"]) == ("r", "n", "proj", "allow")
    assert "group" not in kw and kw["dir"] == str(tmp_path / "n") and kw["settings"] == {"console": "off"}


def test_wandb_env_wins_over_defaults(fake_wandb: list[FakeRun], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.wandb import WandbExporter

    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    before = dict(os.environ)
    with WandbExporter(ExporterOptions(directory=tmp_path, project="proj")) as exp:
        exp.export_window(Window(metrics=[row(RunInfo("r", "n"), 0, "a", 1.0)]))
    kw = fake_wandb[0].kwargs
    assert kw["project"] == "from-env" and "dir" not in kw  # wandb reads WANDB_DIR itself
    assert dict(os.environ) == before  # never writes the environment


def test_missing_wandb_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.exporters.wandb import WandbExporter

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'otel-train\[wandb\]'") as err:
        WandbExporter(ExporterOptions())
    assert err.value.name == "wandb"
